//! The LobeChat plugin: the manifest (public, and shaped as `pluginManifestSchema` of
//! `@lobehub/chat-plugin-sdk` requires), and `POST /lobe/run` as LobeChat's gateway calls
//! it (the arguments as a plain-text body, the key in `X-Lobe-Plugin-Settings`). The same
//! flows through the real gateway package: tests/lobe/ (`make lobe-test`).

mod common;

use codebroker::config::AuthMode;
use common::TestBroker;
use serde_json::{json, Value};

const KEY: &str = "lobe-test-key";
/// The default CODEBROKER_PUBLIC_URL, which the links start with.
const PUBLIC: &str = "http://127.0.0.1:8000";

async fn keyed_broker(tag: &str) -> TestBroker {
    TestBroker::start_with(tag, |c| {
        c.access.auth = AuthMode::Key;
        c.access.api_key = vec![KEY.into()];
    })
    .await
}

fn settings(key: &str) -> String {
    json!({ "apiKey": key }).to_string()
}

/// POST /lobe/run as LobeChat's gateway sends it: `fetch(url, {body: args, headers:
/// {"X-Lobe-Plugin-Settings": ...}, method: "POST"})`, a string body, so `text/plain`.
async fn run(broker: &TestBroker, settings: Option<String>, args: Value) -> (u16, String) {
    let mut request = broker
        .client
        .post(broker.url("/lobe/run"))
        .header("content-type", "text/plain;charset=UTF-8")
        .body(args.to_string());
    if let Some(settings) = settings {
        request = request.header("X-Lobe-Plugin-Settings", settings);
    }
    let resp = request.send().await.expect("POST /lobe/run");
    let status = resp.status().as_u16();
    (status, resp.text().await.expect("body"))
}

/// The session id in an answer's last line (`session_id: \`S\``).
fn session_of(markdown: &str) -> String {
    let (_, rest) = markdown
        .rsplit_once("session_id: `")
        .unwrap_or_else(|| panic!("no session_id in {markdown}"));
    rest.chars().take_while(|c| *c != '`').collect()
}

fn is_object_schema(v: &Value) -> bool {
    v["type"] == "object"
        && v["properties"].is_object()
        && v.get("required")
            .is_none_or(|r| r.as_array().is_some_and(|r| r.iter().all(Value::is_string)))
}

fn optional_string(v: &Value, field: &str) -> bool {
    v.get(field).is_none_or(Value::is_string)
}

/// `pluginManifestSchema` of @lobehub/chat-plugin-sdk 1.32 (lib/schema/manifest.js), in Rust.
fn check_manifest_schema(m: &Value) {
    assert!(m["identifier"].is_string(), "identifier");
    let api = m["api"].as_array().expect("api is an array");
    for entry in api {
        assert!(entry["name"].is_string(), "api.name");
        assert!(entry["description"].is_string(), "api.description");
        assert!(is_object_schema(&entry["parameters"]), "api.parameters");
        if let Some(url) = entry.get("url") {
            let url = url.as_str().expect("api.url is a string");
            assert!(
                url.starts_with("http://") || url.starts_with("https://"),
                "api.url is a URL"
            );
        }
    }
    for field in [
        "author",
        "createAt",
        "gateway",
        "homepage",
        "openapi",
        "systemRole",
    ] {
        assert!(optional_string(m, field), "{field}");
    }
    let meta = &m["meta"];
    assert!(meta.is_object(), "meta");
    for field in ["avatar", "description", "title"] {
        assert!(optional_string(meta, field), "meta.{field}");
    }
    assert!(
        meta.get("tags")
            .is_none_or(|t| t.as_array().is_some_and(|t| t.iter().all(Value::is_string))),
        "meta.tags"
    );
    if let Some(settings) = m.get("settings") {
        assert!(is_object_schema(settings), "settings");
    }
    if let Some(kind) = m.get("type") {
        assert!(
            ["default", "markdown", "standalone"].contains(&kind.as_str().unwrap_or("")),
            "type"
        );
    }
    // The SDK's TypeScript type: `version?: '1'`.
    assert!(m.get("version").is_none_or(|v| v == "1"), "version");
}

#[tokio::test]
async fn the_manifest_is_public_and_valid() {
    let broker = keyed_broker("lobe-manifest").await;
    for path in ["/lobe/manifest.json", "/v1/lobe/manifest.json"] {
        let resp = broker.get(path).await;
        assert_eq!(resp.status(), 200, "{path}");
        let manifest: Value = resp.json().await.expect("json");
        check_manifest_schema(&manifest);
        assert_eq!(manifest["identifier"], "codebroker");
        let api = &manifest["api"][0];
        assert_eq!(api["name"], "runCode");
        assert_eq!(api["url"], format!("{PUBLIC}/lobe/run"));
        let params = &api["parameters"];
        let mut props: Vec<&str> = params["properties"]
            .as_object()
            .expect("properties")
            .keys()
            .map(String::as_str)
            .collect();
        props.sort();
        assert_eq!(props, ["code", "lang", "session_id"]);
        assert_eq!(params["required"], json!(["lang", "code"]));
        assert!(params["properties"]["lang"]["enum"]
            .as_array()
            .is_some_and(|l| l.contains(&json!("py"))));
        for field in ["title", "avatar", "description"] {
            assert!(manifest["meta"][field].is_string(), "meta.{field}");
        }
        assert!(manifest["meta"]["tags"].is_array());
        assert_eq!(manifest["settings"]["required"], json!(["apiKey"]));
        assert_eq!(
            manifest["settings"]["properties"]["apiKey"]["type"],
            "string"
        );
    }
    // Running code is not public.
    let (status, _) = run(&broker, None, json!({"lang": "py", "code": "print(1)"})).await;
    assert_eq!(status, 401);
}

#[tokio::test]
async fn a_plain_text_post_runs_and_answers_markdown() {
    let broker = keyed_broker("lobe-run").await;
    let (status, md) = run(
        &broker,
        Some(settings(KEY)),
        json!({"lang": "py", "code": "x = 41\nprint('answer', x + 1)"}),
    )
    .await;
    assert_eq!(status, 200, "{md}");
    assert!(md.contains("```text\nanswer 42\n```"), "{md}");
    let session = session_of(&md);
    assert_eq!(session.len(), 21, "{md}");

    // The session id of the answer keeps the variables.
    let (status, md) = run(
        &broker,
        Some(settings(KEY)),
        json!({"lang": "python", "code": "print(x)", "session_id": session}),
    )
    .await;
    assert_eq!(status, 200, "{md}");
    assert!(md.contains("```text\n41\n```"), "{md}");
    assert_eq!(session_of(&md), session);

    // Failures show stderr and the exit code.
    let (status, md) = run(
        &broker,
        Some(settings(KEY)),
        json!({"lang": "py", "code": "1/0"}),
    )
    .await;
    assert_eq!(status, 200, "{md}");
    assert!(
        md.contains("stderr:") && md.contains("ZeroDivisionError"),
        "{md}"
    );
    assert!(md.contains("Exit code: 1"), "{md}");
}

#[tokio::test]
async fn images_and_files_come_back_as_links() {
    let broker = keyed_broker("lobe-files").await;
    let code = "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()\nopen('out.csv', 'w').write('a,b\\n')";
    let (status, md) = run(
        &broker,
        Some(settings(KEY)),
        json!({"lang": "py", "code": code}),
    )
    .await;
    assert_eq!(status, 200, "{md}");
    let session = session_of(&md);
    let prefix = format!("]({PUBLIC}/download/{session}/");
    let image = md
        .lines()
        .find(|l| l.starts_with("![") && l.contains(&prefix))
        .unwrap_or_else(|| panic!("no image in {md}"));
    assert!(image.contains(".png]"), "{image}");
    let link = md
        .lines()
        .find(|l| l.starts_with("- [out.csv]") && l.contains(&prefix))
        .unwrap_or_else(|| panic!("no file link in {md}"));

    // The links download (with the key).
    for line in [image, link] {
        let url = line
            .split_once("](")
            .and_then(|(_, rest)| rest.split_once(')'))
            .map(|(url, _)| url)
            .expect("url");
        let resp = broker
            .client
            .get(url.replace(PUBLIC, &broker.base))
            .header("x-api-key", KEY)
            .send()
            .await
            .expect("download");
        assert_eq!(resp.status(), 200, "{url}");
        let bytes = resp.bytes().await.expect("bytes");
        if line.starts_with("![") {
            assert!(bytes.starts_with(b"\x89PNG"), "{url}");
        } else {
            assert_eq!(&bytes[..], b"a,b\n");
        }
    }
}

#[tokio::test]
async fn the_settings_key_or_the_usual_credentials_authenticate() {
    let broker = keyed_broker("lobe-auth").await;
    let args = json!({"lang": "bash", "code": "echo ok"});
    let (status, body) = run(&broker, None, args.clone()).await;
    assert_eq!(status, 401, "{body}");
    let error: Value = serde_json::from_str(&body).expect("json error");
    assert_eq!(error["error"], "unauthorized");
    let (status, _) = run(&broker, Some(settings("wrong")), args.clone()).await;
    assert_eq!(status, 401);
    let (status, _) = run(&broker, Some("{}".into()), args.clone()).await;
    assert_eq!(status, 401);
    let (status, md) = run(&broker, Some(settings(KEY)), args.clone()).await;
    assert_eq!(status, 200, "{md}");
    assert!(md.contains("```text\nok\n```"), "{md}");

    // X-API-Key works too, also beside settings without a key.
    let resp = broker
        .client
        .post(broker.url("/lobe/run"))
        .header("x-api-key", KEY)
        .header("X-Lobe-Plugin-Settings", "{}")
        .body(args.to_string())
        .send()
        .await
        .expect("POST");
    assert_eq!(resp.status(), 200);

    // The settings header is no key anywhere else.
    let resp = broker
        .client
        .post(broker.url("/exec"))
        .header("X-Lobe-Plugin-Settings", settings(KEY))
        .json(&args)
        .send()
        .await
        .expect("POST /exec");
    assert_eq!(resp.status(), 401);

    // Bad arguments: the API's errors.
    let (status, body) = run(
        &broker,
        Some(settings(KEY)),
        json!({"lang": "cobol", "code": "x"}),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    let resp = broker
        .client
        .post(broker.url("/lobe/run"))
        .header("X-Lobe-Plugin-Settings", settings(KEY))
        .body("not json")
        .send()
        .await
        .expect("POST");
    assert_eq!(resp.status(), 400);
}

#[tokio::test]
async fn without_auth_the_manifest_asks_for_no_key() {
    let broker = TestBroker::start("lobe-noauth").await;
    let manifest: Value = broker
        .get("/lobe/manifest.json")
        .await
        .json()
        .await
        .expect("json");
    check_manifest_schema(&manifest);
    assert!(manifest["settings"].get("required").is_none());
    let (status, md) = run(
        &broker,
        None,
        json!({"lang": "js", "code": "console.log(6 * 7)"}),
    )
    .await;
    assert_eq!(status, 200, "{md}");
    assert!(md.contains("```text\n42\n```"), "{md}");
}
