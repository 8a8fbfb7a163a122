//! E2B's protocol by hand, for what the SDKs cannot provoke: error shapes, tokens, tenants,
//! hostile paths and bodies, time limits, host routing, pause and the timeout. The SDKs'
//! own flows are tests/e2b (Python and JavaScript).

mod common;

use common::TestBroker;
use serde_json::{json, Value};
use std::time::Duration;

const KEY_A: &str = "key-of-tenant-a-0123456789";
const KEY_B: &str = "key-of-tenant-b-0123456789";

async fn broker(tag: &str) -> TestBroker {
    TestBroker::start_with(tag, |c| {
        c.access.auth = codebroker::config::AuthMode::Key;
        c.access.api_key = vec![KEY_A.into(), KEY_B.into()];
        c.e2b.e2b_domain = "e2b.test".into();
        c.caps.max_upload_mb = 2;
    })
    .await
}

/// A created sandbox: its id and tokens.
struct Created {
    id: String,
    envd_token: String,
    traffic_token: String,
}

async fn create(b: &TestBroker, key: &str, body: Value) -> Created {
    let resp = b
        .client
        .post(b.url("/e2b/v2/sandboxes"))
        .header("x-api-key", key)
        .json(&body)
        .send()
        .await
        .expect("create");
    assert_eq!(resp.status(), 201);
    let v: Value = resp.json().await.expect("json");
    Created {
        id: v["sandboxID"].as_str().expect("id").to_string(),
        envd_token: v["envdAccessToken"].as_str().expect("token").to_string(),
        traffic_token: v["trafficAccessToken"].as_str().expect("token").to_string(),
    }
}

fn envd(
    b: &TestBroker,
    c: &Created,
    method: reqwest::Method,
    path: &str,
) -> reqwest::RequestBuilder {
    b.client
        .request(method, b.url(&format!("/e2b/sandbox{path}")))
        .header("e2b-sandbox-id", &c.id)
        .header("e2b-sandbox-port", "49983")
        .header("x-access-token", &c.envd_token)
}

/// The messages of a Connect server stream: (flags, JSON) per frame.
fn frames(body: &[u8]) -> Vec<(u8, Value)> {
    let mut out = Vec::new();
    let mut rest = body;
    while rest.len() >= 5 {
        let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
        let json = serde_json::from_slice(&rest[5..5 + len]).expect("frame json");
        out.push((rest[0], json));
        rest = &rest[5 + len..];
    }
    assert!(rest.is_empty(), "trailing bytes");
    out
}

/// A `process.Process/Start` of `cmd` with `headers`; its frames.
async fn start(
    b: &TestBroker,
    c: &Created,
    cmd: &str,
    headers: &[(&str, &str)],
) -> Vec<(u8, Value)> {
    let message = json!({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", cmd]}}).to_string();
    let mut body = vec![0u8];
    body.extend_from_slice(&(message.len() as u32).to_be_bytes());
    body.extend_from_slice(message.as_bytes());
    let mut req = envd(b, c, reqwest::Method::POST, "/process.Process/Start")
        .header("content-type", "application/connect+json")
        .header("connect-protocol-version", "1")
        .body(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await.expect("start");
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "application/connect+json");
    frames(&resp.bytes().await.expect("body"))
}

#[tokio::test]
async fn control_plane_errors_take_e2b_s_shape_and_tenants_are_apart() {
    let b = broker("e2b-control").await;
    // No key, a wrong key: E2B's {code, message}.
    for key in [None, Some("wrong")] {
        let mut req = b
            .client
            .post(b.url("/e2b/v2/sandboxes"))
            .json(&json!({"templateID": "base"}));
        if let Some(key) = key {
            req = req.header("x-api-key", key);
        }
        let resp = req.send().await.expect("send");
        assert_eq!(resp.status(), 401);
        let v: Value = resp.json().await.expect("json");
        assert_eq!(v["code"], 401, "{v}");
        assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    }
    // A template codebroker does not serve, a body that is not JSON, a timeout over the cap.
    for (body, status) in [
        (json!({"templateID": "gpu-box"}).to_string(), 404),
        ("{not json".to_string(), 400),
        (
            json!({"templateID": "base", "timeout": 10_000_000}).to_string(),
            400,
        ),
        (
            json!({"templateID": "base", "volumeMounts": [{"name": "v"}]}).to_string(),
            400,
        ),
        (
            json!({"templateID": "base", "envVars": {"A;rm": "x"}}).to_string(),
            400,
        ),
    ] {
        let resp = b
            .client
            .post(b.url("/e2b/v2/sandboxes"))
            .header("x-api-key", KEY_A)
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .expect("send");
        assert_eq!(resp.status(), status, "{body}");
        let v: Value = resp.json().await.expect("json");
        assert_eq!(v["code"], status, "{v}");
    }
    let a = create(
        &b,
        KEY_A,
        json!({"templateID": "code-interpreter-v1", "metadata": {"who": "a"}}),
    )
    .await;
    // The other tenant neither sees nor lists nor kills it.
    let get = |key: &'static str| {
        b.client
            .get(b.url(&format!("/e2b/sandboxes/{}", a.id)))
            .header("x-api-key", key)
            .send()
    };
    assert_eq!(get(KEY_B).await.expect("get").status(), 404);
    assert_eq!(get(KEY_A).await.expect("get").status(), 200);
    let listed: Value = b
        .client
        .get(b.url("/e2b/v2/sandboxes"))
        .header("x-api-key", KEY_B)
        .send()
        .await
        .expect("list")
        .json()
        .await
        .expect("json");
    assert_eq!(listed, json!([]));
    let kill = b
        .client
        .delete(b.url(&format!("/e2b/sandboxes/{}", a.id)))
        .header("x-api-key", KEY_B)
        .send()
        .await
        .expect("kill");
    assert_eq!(kill.status(), 404);
    // Its data plane answers only its own token; the API key is not one.
    let health = envd(&b, &a, reqwest::Method::GET, "/health")
        .send()
        .await
        .expect("health");
    assert_eq!(health.status(), 204);
    for token in ["", KEY_A, "x"] {
        let resp = b
            .client
            .get(b.url("/e2b/sandbox/health"))
            .header("e2b-sandbox-id", &a.id)
            .header("e2b-sandbox-port", "49983")
            .header("x-access-token", token)
            .send()
            .await
            .expect("health");
        assert_eq!(resp.status(), 401, "token {token:?}");
    }
    let traffic = b
        .client
        .post(b.url("/e2b/sandbox/contexts"))
        .header("e2b-sandbox-id", &a.id)
        .header("e2b-sandbox-port", "49999")
        .header("e2b-traffic-access-token", &a.traffic_token)
        .json(&json!({"language": "python"}))
        .send()
        .await
        .expect("contexts");
    assert_eq!(traffic.status(), 200);
    // Unknown sandboxes and closed ports: E2B's proxy answers.
    let unknown = b
        .client
        .get(b.url("/e2b/sandbox/health"))
        .header("e2b-sandbox-id", "nosuchsandbox")
        .header("x-access-token", &a.envd_token)
        .send()
        .await
        .expect("health");
    assert_eq!(unknown.status(), 502);
    assert!(unknown
        .text()
        .await
        .expect("text")
        .contains("was not found"));
    let port = b
        .client
        .get(b.url("/e2b/sandbox/health"))
        .header("e2b-sandbox-id", &a.id)
        .header("e2b-sandbox-port", "22")
        .send()
        .await
        .expect("health");
    assert_eq!(port.status(), 502);
    // Killed: gone for the control plane and the data plane.
    let kill = b
        .client
        .delete(b.url(&format!("/e2b/sandboxes/{}", a.id)))
        .header("x-api-key", KEY_A)
        .send()
        .await
        .expect("kill");
    assert_eq!(kill.status(), 204);
    assert_eq!(get(KEY_A).await.expect("get").status(), 404);
    let gone = envd(&b, &a, reqwest::Method::GET, "/health")
        .send()
        .await
        .expect("health");
    assert_eq!(gone.status(), 502);
}

#[tokio::test]
async fn paths_outside_the_workspace_and_oversized_uploads_are_refused_and_the_next_call_works() {
    let b = broker("e2b-paths").await;
    let c = create(&b, KEY_A, json!({"templateID": "base"})).await;
    for path in [
        "/etc/passwd",
        "/home/user/../../etc/passwd",
        "../x",
        "/tmp/x",
        "/",
    ] {
        let resp = envd(&b, &c, reqwest::Method::GET, "/files")
            .query(&[("path", path)])
            .send()
            .await
            .expect("read");
        assert!(
            matches!(resp.status().as_u16(), 400 | 403),
            "{path}: {}",
            resp.status()
        );
        let v: Value = resp.json().await.expect("json");
        assert!(v["code"].is_number(), "{v}");
    }
    let stat = envd(&b, &c, reqwest::Method::POST, "/filesystem.Filesystem/Stat")
        .header("content-type", "application/json")
        .body(json!({"path": "/etc"}).to_string())
        .send()
        .await
        .expect("stat");
    assert_eq!(stat.status(), 403);
    let v: Value = stat.json().await.expect("json");
    assert_eq!(v["code"], "permission_denied");
    // 3 MiB against a 2 MiB upload limit, as octet-stream.
    let big = envd(&b, &c, reqwest::Method::POST, "/files")
        .query(&[("path", "/home/user/big.bin")])
        .header("content-type", "application/octet-stream")
        .body(vec![7u8; 3 * 1024 * 1024])
        .send()
        .await
        .expect("write");
    assert!(
        big.status().is_client_error() || big.status().as_u16() == 507,
        "{}",
        big.status()
    );
    let missing = envd(&b, &c, reqwest::Method::GET, "/files")
        .query(&[("path", "big.bin")])
        .send()
        .await
        .expect("read");
    assert_eq!(missing.status(), 404);
    // A gzip body (not served) is refused with a reason.
    let gz = envd(&b, &c, reqwest::Method::POST, "/files")
        .query(&[("path", "a.txt")])
        .header("content-type", "application/octet-stream")
        .header("content-encoding", "gzip")
        .body(vec![1u8; 10])
        .send()
        .await
        .expect("write");
    assert_eq!(gz.status(), 415);
    // The next write and read work.
    let ok = envd(&b, &c, reqwest::Method::POST, "/files")
        .query(&[("path", "/home/user/ok.txt")])
        .header("content-type", "application/octet-stream")
        .body("fine")
        .send()
        .await
        .expect("write");
    assert_eq!(ok.status(), 200);
    let v: Value = ok.json().await.expect("json");
    assert_eq!(
        v,
        json!([{"path": "/home/user/ok.txt", "name": "ok.txt", "type": "file"}])
    );
    let read = envd(&b, &c, reqwest::Method::GET, "/files")
        .query(&[("path", "~/ok.txt")])
        .send()
        .await
        .expect("read");
    assert_eq!(read.text().await.expect("text"), "fine");
    // An unknown RPC says so.
    let watch = envd(
        &b,
        &c,
        reqwest::Method::POST,
        "/filesystem.Filesystem/CreateWatcher",
    )
    .header("content-type", "application/json")
    .body("{}")
    .send()
    .await
    .expect("rpc");
    assert_eq!(watch.status(), 501);
    let v: Value = watch.json().await.expect("json");
    assert_eq!(v["code"], "unimplemented");
    assert!(v["message"]
        .as_str()
        .unwrap_or("")
        .contains("not supported by codebroker"));
}

#[tokio::test]
async fn a_command_past_its_deadline_ends_with_deadline_exceeded_and_the_next_runs() {
    let b = broker("e2b-deadline").await;
    let c = create(&b, KEY_A, json!({"templateID": "base"})).await;
    let started = std::time::Instant::now();
    let out = start(
        &b,
        &c,
        "echo before; sleep 20",
        &[("connect-timeout-ms", "1500")],
    )
    .await;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(out[0].1["event"]["start"]["pid"], 1000, "{out:?}");
    let (flags, last) = out.last().expect("frames");
    assert_eq!(*flags, 2, "{out:?}");
    assert_eq!(last["error"]["code"], "deadline_exceeded", "{last}");
    let out = start(&b, &c, "echo again; exit 4", &[]).await;
    let data: Vec<&Value> = out
        .iter()
        .filter_map(|(_, v)| v["event"].get("data"))
        .collect();
    assert_eq!(data, [&json!({"stdout": "YWdhaW4K"})]);
    let end = out
        .iter()
        .find_map(|(_, v)| v["event"].get("end"))
        .expect("end");
    assert_eq!(end["exitCode"], 4);
    assert_eq!(out.last().expect("end-stream"), &(2, json!({})));
    // A pty is not served, and says so in the stream.
    let message =
        json!({"process": {"cmd": "bash"}, "pty": {"size": {"rows": 24, "cols": 80}}}).to_string();
    let mut body = vec![0u8];
    body.extend_from_slice(&(message.len() as u32).to_be_bytes());
    body.extend_from_slice(message.as_bytes());
    let resp = envd(&b, &c, reqwest::Method::POST, "/process.Process/Start")
        .header("content-type", "application/connect+json")
        .body(body)
        .send()
        .await
        .expect("start");
    assert_eq!(resp.status(), 200);
    let out = frames(&resp.bytes().await.expect("body"));
    assert_eq!(out[0].0, 2);
    assert_eq!(out[0].1["error"]["code"], "unimplemented");
}

#[tokio::test]
async fn host_routing_reaches_the_control_plane_and_each_sandbox_port() {
    let b = broker("e2b-host").await;
    let resp = b
        .client
        .post(b.url("/v2/sandboxes"))
        .header("host", "api.e2b.test")
        .header("x-api-key", KEY_A)
        .json(&json!({"templateID": "base"}))
        .send()
        .await
        .expect("create");
    assert_eq!(resp.status(), 201);
    let v: Value = resp.json().await.expect("json");
    assert_eq!(v["domain"], "e2b.test");
    let id = v["sandboxID"].as_str().expect("id").to_string();
    let token = v["envdAccessToken"].as_str().expect("token").to_string();
    let health = b
        .client
        .get(b.url("/health"))
        .header("host", format!("49983-{id}.e2b.test"))
        .header("x-access-token", &token)
        .send()
        .await
        .expect("health");
    assert_eq!(health.status(), 204);
    let interpreter = b
        .client
        .get(b.url("/health"))
        .header("host", format!("49999-{id}.e2b.test:443"))
        .header("x-access-token", &token)
        .send()
        .await
        .expect("health");
    assert_eq!(interpreter.text().await.expect("text"), "OK");
    // A header that names another sandbox than the host is refused.
    let mismatch = b
        .client
        .get(b.url("/health"))
        .header("host", format!("49983-{id}.e2b.test"))
        .header("e2b-sandbox-id", "someotherid")
        .header("x-access-token", &token)
        .send()
        .await
        .expect("health");
    assert_eq!(mismatch.status(), 400);
    // Other hosts are the usual API.
    let plain = b.client.get(b.url("/health")).send().await.expect("health");
    assert_eq!(plain.status(), 200);
}

#[tokio::test]
async fn a_paused_sandbox_resumes_with_its_python_state_and_a_timeout_ends_one() {
    let b = broker("e2b-pause").await;
    let c = create(&b, KEY_A, json!({"templateID": "code-interpreter-v1"})).await;
    let execute = |code: &'static str| {
        b.client
            .post(b.url("/e2b/sandbox/execute"))
            .header("e2b-sandbox-id", &c.id)
            .header("e2b-sandbox-port", "49999")
            .header("e2b-traffic-access-token", &c.traffic_token)
            .header("x-access-token", &c.envd_token)
            .json(&json!({"code": code}))
            .send()
    };
    let lines = |text: String| -> Vec<Value> {
        text.lines()
            .map(|l| serde_json::from_str(l).expect("ndjson line"))
            .collect()
    };
    let first = lines(
        execute("kept = 6 * 7\nkept")
            .await
            .expect("exec")
            .text()
            .await
            .expect("text"),
    );
    assert_eq!(
        first[0],
        json!({"type": "number_of_executions", "execution_count": 1})
    );
    assert!(
        first
            .iter()
            .any(|l| l["type"] == "result" && l["is_main_result"] == true && l["text"] == "42"),
        "{first:?}"
    );
    assert_eq!(
        first.last().expect("end"),
        &json!({"type": "end_of_execution"})
    );
    let pause = b
        .client
        .post(b.url(&format!("/e2b/sandboxes/{}/pause", c.id)))
        .header("x-api-key", KEY_A)
        .send()
        .await
        .expect("pause");
    assert_eq!(pause.status(), 204);
    let again = b
        .client
        .post(b.url(&format!("/e2b/sandboxes/{}/pause", c.id)))
        .header("x-api-key", KEY_A)
        .send()
        .await
        .expect("pause");
    assert_eq!(again.status(), 409);
    // Paused: its data plane is E2B's "not found" until a connect.
    let paused = execute("kept").await.expect("exec");
    assert_eq!(paused.status(), 502);
    let info: Value = b
        .client
        .get(b.url(&format!("/e2b/sandboxes/{}", c.id)))
        .header("x-api-key", KEY_A)
        .send()
        .await
        .expect("get")
        .json()
        .await
        .expect("json");
    assert_eq!(info["state"], "paused");
    let resume = b
        .client
        .post(b.url(&format!("/e2b/v2/sandboxes/{}/connect", c.id)))
        .header("x-api-key", KEY_A)
        .json(&json!({"timeout": 60}))
        .send()
        .await
        .expect("connect");
    assert_eq!(resume.status(), 201);
    let connect = b
        .client
        .post(b.url(&format!("/e2b/v2/sandboxes/{}/connect", c.id)))
        .header("x-api-key", KEY_A)
        .json(&json!({"timeout": 60}))
        .send()
        .await
        .expect("connect");
    assert_eq!(connect.status(), 200);
    let after = lines(
        execute("kept + 1")
            .await
            .expect("exec")
            .text()
            .await
            .expect("text"),
    );
    assert!(
        after
            .iter()
            .any(|l| l["type"] == "result" && l["text"] == "43"),
        "{after:?}"
    );
    // A one-second timeout ends the sandbox.
    let short = create(&b, KEY_A, json!({"templateID": "base", "timeout": 1})).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let status = b
            .client
            .get(b.url(&format!("/e2b/sandboxes/{}", short.id)))
            .header("x-api-key", KEY_A)
            .send()
            .await
            .expect("get")
            .status();
        if status == 404 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "still there after its timeout"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
