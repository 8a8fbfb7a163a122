//! POST /exec/stream: chunks as they are written, SSE and NDJSON framing, disconnects.

mod common;

use common::{session, stdout, TestBroker};
use futures::StreamExt;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// Reads SSE events (name, data) until the stream ends, with the time each arrived.
async fn sse_events(resp: reqwest::Response, started: Instant) -> Vec<(String, String, Duration)> {
    let mut events = Vec::new();
    let mut buf = String::new();
    let mut body = resp.bytes_stream();
    while let Some(chunk) = body.next().await {
        buf.push_str(&String::from_utf8_lossy(&chunk.expect("chunk")));
        while let Some(end) = buf.find("\n\n") {
            let block: String = buf.drain(..end + 2).collect();
            let mut name = String::new();
            let mut data = Vec::new();
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("event: ") {
                    name = v.to_string();
                } else if let Some(v) = line.strip_prefix("data: ") {
                    data.push(v.to_string());
                }
            }
            events.push((name, data.join("\n"), started.elapsed()));
        }
    }
    events
}

#[tokio::test]
async fn sse_chunks_arrive_while_the_code_runs() {
    let broker = TestBroker::start("sse").await;
    let started = Instant::now();
    let resp = broker
        .client
        .post(broker.url("/exec/stream"))
        .json(&json!({
            "lang": "py",
            "code": "import time, sys\nprint('first', flush=True)\ntime.sleep(1.5)\nprint('second')\n_ = sys.stderr.write('warn\\n')",
        }))
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let events = sse_events(resp, started).await;
    let first = events
        .iter()
        .find(|(n, d, _)| n == "stdout" && d.contains("first"))
        .expect("first chunk");
    let result = events.last().expect("events");
    assert_eq!(result.0, "result", "{events:?}");
    assert!(
        first.2 + Duration::from_millis(1000) < result.2,
        "the first chunk ({:?}) must come well before the end ({:?})",
        first.2,
        result.2
    );
    assert!(
        events
            .iter()
            .any(|(n, d, _)| n == "stderr" && d.contains("warn")),
        "{events:?}"
    );
    let body: Value = serde_json::from_str(&result.1).expect("result json");
    assert_eq!(stdout(&body), "first\nsecond\n", "{body}");
    assert_eq!(body["exit_code"], 0);
}

#[tokio::test]
async fn ndjson_framing() {
    let broker = TestBroker::start("ndjson").await;
    let resp = broker
        .client
        .post(broker.url("/v1/exec/stream"))
        .header("accept", "application/x-ndjson")
        .json(&json!({ "lang": "bash", "code": "echo one; echo two >&2; echo three" }))
        .send()
        .await
        .expect("send");
    assert_eq!(resp.headers()["content-type"], "application/x-ndjson");
    let text = resp.text().await.expect("text");
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("each line is JSON"))
        .collect();
    let last = lines.last().expect("lines");
    assert_eq!(last["event"], "result");
    assert_eq!(last["data"]["stdout"], "one\nthree\n");
    let out: String = lines
        .iter()
        .filter(|l| l["event"] == "stdout")
        .filter_map(|l| l["data"].as_str())
        .collect();
    assert_eq!(out, "one\nthree\n");
    assert!(lines
        .iter()
        .any(|l| l["event"] == "stderr" && l["data"] == "two\n"));
}

#[tokio::test]
async fn a_client_that_disconnects_stops_the_exec() {
    let broker = TestBroker::start("disconnect").await;
    let first = broker.run("bash", "echo ready", None).await;
    let s = session(&first);
    let resp = broker
        .client
        .post(broker.url("/exec/stream"))
        .json(&json!({
            "lang": "py", "session_id": s,
            "code": "import time\nprint('go', flush=True)\ntime.sleep(3)\nopen('late.txt', 'w').write('x')",
        }))
        .send()
        .await
        .expect("send");
    let mut body = resp.bytes_stream();
    let chunk = body.next().await.expect("a first event").expect("chunk");
    assert!(String::from_utf8_lossy(&chunk).contains("go"));
    drop(body);
    tokio::time::sleep(Duration::from_millis(4000)).await;
    let check = broker
        .run("bash", "ls late.txt 2>/dev/null || echo stopped", Some(&s))
        .await;
    assert_eq!(stdout(&check).trim(), "stopped", "{check}");
}

#[tokio::test]
async fn figures_arrive_as_display_events() {
    let broker = TestBroker::start("display").await;
    let started = Instant::now();
    let resp = broker
        .client
        .post(broker.url("/exec/stream"))
        .json(&json!({
            "lang": "py",
            "code": "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()\nprint('after')",
        }))
        .send()
        .await
        .expect("send");
    let events = sse_events(resp, started).await;
    let display = events
        .iter()
        .find(|(n, _, _)| n == "display")
        .expect("a display event");
    let data: Value = serde_json::from_str(&display.1).expect("display json");
    assert_eq!(data["mime"], "image/png");
    assert!(
        data["name"].as_str().is_some_and(|n| n.ends_with(".png")),
        "{data}"
    );
    use base64::Engine as _;
    let png = base64::engine::general_purpose::STANDARD
        .decode(data["data"].as_str().expect("inline data"))
        .expect("base64");
    assert!(png.starts_with(b"\x89PNG"));
}
