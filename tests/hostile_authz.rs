//! Who may reach what, tried as an attacker would: a named user (a JWT, or a key caller
//! naming one) against sessions an unnamed caller made (MCP, LobeChat, the playground);
//! input refs routed through such a session; another user's programmatic run, by its
//! continuation token or by reusing its request id; a LobeChat model that names a user;
//! code mode's upstream servers and `http.fetch` against the broker's own secrets and the
//! host's loopback.

mod common;

use codebroker::config::AuthMode;
use common::child::Launch;
use common::jwt::{jwt, lc_ed_public_key};
use common::{session, stdout, TestBroker};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const KEY: &str = "authz-key";

type Headers = Vec<(&'static str, String)>;

fn bearer(token: &str) -> Headers {
    vec![("authorization", format!("Bearer {token}"))]
}

fn key_only() -> Headers {
    vec![("x-api-key", KEY.to_string())]
}

fn key_user(user: &str) -> Headers {
    vec![
        ("x-api-key", KEY.to_string()),
        ("user-id", user.to_string()),
    ]
}

/// A broker taking the key and LibreChat's JWTs.
async fn keyed(tag: &str, adjust: impl FnOnce(&mut codebroker::config::Config)) -> TestBroker {
    TestBroker::start_with(tag, |c| {
        c.access.auth = AuthMode::Key;
        c.access.api_key = vec![KEY.into()];
        c.access.jwt_public_keys = vec![lc_ed_public_key()];
        adjust(c);
    })
    .await
}

/// Sends `request` with `headers`: status and body (JSON when it is JSON).
async fn send(mut request: reqwest::RequestBuilder, headers: &Headers) -> (u16, Value) {
    for (name, value) in headers {
        request = request.header(*name, value);
    }
    common::answer(request.send().await.expect("request")).await
}

async fn exec(broker: &TestBroker, headers: &Headers, body: Value) -> (u16, Value) {
    send(broker.client.post(broker.url("/exec")).json(&body), headers).await
}

async fn get(broker: &TestBroker, headers: &Headers, path: &str) -> (u16, Value) {
    send(broker.client.get(broker.url(path)), headers).await
}

const WRITE_SECRET: &str =
    "open('/mnt/data/secret.txt', 'w').write('TOP SECRET')\nprint('written')";
const LIST_DATA: &str = "import os\nprint(sorted(os.listdir('/mnt/data')))";

/// Writes the secret through `headers`: its session and file id.
async fn write_secret(broker: &TestBroker, headers: &Headers) -> (String, String) {
    let (status, body) = exec(
        broker,
        headers,
        json!({ "lang": "py", "code": WRITE_SECRET }),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(stdout(&body), "written\n", "{body}");
    let file = body["files"][0]["id"]
        .as_str()
        .expect("file id")
        .to_string();
    (session(&body), file)
}

/// A session made by a caller naming no user (as MCP clients, LobeChat and the
/// playground are) answers a named user as if it did not exist: no files, no downloads,
/// no deletion, no uploads into it, and its id starts a new session. The key's own scope
/// still reaches it.
#[tokio::test]
async fn ownerless_sessions_are_invisible_to_named_users() {
    let broker = keyed("authz-ownerless", |_| {}).await;
    let (s, f) = write_secret(&broker, &key_only()).await;

    for (who, other) in [("jwt", bearer(&jwt("mallory"))), ("key", key_user("bob"))] {
        let (status, body) = get(&broker, &other, &format!("/download/{s}/{f}")).await;
        assert_eq!(status, 404, "{who}: download: {body}");
        let (_, listed) = get(&broker, &other, &format!("/files/{s}?detail=full")).await;
        assert!(!listed.to_string().contains(&f), "{who}: listed: {listed}");
        let (status, body) = exec(
            &broker,
            &other,
            json!({ "lang": "py", "code": LIST_DATA, "session_id": s }),
        )
        .await;
        assert_eq!(status, 200, "{who}: {body}");
        assert_ne!(
            session(&body),
            s,
            "{who}: ran in the ownerless session: {body}"
        );
        assert_eq!(body["runtime_status"], "new", "{who}: {body}");
        assert!(!stdout(&body).contains("secret.txt"), "{who}: {body}");
        let (status, body) = exec(
            &broker,
            &other,
            json!({ "lang": "py", "code": LIST_DATA, "runtime_session_hint": s }),
        )
        .await;
        assert_eq!(status, 200, "{who}: {body}");
        assert_ne!(session(&body), s, "{who}: hint: {body}");
        // An upload naming the session lands elsewhere.
        let form = reqwest::multipart::Form::new()
            .text("session_id", s.clone())
            .part(
                "file",
                reqwest::multipart::Part::bytes(b"planted".to_vec()).file_name("planted.txt"),
            );
        let (status, body) = send(
            broker.client.post(broker.url("/upload")).multipart(form),
            &other,
        )
        .await;
        assert_eq!(status, 200, "{who}: upload: {body}");
        assert_ne!(
            body["session_id"],
            json!(s),
            "{who}: uploaded into it: {body}"
        );
        let (status, body) = send(
            broker.client.delete(broker.url(&format!("/files/{s}/{f}"))),
            &other,
        )
        .await;
        assert_eq!(status, 404, "{who}: delete: {body}");
    }

    // The key's scope: everything still there, nothing planted.
    let (status, body) = get(&broker, &key_only(), &format!("/download/{s}/{f}")).await;
    assert_eq!((status, body), (200, Value::String("TOP SECRET".into())));
    let (status, body) = exec(
        &broker,
        &key_only(),
        json!({ "lang": "py", "code": LIST_DATA, "session_id": s }),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(session(&body), s);
    assert_eq!(stdout(&body), "['secret.txt']\n", "{body}");
}

/// Input refs are authorised against the caller: going through an ownerless session (whose
/// own owner, nobody, would see every session) does not reach another user's file.
#[tokio::test]
async fn refs_through_an_ownerless_session_are_refused() {
    let broker = keyed("authz-refs", |_| {}).await;
    let (alice_s, alice_f) = write_secret(&broker, &bearer(&jwt("alice"))).await;
    let (ownerless, _) = write_secret(&broker, &key_only()).await;

    let mallory = bearer(&jwt("mallory"));
    let (status, body) = exec(
        &broker,
        &mallory,
        json!({ "lang": "py", "code": "print(open('/mnt/data/loot.txt').read())",
                "session_id": ownerless,
                "files": [{ "id": alice_f, "session_id": alice_s, "name": "loot.txt" }] }),
    )
    .await;
    assert!(!body.to_string().contains("TOP SECRET"), "{body}");
    assert_eq!(status, 403, "{body}");
    assert_eq!(body["error"], "forbidden");

    // Alice's own ref still works.
    let (status, body) = exec(
        &broker,
        &bearer(&jwt("alice")),
        json!({ "lang": "py", "code": "print(open('/mnt/data/mine.txt').read())",
                "files": [{ "id": alice_f, "session_id": alice_s, "name": "mine.txt" }] }),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(stdout(&body), "TOP SECRET\n", "{body}");
}

fn tools() -> Value {
    json!([{ "name": "add", "description": "Adds a and b.",
             "parameters": { "type": "object", "properties": { "a": {"type": "number"}, "b": {"type": "number"} } } }])
}

async fn programmatic(
    broker: &TestBroker,
    headers: &Headers,
    body: Value,
    request_id: Option<&str>,
) -> (u16, Value) {
    let mut headers = headers.clone();
    if let Some(id) = request_id {
        headers.push(("x-librechat-code-request-id", id.to_string()));
    }
    send(
        broker
            .client
            .post(broker.url("/exec/programmatic"))
            .json(&body),
        &headers,
    )
    .await
}

async fn cancel(broker: &TestBroker, headers: &Headers, request_id: &str) -> (u16, Value) {
    send(
        broker
            .client
            .post(broker.url("/exec/programmatic/cancel"))
            .json(&json!({ "request_id": request_id })),
        headers,
    )
    .await
}

/// A programmatic run answers only its own user: another user's cancel by its request id
/// and continuation with its token are 404 (and leave it alone), and reusing its request id
/// does not take over the id's mapping.
#[tokio::test]
async fn programmatic_runs_answer_only_their_user() {
    let broker = keyed("authz-ptc", |_| {}).await;
    let (alice, bob) = (bearer(&jwt("alice")), bearer(&jwt("bob")));
    let first = json!({ "code": "print(await add(a=1, b=1))", "tools": tools() });

    let (status, a) = programmatic(&broker, &alice, first.clone(), Some("shared-id")).await;
    assert_eq!(
        (status, &a["status"]),
        (200, &json!("tool_call_required")),
        "{a}"
    );
    let alice_session = a["session_id"].clone();

    // Bob cancels by Alice's request id: unknown to him.
    let (status, body) = cancel(&broker, &bob, "shared-id").await;
    assert_eq!(status, 404, "bob cancelled alice's run: {body}");
    // Bob continues with Alice's token: unknown to him, and not used up.
    let results = json!([{ "call_id": a["tool_calls"][0]["id"], "result": 40 }]);
    let (status, body) = programmatic(
        &broker,
        &bob,
        json!({ "continuation_token": a["continuation_token"], "tool_results": results }),
        None,
    )
    .await;
    assert_eq!(status, 404, "bob continued alice's run: {body}");

    // Bob starts a run under the same request id; Alice's cancel still stops hers.
    let (status, b) = programmatic(&broker, &bob, first, Some("shared-id")).await;
    assert_eq!(
        (status, &b["status"]),
        (200, &json!("tool_call_required")),
        "{b}"
    );
    let (status, body) = cancel(&broker, &alice, "shared-id").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["session_id"], alice_session, "{body}");
    let (status, body) = programmatic(
        &broker,
        &alice,
        json!({ "continuation_token": a["continuation_token"], "tool_results": [] }),
        None,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["status"], "error", "alice's run was cancelled: {body}");

    // Bob's run is untouched.
    let results = json!([{ "call_id": b["tool_calls"][0]["id"], "result": 2 }]);
    let (status, body) = programmatic(
        &broker,
        &bob,
        json!({ "continuation_token": b["continuation_token"], "tool_results": results }),
        None,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["status"], "completed", "{body}");
    assert_eq!(stdout(&body), "2\n", "{body}");
}

/// POST /lobe/run as LobeChat's gateway sends it: the model's arguments as the body.
async fn lobe(broker: &TestBroker, args: Value) -> (u16, String) {
    let resp = broker
        .client
        .post(broker.url("/lobe/run"))
        .header("content-type", "text/plain;charset=UTF-8")
        .header(
            "x-lobe-plugin-settings",
            json!({ "apiKey": KEY }).to_string(),
        )
        .body(args.to_string())
        .send()
        .await
        .expect("POST /lobe/run");
    let status = resp.status().as_u16();
    (status, resp.text().await.expect("body"))
}

fn lobe_session(markdown: &str) -> String {
    let (_, rest) = markdown
        .rsplit_once("session_id: `")
        .unwrap_or_else(|| panic!("no session_id in {markdown}"));
    rest.chars().take_while(|c| *c != '`').collect()
}

/// The model writes LobeChat's request body: it cannot name a user (and spend their rate
/// budget), nor go back to a named user's session by its id.
#[tokio::test]
async fn lobe_models_do_not_choose_the_user() {
    let broker = keyed("authz-lobe", |c| c.caps.rate_execs_per_minute = 2).await;
    for _ in 0..2 {
        let (status, md) = lobe(
            &broker,
            json!({ "lang": "py", "code": "print(1)", "user_id": "alice", "entity_id": "x" }),
        )
        .await;
        assert_eq!(status, 200, "{md}");
    }
    // Alice's budget is hers.
    let (status, body) = exec(
        &broker,
        &key_user("alice"),
        json!({ "lang": "py", "code": WRITE_SECRET }),
    )
    .await;
    assert_eq!(status, 200, "alice's rate was spent by the model: {body}");
    let alice_session = session(&body);

    let broker = keyed("authz-lobe-session", |_| {}).await;
    let (alice_session_2, _) = write_secret(&broker, &key_user("alice")).await;
    let (status, md) = lobe(
        &broker,
        json!({ "lang": "py", "code": LIST_DATA, "session_id": alice_session_2 }),
    )
    .await;
    assert_eq!(status, 200, "{md}");
    assert!(!md.contains("secret.txt"), "{md}");
    assert_ne!(lobe_session(&md), alice_session_2, "{md}");
    // Its own sessions it does go back to.
    let s = lobe_session(&md);
    let (status, md) = lobe(
        &broker,
        json!({ "lang": "py", "code": "print('again')", "session_id": s }),
    )
    .await;
    assert_eq!(status, 200, "{md}");
    assert_eq!(lobe_session(&md), s, "{md}");
    drop(alice_session);
}

/// A `stdio:` upstream server that writes its environment to `argv[1]` and exits.
const ENV_DUMPER: &str = r#"
import json, os, sys
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump(dict(os.environ), f)
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
"#;

/// The broker binary, run with an API key and another secret in its environment, starts a
/// `stdio:` upstream server: the server sees neither, only the base variables and those
/// `CODEBROKER_CODEMODE_MCP_ENV` names.
#[tokio::test]
async fn stdio_upstream_servers_get_no_broker_secrets() {
    common::require_image();
    let dir = tempfile::tempdir().expect("tempdir");
    // The server runs as a uid of its own, and writes its dump here.
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .expect("chmod");
    let script = dir.path().join("dump.py");
    let dump = dir.path().join("env.json");
    std::fs::write(&script, ENV_DUMPER).expect("write");
    let data = tempfile::tempdir().expect("tempdir");
    let api_key = format!("broker-key-{}", std::process::id());
    // Not waited for: the upstream server starts with the broker and writes the dump.
    let mut broker = Launch::binary(&common::instance_name("authz-env"), data.path())
        .env("CODEBROKER_AUTH", "key")
        .env("CODEBROKER_API_KEY", &api_key)
        .env("DATABASE_PASSWORD", "hunter2")
        .env("PASSED_ON", "yes")
        .env("CODEBROKER_CODEMODE", "true")
        .env(
            "CODEBROKER_CODEMODE_MCP_SERVERS",
            format!("ev=stdio:python3 {} {}", script.display(), dump.display()),
        )
        .env("CODEBROKER_CODEMODE_MCP_ENV", "PASSED_ON")
        .owning(data)
        .start();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !dump.exists() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    broker.kill();
    let text = std::fs::read_to_string(&dump).expect("the upstream server started");
    let env: serde_json::Map<String, Value> = serde_json::from_str(&text).expect("json");
    assert!(!text.contains(&api_key), "the API key leaked: {text}");
    for secret in ["CODEBROKER_API_KEY", "DATABASE_PASSWORD", "CODEBROKER_AUTH"] {
        assert!(!env.contains_key(secret), "{secret} leaked: {text}");
    }
    assert!(env.contains_key("PATH"), "{text}");
    assert_eq!(env.get("PASSED_ON"), Some(&json!("yes")), "{text}");
}

/// A plain HTTP server on `ip`, port 0: `/hello`, and `/away` redirecting to
/// `http://localhost:{away}/hello`. Its port.
async fn local_http(ip: &str, away: u16) -> u16 {
    use axum::routing::get;
    let listener = tokio::net::TcpListener::bind((ip, 0)).await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let router = axum::Router::new()
        .route("/hello", get(|| async { "hi from the host" }))
        .route(
            "/away",
            get(move || async move {
                axum::response::Redirect::temporary(&format!("http://localhost:{away}/hello"))
            }),
        );
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    port
}

/// `codemode.http.fetch({url})` as the sandbox calls it, on a code mode made from `allow`.
async fn fetch(allow: &[String], allow_private: bool, url: &str) -> sandbox_runner::ToolResult {
    let mut config = <codebroker::config::Config as clap::Parser>::parse_from(["codebroker"]);
    config.code_mode.codemode = true;
    config.code_mode.codemode_http_allow = allow.to_vec();
    config.code_mode.codemode_http_allow_private = allow_private;
    let mode = codebroker::codemode::CodeMode::new(&config.code_mode);
    mode.serve(sandbox_runner::ToolCall {
        call_id: "c1".into(),
        name: "http.fetch".into(),
        input: json!({ "url": url }),
        batch: None,
    })
    .await
}

fn body_of(result: &sandbox_runner::ToolResult) -> &str {
    result.result["body"].as_str().unwrap_or_default()
}

/// An allowed name that resolves to a loopback address is refused after resolution, and
/// so is a redirect to one; the address listed as such, or the operator's setting, allows
/// it. A bare entry allows the web's ports only.
#[tokio::test]
async fn fetch_refuses_names_that_resolve_to_private_addresses() {
    let port = local_http("127.0.0.1", 0).await;
    let by_name = format!("http://localhost:{port}/hello");

    let refused = fetch(&[format!("localhost:{port}")], false, &by_name).await;
    assert!(refused.is_error, "localhost was reached: {refused:?}");
    let message = refused.error_message.clone().unwrap_or_default();
    assert!(
        message.starts_with("Host 'localhost' resolves to a non-public address ("),
        "{message}"
    );

    // A redirect from a listed address to an allowed name: refused the same way (the
    // redirecting server is on 127.0.0.2, which is listed; 127.0.0.1 is not).
    let away = local_http("127.0.0.2", port).await;
    let allow = [format!("127.0.0.2:{away}"), format!("localhost:{port}")];
    let redirected = fetch(&allow, false, &format!("http://127.0.0.2:{away}/away")).await;
    assert!(
        redirected.is_error,
        "redirected to localhost: {redirected:?}"
    );
    assert!(
        redirected
            .error_message
            .as_deref()
            .unwrap_or_default()
            .contains("non-public address"),
        "{redirected:?}"
    );

    // The address itself on the list: reached, by address and by the name.
    let direct = fetch(
        &[format!("127.0.0.1:{port}")],
        false,
        &format!("http://127.0.0.1:{port}/hello"),
    )
    .await;
    assert!(!direct.is_error, "{direct:?}");
    assert_eq!(body_of(&direct), "hi from the host");
    let listed = [format!("localhost:{port}"), "127.0.0.1".to_string()];
    let named = fetch(&listed, false, &by_name).await;
    assert!(!named.is_error, "{named:?}");
    assert_eq!(body_of(&named), "hi from the host");
    // The operator's setting.
    let private = fetch(&[format!("localhost:{port}")], true, &by_name).await;
    assert!(!private.is_error, "{private:?}");
    assert_eq!(body_of(&private), "hi from the host");

    // A bare entry: 80 and 443, not the port of whatever else the host runs.
    let bare = fetch(
        &["127.0.0.1".to_string()],
        false,
        &format!("http://127.0.0.1:{port}/hello"),
    )
    .await;
    assert!(bare.is_error, "a bare entry reached port {port}: {bare:?}");
    assert_eq!(
        bare.error_message.as_deref(),
        Some(format!("Host '127.0.0.1:{port}' is not allowed").as_str())
    );
}
