//! `codebroker smoke`, the operator's end-to-end check, run as the real binary against a
//! test broker: every check passes against a healthy broker with a key, and a wrong key
//! makes it fail with a non-zero exit.

mod common;

use common::TestBroker;

const KEY: &str = "smoke-test-key";

async fn keyed() -> TestBroker {
    TestBroker::start_with("smoke", |c| {
        c.access.auth = codebroker::config::AuthMode::Key;
        c.access.api_key = vec![KEY.to_string()];
    })
    .await
}

async fn smoke(base: &str, key: &str) -> (Option<i32>, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_codebroker"))
        .args(["smoke", "--url", base, "--key", key])
        .output()
        .await
        .expect("run codebroker smoke");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passes_against_a_healthy_broker() {
    let broker = keyed().await;
    let (code, out) = smoke(&broker.base, KEY).await;
    assert_eq!(code, Some(0), "{out}");
    let languages = sandbox_runner::Language::ALL;
    for lang in languages {
        let line = format!("ok    hello {}", lang.as_str());
        assert!(out.contains(&line), "no {line:?} in\n{out}");
    }
    for check in ["health", "files", "plot", "timeout"] {
        assert!(
            out.contains(&format!("ok    {check} ")),
            "{check} in\n{out}"
        );
    }
    assert!(
        out.contains(&format!("{} passed, 0 failed", languages.len() + 4)),
        "{out}"
    );
    assert!(!out.contains("FAIL"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fails_with_a_wrong_key() {
    let broker = keyed().await;
    let (code, out) = smoke(&broker.base, "not-the-key").await;
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("ok    health"), "{out}");
    assert!(out.contains("FAIL  hello py"), "{out}");
    assert!(out.contains("401"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fails_when_nothing_listens() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let (code, out) = smoke(&format!("http://127.0.0.1:{port}"), KEY).await;
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("FAIL  health"), "{out}");
    assert!(out.contains("0 passed, 1 failed"), "{out}");
}
