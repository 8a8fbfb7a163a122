//! Bad input gets a clear JSON error, never a 500 or a hang.

mod common;

use common::TestBroker;
use sandbox_runner::language::LANGUAGES;
use serde_json::{json, Value};

#[tokio::test]
async fn bad_requests_get_clear_errors() {
    let broker = TestBroker::start("bad").await;
    let (status, body) = broker.exec(json!({ "lang": "cobol", "code": "x" })).await;
    assert_eq!(status, 400);
    assert_eq!(body["error"], "unsupported_language");
    assert_eq!(body["message"], "Unsupported language: cobol");

    let (status, body) = broker.exec(json!({ "lang": "py" })).await;
    assert!(status == 400 || status == 422, "{status}");
    assert!(
        body["message"].as_str().unwrap_or("").contains("code"),
        "{body}"
    );

    let (status, _) = broker.exec(json!({ "lang": "py", "code": 5 })).await;
    assert!(status == 400 || status == 422, "{status}");

    let resp = broker
        .client
        .post(broker.url("/exec"))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 400);
    let body: Value = resp.json().await.expect("json");
    assert!(body["error"].is_string());

    let (status, body) = broker
        .exec(json!({ "lang": "py", "code": "1", "session_id": "../../etc" }))
        .await;
    assert_eq!(status, 400, "{body}");

    let (status, _) = broker
        .exec(json!({ "lang": "py", "code": "1", "files": [{"id": "bad id", "name": "x"}] }))
        .await;
    assert_eq!(status, 400);

    let missing = broker.get("/no/such/route").await;
    assert_eq!(missing.status(), 404);
}

#[tokio::test]
async fn keys_are_required_when_configured() {
    let broker = TestBroker::start_with("auth", |c| {
        c.access.auth = codebroker::config::AuthMode::Key;
        c.access.api_key = vec!["k1".into(), "k2".into()];
    })
    .await;
    let body = json!({ "lang": "bash", "code": "echo ok" });
    let none = broker
        .client
        .post(broker.url("/exec"))
        .json(&body)
        .send()
        .await
        .expect("send");
    assert_eq!(none.status(), 401);
    let json: Value = none.json().await.expect("json");
    assert_eq!(json["error"], "unauthorized");

    let wrong = broker
        .client
        .post(broker.url("/exec"))
        .header("x-api-key", "nope")
        .json(&body)
        .send()
        .await
        .expect("send");
    assert_eq!(wrong.status(), 401);

    for (name, value) in [("x-api-key", "k1"), ("authorization", "Bearer k2")] {
        let ok = broker
            .client
            .post(broker.url("/v1/exec"))
            .header(name, value)
            .json(&body)
            .send()
            .await
            .expect("send");
        assert_eq!(ok.status(), 200, "{name}");
    }
    let in_body = broker
        .client
        .post(broker.url("/exec"))
        .json(&json!({ "lang": "bash", "code": "echo ok", "LIBRECHAT_CODE_API_KEY": "k1" }))
        .send()
        .await
        .expect("send");
    assert_eq!(in_body.status(), 200);

    // Health needs no key.
    assert_eq!(broker.get("/health").await.status(), 200);
    assert_eq!(broker.get("/libraries").await.status(), 401);
}

#[tokio::test]
async fn health_and_libraries() {
    let broker = TestBroker::start("health").await;
    let health: Value = broker.get("/v1/health").await.json().await.expect("json");
    assert_eq!(health["status"], "ok", "{health}");
    assert_eq!(health["image"]["present"], true);
    // Which backend answers: the suite runs on Docker and (make test-k8s) on Kubernetes.
    let backend = std::env::var("CODEBROKER_BACKEND").unwrap_or_else(|_| "docker".into());
    assert_eq!(health["backend"]["kind"], backend.as_str(), "{health}");
    assert_eq!(health["backend"]["reachable"], true, "{health}");
    assert_eq!(
        health["docker"]["reachable"], true,
        "kept for older clients: {health}"
    );
    assert_eq!(
        health["languages"].as_array().map(|a| a.len()),
        Some(LANGUAGES.len())
    );
    let libs: Value = broker.get("/libraries").await.json().await.expect("json");
    for spec in LANGUAGES {
        // list-libraries.py keeps its own list of version commands.
        assert!(
            libs[spec.name]["version"].is_string(),
            "{}: {libs}",
            spec.name
        );
    }
    let py = libs["py"]["packages"].as_array().expect("py packages");
    for want in ["numpy", "pandas", "matplotlib"] {
        assert!(
            py.iter()
                .any(|p| p["name"].as_str().map(|n| n.eq_ignore_ascii_case(want)) == Some(true)),
            "{want} missing"
        );
    }
}
