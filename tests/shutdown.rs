//! Graceful shutdown of the real binary: on SIGTERM (or ctrl-c) it stops taking
//! connections, lets the exec under way finish and answer in full, exits, and keeps or
//! removes its session containers as `CODEBROKER_SHUTDOWN_CONTAINERS` says. Past
//! `CODEBROKER_SHUTDOWN_GRACE` it stops anyway.

mod common;

use common::{containers_of, instance_name, remove_containers_of, require_image};
use futures::StreamExt;
use serde_json::{json, Value};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The broker binary as a child process, with its own port, data and instance label.
struct Proc {
    child: Child,
    base: String,
    instance: String,
    _data: tempfile::TempDir,
}

impl Proc {
    async fn start(tag: &str, containers: &str, grace_secs: u64) -> Proc {
        require_image();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let data = tempfile::tempdir().expect("tempdir");
        let instance = instance_name(tag);
        let child = Command::new(env!("CARGO_BIN_EXE_codebroker"))
            .env("CODEBROKER_LISTEN", format!("127.0.0.1:{port}"))
            .env("CODEBROKER_AUTH", "none")
            .env("CODEBROKER_DATA_DIR", data.path())
            .env("CODEBROKER_INSTANCE", &instance)
            .env("CODEBROKER_IMAGE", common::image())
            .env("CODEBROKER_POOL_SIZE", "0")
            .env("CODEBROKER_SHUTDOWN_CONTAINERS", containers)
            .env("CODEBROKER_SHUTDOWN_GRACE", grace_secs.to_string())
            .stdin(Stdio::null())
            .spawn()
            .expect("start the broker binary");
        let proc = Proc {
            child,
            base: format!("http://127.0.0.1:{port}"),
            instance,
            _data: data,
        };
        let client = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(resp) = client.get(format!("{}/health", proc.base)).send().await {
                if resp.status() == 200 {
                    break;
                }
            }
            assert!(
                Instant::now() < deadline,
                "the broker did not become healthy"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        proc
    }

    fn signal(&self, signal: libc::c_int) {
        let pid = self.child.id() as libc::pid_t;
        // SAFETY: kill(2) on our own child's pid.
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0, "kill");
    }

    /// Waits for the process to exit; its exit status.
    async fn wait(&mut self, within: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "the broker did not exit within {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        remove_containers_of(&self.instance);
    }
}

/// Starts a streamed exec and returns once its first output arrived, with the rest of
/// the stream to read.
async fn start_exec(
    base: &str,
    session: &str,
    code: &str,
) -> (
    String,
    impl futures::Stream<Item = reqwest::Result<bytes::Bytes>>,
) {
    let resp = reqwest::Client::new()
        .post(format!("{base}/exec/stream"))
        .json(&json!({ "lang": "py", "code": code, "session_id": session }))
        .send()
        .await
        .expect("POST /exec/stream");
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    let mut seen = String::new();
    while !seen.contains("started") {
        let chunk = tokio::time::timeout(Duration::from_secs(30), stream.next())
            .await
            .expect("first output in time")
            .expect("stream open")
            .expect("chunk");
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    (seen, stream)
}

/// The `result` event's JSON of a finished SSE body.
fn result_of(sse: &str) -> Value {
    let block = sse
        .split("\n\n")
        .find(|b| b.starts_with("event: result"))
        .unwrap_or_else(|| panic!("no result event in {sse:?}"));
    let data: Vec<&str> = block
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    serde_json::from_str(&data.join("\n")).expect("result JSON")
}

/// A connection made now is refused (the listener is closed) or answered with an error.
async fn refused(base: &str) -> bool {
    let fresh = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(5))
        .build()
        .expect("client");
    fresh.get(format!("{base}/health")).send().await.is_err()
}

/// A first exec makes the session and its container; returns the session id.
async fn session_with_container(base: &str) -> String {
    let resp: Value = reqwest::Client::new()
        .post(format!("{base}/exec"))
        .json(&json!({ "lang": "py", "code": "x = 41" }))
        .send()
        .await
        .expect("POST /exec")
        .json()
        .await
        .expect("JSON");
    resp["session_id"].as_str().expect("session_id").to_string()
}

async fn exec_finishes_during_shutdown(containers: &str, signal: libc::c_int) {
    let mut broker = Proc::start("shutdown", containers, 20).await;
    let session = session_with_container(&broker.base).await;
    assert_eq!(containers_of(&broker.instance).len(), 1);

    let code = "import time\nprint('started', flush=True)\ntime.sleep(3)\nprint('finished', x + 1)";
    let (mut body, mut stream) = start_exec(&broker.base, &session, code).await;
    let signalled = Instant::now();
    broker.signal(signal);

    // New connections are refused while the exec runs on.
    let deadline = Instant::now() + Duration::from_secs(2);
    while !refused(&broker.base).await {
        assert!(
            Instant::now() < deadline,
            "the broker still takes connections after the signal"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        broker.child.try_wait().expect("try_wait").is_none(),
        "the broker exited with an exec under way"
    );

    while let Some(chunk) = stream.next().await {
        body.push_str(&String::from_utf8_lossy(
            &chunk.expect("the stream ends cleanly"),
        ));
    }
    let result = result_of(&body);
    assert_eq!(result["exit_code"], 0, "{result}");
    assert_eq!(result["stdout"], "started\nfinished 42\n", "{result}");
    assert!(
        signalled.elapsed() >= Duration::from_secs(2),
        "the exec ended too early"
    );

    let status = broker.wait(Duration::from_secs(30)).await;
    assert!(status.success(), "exit status {status}");
    let left = containers_of(&broker.instance);
    match containers {
        "keep" => assert_eq!(left.len(), 1, "the session container is kept"),
        _ => assert!(left.is_empty(), "containers left behind: {left:?}"),
    }
}

#[tokio::test]
async fn sigterm_lets_the_exec_finish_and_keeps_containers() {
    exec_finishes_during_shutdown("keep", libc::SIGTERM).await;
}

#[tokio::test]
async fn ctrl_c_lets_the_exec_finish_and_removes_containers() {
    exec_finishes_during_shutdown("remove", libc::SIGINT).await;
}

#[tokio::test]
async fn stops_after_the_grace_period() {
    let mut broker = Proc::start("shutdown-grace", "remove", 1).await;
    let session = session_with_container(&broker.base).await;
    let code = "import time\nprint('started', flush=True)\ntime.sleep(25)";
    let (_seen, _stream) = start_exec(&broker.base, &session, code).await;
    let signalled = Instant::now();
    broker.signal(libc::SIGTERM);
    let status = broker.wait(Duration::from_secs(20)).await;
    assert!(status.success(), "exit status {status}");
    assert!(
        signalled.elapsed() < Duration::from_secs(15),
        "waited {:?} for a 25 s exec with a 1 s grace",
        signalled.elapsed()
    );
    let left = containers_of(&broker.instance);
    assert!(left.is_empty(), "containers left behind: {left:?}");
}
