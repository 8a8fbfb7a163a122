//! Lifecycle and faults: clients that leave, a killed broker, bursts of sessions, idle
//! reaping during a start.

use super::*;
use codebroker::config::ContainerCap;
use common::child::{ChildBroker, Launch};
use common::docker::{container_of, RemoveContainers};
use common::{containers_of, stderr};
use serde_json::json;

/// Bash that appends a line to `/mnt/data/grow.txt` every 100 ms for a minute.
const GROW: &str = "for i in $(seq 1 600); do echo $i >> /mnt/data/grow.txt; sleep 0.1; done";

/// The size of `grow.txt` now and a second later, and whether the loop still runs.
const MEASURE_GROWTH: &str =
    "a=$(wc -l < /mnt/data/grow.txt); sleep 1; b=$(wc -l < /mnt/data/grow.txt)\n\
    echo \"$a $b\"; ps -eo args | grep -c '[s]eq 1 600'";

#[tokio::test]
async fn a_client_that_disconnects_stops_its_exec() {
    let broker = TestBroker::start("hh-disconnect").await;
    let bystander = Bystander::start(&broker).await;
    let first = broker.run("bash", "echo ready", None).await;
    let s = session(&first);
    // Gone before the first byte of the answer (1 s), and gone while the keep-alive
    // spaces already flow (5 s).
    for give_up_after in [Duration::from_secs(1), Duration::from_secs(5)] {
        let request = broker
            .client
            .post(broker.url("/exec"))
            .json(&json!({ "lang": "bash", "code": GROW, "session_id": s, "timeout": 30000 }))
            .send();
        let gave_up = tokio::time::timeout(give_up_after, async {
            let resp = request.await.expect("exec");
            resp.text().await
        })
        .await;
        assert!(gave_up.is_err(), "the exec ended on its own");
        let started = Instant::now();
        // The session's next call waits for the cancelled exec: it comes at once when the
        // cancel worked, and only after the loop's minute when it did not.
        let out = broker.run("bash", MEASURE_GROWTH, Some(&s)).await;
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "the exec ran on after its client left ({:?})",
            started.elapsed()
        );
        let lines: Vec<&str> = stdout(&out).lines().collect();
        let sizes: Vec<u64> = lines[0]
            .split_whitespace()
            .map(|n| n.parse().expect("count"))
            .collect();
        assert_eq!(sizes[0], sizes[1], "grow.txt still grows: {out}");
        assert!(sizes[0] > 0, "the loop never ran: {out}");
        assert_eq!(lines[1], "0", "the loop still runs: {out}");
        broker
            .run("bash", "rm -f /mnt/data/grow.txt", Some(&s))
            .await;
        echo_ok(&broker, &s).await;
    }
    bystander.check(&broker).await;
}

/// The broker binary on `data_dir` as `instance`, without auth; killed with SIGKILL by
/// the test or on drop, its containers left for the next broker.
async fn broker_process(data_dir: &Path, instance: &str) -> ChildBroker {
    Launch::binary(instance, data_dir)
        .env("CODEBROKER_AUTH", "none")
        // Ten sessions of one unnamed caller: over the shipped per-user cap (8), the
        // least recently used would make room, and this case is about the crash.
        .env("CODEBROKER_MAX_SESSIONS_PER_USER", "0")
        .quiet()
        .keep_containers()
        .spawn()
        .await
}

#[tokio::test]
async fn a_killed_broker_restarts_without_leaks_or_losses() {
    common::require_image();
    let tmp = tempfile::tempdir().expect("tempdir");
    let instance = common::instance_name("hh-kill");
    let _cleanup = RemoveContainers(instance.clone());
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap();
    let mut first = broker_process(tmp.path(), &instance).await;
    // Ten sessions, each with a file and a kernel global.
    let mut sessions = Vec::new();
    for i in 0..10 {
        let out: Value = client
            .post(format!("{}/exec", first.base))
            .json(&json!({ "lang": "py", "code":
                format!("open('/mnt/data/kept-{i}.txt', 'w').write('kept {i}')\nKEPT = {i}\nprint('ok')") }))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(stdout(&out), "ok\n", "{out}");
        let file = out["files"][0]["id"].as_str().expect("file id").to_string();
        sessions.push((session(&out), file));
    }
    // Ten execs running when the broker dies.
    let mut running = Vec::new();
    for (s, _) in &sessions {
        let request = client.post(format!("{}/exec", first.base)).json(
            &json!({ "lang": "bash", "session_id": s,
                     "code": "for i in $(seq 1 50); do echo $i >> /mnt/data/during.txt; sleep 0.1; done" }),
        );
        running.push(tokio::spawn(request.send()));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    first.kill();
    for r in running {
        let _ = r.await;
    }
    // Restart on the same data directory and instance: the start-up reconcile re-attaches
    // to the running containers (or removes what it cannot use) before serving.
    let second = broker_process(tmp.path(), &instance).await;
    let after_restart = containers_of(&instance);
    assert!(after_restart.len() <= sessions.len(), "{after_restart:?}");
    for id in &after_restart {
        assert_eq!(common::inspect(id)["State"]["Running"], true, "{id}");
    }
    for (i, (s, file)) in sessions.iter().enumerate() {
        // No file lost.
        let resp = client
            .get(format!("{}/download/{s}/{file}", second.base))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "session {i}");
        assert_eq!(resp.text().await.unwrap(), format!("kept {i}"));
        let started = Instant::now();
        let out: Value = client
            .post(format!("{}/exec", second.base))
            .json(&json!({ "lang": "bash", "code": "echo ok; cat /mnt/data/kept-*.txt", "session_id": s }))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(stdout(&out), format!("ok\nkept {i}"), "{out}");
        assert!(
            started.elapsed() < RECOVERY,
            "session {i} took {:?}",
            started.elapsed()
        );
        // Re-attached, not replaced: the kernel kept its state through the crash.
        let out: Value = client
            .post(format!("{}/exec", second.base))
            .json(&json!({ "lang": "py", "code": "print(KEPT)", "session_id": s }))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(stdout(&out), format!("{i}\n"), "{out}");
    }
    // Every container of the instance belongs to one of the sessions, one each, and runs:
    // re-attached (or replaced), none orphaned.
    let containers = containers_of(&instance);
    assert_eq!(containers.len(), sessions.len(), "{containers:?}");
    for (s, _) in &sessions {
        let id = container_of(&instance, s);
        assert_eq!(common::inspect(&id)["State"]["Running"], true);
    }
    drop(second);
}

/// Starts 64 sessions at once on a broker with `max_containers` (0: no cap); every
/// request is served or refused with 429, never a 5xx. Returns how many were served.
/// Each exec holds its sandbox busy for a moment, so that a cap is met by running code
/// (idle sandboxes make room instead of refusing).
async fn burst_of_64(tag: &str, max_containers: usize) -> usize {
    let broker = TestBroker::start_with(tag, |c| {
        c.caps.max_containers = ContainerCap::Count(max_containers);
        // Room for the burst and the bystander: at the default cap of 64 live sandboxes
        // the 65th would rightly evict the least recently used idle one, the bystander
        // (that eviction is `churn.rs`'s to test).
        c.caps.max_live_sandboxes = 65;
    })
    .await;
    let bystander = Bystander::start(&broker).await;
    let requests = (0..64).map(|i| {
        let broker = &broker;
        async move {
            let resp = broker
                .client
                .post(broker.url("/exec"))
                .json(&json!({ "lang": "bash", "code": format!("sleep 2; echo {i}") }))
                .send()
                .await
                .expect("exec");
            let status = resp.status().as_u16();
            let text = resp.text().await.unwrap();
            let body: Value = serde_json::from_str(text.trim()).unwrap_or(Value::String(text));
            (i, status, body)
        }
    });
    let answers = futures::future::join_all(requests).await;
    let mut served = Vec::new();
    let mut refused = 0;
    for (i, status, body) in &answers {
        match status {
            200 => {
                assert_eq!(stdout(body), format!("{i}\n"), "{body}");
                served.push(session(body));
            }
            429 => {
                assert!(body["retry_after_seconds"].is_number(), "{body}");
                refused += 1;
            }
            other => panic!("request {i}: {other} {body}"),
        }
    }
    assert!(!served.is_empty());
    assert_eq!(served.len() + refused, 64);
    echo_ok(&broker, &served[0]).await;
    if max_containers == 0 {
        bystander.check(&broker).await;
    } else {
        // The idle bystander was the least recently used sandbox, and made room at the
        // cap; its session still works, on a new sandbox.
        echo_ok(&broker, &bystander.session).await;
    }
    served.len()
}

#[tokio::test]
async fn sixty_four_sessions_at_once_are_all_served() {
    assert_eq!(burst_of_64("hh-burst", 0).await, 64);
}

#[tokio::test]
async fn sixty_four_sessions_over_the_cap_are_refused_with_429() {
    // 24 sandboxes at most: the idle bystander's makes room, the busy ones do not.
    assert_eq!(burst_of_64("hh-burst-cap", 24).await, 24);
}

#[tokio::test]
async fn idle_reaping_never_kills_a_starting_exec() {
    let broker = TestBroker::start_with("hh-reap", |c| {
        c.lifecycle.idle_ttl_secs = 1;
        c.lifecycle.reap_interval_secs = 1;
    })
    .await;
    let first = broker.run("bash", "echo start", None).await;
    let s = session(&first);
    // Execs that arrive around the moment the session turns idle (the reaper runs every
    // second with a one-second TTL), and execs that last longer than the TTL.
    let pauses_ms = [950u64, 1000, 1050, 1100, 900, 1200, 1000, 1020, 980, 1300];
    for (i, pause) in pauses_ms.iter().enumerate() {
        tokio::time::sleep(Duration::from_millis(*pause)).await;
        let code = if i % 2 == 0 {
            format!("echo run {i}")
        } else {
            format!("sleep 1.5; echo run {i}")
        };
        let out = broker.run("bash", &code, Some(&s)).await;
        assert_eq!(stdout(&out), format!("run {i}\n"), "{out}");
        assert_eq!(out["exit_code"], 0, "{out}");
        assert!(!stderr(&out).contains("stopped unexpectedly"), "{out}");
        assert_eq!(session(&out), s);
    }
    // Idle for real: the container goes (within a few reaper rounds, however busy the
    // engine), the files stay, the session answers again.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !broker.containers().is_empty() {
        assert!(Instant::now() < deadline, "an idle container stayed");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    echo_ok_within(&broker, &s, FRESH_START).await;
}
