//! Code mode under hostile code: a flood of parallel `http.fetch` calls of a large binary
//! body must not grow the broker's memory, an upstream tool's huge result is refused, and
//! a `stdio:` upstream server runs as a uid of its own, with no groups and no capabilities.

mod common;
#[path = "common/mcp_client.rs"]
mod mcp_client;

use axum::routing::get;
use common::TestBroker;
use mcp_client::call;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Held by every test of this file: each measures the test process's memory, or allocates
/// megabytes that would show in another's figure, so they run one at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Size of the body the test HTTP server serves.
const BLOB_BYTES: usize = 1 << 20;

/// Requests the blob server is answering now, and the most it ever answered at once.
#[derive(Default)]
struct InFlight {
    /// Now.
    now: AtomicUsize,
    /// The most seen.
    max: AtomicUsize,
}

/// An HTTP server on loopback whose `/blob` answers a 1 MiB binary body (not UTF-8) after
/// 20 ms, counting requests in flight; returns its port.
async fn blob_server(seen: Arc<InFlight>) -> u16 {
    let blob = bytes::Bytes::from((0..BLOB_BYTES).map(|i| i as u8).collect::<Vec<u8>>());
    let router = axum::Router::new().route(
        "/blob",
        get(move || {
            let blob = blob.clone();
            let seen = seen.clone();
            async move {
                let now = seen.now.fetch_add(1, Ordering::SeqCst) + 1;
                seen.max.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(20)).await;
                seen.now.fetch_sub(1, Ordering::SeqCst);
                blob
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    port
}

/// `execute`'s structured `{result, logs, error}`.
async fn execute(client: &mcp_client::Client, code: &str) -> Value {
    let result = call(client, "execute", json!({"lang": "js", "code": code})).await;
    result
        .structured_content
        .clone()
        .expect("structuredContent")
}

/// 2 × 256 parallel fetches of a 1 MiB binary body: the broker's RSS grows by less than
/// 64 MiB, no more than a few requests are in flight at once, the calls over the exec's
/// budget get an error that says so, and the next exec works.
#[tokio::test]
async fn parallel_fetches_are_bounded_per_exec() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let seen = Arc::new(InFlight::default());
    let port = blob_server(seen.clone()).await;
    let broker = TestBroker::start_with("hcm-fetch", move |config| {
        config.code_mode.codemode = true;
        config.code_mode.codemode_http_allow = vec![format!("127.0.0.1:{port}")];
        config.code_mode.codemode_timeout_ms = 120_000;
        config.exec_limits.max_programmatic_timeout_ms = 120_000;
    })
    .await;
    let client = mcp_client::connect(&broker, None).await.expect("connect");

    // Warm: the sandbox is up and one fetch has been made.
    let url = format!("http://127.0.0.1:{port}/blob");
    let warm = execute(
        &client,
        &format!("return (await codemode.http.fetch({{url: '{url}'}})).status;"),
    )
    .await;
    assert_eq!(warm["result"], 200, "{warm}");
    seen.max.store(0, Ordering::SeqCst);

    let baseline = common::rss_bytes();
    let peak = Arc::new(std::sync::atomic::AtomicU64::new(baseline));
    let sampling = {
        let peak = peak.clone();
        tokio::spawn(async move {
            loop {
                peak.fetch_max(common::rss_bytes(), Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };
    let code = format!(
        "const url = '{url}';\n\
         let ok = 0, failed = 0, firstError = null;\n\
         for (let round = 0; round < 2; round++) {{\n\
           const settled = await Promise.allSettled(Array.from({{length: 256}},\n\
             () => codemode.http.fetch({{url}}).then((r) => r.body.length)));\n\
           for (const s of settled) {{\n\
             if (s.status === 'fulfilled') ok++;\n\
             else {{ failed++; firstError ??= String(s.reason && s.reason.message || s.reason); }}\n\
           }}\n\
         }}\n\
         return {{ok, failed, firstError}};"
    );
    let started = std::time::Instant::now();
    let flood = execute(&client, &code).await;
    let took = started.elapsed();
    peak.fetch_max(common::rss_bytes(), Ordering::SeqCst);
    sampling.abort();
    let growth = peak.load(Ordering::SeqCst).saturating_sub(baseline);
    let in_flight = seen.max.load(Ordering::SeqCst);
    eprintln!(
        "flood: {flood}; RSS growth {} MiB; most requests in flight {in_flight}; {took:?}",
        growth >> 20
    );
    assert!(
        growth < 64 << 20,
        "RSS grew by {} MiB: {flood}",
        growth >> 20
    );
    assert!(
        in_flight <= 8,
        "{in_flight} requests in flight at once: {flood}"
    );
    // The calls past the exec's budget were refused with an error that names it.
    assert!(flood["result"]["ok"].as_u64() > Some(0), "{flood}");
    assert!(flood["result"]["failed"].as_u64() > Some(0), "{flood}");
    let first_error = flood["result"]["firstError"].as_str().unwrap_or_default();
    assert!(
        first_error.contains("budget") && first_error.contains("bytes"),
        "{flood}"
    );

    // The next exec works, with a fetch of its own.
    let next = execute(
        &client,
        &format!("return (await codemode.http.fetch({{url: '{url}'}})).status;"),
    )
    .await;
    assert_eq!(next["result"], 200, "{next}");
    assert_eq!(next["error"], Value::Null, "{next}");
}

/// 128 parallel POSTs of a 1 MiB body to a slow endpoint: the calls waiting for their turn
/// do not pile their inputs up in the broker (RSS growth under 64 MiB); those past the
/// queue get an error that says so, and the next exec works.
#[tokio::test]
async fn waiting_calls_are_bounded_per_exec() {
    let _turn = ONE_AT_A_TIME.lock().await;
    // Once armed, the endpoint holds every call until 10 s after the first: the calls of
    // the flood pile up behind the eight in flight however slowly a loaded host makes
    // them (with a fixed 300 ms, a slow sandbox made them no faster than they drained,
    // and none was refused).
    let held_from: Arc<std::sync::Mutex<Option<Option<tokio::time::Instant>>>> =
        Arc::new(std::sync::Mutex::new(None));
    let router = {
        let held_from = held_from.clone();
        axum::Router::new().route(
            "/slow",
            axum::routing::post(move || {
                let held_from = held_from.clone();
                async move {
                    let until = {
                        let mut held = held_from.lock().unwrap_or_else(|p| p.into_inner());
                        held.as_mut()
                            .map(|first| *first.get_or_insert_with(tokio::time::Instant::now))
                    };
                    match until {
                        Some(first) => {
                            tokio::time::sleep_until(first + Duration::from_secs(10)).await
                        }
                        None => tokio::time::sleep(Duration::from_millis(300)).await,
                    }
                    "done"
                }
            }),
        )
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    let broker = TestBroker::start_with("hcm-wait", move |config| {
        config.code_mode.codemode = true;
        config.code_mode.codemode_http_allow = vec![format!("127.0.0.1:{port}")];
        config.code_mode.codemode_timeout_ms = 120_000;
    })
    .await;
    let client = mcp_client::connect(&broker, None).await.expect("connect");
    let url = format!("http://127.0.0.1:{port}/slow");
    let one =
        format!("return await codemode.http.fetch({{url: '{url}', method: 'POST', body: 'x'}});");
    let warm = execute(&client, &one).await;
    assert_eq!(warm["result"]["body"], "done", "{warm}");

    *held_from.lock().unwrap_or_else(|p| p.into_inner()) = Some(None);
    let baseline = common::rss_bytes();
    let peak = Arc::new(std::sync::atomic::AtomicU64::new(baseline));
    let sampling = {
        let peak = peak.clone();
        tokio::spawn(async move {
            loop {
                peak.fetch_max(common::rss_bytes(), Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };
    let code = format!(
        "const url = '{url}';\n\
         const body = 'x'.repeat((1 << 20) - 16);\n\
         let ok = 0, failed = 0, firstError = null;\n\
         const settled = await Promise.allSettled(Array.from({{length: 128}},\n\
           () => codemode.http.fetch({{url, method: 'POST', body}})));\n\
         for (const s of settled) {{\n\
           if (s.status === 'fulfilled') ok++;\n\
           else {{ failed++; firstError ??= String(s.reason && s.reason.message || s.reason); }}\n\
         }}\n\
         return {{ok, failed, firstError}};"
    );
    let flood = execute(&client, &code).await;
    peak.fetch_max(common::rss_bytes(), Ordering::SeqCst);
    sampling.abort();
    let growth = peak.load(Ordering::SeqCst).saturating_sub(baseline);
    eprintln!("waiting: {flood}; RSS growth {} MiB", growth >> 20);
    assert!(
        growth < 64 << 20,
        "RSS grew by {} MiB: {flood}",
        growth >> 20
    );
    assert!(flood["result"]["ok"].as_u64() > Some(0), "{flood}");
    assert!(flood["result"]["failed"].as_u64() > Some(0), "{flood}");
    let first_error = flood["result"]["firstError"].as_str().unwrap_or_default();
    assert!(first_error.contains("wait"), "{flood}");

    *held_from.lock().unwrap_or_else(|p| p.into_inner()) = None;
    let next = execute(&client, &one).await;
    assert_eq!(next["result"]["body"], "done", "{next}");
}

/// A binary body is passed whole, as base64, not as a lossy text copy; a UTF-8 one as text.
#[tokio::test]
async fn binary_bodies_come_as_base64() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let seen = Arc::new(InFlight::default());
    let port = blob_server(seen).await;
    let mut config = <codebroker::config::Config as clap::Parser>::parse_from(["codebroker"]);
    config.code_mode.codemode = true;
    config.code_mode.codemode_http_allow = vec![format!("127.0.0.1:{port}")];
    let mode = codebroker::codemode::CodeMode::new(&config.code_mode);
    let result = bridge_call(
        &mode,
        "http.fetch",
        json!({"url": format!("http://127.0.0.1:{port}/blob")}),
    )
    .await;
    assert!(!result.is_error, "{:?}", result.error_message);
    assert_eq!(result.result["encoding"], "base64");
    let body = result.result["body"].as_str().expect("body");
    use base64::Engine;
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(body)
        .expect("base64");
    assert_eq!(decoded.len(), BLOB_BYTES);
    assert!(decoded.iter().enumerate().all(|(i, b)| *b == i as u8));
}

/// A minimal MCP server on stdio with two tools: `whoami` (this process's uid, gids,
/// groups and capability sets, from `/proc/self/status`) and `big` (a text of `n` bytes).
const STDIO_SERVER: &str = r#"
import json, os, sys
for line in sys.stdin:
    msg = json.loads(line)
    if "id" not in msg:
        continue
    method = msg.get("method")
    if method == "initialize":
        result = {"protocolVersion": msg["params"]["protocolVersion"], "capabilities": {"tools": {}},
                  "serverInfo": {"name": "who", "version": "1"}}
    elif method == "tools/list":
        result = {"tools": [{"name": "whoami", "description": "Who runs this server.",
                             "inputSchema": {"type": "object"}},
                            {"name": "big", "description": "A long text.",
                             "inputSchema": {"type": "object", "properties": {"n": {"type": "integer"}}}}]}
    elif method == "tools/call" and msg["params"]["name"] == "whoami":
        status = {}
        for l in open("/proc/self/status"):
            key, _, value = l.partition(":")
            if key in ("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapAmb", "NoNewPrivs"):
                status[key] = value.strip()
        status["HOME"] = os.environ.get("HOME", "")
        status["HOME writable"] = os.access(status["HOME"], os.W_OK)
        result = {"content": [{"type": "text", "text": json.dumps(status)}], "structuredContent": status}
    elif method == "tools/call":
        n = msg["params"].get("arguments", {}).get("n", 0)
        result = {"content": [{"type": "text", "text": "x" * n}]}
    else:
        result = {}
    print(json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": result}), flush=True)
"#;

/// The stdio server's script, in a directory any uid may read (the server does not run
/// as the test's uid).
fn server_script() -> (tempfile::TempDir, std::path::PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let script = dir.path().join("server.py");
    std::fs::write(&script, STDIO_SERVER).expect("write");
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    (dir, script)
}

/// Code mode with the stdio server as `who`.
fn stdio_mode(script: &std::path::Path) -> Arc<codebroker::codemode::CodeMode> {
    let mut config = <codebroker::config::Config as clap::Parser>::parse_from(["codebroker"]);
    config.code_mode.codemode = true;
    config.code_mode.codemode_mcp_servers = vec![format!("who=stdio:python3 {}", script.display())];
    codebroker::codemode::CodeMode::new(&config.code_mode)
}

/// Calls `name` through code mode's bridge, as the sandbox would.
async fn bridge_call(
    mode: &codebroker::codemode::CodeMode,
    name: &str,
    input: Value,
) -> sandbox_runner::ToolResult {
    mode.serve(sandbox_runner::ToolCall {
        call_id: "c1".into(),
        name: name.into(),
        input,
        batch: None,
    })
    .await
}

/// An upstream tool's result larger than the cap is refused with an error that says so;
/// the next call works.
#[tokio::test]
async fn upstream_results_are_capped() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let (_dir, script) = server_script();
    let mode = stdio_mode(&script);
    let big = bridge_call(&mode, "who.big", json!({"n": 8 << 20})).await;
    assert!(big.is_error, "an 8 MiB result was passed on");
    let message = big.error_message.unwrap_or_default();
    assert!(
        message.contains("who.big") && message.contains("bytes"),
        "{message}"
    );
    let small = bridge_call(&mode, "who.big", json!({"n": 5})).await;
    assert!(!small.is_error, "{:?}", small.error_message);
    assert_eq!(small.result, json!("xxxxx"));
}

/// A `stdio:` upstream server runs as neither the broker's uid nor root, in no
/// supplementary group, with every capability set empty. As root here; the broker image's
/// way (uid 10002 with CAP_SETUID and CAP_SETGID permitted only) is this test run under
/// `setpriv --reuid=10002 --regid=10002 --clear-groups --inh-caps=-all,+setuid,+setgid
/// --ambient-caps=-all,+setuid,+setgid`.
#[tokio::test]
async fn stdio_upstreams_run_as_their_own_uid() {
    let _turn = ONE_AT_A_TIME.lock().await;
    // As the broker does at start: CAP_SETUID and CAP_SETGID leave the effective set.
    codebroker::settle_capabilities().expect("settle the capabilities");
    let (_dir, script) = server_script();
    let mode = stdio_mode(&script);
    let who = bridge_call(&mode, "who.whoami", json!({})).await;
    assert!(!who.is_error, "{:?}", who.error_message);
    let status = &who.result;
    eprintln!("upstream: {status}");
    // SAFETY: geteuid has no preconditions.
    let broker_uid = unsafe { libc::geteuid() };
    let uids: Vec<u32> = status["Uid"]
        .as_str()
        .expect("Uid")
        .split_whitespace()
        .map(|u| u.parse().expect("uid"))
        .collect();
    assert_eq!(uids.len(), 4, "{status}");
    assert!(
        uids.iter().all(|u| *u != broker_uid && *u != 0),
        "the upstream runs as {uids:?}, the broker as {broker_uid}: {status}"
    );
    let gids: Vec<&str> = status["Gid"]
        .as_str()
        .expect("Gid")
        .split_whitespace()
        .collect();
    assert!(gids.iter().all(|g| *g != "0"), "{status}");
    assert_eq!(status["Groups"], "", "{status}");
    for set in ["CapInh", "CapPrm", "CapEff", "CapAmb"] {
        assert_eq!(status[set], "0000000000000000", "{set}: {status}");
    }
    // A home of its own to write (caches), not the broker's.
    assert_eq!(status["HOME writable"], true, "{status}");
    assert_ne!(
        status["HOME"].as_str(),
        std::env::var("HOME").ok().as_deref(),
        "{status}"
    );
}
