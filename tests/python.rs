//! The stateful Python kernel.

mod common;

use common::{session, stderr, stdout, TestBroker};

#[tokio::test]
async fn globals_survive_between_execs() {
    let broker = TestBroker::start("pystate").await;
    let first = broker.run("py", "x = 41", None).await;
    let s = session(&first);
    assert_eq!(first["runtime_status"], "new", "{first}");
    let second = broker.run("py", "print(x + 1)", Some(&s)).await;
    assert_eq!(stdout(&second).trim(), "42", "{second}");
    assert_eq!(second["runtime_status"], "reused", "{second}");
    assert_eq!(second["session_id"], s.as_str());
}

#[tokio::test]
async fn trailing_expression_is_shown_like_a_notebook() {
    let broker = TestBroker::start("pyexpr").await;
    let resp = broker.run("py", "a = 6\na * 7", None).await;
    assert_eq!(stdout(&resp).trim(), "42", "{resp}");
    let none = broker.run("py", "None", None).await;
    assert_eq!(stdout(&none), "", "{none}");
    let s = broker.run("py", "'text'", None).await;
    assert_eq!(stdout(&s).trim(), "'text'", "{s}");
}

#[tokio::test]
async fn top_level_await_works() {
    let broker = TestBroker::start("pyawait").await;
    let resp = broker
        .run(
            "py",
            "import asyncio\nasync def f():\n    await asyncio.sleep(0.01)\n    return 5\nr = await f()\nprint(r)",
            None,
        )
        .await;
    assert_eq!(stdout(&resp).trim(), "5", "{resp}");
}

#[tokio::test]
async fn exceptions_go_to_stderr_and_the_kernel_lives_on() {
    let broker = TestBroker::start("pyexc").await;
    let first = broker.run("py", "y = 1\n1 / 0", None).await;
    let s = session(&first);
    assert!(stderr(&first).contains("ZeroDivisionError"), "{first}");
    assert_ne!(first["exit_code"], 0);
    let next = broker.run("py", "print(y)", Some(&s)).await;
    assert_eq!(stdout(&next).trim(), "1", "{next}");
}

#[tokio::test]
async fn plt_show_saves_a_png() {
    let broker = TestBroker::start("pyplot").await;
    let resp = broker
        .run(
            "py",
            "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()",
            None,
        )
        .await;
    let files = resp["files"].as_array().expect("files");
    assert_eq!(files.len(), 1, "{resp}");
    let name = files[0]["name"].as_str().unwrap_or("");
    assert!(name.ends_with(".png"), "{resp}");
    let s = session(&resp);
    let id = files[0]["id"].as_str().expect("id");
    let bytes = broker
        .get(&format!("/download/{s}/{id}"))
        .await
        .bytes()
        .await
        .expect("bytes");
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
}

#[tokio::test]
async fn a_killed_kernel_is_replaced() {
    let broker = TestBroker::start("pykill").await;
    let first = broker.run("py", "z = 1", None).await;
    let s = session(&first);
    let killed = broker
        .run(
            "py",
            "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
            Some(&s),
        )
        .await;
    assert_ne!(killed["exit_code"], 0, "{killed}");
    let next = broker.run("py", "print('z' in globals())", Some(&s)).await;
    assert_eq!(stdout(&next).trim(), "False", "{next}");
    assert_eq!(next["runtime_status"], "new", "{next}");
    let after = broker.run("py", "print('still here')", Some(&s)).await;
    assert_eq!(after["runtime_status"], "reused", "{after}");
}

#[tokio::test]
async fn input_and_c_printf_still_flush() {
    let broker = TestBroker::start("pyflush").await;
    // stdin is /dev/null: input() shows its prompt after what was printed, then fails.
    let resp = broker
        .run("py", "print('before')\nname = input('name? ')", None)
        .await;
    assert_eq!(stdout(&resp), "before\nname? ", "{resp}");
    assert!(stderr(&resp).contains("EOFError"), "{resp}");
    // C stdio buffered in libc is flushed at the end of the exec, after Python's output.
    let s = session(&resp);
    let resp = broker
        .run(
            "py",
            "import ctypes\nlibc = ctypes.CDLL(None)\nlibc.printf(b'from C\\n')\nprint('from Python')",
            Some(&s),
        )
        .await;
    assert_eq!(stdout(&resp), "from Python\nfrom C\n", "{resp}");
}
