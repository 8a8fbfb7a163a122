//! E2B's control plane: create, connect, list, get, set-timeout, pause and kill
//! sandboxes, with codebroker API keys as `X-API-Key`. Every failure is E2B's error shape
//! `{"code": <status>, "message": ...}`, which the SDKs parse (a codebroker envelope makes
//! the Python SDK fail with a `KeyError` instead of its own exception).

use super::{new_sandbox_id, new_token, E2b, E2bSandbox};
use crate::clock::now_ms;
use crate::http::auth::{require_auth, Caller};
use crate::http::error::{AppError, AppResult};
use crate::http::files::iso8601;
use crate::http::AppState;
use crate::sync::LockExt as _;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The control plane's routes, behind the API-key check.
pub(super) fn router(state: &AppState) -> Router<AppState> {
    Router::new()
        .route("/sandboxes", post(create).get(list))
        .route("/v2/sandboxes", post(create).get(list))
        .route("/sandboxes/{id}", get(info).delete(kill))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/connect", post(connect))
        .route("/v2/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/resume", post(connect))
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/sandboxes/{id}/metrics", get(metrics))
        .route("/sandboxes/{id}/fork", post(not_supported))
        .route("/sandboxes/{id}/snapshots", post(not_supported))
        .route("/sandboxes/{id}/network", axum::routing::put(not_supported))
        .route("/sandboxes/{id}/logs", get(not_supported))
        .route("/v2/sandboxes/{id}/logs", get(not_supported))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_auth,
        ))
        .layer(axum::middleware::map_response(e2b_error_shape))
}

/// Rewrites codebroker's error envelope (and any other failure body) as E2B's
/// `{"code": <status>, "message": ...}`, keeping the status and its headers
/// (`Retry-After`).
async fn e2b_error_shape(response: Response) -> Response {
    let status = response.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let bytes = axum::body::to_bytes(body, 64 * 1024)
        .await
        .unwrap_or_default();
    let message = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| v["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(&bytes).trim().to_string());
    let message = if message.is_empty() {
        status.canonical_reason().unwrap_or("error").to_string()
    } else {
        message
    };
    if let Some(retry) = parts.headers.get(header::RETRY_AFTER).cloned() {
        parts.headers.insert(header::RETRY_AFTER, retry);
    }
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    parts.headers.remove(header::CONTENT_LENGTH);
    let body = json!({"code": status.as_u16(), "message": message}).to_string();
    Response::from_parts(parts, Body::from(body))
}

/// A control-plane error with E2B's status: the layer above words it.
fn e2b_error(status: StatusCode, message: String) -> Response {
    (
        status,
        Json(json!({"code": status.as_u16(), "message": message})),
    )
        .into_response()
}

/// A JSON body, or a 400 saying why not (an empty body is `{}`).
fn parse_body<T: for<'de> Deserialize<'de>>(body: &Bytes) -> AppResult<T> {
    let body: &[u8] = if body.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        body
    };
    serde_json::from_slice(body)
        .map_err(|e| AppError::bad_request(format!("invalid request body: {e}")))
}

/// `POST /sandboxes` (SDKs up to 2.45) and `POST /v2/sandboxes`.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: Option<String>,
    /// Seconds it lives.
    timeout: Option<u64>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
    #[serde(default)]
    auto_pause: Option<bool>,
    /// Not served: refused, so a caller does not count on them.
    mcp: Option<Value>,
    volume_mounts: Option<Vec<Value>>,
}

/// The lifetime asked for, checked against the settings.
fn lifetime_secs(state: &AppState, asked: Option<u64>) -> AppResult<u64> {
    let config = &state.broker.config().e2b;
    let secs = asked.unwrap_or(config.e2b_default_timeout_secs);
    if secs > config.e2b_max_timeout_secs {
        return Err(AppError::bad_request(format!(
            "timeout {secs} s is over codebroker's maximum of {} s \
             (CODEBROKER_E2B_MAX_TIMEOUT_SECS)",
            config.e2b_max_timeout_secs
        )));
    }
    Ok(secs)
}

async fn create(
    axum::extract::State(state): axum::extract::State<AppState>,
    Extension(e2b): Extension<Arc<E2b>>,
    caller: Caller,
    body: Bytes,
) -> AppResult<Response> {
    let request: NewSandbox = parse_body(&body)?;
    let config = &state.broker.config().e2b;
    let template = request
        .template_id
        .filter(|t| !t.is_empty())
        .unwrap_or_else(|| "base".to_string());
    if !config.templates().contains(&template.as_str()) {
        return Ok(e2b_error(
            StatusCode::NOT_FOUND,
            format!(
                "template '{template}' not found: codebroker serves {}",
                config.templates().join(", ")
            ),
        ));
    }
    if request.mcp.as_ref().is_some_and(|m| !m.is_null())
        || request
            .volume_mounts
            .as_ref()
            .is_some_and(|v| !v.is_empty())
    {
        return Err(AppError::bad_request(
            "mcp and volumeMounts are not supported by codebroker".to_string(),
        ));
    }
    let env_vars = request.env_vars.unwrap_or_default();
    if let Some(bad) = env_vars.keys().find(|k| !super::process::is_env_name(k)) {
        return Err(AppError::bad_request(format!(
            "invalid environment variable name {bad:?}"
        )));
    }
    let secs = lifetime_secs(&state, request.timeout)?;
    let tenant = caller.tenant.as_deref();
    let session = state.broker.new_session(tenant, None, None, true).await?;
    let now = now_ms();
    let sandbox = Arc::new(E2bSandbox {
        id: new_sandbox_id(),
        session,
        tenant: caller.tenant.clone(),
        template,
        metadata: request.metadata.unwrap_or_default(),
        env_vars,
        started_ms: now,
        created: super::next_created(),
        end_ms: AtomicU64::new(now + secs * 1000),
        paused: AtomicBool::new(false),
        auto_pause: request.auto_pause.unwrap_or(false),
        envd_token: new_token(),
        traffic_token: new_token(),
        executions: AtomicU64::new(0),
        commands: Mutex::default(),
    });
    e2b.sandboxes
        .locked()
        .insert(sandbox.id.clone(), sandbox.clone());
    tracing::debug!(sandbox = %sandbox.id, session = sandbox.session.id(), "e2b sandbox created");
    Ok((StatusCode::CREATED, Json(sandbox_json(&state, &sandbox))).into_response())
}

/// The `Sandbox` answer of create and connect.
fn sandbox_json(state: &AppState, sandbox: &E2bSandbox) -> Value {
    let config = &state.broker.config().e2b;
    json!({
        "templateID": sandbox.template,
        "sandboxID": sandbox.id,
        "clientID": "codebroker",
        "alias": sandbox.template,
        "envdVersion": config.e2b_envd_version,
        "envdAccessToken": sandbox.envd_token,
        "trafficAccessToken": sandbox.traffic_token,
        "domain": domain(state),
    })
}

/// The domain of host routing, or `null`.
fn domain(state: &AppState) -> Value {
    let domain = &state.broker.config().e2b.e2b_domain;
    if domain.is_empty() {
        Value::Null
    } else {
        Value::String(domain.clone())
    }
}

/// The `ListedSandbox` / `SandboxDetail` fields.
fn detail_json(state: &AppState, sandbox: &E2bSandbox, detail: bool) -> Value {
    let config = state.broker.config();
    let end_ms = sandbox.end_ms.load(Ordering::SeqCst);
    let mut value = json!({
        "templateID": sandbox.template,
        "sandboxID": sandbox.id,
        "clientID": "codebroker",
        "alias": sandbox.template,
        "envdVersion": config.e2b.e2b_envd_version,
        "startedAt": iso8601(sandbox.started_ms),
        "endAt": iso8601(if end_ms == u64::MAX { sandbox.started_ms } else { end_ms }),
        "cpuCount": (config.sandbox.cpus.ceil() as i64).max(1),
        "memoryMB": config.sandbox.memory_mb,
        "diskSizeMB": config.sandbox.workspace_quota / (1024 * 1024),
        "state": sandbox.state().as_str(),
        "metadata": sandbox.metadata,
    });
    if detail {
        value["envdAccessToken"] = json!(sandbox.envd_token);
        value["domain"] = domain(state);
    }
    value
}

/// E2B's 404 for a sandbox the caller cannot see.
fn no_such_sandbox(id: &str) -> Response {
    e2b_error(
        StatusCode::NOT_FOUND,
        format!("sandbox \"{id}\" doesn't exist or you don't have access to it"),
    )
}

/// The sandbox `id` of the caller's tenant, or E2B's 404.
fn find(e2b: &E2b, caller: &Caller, id: &str) -> Result<Arc<E2bSandbox>, Box<Response>> {
    e2b.sandbox(caller.tenant.as_deref(), id)
        .ok_or_else(|| Box::new(no_such_sandbox(id)))
}

async fn info(
    axum::extract::State(state): axum::extract::State<AppState>,
    Extension(e2b): Extension<Arc<E2b>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Response {
    match find(&e2b, &caller, &id) {
        Ok(sandbox) => Json(detail_json(&state, &sandbox, true)).into_response(),
        Err(response) => *response,
    }
}

async fn kill(
    Extension(e2b): Extension<Arc<E2b>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Response {
    match find(&e2b, &caller, &id) {
        Ok(sandbox) => {
            e2b.kill(&sandbox).await;
            StatusCode::NO_CONTENT.into_response()
        }
        Err(response) => *response,
    }
}

/// `{"timeout": <seconds>}`.
#[derive(Deserialize)]
struct TimeoutRequest {
    timeout: Option<u64>,
}

async fn set_timeout(
    axum::extract::State(state): axum::extract::State<AppState>,
    Extension(e2b): Extension<Arc<E2b>>,
    caller: Caller,
    Path(id): Path<String>,
    body: Bytes,
) -> AppResult<Response> {
    let request: TimeoutRequest = parse_body(&body)?;
    let Some(asked) = request.timeout else {
        return Err(AppError::bad_request("timeout is required".to_string()));
    };
    let secs = lifetime_secs(&state, Some(asked))?;
    Ok(match find(&e2b, &caller, &id) {
        Ok(sandbox) => {
            // As E2B: the new end may be sooner than the old one.
            sandbox
                .end_ms
                .store(now_ms() + secs * 1000, Ordering::SeqCst);
            StatusCode::NO_CONTENT.into_response()
        }
        Err(response) => *response,
    })
}

async fn connect(
    axum::extract::State(state): axum::extract::State<AppState>,
    Extension(e2b): Extension<Arc<E2b>>,
    caller: Caller,
    Path(id): Path<String>,
    body: Bytes,
) -> AppResult<Response> {
    let request: TimeoutRequest = parse_body(&body)?;
    let secs = lifetime_secs(&state, request.timeout)?;
    let sandbox = match find(&e2b, &caller, &id) {
        Ok(sandbox) => sandbox,
        Err(response) => return Ok(*response),
    };
    let resumed = sandbox.paused.swap(false, Ordering::SeqCst);
    // The lifetime is only extended (E2B: "TTL is only extended").
    let end = now_ms() + secs * 1000;
    let current = sandbox.end_ms.load(Ordering::SeqCst);
    if resumed || current == u64::MAX || current < end {
        sandbox.end_ms.store(end, Ordering::SeqCst);
    }
    let status = if resumed {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(sandbox_json(&state, &sandbox))).into_response())
}

async fn pause(
    Extension(e2b): Extension<Arc<E2b>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Response {
    let sandbox = match find(&e2b, &caller, &id) {
        Ok(sandbox) => sandbox,
        Err(response) => return *response,
    };
    if e2b.pause(&sandbox).await {
        StatusCode::NO_CONTENT.into_response()
    } else {
        e2b_error(
            StatusCode::CONFLICT,
            format!("sandbox \"{id}\" is already paused"),
        )
    }
}

/// No metrics are kept per sandbox: an empty series, as for a sandbox just started.
async fn metrics(
    Extension(e2b): Extension<Arc<E2b>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Response {
    match find(&e2b, &caller, &id) {
        Ok(_) => Json(json!([])).into_response(),
        Err(response) => *response,
    }
}

/// What E2B offers and codebroker does not (docs/E2B.md, "What is not compatible").
async fn not_supported(uri: axum::http::Uri) -> Response {
    e2b_error(
        StatusCode::NOT_IMPLEMENTED,
        format!("{} is not supported by codebroker", uri.path()),
    )
}

/// The most one page of `list` holds.
const MAX_PAGE: usize = 100;

async fn list(
    axum::extract::State(state): axum::extract::State<AppState>,
    Extension(e2b): Extension<Arc<E2b>>,
    caller: Caller,
    Query(query): Query<HashMap<String, String>>,
) -> AppResult<Response> {
    let filter = query
        .get("metadata")
        .map(|m| metadata_filter(m))
        .unwrap_or_default();
    let states: Vec<&str> = query
        .get("state")
        .map(|s| {
            s.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .collect()
        })
        .unwrap_or_default();
    let limit = match query.get("limit") {
        Some(l) => l
            .parse::<usize>()
            .ok()
            .filter(|l| (1..=MAX_PAGE).contains(l))
            .ok_or_else(|| AppError::bad_request(format!("limit must be 1 to {MAX_PAGE}")))?,
        None => MAX_PAGE,
    };
    let offset = match query.get("nextToken").filter(|t| !t.is_empty()) {
        Some(t) => t
            .parse::<usize>()
            .map_err(|_| AppError::bad_request("invalid nextToken".to_string()))?,
        None => 0,
    };
    let ascending = query.get("order").is_some_and(|o| o == "asc");
    let mut found: Vec<Arc<E2bSandbox>> = e2b
        .of_tenant(caller.tenant.as_deref())
        .into_iter()
        .filter(|s| states.is_empty() || states.contains(&s.state().as_str()))
        .filter(|s| filter.iter().all(|(k, v)| s.metadata.get(k) == Some(v)))
        .filter(|s| query.get("template").is_none_or(|t| *t == s.template))
        .collect();
    found.sort_by_key(|s| s.created);
    if !ascending {
        found.reverse();
    }
    let page: Vec<Value> = found
        .iter()
        .skip(offset)
        .take(limit)
        .map(|s| detail_json(&state, s, false))
        .collect();
    let mut response = Json(page).into_response();
    if offset + limit < found.len() {
        if let Ok(token) = HeaderValue::from_str(&(offset + limit).to_string()) {
            response.headers_mut().insert("x-next-token", token);
        }
    }
    Ok(response)
}

/// The `metadata` query of `list`: `k=v&k2=v2` with each key and value percent-encoded
/// once more (both SDKs encode twice; the framework decoded the outer layer).
fn metadata_filter(query: &str) -> Vec<(String, String)> {
    let decode = |s: &str| {
        let once = percent_encoding::percent_decode_str(&s.replace('+', " "))
            .decode_utf8_lossy()
            .into_owned();
        percent_encoding::percent_decode_str(&once)
            .decode_utf8_lossy()
            .into_owned()
    };
    query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (decode(k), decode(v))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_metadata_filter_is_decoded_twice() {
        // What the SDKs send for {"user": "a b", "k&": "v="} after the framework's decode.
        assert_eq!(
            metadata_filter("user=a%2520b&k%2526=v%253D"),
            vec![
                ("user".to_string(), "a b".to_string()),
                ("k&".to_string(), "v=".to_string())
            ]
        );
        assert_eq!(metadata_filter(""), vec![]);
    }

    #[tokio::test]
    async fn failures_take_e2b_s_shape() {
        let response = AppError::Unauthorized.into_response();
        let response = e2b_error_shape(response).await;
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
        let body = axum::body::to_bytes(response.into_body(), 1024)
            .await
            .expect("body");
        let body: Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(body["code"], 401);
        assert!(body["message"].as_str().is_some_and(|m| !m.is_empty()));
    }
}
