//! Observability: the OpenAPI document covers every route, `/metrics` counts execs and
//! limits, and the audit log records uploads, execs (the code's hash, not the code) and
//! downloads.

mod common;

use codebroker::config::AuthMode;
use common::*;
use reqwest::multipart::{Form, Part};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::time::Duration;

const KEY: &str = "obs-key";

/// A broker that requires `KEY`.
async fn keyed(tag: &str, adjust: impl FnOnce(&mut codebroker::config::Config)) -> TestBroker {
    TestBroker::start_with(tag, |c| {
        c.access.auth = AuthMode::Key;
        c.access.api_key = vec![KEY.to_string()];
        adjust(c);
    })
    .await
}

/// Calls every documented route (each method, at `/` and under `/v1`) and checks none
/// reaches the router's fallback: the document names no route the broker lacks. The other
/// direction (no route without a document entry) is `every_route_is_in_the_spec` in
/// `broker/src/http/openapi.rs`, which reads every route the sources register.
#[tokio::test]
async fn spec_lists_every_route_and_each_exists() {
    let broker = keyed("obs-spec", |_| {}).await;
    // Public: no key needed.
    let resp = broker.get("/openapi.json").await;
    assert_eq!(resp.status(), 200);
    let spec: Value = resp.json().await.expect("spec json");
    let v1: Value = broker
        .get("/v1/openapi.json")
        .await
        .json()
        .await
        .expect("v1 spec json");
    assert_eq!(spec, v1);

    let paths = spec["paths"].as_object().expect("paths");
    let expected = [
        ("/exec", "post"),
        ("/exec/stream", "post"),
        ("/exec/programmatic", "post"),
        ("/exec/programmatic/cancel", "post"),
        ("/upload", "post"),
        ("/upload/batch", "post"),
        ("/files/{session_id}", "get"),
        ("/files/{session_id}/{file_id}", "delete"),
        ("/sessions/{session_id}/objects/{file_id}", "get"),
        ("/sessions/{session_id}/objects/{file_id}", "delete"),
        ("/download/{session_id}/{file_id}", "get"),
        ("/health", "get"),
        ("/libraries", "get"),
        ("/lobe/manifest.json", "get"),
        ("/lobe/run", "post"),
        ("/mcp", "post"),
        ("/metrics", "get"),
        ("/openapi.json", "get"),
    ];
    for (path, method) in expected {
        assert!(
            paths.get(path).and_then(|p| p.get(method)).is_some(),
            "{method} {path} is not in the spec"
        );
    }
    let schemes = &spec["components"]["securitySchemes"];
    assert_eq!(schemes["api_key"]["name"], "X-API-Key");
    assert_eq!(schemes["bearer"]["scheme"], "bearer");

    let id = "AAAAAAAAAAAAAAAAAAAAA";
    let mut probed = 0;
    for (path, item) in paths {
        let concrete = path.replace("{session_id}", id).replace("{file_id}", id);
        for method in ["get", "post", "put", "delete", "patch"] {
            if item.get(method).is_none() {
                continue;
            }
            for prefix in ["", "/v1"] {
                // The root route (the playground) is `/v1` under the prefix, not `/v1/`.
                let path = match (prefix, concrete.as_str()) {
                    ("/v1", "/") => prefix.to_string(),
                    _ => format!("{prefix}{concrete}"),
                };
                let url = broker.url(&path);
                let request = broker
                    .client
                    .request(method.to_uppercase().parse().expect("method"), &url)
                    .header("X-API-Key", KEY)
                    .header("Accept", "application/json, text/event-stream")
                    .timeout(Duration::from_secs(10));
                let resp = request.send().await.expect("request");
                let status = resp.status().as_u16();
                // Streams (GET /mcp) are not read to their end.
                let body: Value = if status == 404 {
                    resp.json().await.unwrap_or(Value::Null)
                } else {
                    Value::Null
                };
                assert_ne!(
                    status, 405,
                    "{method} {prefix}{path}: the router lacks this method"
                );
                assert!(
                    !(status == 404 && body["message"] == "no such route"),
                    "{method} {prefix}{path} is documented but not routed"
                );
                probed += 1;
            }
        }
    }
    assert!(probed >= 2 * expected.len(), "probed {probed}");

    // An undocumented path does reach the fallback (the check above can fail).
    let resp = broker.get("/no/such/route").await;
    assert_eq!(resp.status(), 404);
}

fn metric(text: &str, line_start: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test]
async fn metrics_count_execs_latency_and_limits() {
    let broker = keyed("obs-metrics", |_| {}).await;
    // Behind the key, like /libraries.
    assert_eq!(broker.get("/metrics").await.status(), 401);
    let exec = |body: Value| {
        broker
            .client
            .post(broker.url("/exec"))
            .header("X-API-Key", KEY)
            .json(&body)
            .send()
    };
    let first: Value = serde_json::from_str(
        exec(json!({"lang": "py", "code": "print(1)"}))
            .await
            .expect("exec")
            .text()
            .await
            .expect("body")
            .trim(),
    )
    .expect("json");
    assert_eq!(stdout(&first), "1\n", "{first}");
    let slow: Value = serde_json::from_str(
        exec(
            json!({"lang": "py", "code": "import time\ntime.sleep(30)", "timeout": 1000,
                    "session_id": session(&first)}),
        )
        .await
        .expect("exec")
        .text()
        .await
        .expect("body")
        .trim(),
    )
    .expect("json");
    assert!(slow["limits"].to_string().contains("Time limit"), "{slow}");

    let resp = broker
        .client
        .get(broker.url("/v1/metrics"))
        .header("X-API-Key", KEY)
        .send()
        .await
        .expect("metrics");
    assert_eq!(resp.status(), 200);
    let text = resp.text().await.expect("text");
    assert_eq!(
        metric(&text, r#"codebroker_execs_total{lang="py",outcome="ok"}"#),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            r#"codebroker_execs_total{lang="py",outcome="limit"}"#
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            r#"codebroker_exec_duration_seconds_count{lang="py",outcome="ok"}"#
        ),
        Some(1.0),
        "{text}"
    );
    let slow_secs = metric(
        &text,
        r#"codebroker_exec_duration_seconds_sum{lang="py",outcome="limit"}"#,
    )
    .unwrap_or(0.0);
    assert!(slow_secs >= 0.9, "{text}");
    assert_eq!(
        metric(&text, r#"codebroker_limits_hit_total{kind="time"}"#),
        Some(1.0),
        "{text}"
    );
    assert_eq!(metric(&text, "codebroker_sessions "), Some(1.0), "{text}");
    for name in [
        "codebroker_containers ",
        "codebroker_pool_ready ",
        "codebroker_upload_bytes_total ",
        "codebroker_download_bytes_total ",
        "codebroker_rate_limited_total ",
    ] {
        assert!(metric(&text, name).is_some(), "{name} missing: {text}");
    }
}

#[tokio::test]
async fn audit_log_records_upload_exec_download() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("audit.jsonl");
    let log_setting = log.to_string_lossy().to_string();
    let broker = TestBroker::start_with("obs-audit", |c| c.audit_log = log_setting).await;

    let form = Form::new().part(
        "file",
        Part::bytes(b"42\n".to_vec())
            .file_name("in.txt")
            .mime_str("text/plain")
            .expect("mime"),
    );
    let resp = broker
        .client
        .post(broker.url("/upload"))
        .header("User-Id", "alice")
        .multipart(form)
        .send()
        .await
        .expect("upload");
    assert_eq!(resp.status(), 200);
    let uploaded: Value = resp.json().await.expect("json");
    let session_id = uploaded["session_id"]
        .as_str()
        .expect("session")
        .to_string();
    let in_id = uploaded["files"][0]["fileId"]
        .as_str()
        .expect("id")
        .to_string();

    let code = "secret_marker = 'do-not-log-me'\nopen('out.txt', 'w').write(open('in.txt').read())";
    let resp = broker
        .client
        .post(broker.url("/exec"))
        .header("User-Id", "alice")
        .json(&json!({"lang": "py", "code": code, "session_id": session_id}))
        .send()
        .await
        .expect("exec");
    let out: Value = serde_json::from_str(resp.text().await.expect("body").trim()).expect("json");
    let file = out["files"]
        .as_array()
        .and_then(|f| f.iter().find(|f| f["name"] == "out.txt"))
        .cloned()
        .unwrap_or_else(|| panic!("no out.txt: {out}"));
    let out_id = file["id"].as_str().expect("id").to_string();
    let resp = broker
        .client
        .get(broker.url(&format!("/download/{session_id}/{out_id}")))
        .header("User-Id", "alice")
        .send()
        .await
        .expect("download");
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.bytes().await.expect("bytes").as_ref(), b"42\n");

    // The writer is a thread of its own: give it a moment.
    let mut records: Vec<Value> = Vec::new();
    for _ in 0..50 {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        records = text
            .lines()
            .map(|l| serde_json::from_str(l).expect("each line is JSON"))
            .collect();
        if ["upload", "exec", "download"]
            .iter()
            .all(|e| records.iter().any(|r| r["event"] == *e))
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let find = |event: &str| {
        records
            .iter()
            .find(|r| r["event"] == event)
            .cloned()
            .unwrap_or_else(|| panic!("no {event} record in {records:?}"))
    };
    let upload = find("upload");
    assert_eq!(upload["user"], "alice");
    assert_eq!(upload["session"], session_id.as_str());
    assert_eq!(upload["files"][0]["id"], in_id.as_str());
    assert_eq!(upload["files"][0]["name"], "in.txt");
    assert!(upload["time"].as_str().is_some_and(|t| t.contains('T')));

    let exec = find("exec");
    assert_eq!(exec["user"], "alice");
    assert_eq!(exec["session"], session_id.as_str());
    assert_eq!(exec["language"], "py");
    assert_eq!(
        exec["code_sha256"],
        hex::encode(Sha256::digest(code.as_bytes()))
    );
    assert!(exec.get("code").is_none(), "{exec}");
    assert_eq!(exec["exit_code"], 0);
    assert!(exec["duration_ms"].is_u64());
    assert_eq!(exec["limits"], json!([]));
    assert_eq!(exec["files_out"][0]["id"], out_id.as_str());
    let text = std::fs::read_to_string(&log).expect("log");
    assert!(!text.contains("do-not-log-me"), "the code leaked: {text}");

    let download = find("download");
    assert_eq!(download["user"], "alice");
    assert_eq!(download["files"][0]["id"], out_id.as_str());
    assert_eq!(download["files"][0]["name"], "out.txt");

    assert!(records.iter().any(|r| r["event"] == "session_create"));
}
