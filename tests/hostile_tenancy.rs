//! Keys and tenants as boundaries, tried as an attacker would: a caller with another API
//! key (naming no user, or naming the same user) against a session made under the first
//! key, by every path that takes a session id (exec, its hint, files, download, delete,
//! upload into it, a saved Python state, MCP's `execute_code`, code mode), or an
//! `entity_id` affinity; a JWT user of one tenant against the same `sub` in another. Each
//! answers "not found" or a new session, as for an id that does not exist.

mod common;
#[path = "common/mcp_client.rs"]
mod mcp_client;

use codebroker::config::{AuthMode, Config};
use common::jwt::{claims, lc_ed_public_key, sign, ED_A};
use common::{session, stdout, TestBroker};
use jsonwebtoken::{Algorithm, EncodingKey};
use mcp_client::{call, connect, structured};
use serde_json::{json, Value};

const KEY_A: &str = "tenancy-key-a";
const KEY_B: &str = "tenancy-key-b";

type Headers = Vec<(&'static str, String)>;

fn key(key: &str) -> Headers {
    vec![("x-api-key", key.to_string())]
}

fn key_user(key: &str, user: &str) -> Headers {
    vec![
        ("x-api-key", key.to_string()),
        ("user-id", user.to_string()),
    ]
}

fn bearer(token: &str) -> Headers {
    vec![("authorization", format!("Bearer {token}"))]
}

/// A LibreChat token for `sub` in tenant `tenant`, signed by the trusted `lc-ed` key.
fn tenant_jwt(sub: &str, tenant: &str) -> String {
    let mut c = claims(sub, 300, "codeapi", "librechat");
    c["tenant_id"] = json!(tenant);
    let key = EncodingKey::from_ed_pem(ED_A).expect("private key");
    sign(Algorithm::EdDSA, &key, Some("lc-ed"), &c)
}

/// A broker taking both keys (each its own tenant) and LibreChat's JWTs.
async fn two_keys(tag: &str, adjust: impl FnOnce(&mut Config)) -> TestBroker {
    TestBroker::start_with(tag, |c| {
        c.access.auth = AuthMode::Key;
        c.access.api_key = vec![KEY_A.into(), KEY_B.into()];
        c.access.jwt_public_keys = vec![lc_ed_public_key()];
        adjust(c);
    })
    .await
}

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

const WRITE_SECRET: &str = "secret = 'tenant-a-7f3a'\n\
     open('/mnt/data/secret.txt', 'w').write('TOP SECRET')\nprint('written')";
const PEEK: &str = "import os\nprint('secret' in globals(), sorted(os.listdir('/mnt/data')))";
const NOTHING_SEEN: &str = "False []\n";

/// Writes the secret (a variable and a file) through `headers`: its session and file id.
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

/// Everything a caller `other` may try on session `s` (file `f`): each answers as for a
/// session that does not exist, and nothing of it leaks.
async fn try_every_path(broker: &TestBroker, who: &str, other: &Headers, s: &str, f: &str) {
    let (status, body) = get(broker, other, &format!("/download/{s}/{f}")).await;
    assert_eq!(status, 404, "{who}: download: {body}");
    let (status, listed) = get(broker, other, &format!("/files/{s}?detail=full")).await;
    assert_eq!(status, 200, "{who}: list: {listed}");
    assert!(!listed.to_string().contains(f), "{who}: listed: {listed}");
    for field in ["session_id", "runtime_session_hint"] {
        let (status, body) = exec(
            broker,
            other,
            json!({ "lang": "py", "code": PEEK, field: s }),
        )
        .await;
        assert_eq!(status, 200, "{who}: {field}: {body}");
        assert_eq!(stdout(&body), NOTHING_SEEN, "{who}: {field}: {body}");
        assert_ne!(session(&body), s, "{who}: {field}: ran in it: {body}");
    }
    let form = reqwest::multipart::Form::new()
        .text("session_id", s.to_string())
        .part(
            "file",
            reqwest::multipart::Part::bytes(b"planted".to_vec()).file_name("planted.txt"),
        );
    let (status, body) = send(
        broker.client.post(broker.url("/upload")).multipart(form),
        other,
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
        other,
    )
    .await;
    assert_eq!(status, 404, "{who}: delete: {body}");
}

/// The owner still has it all, and nothing was planted.
async fn owner_still_sees(broker: &TestBroker, owner: &Headers, s: &str, f: &str) {
    let (status, body) = get(broker, owner, &format!("/download/{s}/{f}")).await;
    assert_eq!((status, body), (200, Value::String("TOP SECRET".into())));
    let (status, body) = exec(
        broker,
        owner,
        json!({ "lang": "py", "code": PEEK, "session_id": s }),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(session(&body), s, "{body}");
    assert_eq!(stdout(&body), "True ['secret.txt']\n", "{body}");
}

/// Another key's caller, naming no user or naming the same user, finds nothing of a
/// session made under the first key.
#[tokio::test]
async fn another_keys_callers_do_not_find_a_session() {
    let broker = two_keys("tenancy-keys", |_| {}).await;
    let (s, f) = write_secret(&broker, &key(KEY_A)).await;
    try_every_path(&broker, "key b", &key(KEY_B), &s, &f).await;
    owner_still_sees(&broker, &key(KEY_A), &s, &f).await;

    let (s, f) = write_secret(&broker, &key_user(KEY_A, "alice")).await;
    try_every_path(&broker, "key b as alice", &key_user(KEY_B, "alice"), &s, &f).await;
    try_every_path(&broker, "key b", &key(KEY_B), &s, &f).await;
    owner_still_sees(&broker, &key_user(KEY_A, "alice"), &s, &f).await;
}

/// A JWT user is (tenant, sub): `sub=alice` in tenant t2 finds nothing of alice's in t1,
/// nor does a key's caller.
#[tokio::test]
async fn a_jwt_user_is_scoped_by_tenant() {
    let broker = two_keys("tenancy-jwt", |_| {}).await;
    let (s, f) = write_secret(&broker, &bearer(&tenant_jwt("alice", "t1"))).await;
    try_every_path(&broker, "t2", &bearer(&tenant_jwt("alice", "t2")), &s, &f).await;
    try_every_path(&broker, "key a", &key(KEY_A), &s, &f).await;
    try_every_path(&broker, "key a as alice", &key_user(KEY_A, "alice"), &s, &f).await;
    owner_still_sees(&broker, &bearer(&tenant_jwt("alice", "t1")), &s, &f).await;
}

/// An `entity_id` joins calls of one caller, never callers of two keys.
#[tokio::test]
async fn an_entity_does_not_join_two_keys() {
    let broker = two_keys("tenancy-entity", |_| {}).await;
    for headers in [key(KEY_A), key_user(KEY_A, "alice")] {
        let (status, a) = exec(
            &broker,
            &headers,
            json!({ "lang": "py", "code": WRITE_SECRET, "entity_id": "agent-1" }),
        )
        .await;
        assert_eq!(status, 200, "{a}");
        let other = if headers.len() == 1 {
            key(KEY_B)
        } else {
            key_user(KEY_B, "alice")
        };
        let (status, b) = exec(
            &broker,
            &other,
            json!({ "lang": "py", "code": PEEK, "entity_id": "agent-1" }),
        )
        .await;
        assert_eq!(status, 200, "{b}");
        assert_ne!(session(&b), session(&a), "joined: {b}");
        assert_eq!(stdout(&b), NOTHING_SEEN, "{b}");
        // The first key's next call still finds its own.
        let (status, again) = exec(
            &broker,
            &headers,
            json!({ "lang": "py", "code": PEEK, "entity_id": "agent-1" }),
        )
        .await;
        assert_eq!(status, 200, "{again}");
        assert_eq!(session(&again), session(&a), "{again}");
    }
}

/// A saved Python state is restored only into a session of its own tenant: another key
/// naming the session, whose container was removed with its state saved, gets a new one.
#[tokio::test]
async fn a_saved_state_is_restored_only_in_its_tenant() {
    let broker = two_keys("tenancy-state", |c| c.caps.max_live_sandboxes = 1).await;
    let (s, _) = write_secret(&broker, &key(KEY_A)).await;
    // A second session takes the only place: the first's container goes, its state saved.
    let (status, body) = exec(
        &broker,
        &key(KEY_A),
        json!({ "lang": "py", "code": "other = 1" }),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let state = broker
        .data
        .join("sessions")
        .join(&s)
        .join("python-state.bin");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !state.exists() {
        assert!(std::time::Instant::now() < deadline, "no state saved");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let (status, body) = exec(
        &broker,
        &key(KEY_B),
        json!({ "lang": "py", "code": "print(globals().get('secret'))", "session_id": s }),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        stdout(&body),
        "None\n",
        "restored into key b's exec: {body}"
    );
    assert_ne!(session(&body), s, "{body}");
    let (status, body) = exec(
        &broker,
        &key(KEY_A),
        json!({ "lang": "py", "code": "print(secret)", "session_id": s }),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(stdout(&body), "tenant-a-7f3a\n", "{body}");
}

/// `execute_code` of [`PEEK`] in session `s`: the exec response.
async fn mcp_peek(client: &mcp_client::Client, s: &str) -> Value {
    let result = call(
        client,
        "execute_code",
        json!({ "lang": "py", "code": PEEK, "session_id": s }),
    )
    .await;
    structured(&result).clone()
}

/// Code mode's `execute` reading the secret file, in the MCP session's session.
async fn code_mode_read(client: &mcp_client::Client) -> Value {
    let result = call(
        client,
        "execute",
        json!({ "lang": "py", "code": "import os\np = '/mnt/data/secret.txt'\n\
                open(p).read() if os.path.exists(p) else 'absent'" }),
    )
    .await;
    result.structured_content.clone().expect("structured")
}

/// MCP's `execute_code` with a session id goes back only to sessions its caller may see
/// and that name no user (LobeChat's rule): not another key's, not a named user's of its
/// own key; code mode's `execute`, which runs in the session `execute_code` chose, follows.
#[tokio::test]
async fn mcp_execute_code_stays_in_its_callers_sessions() {
    let broker = two_keys("tenancy-mcp", |c| c.code_mode.codemode = true).await;
    let (unnamed, _) = write_secret(&broker, &key(KEY_A)).await;
    let (alice, _) = write_secret(&broker, &key_user(KEY_A, "alice")).await;

    for (who, client_key, target) in [
        ("key b into key a's", KEY_B, unnamed.clone()),
        ("key a into alice's", KEY_A, alice.clone()),
        ("key b into alice's", KEY_B, alice.clone()),
    ] {
        let client = connect(&broker, Some(client_key)).await.expect("connect");
        let body = mcp_peek(&client, &target).await;
        assert_eq!(body["stdout"], NOTHING_SEEN, "{who}: {body}");
        assert_ne!(body["session_id"], json!(target), "{who}: {body}");
        let value = code_mode_read(&client).await;
        assert_eq!(value["result"], "absent", "{who}: code mode: {value}");
        let _ = client.cancel().await;
    }

    // Key a's MCP client goes back to key a's unnamed session, in code mode too.
    let client = connect(&broker, Some(KEY_A)).await.expect("connect");
    let body = mcp_peek(&client, &unnamed).await;
    assert_eq!(body["stdout"], "True ['secret.txt']\n", "{body}");
    let value = code_mode_read(&client).await;
    assert_eq!(value["result"], "TOP SECRET", "{value}");
    let _ = client.cancel().await;
}

/// Keys configured as one tenant (`tenant:key`) find one another's sessions; a key of
/// another tenant still finds nothing.
#[tokio::test]
async fn keys_of_one_named_tenant_share_their_sessions() {
    let broker = TestBroker::start_with("tenancy-named", |c| {
        c.access.auth = AuthMode::Key;
        c.access.api_key = vec![KEY_B.into()];
        c.access.tenant_api_keys = vec!["acme:acme-one".into(), "acme:acme-two".into()];
    })
    .await;
    let (s, f) = write_secret(&broker, &key("acme-one")).await;
    try_every_path(&broker, "key b", &key(KEY_B), &s, &f).await;
    owner_still_sees(&broker, &key("acme-two"), &s, &f).await;
    owner_still_sees(&broker, &key("acme-one"), &s, &f).await;
}

/// A JWT key bound to tenant t1 signs for t1 only: its token for t2 gets 403 with a clear
/// error, and the next token for t1 still works.
#[tokio::test]
async fn a_jwt_key_bound_to_a_tenant_cannot_sign_for_another() {
    let broker = two_keys("tenancy-jwt-bound", |c| {
        c.access.jwt_key_tenants = vec!["lc-ed=t1".into()];
    })
    .await;
    let body = json!({ "lang": "py", "code": "print('ran')" });
    let (status, refused) = exec(&broker, &bearer(&tenant_jwt("alice", "t2")), body.clone()).await;
    assert_eq!(status, 403, "{refused}");
    assert!(
        refused
            .to_string()
            .contains("may not sign for its tenant_id"),
        "{refused}"
    );
    let (status, ran) = exec(&broker, &bearer(&tenant_jwt("alice", "t1")), body).await;
    assert_eq!(status, 200, "{ran}");
    assert_eq!(stdout(&ran), "ran\n", "{ran}");
}

/// A request the per-user cap refuses takes no other user's idle container on its way:
/// with a cap of two containers, one user's only place running code and another user's
/// container idle, the first user's new session gets 429 (told to wait as long as the
/// longest exec may run) and the other's container stays.
#[tokio::test]
async fn a_refused_request_evicts_no_other_users_container() {
    let broker = two_keys("tenancy-make-room", |c| {
        c.caps.max_containers = codebroker::config::ContainerCap::Count(2);
        c.caps.max_sessions_per_user = 1;
        c.exec_limits.max_exec_timeout_ms = 20_000;
    })
    .await;
    let (status, bob) = exec(
        &broker,
        &key_user(KEY_A, "bob"),
        json!({ "lang": "py", "code": "print('idle')" }),
    )
    .await;
    assert_eq!(status, 200, "{bob}");
    let bobs_container = broker.containers();
    assert_eq!(bobs_container.len(), 1, "{bobs_container:?}");

    let (client, url) = (broker.client.clone(), broker.url("/exec"));
    let busy = tokio::spawn(async move {
        let request = client
            .post(url)
            .header("x-api-key", KEY_A)
            .header("user-id", "alice")
            .json(&json!({ "lang": "bash", "code": "sleep 6; echo done" }));
        common::answer(request.send().await.expect("busy exec")).await
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while broker.containers().len() < 2 {
        assert!(std::time::Instant::now() < deadline, "no second container");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;

    let (status, refused) = exec(
        &broker,
        &key_user(KEY_A, "alice"),
        json!({ "lang": "bash", "code": "echo second" }),
    )
    .await;
    assert_eq!(status, 429, "{refused}");
    // Code mode is on, and its `execute` may hold a session 60 s: the wait covers it, not
    // only the 20 s of a plain exec.
    let wait = refused["retry_after_seconds"]
        .as_u64()
        .expect("retry_after_seconds");
    assert!((50..=60).contains(&wait), "{refused}");
    // Removals run at once when no exec holds them back: give one the time it would take.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let now = broker.containers();
    assert!(
        now.contains(&bobs_container[0]),
        "bob's idle container was removed for a request refused anyway: {now:?}"
    );
    let (status, done) = busy.await.expect("busy exec");
    assert_eq!(status, 200, "{done}");
}

/// A programmatic run answers its tenant only: another key's caller cancelling by the
/// run's request id, or continuing with its token, gets 404 and leaves it alone.
#[tokio::test]
async fn a_programmatic_run_answers_its_tenant_only() {
    let broker = two_keys("tenancy-ptc", |_| {}).await;
    let tools = json!([{ "name": "add", "description": "Adds a and b.",
        "parameters": { "type": "object", "properties": { "a": {"type": "number"}, "b": {"type": "number"} } } }]);
    let programmatic = |headers: Headers, body: Value| {
        let request = broker
            .client
            .post(broker.url("/exec/programmatic"))
            .json(&body);
        async move { send(request, &headers).await }
    };
    let mut a_headers = key(KEY_A);
    a_headers.push(("x-librechat-code-request-id", "rid-1".to_string()));
    let (status, a) = programmatic(
        a_headers,
        json!({ "code": "print(await add(a=1, b=1))", "tools": tools }),
    )
    .await;
    assert_eq!(status, 200, "{a}");
    assert_eq!(a["status"], "tool_call_required", "{a}");

    let (status, body) = send(
        broker
            .client
            .post(broker.url("/exec/programmatic/cancel"))
            .json(&json!({ "request_id": "rid-1" })),
        &key(KEY_B),
    )
    .await;
    assert_eq!(status, 404, "key b cancelled key a's run: {body}");
    let results = json!([{ "call_id": a["tool_calls"][0]["id"], "result": 40 }]);
    let (status, body) = programmatic(
        key(KEY_B),
        json!({ "continuation_token": a["continuation_token"], "tool_results": results }),
    )
    .await;
    assert_eq!(status, 404, "key b continued key a's run: {body}");

    // Key a's run is untouched.
    let results = json!([{ "call_id": a["tool_calls"][0]["id"], "result": 2 }]);
    let (status, body) = programmatic(
        key(KEY_A),
        json!({ "continuation_token": a["continuation_token"], "tool_results": results }),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["status"], "completed", "{body}");
    assert_eq!(stdout(&body), "2\n", "{body}");
}

/// MCP's `list_files` and `read_file` with a session id: nothing of another key's session,
/// nor of a named user's session under its own key (LobeChat's rule, as `execute_code`);
/// its own unnamed session it does read.
#[tokio::test]
async fn mcp_reads_stay_in_the_callers_sessions() {
    let broker = two_keys("tenancy-mcp-read", |_| {}).await;
    let (unnamed, _) = write_secret(&broker, &key(KEY_A)).await;
    let (alice, _) = write_secret(&broker, &key_user(KEY_A, "alice")).await;
    for (who, client_key, target) in [
        ("key b in key a's", KEY_B, unnamed.clone()),
        ("key a in alice's", KEY_A, alice.clone()),
        ("key b in alice's", KEY_B, alice.clone()),
    ] {
        let client = connect(&broker, Some(client_key)).await.expect("connect");
        let listed = call(&client, "list_files", json!({ "session_id": target })).await;
        assert_eq!(listed.is_error, Some(true), "{who}: list: {listed:?}");
        assert!(
            !format!("{listed:?}").contains("secret.txt"),
            "{who}: {listed:?}"
        );
        let read = call(
            &client,
            "read_file",
            json!({ "session_id": target, "name": "secret.txt" }),
        )
        .await;
        assert_eq!(read.is_error, Some(true), "{who}: read: {read:?}");
        assert!(
            !format!("{read:?}").contains("TOP SECRET"),
            "{who}: {read:?}"
        );
        let _ = client.cancel().await;
    }
    let client = connect(&broker, Some(KEY_A)).await.expect("connect");
    let read = call(
        &client,
        "read_file",
        json!({ "session_id": unnamed, "name": "secret.txt" }),
    )
    .await;
    assert_eq!(read.is_error, Some(false), "{read:?}");
    assert!(format!("{read:?}").contains("TOP SECRET"), "{read:?}");
    let _ = client.cancel().await;
}
