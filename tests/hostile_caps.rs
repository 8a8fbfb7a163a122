//! A fresh install protects a shared host: with the shipped defaults (the configuration
//! parsed from an empty command line, as `codebroker` starts), one user's flood of new
//! sessions or execs gets 429 with `retry_after_seconds` while another user's exec still
//! runs, and the containers never outnumber the cap derived from the host's memory.

mod common;

use clap::Parser;
use codebroker::config::Config;
use common::{session, stdout, TestBroker};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A broker on the shipped defaults, except what a test must set to run at all (auth
/// off, its own data directory and instance, port 0) and the `extra` flags it names.
/// The warm pool is off so that `docker ps` counts session containers only.
async fn shipped(tag: &str, extra: &[&str]) -> (TestBroker, tempfile::TempDir) {
    common::require_image();
    let tmp = tempfile::tempdir().expect("tempdir");
    let instance = common::instance_name(tag);
    let data = tmp.path().display().to_string();
    let mut args = vec![
        "codebroker",
        "--auth",
        "none",
        "--data-dir",
        &data,
        "--instance",
        &instance,
        "--pool-size",
        "0",
    ];
    args.extend_from_slice(extra);
    let config = Config::try_parse_from(args).expect("the shipped defaults parse");
    (TestBroker::serve(config).await, tmp)
}

/// The Docker host's memory, as `docker info` reports it.
fn host_memory() -> u64 {
    let out = common::docker::docker(&["info", "--format", "{{.MemTotal}}"]);
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("MemTotal")
}

/// The container ceiling the documentation promises for the defaults, with the broker on
/// the Docker host: three quarters of the host's memory over 64 MiB (an idle sandbox), at
/// least 2; below it, admission by the memory available (`auto_admits_by_the_memory_the_host_has`).
fn documented_container_cap() -> usize {
    ((host_memory() / 4 * 3) / (64 << 20)).max(2) as usize
}

/// A proc directory for CODEBROKER_HOST_PROC: this host's MemTotal (the engine's), and
/// `available_mib` available.
fn fake_proc(dir: &std::path::Path, available_mib: u64) {
    let real = std::fs::read_to_string("/proc/meminfo").expect("meminfo");
    let total = real
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .expect("MemTotal");
    std::fs::write(
        dir.join("meminfo"),
        format!("{total}\nMemAvailable:   {} kB\n", available_mib * 1024),
    )
    .expect("write meminfo");
}

#[tokio::test]
async fn auto_admits_by_the_memory_the_host_has() {
    let proc_dir = tempfile::tempdir().expect("tempdir");
    let plenty = (host_memory() * 9 / 10) >> 20;
    fake_proc(proc_dir.path(), plenty);
    let host_proc = proc_dir.path().display().to_string();
    let (broker, _tmp) = shipped("caps-memory", &["--host-proc", &host_proc]).await;
    // Memory to spare: two users' sessions start.
    let (status, first) = exec_as(&broker, "a", json!({"lang": "bash", "code": "echo a"})).await;
    assert_eq!(status, 200, "{first}");
    let (status, second) = exec_as(&broker, "b", json!({"lang": "bash", "code": "echo b"})).await;
    assert_eq!(status, 200, "{second}");
    assert_eq!(common::containers_of(&broker.instance).len(), 2);
    // The host runs short (less than a quarter available): a new session takes the place
    // of the least recently used idle sandbox, whose session keeps its files.
    fake_proc(proc_dir.path(), (host_memory() / 8) >> 20);
    let (status, third) = exec_as(&broker, "c", json!({"lang": "bash", "code": "echo c"})).await;
    assert_eq!(status, 200, "{third}");
    let first_session = session(&first);
    let label = format!("codebroker.session={first_session}");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !common::docker::containers_matching(&broker.instance, &[&label]).is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the least recently used idle sandbox still runs"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Every sandbox running code and no memory: 429, saying why.
    let busy: Vec<_> = [&second, &third]
        .iter()
        .map(|s| {
            let broker = &broker;
            let id = session(s);
            async move {
                broker
                    .exec(json!({"lang": "bash", "code": "sleep 6", "session_id": id}))
                    .await
            }
        })
        .collect();
    let refused = async {
        tokio::time::sleep(Duration::from_secs(2)).await;
        exec_as(&broker, "d", json!({"lang": "bash", "code": "echo d"})).await
    };
    let (ran, (status, body)) = tokio::join!(futures::future::join_all(busy), refused);
    for (status, body) in ran {
        assert_eq!(status, 200, "{body}");
    }
    assert_eq!(status, 429, "{body}");
    assert_rate_limited(&body);
    assert!(
        body["message"].to_string().contains("short of memory"),
        "{body}"
    );
    // Memory back: served again, and the first session runs again with its files.
    fake_proc(proc_dir.path(), plenty);
    let (status, body) = exec_as(&broker, "d", json!({"lang": "bash", "code": "echo d"})).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = exec_as(
        &broker,
        "a",
        json!({"lang": "bash", "code": "echo again", "session_id": first_session}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
}

/// POST /exec as `user`.
async fn exec_as(broker: &TestBroker, user: &str, body: Value) -> (u16, Value) {
    broker.exec_with(&[("user-id", user)], body).await
}

fn assert_rate_limited(body: &Value) {
    assert_eq!(body["error"], "rate_limited", "{body}");
    let wait = body["retry_after_seconds"]
        .as_u64()
        .expect("retry_after_seconds");
    assert!(wait >= 1, "{body}");
}

/// Samples the instance's container count until stopped; returns the largest seen.
fn watch_containers(instance: String, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<usize> {
    tokio::task::spawn_blocking(move || {
        let mut most = 0;
        while !stop.load(Ordering::SeqCst) {
            most = most.max(common::containers_of(&instance).len());
            std::thread::sleep(Duration::from_millis(250));
        }
        most
    })
}

#[tokio::test]
async fn a_flood_of_new_sessions_gets_429_while_another_user_runs_code() {
    let (broker, _tmp) = shipped("caps-flood", &[]).await;
    let cap = documented_container_cap();
    // Over the per-user cap (8) and, on hosts up to 48 GiB, over the container cap too;
    // few enough for a 2-core machine.
    const FLOOD: usize = 40;
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = watch_containers(broker.instance.clone(), stop.clone());
    let served = Arc::new(AtomicUsize::new(0));
    let flood = futures::future::join_all((0..FLOOD).map(|i| {
        let broker = &broker;
        let served = served.clone();
        async move {
            let code = format!("sleep 12; echo {i}");
            let (status, body) =
                exec_as(broker, "flood", json!({ "lang": "bash", "code": code })).await;
            match status {
                200 => {
                    assert_eq!(stdout(&body), format!("{i}\n"), "{body}");
                    served.fetch_add(1, Ordering::SeqCst);
                }
                429 => assert_rate_limited(&body),
                other => panic!("flood exec {i}: {other} {body}"),
            }
            status
        }
    }));
    let bystander = async {
        // Once the flood holds its sandboxes, another user's code still runs.
        tokio::time::sleep(Duration::from_secs(4)).await;
        let (status, body) = exec_as(
            &broker,
            "calm",
            json!({ "lang": "py", "code": "print(6 * 7)" }),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(stdout(&body), "42\n", "{body}");
        session(&body)
    };
    let (statuses, calm) = tokio::join!(flood, bystander);
    stop.store(true, Ordering::SeqCst);
    let most = watcher.await.expect("watcher");
    let refused = statuses.iter().filter(|s| **s == 429).count();
    let served = served.load(Ordering::SeqCst);
    let per_user = 8.min((cap / 4).max(1));
    eprintln!("flood of {FLOOD}: {served} served, {refused} refused, at most {most} containers at once (cap {cap}, per user {per_user})");
    assert!(refused > 0, "no 429 among {FLOOD} new sessions of one user");
    assert!(
        served <= per_user,
        "{served} sessions served to one user, over the per-user cap {per_user}"
    );
    assert!(
        most <= cap,
        "{most} containers at once, over the documented cap {cap}"
    );
    // The flooding user, now idle, is served again; so is the bystander.
    let (status, body) = exec_as(
        &broker,
        "flood",
        json!({ "lang": "bash", "code": "echo again" }),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = exec_as(
        &broker,
        "calm",
        json!({ "lang": "py", "code": "print('still')", "session_id": calm }),
    )
    .await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test]
async fn an_exec_flood_in_one_session_gets_429_while_another_user_runs_code() {
    let (broker, _tmp) = shipped("caps-rate", &[]).await;
    let (status, first) =
        exec_as(&broker, "flood", json!({ "lang": "bash", "code": "true" })).await;
    assert_eq!(status, 200, "{first}");
    let s = session(&first);
    // 130 at once into one session: the default budget of 120 a minute (the first one
    // above used one) lets 119 queue, and two more a second; the rest are refused.
    let started = std::time::Instant::now();
    let flood = futures::future::join_all((0..130).map(|_| {
        exec_as(
            &broker,
            "flood",
            json!({ "lang": "bash", "code": "true", "session_id": s }),
        )
    }))
    .await;
    let refused: Vec<&Value> = flood
        .iter()
        .filter(|(status, _)| *status == 429)
        .map(|(_, body)| body)
        .collect();
    for (status, body) in &flood {
        assert!(*status == 200 || *status == 429, "{status} {body}");
    }
    let refilled = (started.elapsed().as_secs_f64() * 2.0).ceil() as usize;
    eprintln!(
        "exec flood of 130 into one session: {} refused in {:?}",
        refused.len(),
        started.elapsed()
    );
    assert!(!refused.is_empty(), "none of 130 refused");
    assert!(
        130 - refused.len() <= 119 + refilled,
        "{} of 130 served in {:?}",
        130 - refused.len(),
        started.elapsed()
    );
    assert_rate_limited(refused[0]);
    let (status, body) = exec_as(
        &broker,
        "calm",
        json!({ "lang": "bash", "code": "echo ok" }),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(stdout(&body), "ok\n");
}

#[tokio::test]
async fn uploads_count_against_the_rate() {
    let (broker, _tmp) = shipped("caps-upload", &["--rate-execs-per-minute", "4"]).await;
    let upload = |session_id: Option<String>| {
        let mut form = reqwest::multipart::Form::new().part(
            "file",
            reqwest::multipart::Part::bytes(b"x".to_vec()).file_name("a.txt"),
        );
        if let Some(s) = session_id {
            form = form.text("session_id", s);
        }
        broker
            .client
            .post(broker.url("/upload"))
            .header("user-id", "uploader")
            .multipart(form)
            .send()
    };
    let mut made = Vec::new();
    for _ in 0..3 {
        let resp = upload(None).await.expect("upload");
        assert_eq!(resp.status().as_u16(), 200);
        let body: Value = resp.json().await.expect("json");
        made.push(session(&body));
    }
    // Into a session of hers, an upload makes nothing new but writes as much: it is
    // counted too.
    let resp = upload(Some(made[0].clone())).await.expect("upload");
    assert_eq!(resp.status().as_u16(), 200);
    for into in [None, Some(made[0].clone())] {
        let resp = upload(into).await.expect("upload");
        assert_eq!(resp.status().as_u16(), 429);
        assert_rate_limited(&resp.json().await.expect("json"));
    }
}

#[tokio::test]
async fn the_shipped_caps_are_on_and_derived_from_the_hosts_memory() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let instance = common::instance_name("caps-defaults");
    let data = tmp.path().display().to_string();
    let config = Config::try_parse_from([
        "codebroker",
        "--auth",
        "none",
        "--data-dir",
        &data,
        "--instance",
        &instance,
    ])
    .expect("defaults");
    assert_eq!(config.caps.rate_execs_per_minute, 120);
    let broker = codebroker::build(config).await.expect("broker");
    let cap = documented_container_cap();
    assert!(cap >= 2);
    assert_eq!(broker.caps().max_containers, cap);
    assert_eq!(
        broker.caps().max_sessions_per_user,
        8.min((cap / 4).max(1)),
        "a quarter of the cap by default"
    );
}
