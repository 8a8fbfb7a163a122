//! Code mode on `/mcp`: `execute` runs code whose `codemode.*` functions the broker serves
//! itself (an upstream MCP server started here, an allowlisted HTTP server started here,
//! allowlisted environment variables), and `search` finds them. Driven by rmcp's client.

mod common;
#[path = "common/mcp_client.rs"]
mod mcp_client;

use axum::response::Redirect;
use axum::routing::get;
use common::TestBroker;
use mcp_client::{call, Client};
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{ServerCapabilities, ServerConfig};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{tool, tool_handler, tool_router, ServerHandler};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

const ENV_KEY: &str = "CODEBROKER_CODEMODE_TEST_VALUE";

/// `add` arguments of the upstream test server.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
struct AddArgs {
    /// First number.
    a: i64,
    /// Second number.
    b: i64,
}

/// `greet` arguments of the upstream test server.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
struct GreetArgs {
    /// Who to greet.
    name: String,
}

/// An upstream MCP server with two tools.
#[derive(Clone)]
struct Upstream {
    /// Its tools.
    tool_router: ToolRouter<Upstream>,
}

#[tool_router]
impl Upstream {
    #[tool(description = "Adds two integers.")]
    async fn add(&self, Parameters(args): Parameters<AddArgs>) -> String {
        (args.a + args.b).to_string()
    }

    #[tool(description = "Greets someone by name.")]
    async fn greet(&self, Parameters(args): Parameters<GreetArgs>) -> String {
        format!("Hello, {}!", args.name)
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Upstream {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }
}

/// Serves `router` on 127.0.0.1:0; returns its port.
async fn serve(router: axum::Router) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    port
}

/// The upstream MCP server at `/mcp` and an HTTP server (`/hello`, `/away`: a redirect to a
/// host off the list) on another port; returns (mcp port, http port).
async fn start_servers() -> (u16, u16) {
    let mcp = StreamableHttpService::new(
        || {
            Ok(Upstream {
                tool_router: Upstream::tool_router(),
            })
        },
        Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default().disable_allowed_hosts(),
    );
    let mcp_port = serve(axum::Router::new().route_service("/mcp", mcp)).await;
    let http_port = {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let router = axum::Router::new()
            .route("/hello", get(|| async { "hi from the host" }))
            .route(
                "/away",
                get(move || async move {
                    Redirect::temporary(&format!("http://localhost:{port}/hello"))
                }),
            );
        tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        port
    };
    (mcp_port, http_port)
}

/// A broker with code mode on, wired to the test servers; and the HTTP server's port.
async fn start(tag: &str) -> (TestBroker, u16) {
    let (mcp_port, http_port) = start_servers().await;
    // Only read by the brokers of this file, always with the same value.
    std::env::set_var(ENV_KEY, "forty-two");
    let broker = TestBroker::start_with(tag, move |config| {
        config.code_mode.codemode = true;
        config.code_mode.codemode_http_allow = vec![format!("127.0.0.1:{http_port}")];
        config.code_mode.codemode_env_allow = vec![ENV_KEY.to_string()];
        config.code_mode.codemode_mcp_servers = vec![format!("up=http://127.0.0.1:{mcp_port}/mcp")];
        config.code_mode.codemode_timeout_ms = 8_000;
    })
    .await;
    (broker, http_port)
}

async fn connect(broker: &TestBroker) -> Client {
    mcp_client::connect(broker, None).await.expect("connect")
}

/// `execute`'s structured `{result, logs, error}`.
async fn execute(client: &Client, lang: &str, code: &str) -> Value {
    let result = call(client, "execute", json!({"lang": lang, "code": code})).await;
    let value = result
        .structured_content
        .clone()
        .expect("structuredContent");
    assert_eq!(
        result.is_error == Some(true),
        !value["error"].is_null(),
        "{result:?}"
    );
    value
}

#[tokio::test]
async fn upstream_tools_fan_out_and_declarations() {
    let (broker, _) = start("cm-upstream").await;
    let client = connect(&broker).await;

    // The tools, and execute's description with the functions as TypeScript.
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
    let execute_tool = tools.iter().find(|t| t.name == "execute").expect("execute");
    let description = execute_tool.description.as_deref().unwrap_or_default();
    assert!(
        description.contains("declare const codemode: {"),
        "{description}"
    );
    assert!(
        description.contains("add(input: { a: number; b: number }): Promise<unknown>;"),
        "{description}"
    );
    assert!(
        description.contains("greet(input: { name: string })"),
        "{description}"
    );
    assert!(
        description.contains("async def codemode.up.add(*, a: int, b: int)"),
        "{description}"
    );
    // Stable across lists.
    let again = client.list_all_tools().await.expect("tools/list");
    let again = again.iter().find(|t| t.name == "execute").expect("execute");
    assert_eq!(again.description, execute_tool.description);

    // Two upstream tools in one run.
    let out = execute(
        &client,
        "js",
        "const sum = await codemode.up.add({a: 2, b: 3});\n\
         const hello = await codemode.up.greet({name: 'Ada'});\n\
         console.log('got', sum, hello);\n\
         return {sum, hello};",
    )
    .await;
    assert_eq!(out["error"], Value::Null, "{out}");
    assert_eq!(
        out["result"],
        json!({"sum": "5", "hello": "Hello, Ada!"}),
        "{out}"
    );
    assert_eq!(out["logs"], json!(["got 5 Hello, Ada!"]), "{out}");

    // Promise.all fan-out, as a lone expression.
    let out = execute(
        &client,
        "js",
        "Promise.all([1, 2, 3, 4, 5].map((i) => codemode.up.add({a: i, b: 10})))",
    )
    .await;
    assert_eq!(
        out["result"],
        json!(["11", "12", "13", "14", "15"]),
        "{out}"
    );

    // TypeScript and Python reach the same functions.
    let out = execute(
        &client,
        "ts",
        "const n: string = await codemode.up.add({a: 1, b: 1});\nreturn n;",
    )
    .await;
    assert_eq!(out["result"], "2", "{out}");
    let out = execute(
        &client,
        "py",
        "import asyncio\nr = await asyncio.gather(codemode.up.add(a=1, b=2), codemode.up.greet(name='Py'))\nprint('py', r)\nr",
    )
    .await;
    assert_eq!(out["error"], Value::Null, "{out}");
    assert_eq!(out["result"], json!(["3", "Hello, Py!"]), "{out}");
    assert_eq!(out["logs"], json!(["py ['3', 'Hello, Py!']"]), "{out}");

    // search ranks by name and description.
    let found = call(&client, "search", json!({"query": "greet someone"})).await;
    let found = found.structured_content.expect("structured");
    assert_eq!(found["tools"][0]["name"], "codemode.up.greet", "{found}");
    let _ = client.cancel().await;
}

#[tokio::test]
async fn denials_errors_and_the_network() {
    let (broker, port) = start("cm-deny").await;
    let client = connect(&broker).await;

    // The container has no network, but the broker fetches an allowed host for it.
    let code = format!(
        "let direct;\n\
         try {{ await fetch('http://1.1.1.1', {{signal: AbortSignal.timeout(3000)}}); direct = 'reached'; }}\n\
         catch (e) {{ direct = 'failed'; }}\n\
         const r = await codemode.http.fetch({{url: 'http://127.0.0.1:{port}/hello'}});\n\
         return {{direct, status: r.status, body: r.body, type: r.headers['content-type']}};"
    );
    let out = execute(&client, "js", &code).await;
    assert_eq!(out["error"], Value::Null, "{out}");
    assert_eq!(out["result"]["direct"], "failed", "{out}");
    assert_eq!(out["result"]["status"], 200, "{out}");
    assert_eq!(out["result"]["body"], "hi from the host", "{out}");

    // A host off the list, and a redirect to one, are refused; the code can catch it.
    let code = format!(
        "const seen = [];\n\
         for (const url of ['http://example.com/', 'http://127.0.0.1:{port}/away']) {{\n\
           try {{ await codemode.http.fetch({{url}}); seen.push('fetched'); }}\n\
           catch (e) {{ seen.push(e.message); }}\n\
         }}\n\
         return seen;"
    );
    let out = execute(&client, "js", &code).await;
    assert_eq!(
        out["result"],
        json!([
            "Host 'example.com' is not allowed",
            format!("Host 'localhost:{port}' is not allowed")
        ]),
        "{out}"
    );

    // env.get: an allowed key, a denied one.
    let out = execute(
        &client,
        "js",
        &format!(
            "const v = await codemode.env.get({{key: '{ENV_KEY}'}});\n\
             try {{ await codemode.env.get({{key: 'HOME'}}); }} catch (e) {{ return [v, e.message]; }}"
        ),
    )
    .await;
    assert_eq!(
        out["result"],
        json!(["forty-two", "Key 'HOME' is not allowed"]),
        "{out}"
    );

    // A tool that is not there, asked for over the socket directly.
    let out = execute(
        &client,
        "js",
        "const net = require('net');\n\
         return await new Promise((resolve) => {\n\
           const s = net.createConnection(process.env.CODEBROKER_TOOL_SOCKET);\n\
           let d = '';\n\
           s.on('connect', () => s.write(JSON.stringify({name: 'up.nothing', input: {}}) + '\\n'));\n\
           s.on('data', (c) => d += c);\n\
           s.on('close', () => resolve(JSON.parse(d)));\n\
         });",
    )
    .await;
    assert_eq!(out["result"]["is_error"], true, "{out}");
    assert_eq!(
        out["result"]["error_message"], "Unknown tool: 'up.nothing'",
        "{out}"
    );

    // Logs are kept when the code throws.
    let out = execute(
        &client,
        "js",
        "console.log('before');\nconsole.error('to stderr');\nthrow new Error('boom');",
    )
    .await;
    assert_eq!(out["error"], "Error: boom", "{out}");
    assert_eq!(out["result"], Value::Null, "{out}");
    assert_eq!(out["logs"], json!(["before", "to stderr"]), "{out}");
    let out = execute(&client, "py", "print('py before')\nraise ValueError('bad')").await;
    assert_eq!(out["error"], "ValueError: bad", "{out}");
    assert_eq!(out["logs"], json!(["py before"]), "{out}");

    // A run past the time limit.
    let out = execute(
        &client,
        "js",
        "console.log('waiting');\nawait new Promise((r) => setTimeout(r, 60000));",
    )
    .await;
    assert_eq!(out["error"], "Time limit exceeded", "{out}");
    // The runner's own notice follows what the code printed.
    assert_eq!(out["logs"][0], "waiting", "{out}");
    let _ = client.cancel().await;
}

/// A minimal MCP server on stdio (newline-delimited JSON-RPC) with two tools: `echo`, and
/// `quit`, which ends the process without answering. Given a path, it starts only when
/// that file exists (a server that is not up yet).
const STDIO_SERVER: &str = r#"
import json, os, sys
if len(sys.argv) > 1 and not os.path.exists(sys.argv[1]):
    sys.exit(1)
for line in sys.stdin:
    msg = json.loads(line)
    if "id" not in msg:
        continue
    method = msg.get("method")
    if method == "initialize":
        result = {"protocolVersion": msg["params"]["protocolVersion"], "capabilities": {"tools": {}},
                  "serverInfo": {"name": "echo", "version": "1"}}
    elif method == "tools/list":
        result = {"tools": [{"name": "echo", "description": "Echoes.",
                             "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}}},
                            {"name": "quit", "description": "Ends the server.",
                             "inputSchema": {"type": "object"}}]}
    elif method == "tools/call" and msg["params"]["name"] == "quit":
        sys.exit(0)
    elif method == "tools/call":
        text = msg["params"].get("arguments", {}).get("text", "")
        result = {"content": [{"type": "text", "text": text}], "structuredContent": {"echo": text}}
    else:
        result = {}
    print(json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": result}), flush=True)
"#;

/// A `stdio:` upstream server: started as a child process, its tool listed and called
/// (no sandbox needed: the broker answers the call itself).
#[tokio::test]
async fn stdio_upstream_servers_are_called() {
    let dir = readable_tempdir();
    let script = dir.path().join("server.py");
    std::fs::write(&script, STDIO_SERVER).expect("write");
    let mut config = <codebroker::config::Config as clap::Parser>::parse_from(["codebroker"]);
    config.code_mode.codemode = true;
    config.code_mode.codemode_mcp_servers =
        vec![format!("echo=stdio:python3 {}", script.display())];
    let mode = codebroker::codemode::CodeMode::new(&config.code_mode);
    let specs = mode.specs().await;
    assert!(specs.iter().any(|s| s.name == "echo.echo"), "{specs:?}");
    let result = mode
        .serve(sandbox_runner::ToolCall {
            call_id: "c1".into(),
            name: "echo.echo".into(),
            input: json!({"text": "hi"}),
            batch: None,
        })
        .await;
    assert!(!result.is_error, "{result:?}");
    assert_eq!(result.result, json!({"echo": "hi"}));
}

/// A temporary directory any uid may read: the stdio server does not run as the test's.
fn readable_tempdir() -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    dir
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

/// An upstream server that is not up when the broker starts is connected once it is, and
/// one whose process dies is started again by the next call.
#[tokio::test]
async fn upstream_servers_are_reconnected() {
    let dir = readable_tempdir();
    let script = dir.path().join("server.py");
    let ready = dir.path().join("ready");
    std::fs::write(&script, STDIO_SERVER).expect("write");
    let mut config = <codebroker::config::Config as clap::Parser>::parse_from(["codebroker"]);
    config.code_mode.codemode = true;
    config.code_mode.codemode_mcp_servers = vec![format!(
        "echo=stdio:python3 {} {}",
        script.display(),
        ready.display()
    )];
    let mode = codebroker::codemode::CodeMode::new(&config.code_mode);

    // Down: its tools are not offered, and a call says why it fails.
    assert!(!mode.specs().await.iter().any(|s| s.name == "echo.echo"));
    let down = bridge_call(&mode, "echo.echo", json!({"text": "hi"})).await;
    assert!(down.is_error, "{down:?}");
    assert_eq!(
        down.error_message.as_deref(),
        Some("Tool 'echo.echo' is unavailable: server 'echo' cannot be reached"),
        "{down:?}"
    );

    // Up: found on a use after the retry interval.
    std::fs::write(&ready, "").expect("write");
    tokio::time::sleep(std::time::Duration::from_millis(2_100)).await;
    let specs = mode.specs().await;
    assert!(specs.iter().any(|s| s.name == "echo.echo"), "{specs:?}");
    let up = bridge_call(&mode, "echo.echo", json!({"text": "one"})).await;
    assert_eq!(up.result, json!({"echo": "one"}), "{up:?}");

    // Its process dies mid-call: that call fails (it may have run), the next one starts it
    // again.
    let quit = bridge_call(&mode, "echo.quit", json!({})).await;
    assert!(quit.is_error, "{quit:?}");
    let again = bridge_call(&mode, "echo.echo", json!({"text": "two"})).await;
    assert!(!again.is_error, "{again:?}");
    assert_eq!(again.result, json!({"echo": "two"}));
}
