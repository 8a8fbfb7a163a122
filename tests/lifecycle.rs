//! Lockdown read back from `docker inspect`, idle removal, dead sandboxes, restarts.

mod common;

use codebroker::config::Config;
use common::{inspect, session, stdout, TestBroker};
use std::time::Duration;

#[tokio::test]
async fn lockdown_flags_read_back_from_docker_inspect() {
    let broker = TestBroker::start("lockdown").await;
    let resp = broker.run("bash", "id -u; echo $HOME; pwd", None).await;
    let lines: Vec<&str> = stdout(&resp).lines().collect();
    assert_eq!(lines[1..], ["/mnt/data", "/mnt/data"], "{resp}");
    // A uid of its own from CODEBROKER_SANDBOX_UIDS (the first is given to none).
    let uid: u32 = lines[0].parse().expect("uid");
    assert!((200_001..=265_535).contains(&uid), "{resp}");
    let containers = broker.containers();
    assert_eq!(containers.len(), 1);
    let c = inspect(&containers[0]);
    let host = &c["HostConfig"];
    assert_eq!(host["NetworkMode"], "none");
    assert_eq!(host["CapDrop"], serde_json::json!(["ALL"]));
    assert!(host["SecurityOpt"]
        .as_array()
        .is_some_and(|o| o.iter().any(|v| v == "no-new-privileges")));
    assert_eq!(host["ReadonlyRootfs"], true);
    assert!(host["Tmpfs"]["/tmp"]
        .as_str()
        .unwrap_or("")
        .contains("size="));
    assert!(host["Tmpfs"]["/dev/shm"]
        .as_str()
        .unwrap_or("")
        .contains("size="));
    assert_eq!(host["PidsLimit"], 256);
    assert_eq!(host["Memory"], host["MemorySwap"]);
    assert!(host["Memory"].as_i64().unwrap_or(0) > 0);
    assert!(host["NanoCpus"].as_i64().unwrap_or(0) > 0);
    let ulimits = host["Ulimits"].as_array().expect("ulimits");
    assert!(ulimits.iter().any(|u| u["Name"] == "nofile"));
    assert!(ulimits.iter().any(|u| u["Name"] == "fsize"));
    assert_eq!(host["IpcMode"], "private");
    assert_eq!(host["LogConfig"]["Type"], "none");
    assert_eq!(c["Config"]["User"], format!("{uid}:{uid}").as_str());
    let labels = &c["Config"]["Labels"];
    assert_eq!(labels["codebroker.instance"], broker.instance.as_str());
    assert_eq!(labels["codebroker.session"], session(&resp).as_str());
    assert!(labels["codebroker.created"].is_string());

    // Root is read-only, /tmp is writable, there is no network.
    let probe = broker
        .run(
            "bash",
            "touch /usr/x 2>/dev/null && echo rw || echo ro; touch /tmp/x && echo tmp-ok; cat /sys/class/net/*/operstate 2>/dev/null | wc -l; ls /var/run/docker.sock 2>/dev/null || echo no-socket",
            Some(&session(&resp)),
        )
        .await;
    let out = stdout(&probe);
    assert!(out.contains("ro\n"), "{probe}");
    assert!(out.contains("tmp-ok"), "{probe}");
    assert!(out.contains("no-socket"), "{probe}");
}

#[tokio::test]
async fn an_idle_container_is_removed_and_the_session_restarts_on_its_files() {
    let broker = TestBroker::start_with("idle", |c| {
        c.lifecycle.idle_ttl_secs = 1;
        c.lifecycle.reap_interval_secs = 1;
        // Only the files here; the Python state kept across containers: python_state.rs.
        c.state.persist_state = false;
    })
    .await;
    let first = broker
        .run("py", "x = 1\nopen('keep.txt','w').write('kept')", None)
        .await;
    let s = session(&first);
    assert_eq!(broker.containers().len(), 1);
    let mut gone = false;
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        if broker.containers().is_empty() {
            gone = true;
            break;
        }
    }
    assert!(gone, "the idle container was not removed");
    let next = broker
        .run(
            "py",
            "print(open('keep.txt').read(), 'x' in globals())",
            Some(&s),
        )
        .await;
    assert_eq!(stdout(&next).trim(), "kept False", "{next}");
    assert_eq!(next["runtime_status"], "new");
}

#[tokio::test]
async fn a_dead_sandbox_is_replaced_without_touching_other_sessions() {
    let broker = TestBroker::start("dead").await;
    let a = broker.run("py", "a = 1", None).await;
    let b = broker.run("py", "b = 2", None).await;
    let (sa, sb) = (session(&a), session(&b));
    let containers = broker.containers();
    assert_eq!(containers.len(), 2);
    // Kill the container of session a from outside.
    let victim = common::docker::container_of(&broker.instance, &sa);
    assert!(containers.contains(&victim));
    let _ = common::docker::kill_container(&victim);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let again = broker.run("bash", "echo back", Some(&sa)).await;
    assert_eq!(stdout(&again).trim(), "back", "{again}");
    let other = broker.run("py", "print(b)", Some(&sb)).await;
    assert_eq!(stdout(&other).trim(), "2", "{other}");
    assert_eq!(other["runtime_status"], "reused");
}

#[tokio::test]
async fn a_restarted_broker_finds_its_containers() {
    let first = TestBroker::start("restart").await;
    let resp = first
        .run("py", "x = 41\nopen('f.txt','w').write('hi')", None)
        .await;
    let s = session(&resp);
    let file_id = resp["files"][0]["id"]
        .as_str()
        .expect("file id")
        .to_string();
    let instance = first.instance.clone();
    let data = first.data.clone();
    let tmp = first.stop().await;
    assert_eq!(
        common::containers_of(&instance).len(),
        1,
        "the container outlives the broker"
    );

    let mut config = Config::for_tests(data, &instance);
    config.pool.pool_size = 0;
    let second = TestBroker::serve(config).await;
    let next = second.run("py", "print(x + 1)", Some(&s)).await;
    assert_eq!(stdout(&next).trim(), "42", "{next}");
    assert_eq!(next["runtime_status"], "reused");
    assert_eq!(second.containers().len(), 1);
    let dl = second.get(&format!("/download/{s}/{file_id}")).await;
    assert_eq!(dl.status(), 200);
    assert_eq!(dl.text().await.unwrap_or_default(), "hi");
    drop(second);
    drop(tmp);
}

#[tokio::test]
async fn new_sessions_come_from_the_pool() {
    let broker = TestBroker::start_with("pool", |c| c.pool.pool_size = 1).await;
    broker.wait_for_pool(1).await;
    let resp = broker.run("py", "print(1)", None).await;
    assert_eq!(stdout(&resp).trim(), "1");
    assert_eq!(resp["runtime_status"], "new");
    // Two distinct sessions never share a container or files.
    let other = broker.run("bash", "ls", None).await;
    assert_ne!(session(&other), session(&resp));
    assert_eq!(stdout(&other), "");
    // A graceful stop ends the pool's refills first, so none creates a container after
    // the removal (dropping the broker mid-refill left one in `Created`).
    let instance = broker.instance.clone();
    let _data = broker.stop().await;
    common::remove_containers_of(&instance);
}

/// An upload makes a session without a sandbox; its first exec is handed a pooled one
/// (the session's files move into the pooled workspace) instead of starting a container,
/// and a restarted broker still finds that container for the session.
#[tokio::test]
async fn an_upload_session_is_handed_a_pooled_sandbox_that_survives_a_restart() {
    let first = TestBroker::start_with("pool-hand", |c| {
        c.pool.pool_size = 1;
        c.pool.pool_max = 1;
    })
    .await;
    first.wait_for_pool(1).await;
    let pooled = first.containers();
    assert_eq!(pooled.len(), 1, "{pooled:?}");
    let pooled = pooled[0].clone();
    let form = reqwest::multipart::Form::new().part(
        "file",
        reqwest::multipart::Part::bytes(b"4,5\n".to_vec()).file_name("in.csv"),
    );
    let up: serde_json::Value = reqwest::Client::new()
        .post(first.url("/upload"))
        .multipart(form)
        .send()
        .await
        .expect("upload")
        .json()
        .await
        .expect("json");
    let s = up["session_id"].as_str().expect("session").to_string();
    let file_id = up["files"][0]["id"].as_str().expect("id").to_string();
    let (status, resp) = first
        .exec(serde_json::json!({
            "lang": "py",
            "session_id": s,
            "code": "x = sum(map(int, open('in.csv').read().split(',')))\nprint(x)\n_ = open('out.txt','w').write(str(x))",
            "files": [{"id": file_id, "session_id": s, "name": "in.csv"}],
        }))
        .await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(stdout(&resp), "9\n", "{resp}");
    assert_eq!(session(&resp), s);
    // The exec ran in the container that was pooled, which now sees the session's files.
    assert!(first.containers().contains(&pooled));
    let seen = common::docker::docker(&[
        "exec",
        &pooled,
        "cat",
        "/mnt/data/in.csv",
        "/mnt/data/out.txt",
    ]);
    assert_eq!(String::from_utf8_lossy(&seen.stdout), "4,5\n9");
    let out_id = resp["files"][0]["id"].as_str().expect("out id").to_string();
    assert_eq!(resp["files"][0]["name"], "out.txt", "{resp}");

    let instance = first.instance.clone();
    let data = first.data.clone();
    let tmp = first.stop().await;
    let mut config = Config::for_tests(data, &instance);
    config.pool.pool_size = 0;
    let second = TestBroker::serve(config).await;
    let next = second.run("py", "print(x * 2)", Some(&s)).await;
    assert_eq!(stdout(&next), "18\n", "{next}");
    assert_eq!(next["runtime_status"], "reused");
    assert_eq!(second.containers(), vec![pooled]);
    let dl = second.get(&format!("/download/{s}/{out_id}")).await;
    assert_eq!(dl.text().await.unwrap_or_default(), "9");
    drop(second);
    drop(tmp);
}

/// A burst of new sessions grows the pool to the burst's size (up to its maximum), so the
/// next burst is served from it.
#[tokio::test]
async fn the_pool_grows_after_a_burst_of_new_sessions() {
    let broker = TestBroker::start_with("pool-grow", |c| {
        c.pool.pool_size = 1;
        c.pool.pool_max = 3;
    })
    .await;
    broker.wait_for_pool(1).await;
    let codes: Vec<String> = (0..4).map(|i| format!("print({i})")).collect();
    let burst = codes.iter().map(|code| broker.run("py", code, None));
    for (i, resp) in futures::future::join_all(burst).await.iter().enumerate() {
        assert_eq!(stdout(resp), format!("{i}\n"), "{resp}");
    }
    let health = broker.wait_for_pool(3).await;
    assert_eq!(health["pool"]["target"], 3, "{health}");
    assert_eq!(health["pool"]["ready"], 3, "{health}");
    let burst = (0..3).map(|_| broker.run("py", "print('again')", None));
    for resp in futures::future::join_all(burst).await {
        assert_eq!(stdout(&resp), "again\n", "{resp}");
    }
}

/// A pooled container that dies before it is taken is removed with its workspace, and the
/// pool starts another.
#[tokio::test]
async fn a_dead_pooled_container_is_removed_and_replaced() {
    let broker = TestBroker::start_with("pool-dead", |c| {
        c.pool.pool_size = 1;
        c.pool.pool_max = 1;
    })
    .await;
    broker.wait_for_pool(1).await;
    let dead = broker.containers();
    assert_eq!(dead.len(), 1, "{dead:?}");
    let killed = common::docker::kill_container(&dead[0]);
    assert!(killed.status.success(), "{killed:?}");
    let sessions = broker.data.join("sessions");
    let workspaces = || std::fs::read_dir(&sessions).map_or(0, |d| d.count());
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let ids = broker.containers();
        if ids.len() == 1 && ids[0] != dead[0] && workspaces() == 1 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "containers {ids:?}, workspaces {}",
            workspaces()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    broker.wait_for_pool(1).await;
    let resp = broker.run("py", "print('fresh')", None).await;
    assert_eq!(stdout(&resp), "fresh\n");
}
