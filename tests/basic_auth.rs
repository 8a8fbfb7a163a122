//! HTTP Basic credentials carrying an API key, as LibreChat sends them from a base URL with
//! credentials (`LIBRECHAT_CODE_BASEURL=https://<key>@host/v1`): node-fetch 2 sends
//! `base64("key")`, axios `base64("key:")`, users write `:key` or `user:key`. Bad input of
//! every kind is a 401 that says why, with a Basic challenge, and the next call works.

mod common;

use base64::Engine as _;
use codebroker::config::AuthMode;
use common::{session, stdout, TestBroker};
use serde_json::{json, Value};

const KEY: &str = "basic-key-1";
const OTHER_KEY: &str = "basic-key-2";

async fn keyed(tag: &str) -> TestBroker {
    TestBroker::start_with(tag, |c| {
        c.access.auth = AuthMode::Key;
        c.access.api_key = vec![KEY.into(), OTHER_KEY.into()];
    })
    .await
}

fn basic(credentials: &str) -> String {
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(credentials)
    )
}

/// `GET /files/<an unknown session>` with this `Authorization`: the status, the
/// `WWW-Authenticate` header and the body. `[]` when authenticated.
async fn probe(broker: &TestBroker, authorization: &str) -> (u16, Option<String>, Value) {
    let resp = broker
        .client
        .get(broker.url("/v1/files/AAAAAAAAAAAAAAAAAAAAA?detail=summary"))
        .header("authorization", authorization)
        .send()
        .await
        .expect("request");
    let status = resp.status().as_u16();
    let challenge = resp
        .headers()
        .get("www-authenticate")
        .map(|v| v.to_str().expect("ascii").to_string());
    let text = resp.text().await.expect("body");
    (
        status,
        challenge,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

#[tokio::test]
async fn the_key_is_taken_from_either_part_of_basic_credentials() {
    let broker = keyed("basic-ok").await;
    for credentials in [
        KEY.to_string(),
        format!("{KEY}:"),
        format!(":{KEY}"),
        format!("librechat:{KEY}"),
        format!("{OTHER_KEY}:"),
    ] {
        let (status, challenge, body) = probe(&broker, &basic(&credentials)).await;
        assert_eq!(status, 200, "{credentials:?}: {body}");
        assert_eq!(body, json!([]), "{credentials:?}");
        assert_eq!(challenge, None);
    }
    // An exec with node-fetch 2's form, and its output downloaded with axios's.
    let resp = broker
        .client
        .post(broker.url("/v1/exec"))
        .header("authorization", basic(KEY))
        .json(&json!({"lang": "py", "code": "open('out.txt','w').write('hi')\nprint(6*7)"}))
        .send()
        .await
        .expect("exec");
    let (status, body) = common::answer(resp).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(stdout(&body), "42\n");
    let s = session(&body);
    let f = body["files"][0]["id"].as_str().expect("file id");
    let resp = broker
        .client
        .get(broker.url(&format!("/v1/download/{s}/{f}")))
        .header("authorization", basic(&format!("{KEY}:")))
        .send()
        .await
        .expect("download");
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(resp.text().await.expect("bytes"), "hi");
}

#[tokio::test]
async fn bad_basic_credentials_are_a_401_that_says_why_and_the_next_call_works() {
    let broker = keyed("basic-bad").await;
    let cases: Vec<(String, &str)> = vec![
        (basic("wrong-key"), "no configured API key"),
        (basic("wrong-key:"), "no configured API key"),
        (basic(&format!("{KEY}x")), "no configured API key"),
        (
            basic(&format!("{KEY}:{OTHER_KEY}")),
            "two different API keys",
        ),
        (basic(""), "empty"),
        (basic(":"), "empty"),
        ("Basic".into(), "empty"),
        ("Basic !!not-base64!!".into(), "base64"),
        (
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode([0xff, 0xfe, 0x3a])
            ),
            "UTF-8",
        ),
        // Within the request head's bound, over the credentials' own.
        (basic(&"k".repeat(10_000)), "4096"),
    ];
    for (authorization, why) in &cases {
        let shown: String = authorization.chars().take(40).collect();
        let (status, challenge, body) = probe(&broker, authorization).await;
        assert_eq!(status, 401, "{shown}: {body}");
        assert_eq!(body["error"], "unauthorized", "{shown}: {body}");
        let message = body["message"].as_str().unwrap_or_default();
        assert!(message.contains(why), "{shown}: {message}");
        assert!(!message.contains(KEY), "{shown}: the key is never echoed");
        assert_eq!(
            challenge.as_deref(),
            Some("Basic realm=\"codebroker\", charset=\"UTF-8\""),
            "{shown}"
        );
    }
    // Other 401s carry no Basic challenge (a browser would open a login dialog).
    let (status, challenge, _) = probe(&broker, "Bearer wrong").await;
    assert_eq!((status, challenge), (401, None));

    // A header over the request head's bound: the connection is refused, not the broker.
    let huge = basic(&"k".repeat(100_000));
    let refused = broker
        .client
        .get(broker.url("/v1/files/AAAAAAAAAAAAAAAAAAAAA"))
        .header("authorization", huge)
        .send()
        .await;
    if let Ok(resp) = refused {
        assert!(
            resp.status().is_client_error(),
            "a 100 KB header: {}",
            resp.status()
        );
    }

    let (status, _, body) = probe(&broker, &basic(KEY)).await;
    assert_eq!(status, 200, "after all that: {body}");
}

/// A valid `X-API-Key` wins over Basic credentials (as over a bearer key); a wrong one is
/// refused whatever the Basic credentials say.
#[tokio::test]
async fn a_header_key_is_checked_before_basic_credentials() {
    let broker = keyed("basic-order").await;
    let get = |key: &'static str, authorization: String| {
        broker
            .client
            .get(broker.url("/v1/files/AAAAAAAAAAAAAAAAAAAAA"))
            .header("x-api-key", key)
            .header("authorization", authorization)
            .send()
    };
    let resp = get(KEY, basic("wrong")).await.expect("request");
    assert_eq!(resp.status().as_u16(), 200);
    let resp = get("wrong", basic(KEY)).await.expect("request");
    assert_eq!(resp.status().as_u16(), 401);
}
