//! A sandbox's data plane: envd (port 49983: files, commands, filesystem) and the code
//! interpreter (port 49999), both under `/e2b/sandbox`, told apart by `E2b-Sandbox-Port`
//! and named by `E2b-Sandbox-Id`. Its one credential is the sandbox's own access token;
//! the API key never travels here, and an `Authorization` header (envd's user name) is
//! not a credential.

use super::{files, interpreter, process, E2b, E2bSandbox, SandboxState};
use crate::http::AppState;
use axum::body::Body;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use axum::{Extension, Json, Router};
use serde_json::json;
use std::sync::Arc;

/// envd's port.
const ENVD_PORT: u16 = 49983;
/// The code interpreter's port.
const INTERPRETER_PORT: u16 = 49999;

pub(super) fn router() -> Router<AppState> {
    Router::new().route("/sandbox/{*rest}", any(dispatch))
}

/// What a data-plane handler gets.
pub(super) struct DataRequest {
    pub(super) state: AppState,
    pub(super) sandbox: Arc<E2bSandbox>,
    pub(super) headers: HeaderMap,
    pub(super) query: Option<String>,
}

async fn dispatch(
    State(state): State<AppState>,
    Extension(e2b): Extension<Arc<E2b>>,
    method: Method,
    headers: HeaderMap,
    Path(rest): Path<String>,
    RawQuery(query): RawQuery,
    body: Body,
) -> Response {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let id = header("e2b-sandbox-id").unwrap_or("").to_string();
    let port = match header("e2b-sandbox-port") {
        None => ENVD_PORT,
        Some(p) => match p.trim().parse::<u16>() {
            Ok(p) => p,
            Err(_) => return port_closed(&id),
        },
    };
    let Some(sandbox) = e2b.sandbox_by_id(&id) else {
        return not_found(&id);
    };
    if sandbox.state() == SandboxState::Paused {
        return not_found(&id);
    }
    let token_ok = match port {
        ENVD_PORT => same_secret(header("x-access-token"), &sandbox.envd_token),
        INTERPRETER_PORT => {
            same_secret(header("e2b-traffic-access-token"), &sandbox.traffic_token)
                || same_secret(header("x-access-token"), &sandbox.envd_token)
        }
        _ => return port_closed(&id),
    };
    if !token_ok {
        return (
            StatusCode::UNAUTHORIZED,
            Json(
                json!({"code": 401, "message": "missing or invalid access token for this sandbox"}),
            ),
        )
            .into_response();
    }
    let path = format!("/{}", rest.trim_start_matches('/'));
    let request = DataRequest {
        state,
        sandbox,
        headers,
        query,
    };
    drop(e2b);
    match (port, &method, path.as_str()) {
        (ENVD_PORT, &Method::GET, "/health") => StatusCode::NO_CONTENT.into_response(),
        (ENVD_PORT, &Method::GET, "/files") => files::read(request).await,
        (ENVD_PORT, &Method::POST, "/files") => files::write(request, body).await,
        (ENVD_PORT, &Method::POST, rpc) if rpc.starts_with("/process.Process/") => {
            process::rpc(request, body, &rpc["/process.Process/".len()..]).await
        }
        (ENVD_PORT, &Method::POST, rpc) if rpc.starts_with("/filesystem.Filesystem/") => {
            files::rpc(request, body, &rpc["/filesystem.Filesystem/".len()..]).await
        }
        (INTERPRETER_PORT, &Method::GET, "/health") => "OK".into_response(),
        (INTERPRETER_PORT, _, _) => interpreter::route(request, body, &method, &path).await,
        _ => (
            StatusCode::NOT_FOUND,
            Json(json!({"code": 404, "message": format!("no such route: {method} {path}")})),
        )
            .into_response(),
    }
}

/// E2B's proxy answer for a sandbox that is not running: the SDKs look for "was not
/// found" and raise their sandbox-not-running error.
pub(super) fn not_found(id: &str) -> Response {
    (
        StatusCode::BAD_GATEWAY,
        Json(json!({"sandboxId": id, "message": "The sandbox was not found", "code": 502})),
    )
        .into_response()
}

/// E2B's proxy answer for a port nothing listens on.
fn port_closed(id: &str) -> Response {
    (
        StatusCode::BAD_GATEWAY,
        Json(json!({
            "sandboxId": id,
            "message": "The sandbox is running but port is not open",
            "code": 502
        })),
    )
        .into_response()
}

/// Whether `given` is `expected`, compared in time that does not depend on where they
/// differ.
fn same_secret(given: Option<&str>, expected: &str) -> bool {
    let Some(given) = given else {
        return false;
    };
    let (a, b) = (given.trim().as_bytes(), expected.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_match_only_exactly() {
        assert!(same_secret(Some("abc"), "abc"));
        assert!(!same_secret(Some("abd"), "abc"));
        assert!(!same_secret(Some("ab"), "abc"));
        assert!(!same_secret(None, "abc"));
        assert!(!same_secret(Some(""), "abc"));
    }
}
