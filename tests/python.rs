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

/// A broker with a pool of one whose kernels preload `preload`; its pooled container,
/// once its CPU use has settled (the preload is done).
async fn pooled_broker(tag: &str, preload: &str) -> (TestBroker, String) {
    let preload: codebroker::config::PreloadModules = preload.parse().expect("module names");
    let broker = TestBroker::start_with(tag, |c| {
        c.pool.pool_size = 1;
        c.pool.pool_max = 1;
        c.pool.preload = preload;
    })
    .await;
    broker.wait_for_pool(1).await;
    let pooled = broker.containers();
    assert_eq!(pooled.len(), 1, "{pooled:?}");
    (broker, pooled[0].clone())
}

/// The CPU weight (`cpu.shares`) the engine gives a container (0, the engine's default,
/// is 1024).
fn cpu_shares(id: &str) -> Option<i64> {
    common::inspect(id)["HostConfig"]["CpuShares"]
        .as_i64()
        .map(|s| if s == 0 { 1024 } else { s })
}

/// Waits (at most 10 s) for a container's CPU weight to become `want`; the last seen.
async fn wait_for_shares(id: &str, want: i64) -> Option<i64> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while cpu_shares(id) != Some(want) && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    cpu_shares(id)
}

/// Whether sandboxes run under gVisor, whose runsc cannot change a running container's
/// CPU weight: the broker then leaves it alone (SECURITY.md, "gVisor").
fn weight_is_fixed() -> bool {
    std::env::var("CODEBROKER_RUNTIME").is_ok_and(|r| r.contains("runsc"))
}

/// What a first exec reports about the state the preload could have left.
const PRELOAD_PROBE: &str = "import os, sys, threading\n\
    print('pandas' in sys.modules, 'matplotlib.pyplot' in sys.modules)\n\
    print('CODEBROKER_PRELOAD' in os.environ, [t.name for t in threading.enumerate()])\n";

#[tokio::test]
async fn a_pooled_kernel_has_the_data_stack_loaded_and_leaves_nothing_else() {
    let (broker, pooled) = pooled_broker("preload", "numpy,pandas,matplotlib.pyplot").await;
    // It preloads at the lowest CPU weight, and gets the usual one back when done, before
    // any session takes it (under gVisor at the usual weight throughout).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(90);
    let mut weights = Vec::new();
    loop {
        let shares = cpu_shares(&pooled);
        if weights.last() != Some(&shares) {
            weights.push(shares);
        }
        let health: serde_json::Value = broker.get("/health").await.json().await.expect("health");
        if health["pool"]["preloading"] == 0 || std::time::Instant::now() > deadline {
            break;
        }
    }
    if weight_is_fixed() {
        assert_eq!(weights, [Some(1024)], "the weight left alone");
    } else {
        assert!(
            weights.contains(&Some(2)),
            "never at the low weight: {weights:?}"
        );
    }
    assert_eq!(cpu_shares(&pooled), Some(1024), "the weight once preloaded");
    let first = broker
        .run(
            "py",
            &format!(
                "{PRELOAD_PROBE}\
                 import matplotlib, matplotlib.pyplot as plt, pandas as pd\n\
                 print(plt.get_fignums(), matplotlib.get_backend().lower())\n\
                 print(pd.get_option('display.max_rows'), matplotlib.rcParams['figure.figsize'])\n\
                 print(plt.figure().number)\n\
                 df = pd.DataFrame({{'x': range(10), 'y': [i * i for i in range(10)]}})\n\
                 df.plot()\n\
                 plt.savefig('/mnt/data/chart.png')\n\
                 print(int(df['y'].sum()))"
            ),
            None,
        )
        .await;
    assert_eq!(first["runtime_status"], "new", "{first}");
    assert_eq!(
        stdout(&first),
        "True True\nFalse ['MainThread']\n[] agg\n60 [6.4, 4.8]\n1\n285\n",
        "{first}"
    );
    assert_eq!(stderr(&first), "", "{first}");
    let names: Vec<&str> = first["files"]
        .as_array()
        .map(|f| f.iter().filter_map(|f| f["name"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(names, ["chart.png"], "{first}");

    // A kernel started later in the session (here after a crash) has an exec waiting on
    // it and preloads nothing.
    let s = session(&first);
    let killed = broker
        .run(
            "py",
            "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
            Some(&s),
        )
        .await;
    assert_ne!(killed["exit_code"], 0, "{killed}");
    let restarted = broker
        .run(
            "py",
            "import sys, time\ntime.sleep(1)\nprint('numpy' in sys.modules)",
            Some(&s),
        )
        .await;
    assert_eq!(stdout(&restarted), "False\n", "{restarted}");
}

#[tokio::test]
async fn without_preload_a_pooled_kernel_imports_nothing_ahead() {
    let (broker, pooled) = pooled_broker("nopreload", "").await;
    common::docker::wait_until_idle(&pooled, std::time::Duration::from_secs(10)).await;
    assert_eq!(
        common::inspect(&pooled)["HostConfig"]["CpuShares"].as_i64(),
        Some(0),
        "nothing to preload: the engine's default weight, never changed"
    );
    common::docker::wait_until_idle(&pooled, std::time::Duration::from_secs(10)).await;
    let first = broker.run("py", PRELOAD_PROBE, None).await;
    assert_eq!(
        stdout(&first),
        "False False\nFalse ['MainThread']\n",
        "{first}"
    );
    assert_eq!(first["runtime_status"], "new", "{first}");
}

#[tokio::test]
async fn a_cold_started_kernel_preloads_nothing() {
    // The default preload list, but no pool: the kernel starts for the exec.
    let broker = TestBroker::start("coldpreload").await;
    let first = broker
        .run(
            "py",
            "import sys, time\ntime.sleep(1)\nprint('numpy' in sys.modules)",
            None,
        )
        .await;
    assert_eq!(stdout(&first), "False\n", "{first}");
}

#[tokio::test]
async fn a_module_that_cannot_be_imported_is_skipped_and_the_kernel_works() {
    let (broker, pooled) = pooled_broker(
        "badpreload",
        "no_such_module_here,json,_codebroker_missing.sub",
    )
    .await;
    broker.wait_for_preloaded_pool(1).await;
    assert_eq!(cpu_shares(&pooled), Some(1024));
    let first = broker
        .run(
            "py",
            "import sys\nprint('json' in sys.modules, 'no_such_module_here' in sys.modules)",
            None,
        )
        .await;
    assert_eq!(stdout(&first), "True False\n", "{first}");
    assert_eq!(stderr(&first), "", "{first}");
    let s = session(&first);
    let next = broker.run("py", "print(6 * 7)", Some(&s)).await;
    assert_eq!(stdout(&next), "42\n", "{next}");
    assert_eq!(next["runtime_status"], "reused", "{next}");
}

#[tokio::test]
async fn an_exec_right_after_the_take_stops_the_preload_and_gets_the_usual_weight() {
    let (broker, pooled) = pooled_broker("earlypreload", "numpy,pandas,matplotlib.pyplot").await;
    // Taken as soon as its preload has begun (at the lowest weight). The take gives the
    // weight back, and the first exec stops the preload after the import under way:
    // pyplot, the last, is not imported.
    assert_eq!(wait_for_shares(&pooled, 2).await, Some(2));
    let first = broker
        .run(
            "py",
            "import sys, time\ntime.sleep(2)\nprint('matplotlib.pyplot' in sys.modules)",
            None,
        )
        .await;
    assert_eq!(stdout(&first), "False\n", "{first}");
    assert_eq!(first["runtime_status"], "new", "{first}");
    assert_eq!(wait_for_shares(&pooled, 1024).await, Some(1024));
    let s = session(&first);
    // An import the preload may be in the middle of waits for it, then works.
    let plot = broker
        .run(
            "py",
            "import pandas as pd, matplotlib.pyplot as plt\n\
             pd.DataFrame({'a': [1, 2, 3]}).plot()\n\
             print(plt.get_fignums(), int(pd.Series([1, 2, 3]).sum()))",
            Some(&s),
        )
        .await;
    assert_eq!(stdout(&plot), "[1] 6\n", "{plot}");
    assert_eq!(plot["exit_code"], 0, "{plot}");
}

#[tokio::test]
async fn a_first_exec_in_another_language_stops_the_preload_too() {
    let (broker, pooled) = pooled_broker("bashpreload", "numpy,pandas,matplotlib.pyplot").await;
    assert_eq!(wait_for_shares(&pooled, 2).await, Some(2));
    let first = broker.run("bash", "sleep 2; echo b", None).await;
    assert_eq!(stdout(&first), "b\n", "{first}");
    assert_eq!(wait_for_shares(&pooled, 1024).await, Some(1024));
    let s = session(&first);
    let probe = broker
        .run(
            "py",
            "import sys\nprint('matplotlib.pyplot' in sys.modules)",
            Some(&s),
        )
        .await;
    assert_eq!(stdout(&probe), "False\n", "{probe}");
    assert_eq!(
        probe["runtime_status"], "new",
        "the kernel ran no code before: {probe}"
    );
}

#[tokio::test]
async fn matplotlib_outside_the_kernel_finds_the_font_cache() {
    let broker = TestBroker::start("pyfontcache").await;
    // A script run from bash, not the kernel: the runner seeded MPLCONFIGDIR at start.
    // (Listed by Python: under Debian's runsc, coreutils' ls and stat get EINVAL in /tmp.)
    let resp = broker
        .run(
            "bash",
            "python3 -c 'import os; print(*os.listdir(os.environ[\"MPLCONFIGDIR\"]))'\n\
             python3 -c 'import matplotlib.font_manager' && echo imported",
            None,
        )
        .await;
    let out = stdout(&resp);
    assert!(out.contains("fontlist-"), "{resp}");
    assert!(out.contains("imported"), "{resp}");
    assert!(!stderr(&resp).contains("font cache"), "{resp}");
}
