//! MCP over streamable HTTP at `/mcp`, driven by the official Rust SDK's client (rmcp):
//! initialize, the tool list, execute_code (output, images, failures, state kept within
//! one MCP session), the file tools, auth and the Host check.

mod common;
#[path = "common/mcp_client.rs"]
mod mcp_client;

use base64::Engine as _;
use common::jwt::jwt;
use common::TestBroker;
use mcp_client::{call, connect, structured, text};
use rmcp::model::ContentBlock;
use serde_json::{json, Value};

const KEY: &str = "mcp-test-key";

#[tokio::test]
async fn initialize_lists_the_tools() {
    let broker = TestBroker::start("mcp-init").await;
    let client = connect(&broker, None).await.expect("connect");
    let info = client.peer_info().expect("server info");
    let server = info.server_info.as_ref().expect("serverInfo");
    assert_eq!(server.name, "codebroker");
    assert_eq!(info.protocol_version.as_str(), "2025-11-25");
    assert!(info.capabilities.tools.is_some());
    let tools = client.list_all_tools().await.expect("tools/list");
    let mut names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    names.sort();
    assert_eq!(
        names,
        [
            "execute",
            "execute_code",
            "list_files",
            "read_file",
            "search",
            "upload_file"
        ]
    );
    // Every tool that works on a session says how to keep it; code mode runs in the MCP
    // session's own.
    for tool in tools
        .iter()
        .filter(|t| !["execute", "search"].contains(&t.name.as_ref()))
    {
        let description = tool.description.as_deref().unwrap_or("");
        assert!(description.contains("session_id"), "{description}");
    }
    let exec = tools
        .iter()
        .find(|t| t.name == "execute_code")
        .expect("execute_code");
    let schema = Value::Object((*exec.input_schema).clone());
    assert_eq!(schema["type"], "object");
    for field in ["lang", "code", "session_id", "args"] {
        assert!(schema["properties"].get(field).is_some(), "{schema}");
    }
    let mut required: Vec<&str> = schema["required"]
        .as_array()
        .expect("required")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    required.sort();
    assert_eq!(required, ["code", "lang"], "{schema}");
    let _ = client.cancel().await;
}

#[tokio::test]
async fn execute_code_prints_and_returns_the_exec_response() {
    let broker = TestBroker::start("mcp-print").await;
    let client = connect(&broker, None).await.expect("connect");
    let result = call(
        &client,
        "execute_code",
        json!({"lang": "py", "code": "import sys\nprint('hello from mcp')\nprint('warn', file=sys.stderr)"}),
    )
    .await;
    assert_eq!(result.is_error, Some(false), "{result:?}");
    let out = text(&result);
    assert!(out.contains("hello from mcp"), "{out}");
    assert!(out.contains("warn"), "{out}");
    let body = structured(&result);
    assert_eq!(body["stdout"], "hello from mcp\n");
    assert_eq!(body["exit_code"], 0);
    let session = body["session_id"].as_str().expect("session_id");
    assert_eq!(session.len(), 21);
    assert!(out.contains(&format!("session_id: {session}")), "{out}");

    // Arguments reach the program; a language alias works.
    let result = call(
        &client,
        "execute_code",
        json!({"lang": "bash", "code": "echo \"$1-$2\"", "args": ["a", "b"]}),
    )
    .await;
    assert_eq!(structured(&result)["stdout"], "a-b\n", "{result:?}");
    let _ = client.cancel().await;
}

#[tokio::test]
async fn a_plot_comes_back_as_an_image_block() {
    let broker = TestBroker::start("mcp-plot").await;
    let client = connect(&broker, None).await.expect("connect");
    let result = call(
        &client,
        "execute_code",
        json!({"lang": "py", "code": "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()"}),
    )
    .await;
    assert_eq!(result.is_error, Some(false), "{result:?}");
    let images: Vec<_> = result
        .content
        .iter()
        .filter_map(ContentBlock::as_image)
        .collect();
    assert_eq!(images.len(), 1, "{result:?}");
    assert_eq!(images[0].mime_type, "image/png");
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(&images[0].data)
        .expect("base64");
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    // The structured response lists the file, and the text names its download URL.
    let body = structured(&result);
    let file = &body["files"][0];
    assert!(
        file["name"].as_str().unwrap_or("").ends_with(".png"),
        "{body}"
    );
    let url = format!(
        "http://127.0.0.1:8000/download/{}/{}",
        body["session_id"].as_str().unwrap_or(""),
        file["id"].as_str().unwrap_or("")
    );
    assert!(text(&result).contains(&url), "{}", text(&result));
    let _ = client.cancel().await;
}

#[tokio::test]
async fn failing_code_is_an_error_result() {
    let broker = TestBroker::start("mcp-fail").await;
    let client = connect(&broker, None).await.expect("connect");
    let result = call(
        &client,
        "execute_code",
        json!({"lang": "py", "code": "1/0"}),
    )
    .await;
    assert_eq!(result.is_error, Some(true), "{result:?}");
    assert!(text(&result).contains("ZeroDivisionError"), "{result:?}");
    assert_ne!(structured(&result)["exit_code"], 0);

    let result = call(
        &client,
        "execute_code",
        json!({"lang": "cobol", "code": "x"}),
    )
    .await;
    assert_eq!(result.is_error, Some(true), "{result:?}");
    assert!(
        text(&result).contains("Unsupported language: cobol"),
        "{result:?}"
    );
    let _ = client.cancel().await;
}

#[tokio::test]
async fn calls_in_one_mcp_session_share_a_session() {
    let broker = TestBroker::start("mcp-state").await;
    let client = connect(&broker, None).await.expect("connect");
    let first = call(
        &client,
        "execute_code",
        json!({"lang": "py", "code": "x = 1"}),
    )
    .await;
    let second = call(
        &client,
        "execute_code",
        json!({"lang": "py", "code": "print(x)"}),
    )
    .await;
    assert_eq!(structured(&second)["stdout"], "1\n", "{second:?}");
    assert_eq!(
        structured(&first)["session_id"],
        structured(&second)["session_id"]
    );

    // Another MCP session starts elsewhere, and can join the first by session_id.
    let other = connect(&broker, None).await.expect("connect");
    let fresh = call(
        &other,
        "execute_code",
        json!({"lang": "py", "code": "print('x' in dir())"}),
    )
    .await;
    assert_eq!(structured(&fresh)["stdout"], "False\n", "{fresh:?}");
    assert_ne!(
        structured(&fresh)["session_id"],
        structured(&first)["session_id"]
    );
    let joined = call(
        &other,
        "execute_code",
        json!({"lang": "py", "code": "print(x + 1)", "session_id": structured(&first)["session_id"]}),
    )
    .await;
    assert_eq!(structured(&joined)["stdout"], "2\n", "{joined:?}");
    let _ = client.cancel().await;
    let _ = other.cancel().await;
}

#[tokio::test]
async fn upload_list_and_read_round_trip() {
    let broker = TestBroker::start("mcp-files").await;
    let client = connect(&broker, None).await.expect("connect");
    let csv = "a,b\n1,2\n";
    let uploaded = call(
        &client,
        "upload_file",
        json!({"name": "data/in.csv", "content_base64": base64::engine::general_purpose::STANDARD.encode(csv)}),
    )
    .await;
    assert_eq!(uploaded.is_error, Some(false), "{uploaded:?}");
    let session = structured(&uploaded)["session_id"]
        .as_str()
        .expect("session_id")
        .to_string();

    let listed = call(&client, "list_files", json!({"session_id": session})).await;
    let files = structured(&listed)["files"]
        .as_array()
        .expect("files")
        .clone();
    assert_eq!(files.len(), 1, "{listed:?}");
    assert_eq!(files[0]["name"], "data/in.csv");
    assert_eq!(files[0]["size"], csv.len());
    assert!(
        text(&listed).contains("/mnt/data/data/in.csv"),
        "{listed:?}"
    );

    let read = call(
        &client,
        "read_file",
        json!({"session_id": session, "name": "/mnt/data/data/in.csv"}),
    )
    .await;
    assert_eq!(text(&read), csv, "{read:?}");

    // The upload is this MCP session's session: code finds the file without a session_id,
    // and what it writes reads back too (an image as an image).
    let ran = call(
        &client,
        "execute_code",
        json!({"lang": "py", "code": "import base64\nprint(open('data/in.csv').read().count(','))\n_ = open('dot.png','wb').write(base64.b64decode('iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=='))"}),
    )
    .await;
    assert_eq!(structured(&ran)["session_id"], session.as_str());
    assert_eq!(structured(&ran)["stdout"], "2\n", "{ran:?}");
    let image = call(&client, "read_file", json!({"name": "dot.png"})).await;
    let block = image
        .content
        .iter()
        .find_map(ContentBlock::as_image)
        .expect("image block");
    assert_eq!(block.mime_type, "image/png");
    let missing = call(&client, "read_file", json!({"name": "nope.txt"})).await;
    assert_eq!(missing.is_error, Some(true), "{missing:?}");

    let bad = call(
        &client,
        "upload_file",
        json!({"name": "../escape.txt", "content_base64": "aGk="}),
    )
    .await;
    assert_eq!(bad.is_error, Some(true), "{bad:?}");
    let _ = client.cancel().await;
}

#[tokio::test]
async fn mcp_needs_the_key_and_an_allowed_host() {
    let broker = TestBroker::start_with("mcp-auth", |c| {
        c.access.auth = codebroker::config::AuthMode::Key;
        c.access.api_key = vec![KEY.into()];
    })
    .await;
    assert!(connect(&broker, None).await.is_err());
    assert!(connect(&broker, Some("wrong")).await.is_err());
    let client = connect(&broker, Some(KEY)).await.expect("connect with key");
    let result = call(
        &client,
        "execute_code",
        json!({"lang": "py", "code": "print(6*7)"}),
    )
    .await;
    assert_eq!(structured(&result)["stdout"], "42\n");
    let _ = client.cancel().await;

    // Plain HTTP: no credentials is 401 in the API's envelope; a foreign Host is refused.
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "curl", "version": "1"}}});
    let resp = broker
        .client
        .post(broker.url("/mcp"))
        .header("accept", "application/json, text/event-stream")
        .json(&init)
        .send()
        .await
        .expect("POST /mcp");
    assert_eq!(resp.status(), 401);
    let resp = broker
        .client
        .post(broker.url("/mcp"))
        .header("accept", "application/json, text/event-stream")
        .header("x-api-key", KEY)
        .header("host", "evil.example")
        .json(&init)
        .send()
        .await
        .expect("POST /mcp");
    assert_eq!(resp.status(), 403);
    let resp = broker
        .client
        .post(broker.url("/mcp"))
        .header("accept", "application/json, text/event-stream")
        .header("x-api-key", KEY)
        .json(&init)
        .send()
        .await
        .expect("POST /mcp");
    assert_eq!(resp.status(), 200);
    assert!(
        resp.headers().get("mcp-session-id").is_some(),
        "{:?}",
        resp.headers()
    );
}

#[tokio::test]
async fn a_jwt_user_sees_only_their_own_sessions_over_mcp() {
    let broker = TestBroker::start_with("mcp-jwt", |c| {
        c.access.auth = codebroker::config::AuthMode::Key;
        c.access.jwt_public_keys = vec![common::jwt::lc_ed_public_key()];
    })
    .await;
    let alice = connect(&broker, Some(&jwt("alice"))).await.expect("alice");
    let ran = call(
        &alice,
        "execute_code",
        json!({"lang": "py", "code": "secret = 7\nopen('s.txt','w').write('s')"}),
    )
    .await;
    let s = structured(&ran)["session_id"]
        .as_str()
        .expect("session")
        .to_string();

    let bob = connect(&broker, Some(&jwt("bob"))).await.expect("bob");
    let listed = call(&bob, "list_files", json!({"session_id": s})).await;
    assert_eq!(listed.is_error, Some(true), "{listed:?}");
    let read = call(&bob, "read_file", json!({"session_id": s, "name": "s.txt"})).await;
    assert_eq!(read.is_error, Some(true), "{read:?}");
    let tried = call(
        &bob,
        "execute_code",
        json!({"lang": "py", "code": "print('secret' in dir())", "session_id": s}),
    )
    .await;
    assert_eq!(structured(&tried)["stdout"], "False\n", "{tried:?}");
    assert_ne!(structured(&tried)["session_id"], s.as_str());

    let mine = call(&alice, "list_files", json!({})).await;
    assert_eq!(structured(&mine)["files"][0]["name"], "s.txt", "{mine:?}");
    let _ = alice.cancel().await;
    let _ = bob.cancel().await;
}

#[tokio::test]
async fn open_mcp_sessions_do_not_hold_up_shutdown() {
    let broker = TestBroker::start("mcp-stop").await;
    let client = connect(&broker, None).await.expect("connect");
    let _ = call(
        &client,
        "execute_code",
        json!({"lang": "bash", "code": "echo hi"}),
    )
    .await;
    // The client keeps its session (and its GET stream) open while the server stops.
    let instance = broker.instance.clone();
    let stopped = tokio::time::timeout(std::time::Duration::from_secs(20), broker.stop()).await;
    common::remove_containers_of(&instance);
    assert!(
        stopped.is_ok(),
        "the broker did not stop with an MCP session open"
    );
    drop(client);
}

#[tokio::test]
async fn mcp_sessions_are_capped() {
    let broker = TestBroker::start_with("mcpcap", |c| c.caps.max_mcp_sessions = 3).await;
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "curl", "version": "1"}}});
    let initialize = || {
        broker
            .client
            .post(broker.url("/mcp"))
            .header("accept", "application/json, text/event-stream")
            .json(&init)
            .send()
    };
    let mut ids = Vec::new();
    for _ in 0..3 {
        let resp = initialize().await.expect("POST /mcp");
        assert_eq!(resp.status(), 200);
        let id = resp.headers()["mcp-session-id"]
            .to_str()
            .expect("id")
            .to_string();
        ids.push(id);
    }
    let over = initialize().await.expect("POST /mcp");
    assert_eq!(over.status(), 503);
    let body: Value = over.json().await.expect("JSON");
    assert!(
        body["message"]
            .as_str()
            .unwrap_or("")
            .contains("CODEBROKER_MAX_MCP_SESSIONS"),
        "{body}"
    );
    // Closing one makes room.
    let closed = broker
        .client
        .delete(broker.url("/mcp"))
        .header("mcp-session-id", &ids[0])
        .send()
        .await
        .expect("DELETE /mcp");
    assert!(closed.status().is_success(), "{}", closed.status());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let resp = initialize().await.expect("POST /mcp");
        if resp.status() == 200 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{}", resp.status());
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn uploads_into_the_session_count_against_the_rate() {
    // Two tokens: the first upload makes the session, the second adds to it, the third is
    // refused as over the rate, like the HTTP route's.
    let broker = TestBroker::start_with("mcp-uprate", |c| {
        c.caps.rate_execs_per_minute = 2;
    })
    .await;
    let client = connect(&broker, None).await.expect("connect");
    let upload = |name: &'static str| {
        call(
            &client,
            "upload_file",
            json!({"name": name, "content_base64": "aGk="}),
        )
    };
    let first = upload("a.txt").await;
    assert_eq!(first.is_error, Some(false), "{first:?}");
    let second = upload("b.txt").await;
    assert_eq!(second.is_error, Some(false), "{second:?}");
    let third = upload("c.txt").await;
    assert_eq!(third.is_error, Some(true), "{third:?}");
    assert!(text(&third).contains("too many"), "{third:?}");
    let _ = client.cancel().await;
}

/// The audit log's promise holds on every front end: an MCP upload and an MCP read are
/// recorded and counted like the same over HTTP.
#[tokio::test]
async fn mcp_uploads_and_reads_are_audited_and_counted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("audit.jsonl");
    let log_setting = log.to_string_lossy().to_string();
    let broker = TestBroker::start_with("mcp-audit", |c| c.audit_log = log_setting).await;
    let client = connect(&broker, None).await.expect("connect");
    let uploaded = call(
        &client,
        "upload_file",
        json!({"name": "notes.txt", "content_base64": base64::engine::general_purpose::STANDARD.encode("hello\n")}),
    )
    .await;
    assert_eq!(uploaded.is_error, Some(false), "{uploaded:?}");
    let session = structured(&uploaded)["session_id"]
        .as_str()
        .expect("session_id")
        .to_string();
    let read = call(
        &client,
        "read_file",
        json!({"session_id": session, "name": "notes.txt"}),
    )
    .await;
    assert_eq!(text(&read), "hello\n", "{read:?}");
    let _ = client.cancel().await;

    // The writer is a thread of its own: give it a moment.
    let mut records: Vec<Value> = Vec::new();
    for _ in 0..50 {
        records = std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).expect("each line is JSON"))
            .collect();
        if ["upload", "download"]
            .iter()
            .all(|e| records.iter().any(|r| r["event"] == *e))
        {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    for event in ["upload", "download"] {
        let record = records
            .iter()
            .find(|r| r["event"] == event)
            .unwrap_or_else(|| panic!("no {event} record: {records:?}"));
        assert_eq!(record["session"], session.as_str(), "{record}");
        assert_eq!(record["files"][0]["name"], "notes.txt", "{record}");
        assert_eq!(record["files"][0]["size"], 6, "{record}");
    }
    let metrics = broker
        .client
        .get(broker.url("/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    for name in [
        "codebroker_upload_bytes_total 6",
        "codebroker_download_bytes_total 6",
    ] {
        assert!(
            metrics.lines().any(|l| l.trim() == name),
            "{name} missing: {metrics}"
        );
    }
}
