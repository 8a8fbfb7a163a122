//! Graceful shutdown of the real binary: on SIGTERM (or ctrl-c) it stops taking
//! connections, lets the exec under way finish and answer in full, exits, and keeps or
//! removes its session containers as `CODEBROKER_SHUTDOWN_CONTAINERS` says. Past
//! `CODEBROKER_SHUTDOWN_GRACE` it stops anyway.

mod common;

use common::child::{ChildBroker, Launch, Ready};
use common::docker::is_running as running;
use common::{containers_of, instance_name, require_image};
use futures::StreamExt;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// The broker binary without auth, on a fresh data directory, keeping or removing its
/// containers at shutdown as `containers` says, with `grace_secs` for execs under way.
async fn start(tag: &str, containers: &str, grace_secs: u64) -> ChildBroker {
    let data = tempfile::tempdir().expect("tempdir");
    launch(instance_name(tag), data, containers, grace_secs, &[]).await
}

/// [`start`] on a given instance and data directory (a broker's successor), with `extra`
/// settings; waits until `/health` answers 200.
async fn launch(
    instance: String,
    data: tempfile::TempDir,
    containers: &str,
    grace_secs: u64,
    extra: &[(&str, &str)],
) -> ChildBroker {
    require_image();
    Launch::binary(&instance, data.path())
        .env("CODEBROKER_AUTH", "none")
        .env("CODEBROKER_SHUTDOWN_CONTAINERS", containers)
        .env("CODEBROKER_SHUTDOWN_GRACE", grace_secs.to_string())
        .envs(extra)
        .owning(data)
        .ready(Ready::Healthy)
        .spawn()
        .await
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
    assert_eq!(resp["exit_code"], 0, "the first exec: {resp}");
    resp["session_id"]
        .as_str()
        .unwrap_or_else(|| panic!("no session_id in {resp}"))
        .to_string()
}

async fn exec_finishes_during_shutdown(containers: &str, signal: libc::c_int) {
    let mut broker = start("shutdown", containers, 20).await;
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
        broker.exited().is_none(),
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
    let mut broker = start("shutdown-grace", "remove", 1).await;
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

#[tokio::test]
async fn kept_containers_end_themselves_when_no_broker_comes_back() {
    let ttl = [("CODEBROKER_IDLE_TTL_SECS", "5")];
    let data = tempfile::tempdir().expect("tempdir");
    let mut broker = launch(instance_name("unattended"), data, "keep", 10, &ttl).await;
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
    let mut first = launch(instance_name("reattach-ttl"), data, "keep", 10, &ttl).await;
    let session = session_with_container(&first.base).await;
    let kept = containers_of(&first.instance);
    first.signal(libc::SIGTERM);
    assert!(first.wait(Duration::from_secs(30)).await.success());
    let (instance, data) = first.hand_over();
    let second = launch(instance, data, "remove", 10, &ttl).await;
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

#[tokio::test]
async fn a_stop_that_removes_containers_keeps_the_python_state_for_the_next_start() {
    let data = tempfile::tempdir().expect("tempdir");
    let mut first = launch(instance_name("shutdown-state"), data, "remove", 10, &[]).await;
    let session = session_with_container(&first.base).await;
    first.signal(libc::SIGTERM);
    assert!(first.wait(Duration::from_secs(60)).await.success());
    assert!(
        containers_of(&first.instance).is_empty(),
        "removed at the stop"
    );
    let (instance, data) = first.hand_over();
    let saved = data
        .path()
        .join("sessions")
        .join(&session)
        .join("python-state.bin");
    assert!(
        saved.exists(),
        "the state was saved before the container went"
    );
    let second = launch(instance, data, "remove", 10, &[]).await;
    let resp: Value = reqwest::Client::new()
        .post(format!("{}/exec", second.base))
        .json(&json!({ "lang": "py", "session_id": session, "code": "print(x + 1)" }))
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .expect("POST /exec")
        .json()
        .await
        .expect("JSON");
    assert_eq!(resp["stdout"], "42\n", "{resp}");
    assert_eq!(resp["runtime_status"], "reused", "{resp}");
}
