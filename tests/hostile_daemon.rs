//! The Docker daemon restarted under a running broker: the broker recovers on its own (no
//! restart of its own), new execs work once the daemon is back, and no container of the
//! old daemon's life is left behind.
//!
//! Restarting dockerd disrupts everything else using it, so this test is `#[ignore]`d in
//! the normal run and `make test` runs it last, alone:
//! `cargo test -p codebroker --test hostile_daemon -- --ignored`.

mod common;

use common::{session, stdout, TestBroker};
use serde_json::Value;
use std::process::Command;
use std::time::{Duration, Instant};

/// The script that brings the daemon up on these machines (and on CI).
fn docker_up_script() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/scripts/docker-up.sh")
}

fn engine_ready() -> bool {
    Command::new("docker")
        .args(["info", "--format", "{{.ServerVersion}}"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// The pid of the running dockerd.
fn dockerd_pid() -> i32 {
    let out = Command::new("pidof")
        .arg("dockerd")
        .output()
        .expect("pidof");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .and_then(|p| p.parse().ok())
        .expect("dockerd is running")
}

/// Kills dockerd (SIGKILL: a crash, not a clean stop) and waits until it is gone.
fn kill_dockerd() {
    let pid = dockerd_pid();
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0, "kill dockerd");
    let deadline = Instant::now() + Duration::from_secs(30);
    while unsafe { libc::kill(pid, 0) } == 0 {
        assert!(Instant::now() < deadline, "dockerd did not die");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Starts the daemon again the way CI does.
fn start_dockerd() {
    let status = Command::new("bash")
        .arg(docker_up_script())
        .status()
        .expect("run docker-up.sh");
    assert!(status.success(), "docker-up.sh failed");
    assert!(engine_ready());
}

#[tokio::test]
#[ignore = "restarts the Docker daemon; run alone (make test runs it last)"]
async fn the_broker_recovers_from_a_docker_daemon_restart() {
    let script = docker_up_script();
    assert!(script.exists(), "{} is missing", script.display());
    let broker = TestBroker::start("hh-daemon").await;
    let before = broker
        .run("bash", "echo kept > /mnt/data/kept.txt; echo before", None)
        .await;
    let s = session(&before);
    let kept = before["files"][0]["id"].as_str().expect("file").to_string();
    let other = broker.run("py", "X = 1\nprint('other')", None).await;

    kill_dockerd();
    // While the daemon is down: a clean refusal, not a hang and not a crash.
    let down = tokio::time::timeout(
        Duration::from_secs(60),
        broker
            .client
            .post(broker.url("/exec"))
            .json(&serde_json::json!({ "lang": "bash", "code": "echo down" }))
            .send(),
    )
    .await
    .expect("an exec hung while the daemon was down")
    .expect("the broker answers");
    let status = down.status().as_u16();
    assert!(matches!(status, 503 | 200), "{status}");
    let health = broker.get("/health").await;
    assert_eq!(health.status(), 503);
    tokio::task::spawn_blocking(start_dockerd)
        .await
        .expect("docker-up");

    // Back: the same broker process serves again, without a restart of its own.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let health: Value = broker.get("/health").await.json().await.expect("health");
        if health["status"] == "ok" {
            break;
        }
        assert!(Instant::now() < deadline, "health stays degraded: {health}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // The first call of each session may find its container gone with the old daemon;
    // it answers with a new one, never an error, and its files are all there.
    for id in [&s, &session(&other)] {
        let out = broker.run("bash", "echo ok", Some(id)).await;
        assert_eq!(stdout(&out), "ok\n", "{out}");
        assert_eq!(session(&out), *id);
    }
    let started = Instant::now();
    let out = broker
        .run("bash", "echo ok; cat /mnt/data/kept.txt", Some(&s))
        .await;
    assert_eq!(stdout(&out), "ok\nkept\n", "{out}");
    assert!(started.elapsed() < Duration::from_secs(2), "{out}");
    let download = broker.get(&format!("/download/{s}/{kept}")).await;
    assert_eq!(download.status(), 200);
    let fresh = broker.run("bash", "echo fresh", None).await;
    assert_eq!(stdout(&fresh), "fresh\n", "{fresh}");
    // Only live containers are left: the old daemon's ones were removed.
    for id in broker.containers() {
        assert_eq!(
            common::inspect(&id)["State"]["Running"],
            true,
            "a dead container was left: {id}"
        );
    }
    assert_eq!(broker.containers().len(), 3);
}
