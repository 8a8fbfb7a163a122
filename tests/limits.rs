//! Limits: wall time, leftovers, output caps. Each is followed by a call that must work.

mod common;

use common::{session, stderr, stdout, TestBroker};
use serde_json::json;
use std::time::Instant;

#[tokio::test]
async fn an_endless_loop_is_stopped_and_the_next_exec_works() {
    let broker = TestBroker::start("loop").await;
    let started = Instant::now();
    let (status, resp) = broker
        .exec(json!({ "lang": "py", "code": "while True:\n    pass", "timeout": 2000 }))
        .await;
    assert_eq!(status, 200);
    assert!(
        started.elapsed().as_secs() < 15,
        "took {:?}",
        started.elapsed()
    );
    assert_eq!(resp["limits"], json!(["Time limit exceeded"]), "{resp}");
    assert!(stderr(&resp).contains("Time limit exceeded"), "{resp}");
    let s = session(&resp);
    let next = broker.run("py", "print('ok')", Some(&s)).await;
    assert_eq!(stdout(&next).trim(), "ok", "{next}");

    let (_, bash) = broker
        .exec(json!({ "lang": "bash", "code": "while true; do :; done", "timeout": 1000, "session_id": s }))
        .await;
    assert_eq!(bash["limits"], json!(["Time limit exceeded"]), "{bash}");
    let next = broker.run("bash", "echo ok", Some(&s)).await;
    assert_eq!(stdout(&next).trim(), "ok", "{next}");
}

#[tokio::test]
async fn background_processes_are_gone_after_the_exec() {
    let broker = TestBroker::start("leftovers").await;
    let first = broker
        .run(
            "bash",
            "nohup sleep 1000 >/dev/null 2>&1 &\nsetsid sleep 1001 >/dev/null 2>&1 &\n(sleep 1002 &) &\necho started",
            None,
        )
        .await;
    assert_eq!(stdout(&first).trim(), "started", "{first}");
    let s = session(&first);
    let check = broker
        .run(
            "bash",
            "ps -eo args | grep '^sleep 100' || echo none",
            Some(&s),
        )
        .await;
    assert_eq!(stdout(&check).trim(), "none", "{check}");

    // The same from Python's kernel.
    broker
        .run(
            "py",
            "import subprocess\nsubprocess.Popen(['setsid', 'sleep', '1003'])",
            Some(&s),
        )
        .await;
    let check = broker
        .run(
            "bash",
            "ps -eo args | grep '^sleep 100' || echo none",
            Some(&s),
        )
        .await;
    assert_eq!(stdout(&check).trim(), "none", "{check}");
}

#[tokio::test]
async fn output_is_capped_and_reported() {
    let broker = TestBroker::start("flood").await;
    let resp = broker
        .run(
            "py",
            "import sys\nsys.stdout.write('x' * 1_000_000)\nsys.stderr.write('e' * 1_000_000)",
            None,
        )
        .await;
    let out = stdout(&resp);
    assert!(out.len() <= 64 * 1024 + 100, "stdout {} bytes", out.len());
    assert!(out.len() >= 60 * 1024, "stdout {} bytes", out.len());
    let limits = resp["limits"].as_array().expect("limits");
    assert!(
        limits.contains(&json!("stdout length exceeded")),
        "{limits:?}"
    );
    assert!(
        limits.contains(&json!("stderr length exceeded")),
        "{limits:?}"
    );
    assert!(stderr(&resp).contains("stdout length exceeded"));
    let s = session(&resp);
    let next = broker.run("bash", "echo ok", Some(&s)).await;
    assert_eq!(stdout(&next).trim(), "ok");
}

#[tokio::test]
async fn a_print_loop_hits_the_output_cap_and_the_kernel_goes_on() {
    let broker = TestBroker::start("floodloop").await;
    let resp = broker
        .run(
            "py",
            "for i in range(200000):\n    print(i)\nx = 'kept'",
            None,
        )
        .await;
    let out = stdout(&resp);
    assert!(out.len() <= 64 * 1024, "stdout {} bytes", out.len());
    assert!(
        out.starts_with("0\n1\n2\n"),
        "{}",
        &out[..40.min(out.len())]
    );
    let limits = resp["limits"].as_array().expect("limits");
    assert_eq!(limits, &vec![json!("stdout length exceeded")], "{resp}");
    assert!(
        stderr(&resp).contains("Error: stdout length exceeded (limit 65536 bytes)"),
        "{resp}"
    );
    // The same kernel runs the next exec, and its variables survived.
    let s = session(&resp);
    let next = broker.run("py", "print(x)", Some(&s)).await;
    assert_eq!(stdout(&next), "kept\n", "{next}");
    assert_eq!(next["runtime_status"], "reused", "{next}");
    assert_eq!(next["limits"], json!([]), "{next}");
}

#[tokio::test]
async fn a_crash_is_a_200_with_the_story() {
    let broker = TestBroker::start("crash").await;
    let resp = broker
        .run("c", "int main(void) { int *p = 0; return *p; }", None)
        .await;
    assert_ne!(resp["exit_code"], 0, "{resp}");
    let s = session(&resp);
    let exit = broker.run("bash", "echo bye; exit 3", Some(&s)).await;
    assert_eq!(exit["exit_code"], 3, "{exit}");
    assert_eq!(stdout(&exit).trim(), "bye");
}

#[tokio::test]
async fn a_long_exec_survives_a_client_with_a_5s_idle_timeout() {
    let broker = TestBroker::start("keepalive").await;
    let client = reqwest::Client::builder()
        .read_timeout(std::time::Duration::from_secs(5))
        .build()
        .expect("client");
    let resp = client
        .post(broker.url("/exec"))
        .json(&json!({ "lang": "py", "code": "import time\ntime.sleep(20)\nprint('done')", "timeout": 30000 }))
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 200);
    let text = resp.text().await.expect("no idle gap over 5 s");
    let body: serde_json::Value = serde_json::from_str(text.trim()).expect("JSON after whitespace");
    assert_eq!(stdout(&body).trim(), "done", "{body}");
}

#[tokio::test]
async fn programs_and_the_kernel_are_the_oom_killers_first_choice() {
    // The runner (PID 1, not dumpable, not root) stays; what it starts goes first.
    let broker = TestBroker::start("oomadj").await;
    let bash = broker
        .run("bash", "cat /proc/self/oom_score_adj", None)
        .await;
    assert_eq!(stdout(&bash).trim(), "500", "{bash}");
    let py = broker
        .run(
            "py",
            "print(open('/proc/self/oom_score_adj').read().strip())",
            None,
        )
        .await;
    assert_eq!(stdout(&py).trim(), "500", "{py}");
}
