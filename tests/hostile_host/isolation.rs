//! Isolation: sessions and users share nothing, and a pooled container carries no other
//! session's state.

use super::*;
use common::docker::container_of;
use common::jwt::jwt;
use serde_json::json;

/// What one session leaves for another to find: a Python global, a file, a process.
const LEAVE_TRACES: &str = "import subprocess\n\
    TRACE = 'left-behind'\n\
    open('/mnt/data/trace.txt', 'w').write('trace')\n\
    open('/tmp/trace.txt', 'w').write('trace')\n\
    subprocess.Popen(['bash', '-c', 'exec -a trace-process sleep 300'], start_new_session=True)\n\
    print('traced')";

/// Python that prints what it finds of another session's traces.
const LOOK_FOR_TRACES: &str = "import os, subprocess\n\
    print('global', 'TRACE' in globals())\n\
    print('file', os.path.exists('/mnt/data/trace.txt'))\n\
    print('tmp', os.path.exists('/tmp/trace.txt'))\n\
    ps = subprocess.run(['ps', '-eo', 'pid,args'], capture_output=True, text=True).stdout\n\
    print('process', 'trace-process' in ps)\n\
    print('pids', len(ps.strip().splitlines()) - 1)";

fn assert_no_traces(out: &Value) {
    let text = stdout(out);
    for line in ["global False", "file False", "tmp False", "process False"] {
        assert!(text.contains(line), "{line}: {out}");
    }
    // Only this sandbox's own few processes: the runner, the kernel, ps and its shell.
    let pids: usize = text
        .lines()
        .find_map(|l| l.strip_prefix("pids "))
        .and_then(|n| n.trim().parse().ok())
        .expect("pid count");
    assert!(pids < 10, "{pids} processes visible: {out}");
}

#[tokio::test]
async fn sessions_of_one_user_share_nothing() {
    let broker = TestBroker::start_with("hh-iso-user", |c| {
        c.access.auth = AuthMode::Key;
        c.access.api_key = vec!["k".into()];
    })
    .await;
    let exec = |body: Value| {
        let broker = &broker;
        async move {
            let resp = broker
                .client
                .post(broker.url("/exec"))
                .header("x-api-key", "k")
                .json(&body)
                .send()
                .await
                .expect("exec");
            assert_eq!(resp.status(), 200);
            let text = resp.text().await.unwrap();
            serde_json::from_str::<Value>(text.trim()).unwrap()
        }
    };
    let a = exec(json!({ "lang": "py", "code": LEAVE_TRACES, "user_id": "u1" })).await;
    assert_eq!(stdout(&a), "traced\n", "{a}");
    let b = exec(json!({ "lang": "py", "code": LOOK_FOR_TRACES, "user_id": "u1" })).await;
    assert_ne!(session(&a), session(&b));
    assert_no_traces(&b);
    // The traces are still where they were left.
    let again = exec(
        json!({ "lang": "py", "code": "print(TRACE)", "user_id": "u1",
                             "session_id": session(&a) }),
    )
    .await;
    assert_eq!(stdout(&again), "left-behind\n", "{again}");
    let started = Instant::now();
    let ok = exec(json!({ "lang": "bash", "code": "echo ok", "user_id": "u1",
                          "session_id": session(&b) }))
    .await;
    assert_eq!(stdout(&ok), "ok\n");
    assert!(started.elapsed() < RECOVERY);
}

#[tokio::test]
async fn users_share_nothing() {
    let broker = authed_broker("hh-iso-users").await;
    let (alice, bob) = (jwt("alice"), jwt("bob"));
    let (status, a) = exec_as(
        &broker,
        &alice,
        json!({ "lang": "py", "code": LEAVE_TRACES }),
    )
    .await;
    assert_eq!(status, 200, "{a}");
    let s = session(&a);
    // Bob, even naming her session, gets his own with none of her traces.
    let (status, b) = exec_as(
        &broker,
        &bob,
        json!({ "lang": "py", "code": LOOK_FOR_TRACES, "session_id": s }),
    )
    .await;
    assert_eq!(status, 200, "{b}");
    assert_ne!(session(&b), s);
    assert_no_traces(&b);
    let listed = broker
        .client
        .get(broker.url(&format!("/files/{s}")))
        .bearer_auth(&bob)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!listed.contains("trace.txt"), "{listed}");
    // Alice's session is intact and answers.
    let started = Instant::now();
    let (status, ok) = exec_as(
        &broker,
        &alice,
        json!({ "lang": "bash", "code": "echo ok; cat /mnt/data/trace.txt", "session_id": s }),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(stdout(&ok), "ok\ntrace", "{ok}");
    assert!(started.elapsed() < RECOVERY);
}

#[tokio::test]
async fn a_pooled_container_never_carries_another_sessions_state() {
    let broker = TestBroker::start_with("hh-pool", |c| c.pool.pool_size = 2).await;
    broker.wait_for_pool(2).await;
    let a = broker.run("py", LEAVE_TRACES, None).await;
    assert_eq!(stdout(&a), "traced\n", "{a}");
    let a_container = container_of(&broker.instance, &session(&a));
    // Every session the pool serves after A is clean, and never runs in A's container.
    for _ in 0..3 {
        broker.wait_for_pool(1).await;
        let b = broker.run("py", LOOK_FOR_TRACES, None).await;
        assert_ne!(session(&b), session(&a));
        assert_eq!(b["runtime_status"], "new", "{b}");
        assert_no_traces(&b);
        assert_ne!(container_of(&broker.instance, &session(&b)), a_container);
        echo_ok(&broker, &session(&b)).await;
    }
    let again = broker.run("py", "print(TRACE)", Some(&session(&a))).await;
    assert_eq!(stdout(&again), "left-behind\n");
    // A graceful stop first: it ends the pool's refills, so none creates a container after
    // the removal below (a slow runtime's refill is often still under way here).
    let instance = broker.instance.clone();
    let _data = broker.stop().await;
    common::remove_containers_of(&instance);
}
