//! Graceful shutdown of the real binary: on SIGTERM (or ctrl-c) it stops taking
//! connections, lets the exec under way finish and answer in full, exits, and keeps or
//! removes its session containers as `CODEBROKER_SHUTDOWN_CONTAINERS` says. Past
//! `CODEBROKER_SHUTDOWN_GRACE` it stops anyway.

mod common;

use common::{containers_of, inspect, instance_name, remove_containers_of, require_image};
use futures::StreamExt;
use serde_json::{json, Value};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The broker binary as a child process, with its own port, data and instance label.
struct Proc {
    child: Child,
    base: String,
    instance: String,
    /// The data directory; handed to the next broker by `hand_over`.
    data: Option<tempfile::TempDir>,
    /// Remove the instance's containers on drop (not when handed over).
    remove_on_drop: bool,
}

impl Proc {
    async fn start(tag: &str, containers: &str, grace_secs: u64) -> Proc {
        let data = tempfile::tempdir().expect("tempdir");
        Proc::launch(instance_name(tag), data, containers, grace_secs, &[]).await
    }

    /// Gives up the instance and data directory for a next broker, leaving the
    /// containers alone.
    fn hand_over(mut self) -> (String, tempfile::TempDir) {
        self.remove_on_drop = false;
        let data = self.data.take().expect("data");
        (self.instance.clone(), data)
    }

    async fn launch(
        instance: String,
        data: tempfile::TempDir,
        containers: &str,
        grace_secs: u64,
        extra: &[(&str, &str)],
    ) -> Proc {
        require_image();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let child = Command::new(env!("CARGO_BIN_EXE_codebroker"))
            .env("CODEBROKER_LISTEN", format!("127.0.0.1:{port}"))
            .env("CODEBROKER_AUTH", "none")
            .env("CODEBROKER_DATA_DIR", data.path())
            .env("CODEBROKER_INSTANCE", &instance)
            .env("CODEBROKER_IMAGE", common::image())
            .env("CODEBROKER_POOL_SIZE", "0")
            .env("CODEBROKER_SHUTDOWN_CONTAINERS", containers)
            .env("CODEBROKER_SHUTDOWN_GRACE", grace_secs.to_string())
            .envs(extra.iter().copied())
            .stdin(Stdio::null())
            .spawn()
            .expect("start the broker binary");
        let proc = Proc {
            child,
            base: format!("http://127.0.0.1:{port}"),
            instance,
            data: Some(data),
            remove_on_drop: true,
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
        if self.remove_on_drop {
            remove_containers_of(&self.instance);
        }
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

/// Whether the container is running (a removed one is not).
fn running(id: &str) -> bool {
    inspect(id)["State"]["Running"].as_bool().unwrap_or(false)
}

#[tokio::test]
async fn kept_containers_end_themselves_when_no_broker_comes_back() {
    let ttl = [("CODEBROKER_IDLE_TTL_SECS", "5")];
    let data = tempfile::tempdir().expect("tempdir");
    let mut broker = Proc::launch(instance_name("unattended"), data, "keep", 10, &ttl).await;
    session_with_container(&broker.base).await;
    let kept = containers_of(&broker.instance);
    assert_eq!(kept.len(), 1);
    broker.signal(libc::SIGTERM);
    assert!(broker.wait(Duration::from_secs(30)).await.success());
    let stopped = Instant::now();
    assert!(
        running(&kept[0]),
        "the container is kept for the next start"
    );
    // `docker compose down`: no broker comes back. Within the runner's unattended limit
    // (the idle TTL, at least 20 s) and a margin for a loaded host, the container has
    // ended itself.
    while running(&kept[0]) {
        assert!(
            stopped.elapsed() < Duration::from_secs(45),
            "the kept container still runs {:?} after its broker stopped (limit 20 s)",
            stopped.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    eprintln!(
        "the kept container ended {:?} after its broker stopped",
        stopped.elapsed()
    );
    assert!(
        stopped.elapsed() >= Duration::from_secs(15),
        "it ended after {:?}, long before its limit",
        stopped.elapsed()
    );
}

#[tokio::test]
async fn a_broker_back_within_the_idle_ttl_re_attaches_and_keeps_its_containers_alive() {
    let ttl = [("CODEBROKER_IDLE_TTL_SECS", "5")];
    let data = tempfile::tempdir().expect("tempdir");
    let mut first = Proc::launch(instance_name("reattach-ttl"), data, "keep", 10, &ttl).await;
    let session = session_with_container(&first.base).await;
    let kept = containers_of(&first.instance);
    first.signal(libc::SIGTERM);
    assert!(first.wait(Duration::from_secs(30)).await.success());
    let (instance, data) = first.hand_over();
    let second = Proc::launch(instance, data, "remove", 10, &ttl).await;
    // Longer than the runner's unattended limit (20 s): the new broker's heartbeats keep it.
    let resp: Value = reqwest::Client::new()
        .post(format!("{}/exec", second.base))
        .json(&json!({
            "lang": "py", "session_id": session,
            "code": "import time\ntime.sleep(24)\nprint(x + 1)",
        }))
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .expect("POST /exec")
        .json()
        .await
        .expect("JSON");
    assert_eq!(resp["stdout"], "42\n", "{resp}");
    assert_eq!(containers_of(&second.instance), kept, "the same container");
    assert!(running(&kept[0]));
}
