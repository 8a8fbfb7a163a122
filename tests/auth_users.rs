//! Identity end to end: JWT and API-key callers, users who cannot see each other's
//! sessions and files, and the 429s of the rate limit and the capacity caps.

mod common;

use codebroker::config::{AuthMode, ContainerCap};
use common::jwt::{
    claims_issued, jwt, key_path, lc_ed_public_key, sign, token, unix_now, ED_A, ED_B, RSA_A,
};
use common::{session, stdout, TestBroker};
use jsonwebtoken::{Algorithm, EncodingKey};
use serde_json::{json, Value};
use std::time::Duration;

/// A response's status, JSON body (after any keep-alive whitespace) and headers.
struct Answer {
    status: u16,
    body: Value,
    headers: reqwest::header::HeaderMap,
}

async fn send(request: reqwest::RequestBuilder) -> Answer {
    let resp = request.send().await.expect("request");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let text = resp.text().await.expect("body");
    let body = serde_json::from_str(text.trim()).unwrap_or(Value::String(text));
    Answer {
        status,
        body,
        headers,
    }
}

/// POST /exec with extra headers.
async fn exec(broker: &TestBroker, headers: &[(&str, String)], body: Value) -> Answer {
    let mut request = broker.client.post(broker.url("/exec")).json(&body);
    for (name, value) in headers {
        request = request.header(*name, value);
    }
    send(request).await
}

async fn get(broker: &TestBroker, headers: &[(&str, String)], path: &str) -> Answer {
    let mut request = broker.client.get(broker.url(path));
    for (name, value) in headers {
        request = request.header(*name, value);
    }
    send(request).await
}

fn bearer(token: &str) -> (&'static str, String) {
    ("authorization", format!("Bearer {token}"))
}

const WRITE_SECRET: &str =
    "open('/mnt/data/secret.txt', 'w').write('for alice only')\nprint('written')";
const LIST_DATA: &str = "import os\nprint(sorted(os.listdir('/mnt/data')))";

/// The session and file id of Alice's secret, written through `headers`.
async fn write_secret(broker: &TestBroker, headers: &[(&str, String)]) -> (String, String) {
    let a = exec(
        broker,
        headers,
        json!({ "lang": "py", "code": WRITE_SECRET }),
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(stdout(&a.body), "written\n", "{}", a.body);
    let file = a.body["files"][0]["id"]
        .as_str()
        .expect("file id")
        .to_string();
    (session(&a.body), file)
}

/// What `other` may not do with `owner`'s session `s` and file `f`.
async fn cannot_reach(broker: &TestBroker, other: &[(&str, String)], s: &str, f: &str) {
    // Her session id gets a new session of its own: never her container or files.
    let b = exec(
        broker,
        other,
        json!({ "lang": "py", "code": LIST_DATA, "session_id": s }),
    )
    .await;
    assert_eq!(b.status, 200, "{}", b.body);
    assert_ne!(session(&b.body), s);
    assert_eq!(b.body["runtime_status"], "new", "{}", b.body);
    assert!(!stdout(&b.body).contains("secret.txt"), "{}", b.body);
    // The same as a runtime hint.
    let b = exec(
        broker,
        other,
        json!({ "lang": "py", "code": LIST_DATA, "runtime_session_hint": s }),
    )
    .await;
    assert_eq!(b.status, 200, "{}", b.body);
    assert_ne!(session(&b.body), s);
    // Her files: not found.
    let d = get(broker, other, &format!("/download/{s}/{f}")).await;
    assert_eq!(d.status, 404, "{}", d.body);
    let listed = get(broker, other, &format!("/files/{s}?detail=full")).await;
    assert!(!listed.body.to_string().contains(f), "{}", listed.body);
    // A ref to her file: forbidden.
    let r = exec(
        broker,
        other,
        json!({ "lang": "py", "code": LIST_DATA,
                "files": [{ "id": f, "session_id": s, "name": "secret.txt" }] }),
    )
    .await;
    assert_eq!(r.status, 403, "{}", r.body);
    assert_eq!(r.body["error"], "forbidden");
}

#[tokio::test]
async fn jwt_users_see_only_their_own_sessions() {
    let broker = TestBroker::start_with("jwt", |c| {
        c.access.auth = AuthMode::Key;
        c.access.api_key = vec![];
        c.access.jwt_public_keys = vec![
            lc_ed_public_key(),
            format!("lc-rsa={}", key_path("rsa_a.pub.pem")),
        ];
    })
    .await;
    let alice = [bearer(&jwt("alice"))];
    let (s, f) = write_secret(&broker, &alice).await;

    // Bob's token names him, whatever else his request says.
    let bob = [bearer(&jwt("bob")), ("user-id", "alice".to_string())];
    cannot_reach(&broker, &bob, &s, &f).await;
    let b = exec(
        &broker,
        &bob,
        json!({ "lang": "py", "code": "print(1)", "session_id": s, "user_id": "alice" }),
    )
    .await;
    assert_ne!(session(&b.body), s, "{}", b.body);
    let d = get(
        &broker,
        &bob,
        &format!("/download/{s}/{f}?kind=user&id=alice"),
    )
    .await;
    assert_eq!(d.status, 404);

    // Alice still has it all, also with an RS256 token.
    let alice_rs = [bearer(&token(
        Algorithm::RS256,
        "lc-rsa",
        RSA_A,
        "alice",
        300,
    ))];
    let d = get(&broker, &alice_rs, &format!("/download/{s}/{f}")).await;
    assert_eq!(d.status, 200);
    assert_eq!(d.body, Value::String("for alice only".into()));
    let again = exec(
        &broker,
        &alice,
        json!({ "lang": "py", "code": LIST_DATA, "session_id": s }),
    )
    .await;
    assert_eq!(session(&again.body), s);
    assert!(stdout(&again.body).contains("secret.txt"), "{}", again.body);
    // Her refs lead to her session.
    let by_ref = exec(
        &broker,
        &alice,
        json!({ "lang": "py", "code": "print(open('/mnt/data/secret.txt').read())",
                "files": [{ "id": f, "storage_session_id": s, "name": "secret.txt", "kind": "user" }] }),
    )
    .await;
    assert_eq!(by_ref.status, 200, "{}", by_ref.body);
    assert_eq!(session(&by_ref.body), s);
    assert_eq!(stdout(&by_ref.body), "for alice only\n");

    // Bad tokens and keys: 401.
    let body = json!({ "lang": "bash", "code": "echo no" });
    for headers in [
        vec![bearer(&token(
            Algorithm::EdDSA,
            "lc-ed",
            ED_B,
            "alice",
            300,
        ))],
        vec![bearer(&token(
            Algorithm::EdDSA,
            "lc-ed",
            ED_A,
            "alice",
            -120,
        ))],
        vec![bearer(&token(
            Algorithm::EdDSA,
            "lc-ed",
            ED_A,
            "alice",
            3600,
        ))],
        vec![bearer(&token(
            Algorithm::EdDSA,
            "other",
            ED_A,
            "alice",
            300,
        ))],
        vec![bearer("eyJhbGciOiJub25lIn0.eyJzdWIiOiJhbGljZSJ9.")],
        vec![("x-api-key", "guess".to_string())],
        vec![],
    ] {
        let a = exec(&broker, &headers, body.clone()).await;
        assert_eq!(a.status, 401, "{headers:?}: {}", a.body);
        assert_eq!(a.body["error"], "unauthorized");
    }
}

#[tokio::test]
async fn api_key_callers_name_their_users() {
    let broker = TestBroker::start_with("keyusers", |c| {
        c.access.auth = AuthMode::Key;
        c.access.api_key = vec!["k1".into()];
        c.access.jwt_public_keys = vec![key_path("ed25519_a.pub.pem")];
    })
    .await;
    let key = ("x-api-key", "k1".to_string());
    let alice = [key.clone(), ("user-id", "alice".to_string())];
    let (s, f) = write_secret(&broker, &alice).await;

    let bob = [key.clone(), ("user-id", "bob".to_string())];
    cannot_reach(&broker, &bob, &s, &f).await;
    // Named in the body or the query instead of the header: the same.
    let b = exec(
        &broker,
        std::slice::from_ref(&key),
        json!({ "lang": "py", "code": LIST_DATA, "session_id": s, "user_id": "bob" }),
    )
    .await;
    assert_ne!(session(&b.body), s, "{}", b.body);
    let d = get(
        &broker,
        std::slice::from_ref(&key),
        &format!("/download/{s}/{f}?kind=user&id=bob"),
    )
    .await;
    assert_eq!(d.status, 404);

    // Alice, and the key's own scope (LibreChat's downloads carry only the key), can.
    for headers in [&alice[..], std::slice::from_ref(&key)] {
        let d = get(&broker, headers, &format!("/download/{s}/{f}")).await;
        assert_eq!(d.status, 200, "{headers:?}");
    }
    // Alice's session with the key as a bearer token.
    let alice_bearer = [bearer("k1"), ("user-id", "alice".to_string())];
    let again = exec(
        &broker,
        &alice_bearer,
        json!({ "lang": "py", "code": LIST_DATA, "session_id": s }),
    )
    .await;
    assert_eq!(session(&again.body), s);
    // A JWT on the same broker is a user of its own, and cannot borrow Alice's name.
    let jwt_bob = [bearer(&jwt("bob")), ("user-id", "alice".to_string())];
    let d = get(&broker, &jwt_bob, &format!("/download/{s}/{f}")).await;
    assert_eq!(d.status, 404);
}

#[tokio::test]
async fn body_key_can_be_turned_off() {
    let broker = TestBroker::start_with("bodykey", |c| {
        c.access.auth = AuthMode::Key;
        c.access.api_key = vec!["k1".into()];
        c.access.body_api_key = false;
    })
    .await;
    let a = exec(
        &broker,
        &[],
        json!({ "lang": "bash", "code": "echo hi", "LIBRECHAT_CODE_API_KEY": "k1" }),
    )
    .await;
    assert_eq!(a.status, 401, "{}", a.body);
}

fn retry_after(a: &Answer) -> u64 {
    assert_eq!(a.status, 429, "{}", a.body);
    assert_eq!(a.body["error"], "rate_limited", "{}", a.body);
    assert!(a.body["message"].is_string());
    let secs = a.body["retry_after_seconds"]
        .as_u64()
        .expect("retry_after_seconds");
    assert!(secs >= 1, "{}", a.body);
    let header = a
        .headers
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    assert_eq!(header, Some(secs));
    secs
}

#[tokio::test]
async fn exec_rate_limit_is_per_user() {
    // One exec every 10 s, one at a time.
    let broker = TestBroker::start_with("rate", |c| {
        c.caps.rate_execs_per_minute = 6;
        c.caps.rate_burst = 1;
    })
    .await;
    let alice = [("user-id", "alice".to_string())];
    let body = json!({ "lang": "bash", "code": "echo hi" });
    let first = exec(&broker, &alice, body.clone()).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let limited = exec(&broker, &alice, body.clone()).await;
    let wait = retry_after(&limited);
    assert!(wait <= 10, "{}", limited.body);
    // Bob has a budget of his own.
    let bob = exec(&broker, &[("user-id", "bob".to_string())], body.clone()).await;
    assert_eq!(bob.status, 200, "{}", bob.body);
    tokio::time::sleep(Duration::from_secs(wait)).await;
    let after = exec(&broker, &alice, body).await;
    assert_eq!(after.status, 200, "{}", after.body);
    assert_eq!(stdout(&after.body), "hi\n");
}

/// Starts `code` (bash) as `user` in the background; the exec holds its sandbox busy.
fn busy_exec(broker: &TestBroker, user: &str, code: &str) -> tokio::task::JoinHandle<(u16, Value)> {
    let request = broker
        .client
        .post(broker.url("/exec"))
        .header("user-id", user)
        .json(&json!({ "lang": "bash", "code": code }));
    tokio::spawn(async move {
        let a = send(request).await;
        (a.status, a.body)
    })
}

/// Waits until `n` of the broker's containers exist.
async fn wait_for_containers(broker: &TestBroker, n: usize) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while broker.containers().len() < n {
        assert!(std::time::Instant::now() < deadline, "no {n} containers");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn container_cap_answers_429_while_all_run_code() {
    let broker = TestBroker::start_with("cap", |c| {
        c.caps.max_containers = ContainerCap::Count(1);
        c.exec_limits.max_exec_timeout_ms = 10_000;
        // Without code mode (whose execute may run longer) a plain exec is the longest.
        c.code_mode.codemode = false;
    })
    .await;
    let busy = busy_exec(&broker, "first", "sleep 4; echo done");
    wait_for_containers(&broker, 1).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    // A new session would need a second container, and the only one runs code.
    let body = json!({ "lang": "bash", "code": "echo hi" });
    let limited = exec(&broker, &[("user-id", "other".to_string())], body.clone()).await;
    let wait = retry_after(&limited);
    assert!(wait <= 10, "{}", limited.body);
    let (status, first) = busy.await.expect("busy exec");
    assert_eq!(status, 200, "{first}");
    let s = session(&first);
    // Now idle, it makes room: the next session is served at once.
    let after = exec(&broker, &[("user-id", "other".to_string())], body).await;
    assert_eq!(after.status, 200, "{}", after.body);
    assert_ne!(session(&after.body), s);
    // The first session keeps its files and starts a new sandbox when used again (which
    // in turn takes the idle one's place).
    let again = exec(
        &broker,
        &[("user-id", "first".to_string())],
        json!({ "lang": "bash", "code": "echo again", "session_id": s }),
    )
    .await;
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(session(&again.body), s);
}

#[tokio::test]
async fn live_sessions_per_user_are_capped() {
    let broker = TestBroker::start_with("peruser", |c| {
        c.caps.max_sessions_per_user = 1;
    })
    .await;
    let alice = [("user-id", "alice".to_string())];
    let body = json!({ "lang": "bash", "code": "echo hi" });
    let busy = busy_exec(&broker, "alice", "sleep 4; echo done");
    wait_for_containers(&broker, 1).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let second = exec(&broker, &alice, body.clone()).await;
    retry_after(&second);
    // Bob has his own allowance.
    let bob = exec(&broker, &[("user-id", "bob".to_string())], body.clone()).await;
    assert_eq!(bob.status, 200, "{}", bob.body);
    let (status, first) = busy.await.expect("busy exec");
    assert_eq!(status, 200, "{first}");
    // Her idle session makes room for her next one; its files stay.
    let third = exec(&broker, &alice, body).await;
    assert_eq!(third.status, 200, "{}", third.body);
    assert_ne!(session(&third.body), session(&first));
    // Only one of Alice's and Bob's containers run (the evicted one may take a moment
    // to be removed).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while broker.containers().len() > 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "{:?}",
            broker.containers()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A token LibreChat minted `age` seconds ago with the usual five-minute lifetime.
fn token_minted_ago(sub: &str, age: u64) -> String {
    let key = EncodingKey::from_ed_pem(ED_A).expect("private key");
    let claims = claims_issued(sub, unix_now() - age, 300, "codeapi", "librechat");
    sign(Algorithm::EdDSA, &key, Some("lc-ed"), &claims)
}

#[tokio::test]
async fn a_jwt_is_accepted_at_most_300_seconds_after_it_was_issued() {
    let broker = TestBroker::start_with("jwtlife", |c| {
        c.access.auth = AuthMode::Key;
        c.access.api_key = vec![];
        c.access.jwt_public_keys = vec![lc_ed_public_key()];
    })
    .await;
    // iat = now - 320, exp = now - 20: inside the clock-skew leeway of exp, but issued
    // more than 300 s ago.
    let old = get(
        &broker,
        &[bearer(&token_minted_ago("alice", 320))],
        "/libraries",
    )
    .await;
    assert_eq!(old.status, 401, "{}", old.body);
    // Near the end of its 300 s it still works.
    let fresh = get(
        &broker,
        &[bearer(&token_minted_ago("alice", 280))],
        "/libraries",
    )
    .await;
    assert_ne!(fresh.status, 401, "{}", fresh.body);
}
