//! Auth: every route but the public ones needs credentials, and forged, misused or
//! expired JWTs are refused.

use super::*;
use common::jwt::{claims, jwt, key_path, sign, ED_A, ED_B};
use jsonwebtoken::{Algorithm, EncodingKey};
use serde_json::json;

/// Routes that are public on purpose: the health check, and static documents that carry no
/// session data (the OpenAPI description, the LobeChat manifest, which LobeChat fetches
/// without credentials, and the playground's page and assets, which ask for the key).
const PUBLIC: &[&str] = &[
    "/health",
    "/openapi.json",
    "/lobe/manifest.json",
    "/",
    "/playground/app.js",
];

/// Every route of the OpenAPI document, method and path with ids filled in.
async fn documented_routes(broker: &TestBroker, s: &str, f: &str) -> Vec<(String, String)> {
    let doc: Value = broker
        .get("/openapi.json")
        .await
        .json()
        .await
        .expect("openapi");
    let mut routes = Vec::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for method in ["get", "post", "put", "patch", "delete"] {
            if item.get(method).is_some() {
                let filled = path
                    .replace("{session_id}", s)
                    .replace("{file_id}", f)
                    .replace("{id}", f)
                    .replace("{asset}", "app.js");
                assert!(!filled.contains('{'), "unfilled parameter in {path}");
                routes.push((method.to_string(), filled));
            }
        }
    }
    routes
}

/// Sends `method path` with `credentials` (header name and value, or none).
async fn status_of(
    broker: &TestBroker,
    method: &str,
    path: &str,
    credentials: Option<(&str, String)>,
) -> u16 {
    let method = reqwest::Method::from_bytes(method.to_uppercase().as_bytes()).unwrap();
    let mut request = broker
        .client
        .request(method, broker.url(path))
        .header("accept", "application/json, text/event-stream")
        .header("content-type", "application/json")
        .body(r#"{"lang":"bash","code":"echo no"}"#);
    if let Some((name, value)) = credentials {
        request = request.header(name, value);
    }
    request.send().await.expect("request").status().as_u16()
}

#[tokio::test]
async fn every_route_but_the_public_ones_needs_credentials() {
    let broker = authed_broker("hh-routes").await;
    let a = exec_as(
        &broker,
        KEY,
        json!({ "lang": "bash", "code": "echo x > /mnt/data/f" }),
    )
    .await;
    assert_eq!(a.0, 200, "{}", a.1);
    let s = session(&a.1);
    let f = a.1["files"][0]["id"].as_str().expect("file").to_string();
    let routes = documented_routes(&broker, &s, &f).await;
    // The document covers what must be covered, so a new route is checked too.
    for must in [
        "/exec",
        "/upload",
        "/mcp",
        "/metrics",
        "/libraries",
        "/lobe/run",
    ] {
        assert!(
            routes.iter().any(|(_, p)| p == must),
            "{must} is not in /openapi.json"
        );
    }
    let forged = {
        let key = EncodingKey::from_ed_pem(ED_B).expect("key");
        sign(
            Algorithm::EdDSA,
            &key,
            Some("lc-ed"),
            &claims("alice", 300, "codeapi", "librechat"),
        )
    };
    let bad: Vec<Option<(&str, String)>> = vec![
        None,
        Some(("x-api-key", "wrong".into())),
        Some(("authorization", "Bearer wrong".into())),
        Some(("authorization", format!("Bearer {forged}"))),
        Some(("authorization", format!("Basic {KEY}"))),
        Some(("x-lobe-plugin-settings", r#"{"apiKey":"wrong"}"#.into())),
    ];
    let mut checked = 0;
    for (method, path) in &routes {
        for prefix in ["", "/v1"] {
            // The root route is `/v1` under the prefix, not `/v1/`.
            let full = match (prefix, path.as_str()) {
                ("/v1", "/") => prefix.to_string(),
                _ => format!("{prefix}{path}"),
            };
            let public = PUBLIC.contains(&path.as_str());
            for credentials in &bad {
                let status = status_of(&broker, method, &full, credentials.clone()).await;
                if public {
                    assert_ne!(status, 401, "{method} {full} is public");
                } else {
                    assert_eq!(status, 401, "{method} {full} with {credentials:?}");
                    checked += 1;
                }
            }
        }
    }
    assert!(checked >= 6 * 2 * 10, "only {checked} refusals checked");
    // The public documents say nothing about sessions.
    for path in PUBLIC {
        let body = broker.get(path).await.text().await.unwrap();
        assert!(!body.contains(&s) && !body.contains(&f), "{path} leaks ids");
    }
    // A refused caller left nothing behind; the right key still works at once.
    let started = Instant::now();
    let (status, ok) = exec_as(
        &broker,
        KEY,
        json!({ "lang": "bash", "code": "echo ok", "session_id": s }),
    )
    .await;
    assert_eq!((status, stdout(&ok)), (200, "ok\n"), "{ok}");
    assert!(started.elapsed() < RECOVERY);
}

/// A forged token is refused on `/exec`, `/mcp` and a download, and a good one still
/// runs `echo ok` in the same session right after.
async fn refuse_token(tag: &str, token: String) {
    let broker = authed_broker(tag).await;
    let (status, first) = exec_as(
        &broker,
        &jwt("alice"),
        json!({ "lang": "bash", "code": "echo x > /mnt/data/f" }),
    )
    .await;
    assert_eq!(status, 200, "{first}");
    let s = session(&first);
    let f = first["files"][0]["id"].as_str().expect("file").to_string();
    let (status, body) = exec_as(
        &broker,
        &token,
        json!({ "lang": "bash", "code": "echo pwned", "session_id": s }),
    )
    .await;
    assert_eq!(status, 401, "{body}");
    assert_eq!(body["error"], "unauthorized", "{body}");
    for (method, path) in [
        ("get", format!("/download/{s}/{f}")),
        ("post", "/mcp".into()),
    ] {
        let status = status_of(
            &broker,
            method,
            &path,
            Some(("authorization", format!("Bearer {token}"))),
        )
        .await;
        assert_eq!(status, 401, "{method} {path}");
    }
    let started = Instant::now();
    let (status, ok) = exec_as(
        &broker,
        &jwt("alice"),
        json!({ "lang": "bash", "code": "echo ok", "session_id": s }),
    )
    .await;
    assert_eq!((status, stdout(&ok)), (200, "ok\n"), "{ok}");
    assert_eq!(session(&ok), s);
    assert!(started.elapsed() < RECOVERY);
}

fn b64url(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

#[tokio::test]
async fn jwt_with_alg_none_is_refused() {
    let header = b64url(br#"{"alg":"none","typ":"JWT","kid":"lc-ed"}"#);
    let body = b64url(
        claims("alice", 300, "codeapi", "librechat")
            .to_string()
            .as_bytes(),
    );
    refuse_token("hh-jwt-none", format!("{header}.{body}.")).await;
}

#[tokio::test]
async fn jwt_signed_with_the_wrong_key_is_refused() {
    let key = EncodingKey::from_ed_pem(ED_B).expect("key");
    let token = sign(
        Algorithm::EdDSA,
        &key,
        Some("lc-ed"),
        &claims("alice", 300, "codeapi", "librechat"),
    );
    refuse_token("hh-jwt-key", token).await;
}

#[tokio::test]
async fn jwt_signed_with_the_public_key_as_hmac_secret_is_refused() {
    let public = std::fs::read(key_path("ed25519_a.pub.pem")).expect("public key");
    let token = sign(
        Algorithm::HS256,
        &EncodingKey::from_secret(&public),
        Some("lc-ed"),
        &claims("alice", 300, "codeapi", "librechat"),
    );
    refuse_token("hh-jwt-hmac", token).await;
}

#[tokio::test]
async fn expired_jwt_is_refused() {
    let key = EncodingKey::from_ed_pem(ED_A).expect("key");
    let token = sign(
        Algorithm::EdDSA,
        &key,
        Some("lc-ed"),
        &claims("alice", -600, "codeapi", "librechat"),
    );
    refuse_token("hh-jwt-exp", token).await;
}

#[tokio::test]
async fn jwt_for_another_audience_or_issuer_is_refused() {
    let key = EncodingKey::from_ed_pem(ED_A).expect("key");
    for (i, (aud, iss)) in [("other-api", "librechat"), ("codeapi", "evil")]
        .into_iter()
        .enumerate()
    {
        let token = sign(
            Algorithm::EdDSA,
            &key,
            Some("lc-ed"),
            &claims("alice", 300, aud, iss),
        );
        refuse_token(&format!("hh-jwt-aud{i}"), token).await;
    }
}
