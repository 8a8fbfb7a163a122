//! The functions the broker serves itself: `http.fetch` (through the allow-list) and
//! `env.get`.

use super::allow::{host_allowed, CheckedResolver, Denied, HostRule};
use super::{CodeMode, ResultBudget};
use base64::Engine;
use sandbox_runner::ToolSpec;
use serde_json::{json, Map, Value};
use std::sync::Arc;
use std::time::Duration;

/// Most redirects `http.fetch` follows.
const MAX_REDIRECTS: usize = 5;

/// The HTTP client of `http.fetch`: redirects are followed only to allowed hosts (and
/// never from https to http), names resolve only to allowed addresses. `None` when it
/// cannot be made.
pub(super) fn http_client(
    rules: Arc<Vec<HostRule>>,
    allow_private: bool,
    timeout: Duration,
) -> Option<reqwest::Client> {
    let listed = rules.iter().filter_map(|r| r.host.parse().ok()).collect();
    let policy = reqwest::redirect::Policy::custom(move |attempt| {
        if attempt.previous().len() >= MAX_REDIRECTS {
            return attempt.error(Denied("Too many redirects".into()));
        }
        let from_https = attempt
            .previous()
            .last()
            .is_some_and(|u| u.scheme() == "https");
        if from_https && attempt.url().scheme() != "https" {
            return attempt.error(Denied(
                "A redirect from https to http is not allowed".into(),
            ));
        }
        let (host, ok) = host_allowed(&rules, attempt.url());
        if ok {
            attempt.follow()
        } else {
            attempt.error(Denied(format!("Host '{host}' is not allowed")))
        }
    });
    let resolver = CheckedResolver {
        listed,
        allow_private,
    };
    reqwest::Client::builder()
        .dns_resolver(Arc::new(resolver))
        .redirect(policy)
        .timeout(timeout)
        .no_proxy()
        .build()
        .map_err(|e| tracing::error!(error = %e, "cannot make the code mode HTTP client"))
        .ok()
}

impl CodeMode {
    pub(super) fn env_get(&self, input: &Value) -> Result<Value, String> {
        let key = input
            .get("key")
            .and_then(Value::as_str)
            .ok_or("env.get needs {key: string}")?;
        if !self.env_allow.iter().any(|k| k == key) {
            // Named, not echoed whole: a 4 MB key must not come back as a 4 MB answer.
            let shown: String = key.chars().take(64).collect();
            let more = if shown.len() < key.len() { "..." } else { "" };
            return Err(format!("Key '{shown}{more}' is not allowed"));
        }
        Ok(std::env::var(key).map(Value::String).unwrap_or(Value::Null))
    }

    /// Makes the request; a response body that would not fit in `budget` is not read on.
    pub(super) async fn fetch(
        &self,
        input: &Value,
        budget: &ResultBudget,
    ) -> Result<Value, String> {
        let url = input
            .get("url")
            .and_then(Value::as_str)
            .ok_or("http.fetch needs {url: string}")?;
        let url = reqwest::Url::parse(url).map_err(|e| format!("Invalid URL: {e}"))?;
        let (host, ok) = host_allowed(&self.http_allow, &url);
        if !ok {
            return Err(format!("Host '{host}' is not allowed"));
        }
        let method = input
            .get("method")
            .and_then(Value::as_str)
            .unwrap_or("GET")
            .to_ascii_uppercase();
        let method = reqwest::Method::from_bytes(method.as_bytes())
            .map_err(|_| format!("Invalid method: {method}"))?;
        let client = self.http.as_ref().ok_or("HTTP is not available")?;
        let mut request = client.request(method, url);
        if let Some(headers) = input.get("headers").and_then(Value::as_object) {
            for (name, value) in headers {
                // The Host header is the allowlist's business.
                if name.eq_ignore_ascii_case("host") {
                    continue;
                }
                let value = match value {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                request = request.header(name.as_str(), value);
            }
        }
        match input.get("body") {
            None | Some(Value::Null) => {}
            Some(body) => {
                let body = match body {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                if body.len() as u64 > self.max_body {
                    return Err(format!(
                        "Request body is larger than {} bytes",
                        self.max_body
                    ));
                }
                request = request.body(body);
            }
        }
        let mut response = request.send().await.map_err(fetch_error)?;
        let status = response.status().as_u16();
        let mut headers = Map::new();
        for (name, value) in response.headers() {
            let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
            match headers.get_mut(name.as_str()) {
                Some(Value::String(seen)) => {
                    seen.push_str(", ");
                    seen.push_str(&value);
                }
                _ => {
                    headers.insert(name.as_str().to_string(), Value::String(value));
                }
            }
        }
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(fetch_error)? {
            let size = (body.len() + chunk.len()) as u64;
            if size > self.max_body {
                return Err(format!(
                    "Response body is larger than {} bytes",
                    self.max_body
                ));
            }
            if size > budget.left() {
                return Err(budget.exceeded());
            }
            body.extend_from_slice(&chunk);
        }
        // Text is passed as it is (no copy); anything else whole, as base64, rather than
        // as a lossy text copy up to three times its size.
        let (body, encoding) = match String::from_utf8(body) {
            Ok(text) => (text, "utf-8"),
            Err(binary) => (
                base64::engine::general_purpose::STANDARD.encode(binary.as_bytes()),
                "base64",
            ),
        };
        Ok(json!({
            "status": status,
            "headers": headers,
            "body": body,
            "encoding": encoding,
        }))
    }
}

/// A failed request as the code sees it: a refused redirect by its own words.
fn fetch_error(err: reqwest::Error) -> String {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = source {
        if let Some(denied) = e.downcast_ref::<Denied>() {
            return denied.0.clone();
        }
        source = e.source();
    }
    if err.is_timeout() {
        return "The request timed out".to_string();
    }
    if err.is_connect() {
        return "Cannot connect".to_string();
    }
    format!("The request failed: {}", err.without_url())
}

/// The functions the broker serves itself.
pub(super) fn builtin_specs() -> Vec<ToolSpec> {
    vec![
        ToolSpec {
            name: "http.fetch".to_string(),
            description: "Make an HTTP request (the broker makes it, for allowed hosts only) and \
get {status, headers, body, encoding}: the body as text when it is UTF-8 (encoding \"utf-8\"), \
else as base64 (encoding \"base64\")."
                .to_string(),
            parameters: json!({
                "type": "object",
                "required": ["url"],
                "properties": {
                    "url": {"type": "string", "description": "http(s) URL"},
                    "method": {"type": "string", "description": "GET (default), POST, ..."},
                    "headers": {"type": "object", "additionalProperties": {"type": "string"}},
                    "body": {"type": "string", "description": "request body"}
                },
                "additionalProperties": false
            }),
        },
        ToolSpec {
            name: "env.get".to_string(),
            description: "Read an allowed configuration value (null when unset).".to_string(),
            parameters: json!({
                "type": "object",
                "required": ["key"],
                "properties": {"key": {"type": "string"}},
                "additionalProperties": false
            }),
        },
    ]
}
