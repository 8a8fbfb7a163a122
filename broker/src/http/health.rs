//! `GET /health` (no auth) and `GET /libraries`.

use super::AppState;
use crate::error::AppResult;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use sandbox_runner::Language;
use serde_json::json;

/// Routes that need no key: monitors and load balancers call them.
pub fn public_router() -> Router<AppState> {
    Router::new().route("/health", get(health))
}

/// Routes behind the key.
pub fn protected_router() -> Router<AppState> {
    Router::new()
        .route("/libraries", get(libraries))
        .route("/metrics", get(metrics))
}

/// Whether Docker answers and the image is present; languages, sessions, live sandboxes, pool. No auth.
#[utoipa::path(
    get,
    path = "/health",
    tag = "meta",
    responses(
        (status = 200, description = "`{status: ok, version, docker, image, languages, sessions, sandboxes, pool}`", content_type = "application/json"),
        (status = 503, description = "Degraded: the same body with `status: degraded`", content_type = "application/json"),
    )
)]
async fn health(State(state): State<AppState>) -> impl IntoResponse {
    let broker = &state.broker;
    let (docker_ok, image_ok) = tokio::join!(broker.docker.ping(), broker.docker.image_present());
    let healthy = docker_ok && image_ok;
    let body = json!({
        "status": if healthy { "ok" } else { "degraded" },
        "version": env!("CARGO_PKG_VERSION"),
        "docker": { "reachable": docker_ok },
        "image": { "name": broker.config.image, "present": image_ok },
        "languages": Language::ALL.iter().map(|l| l.as_str()).collect::<Vec<_>>(),
        "sessions": broker.registry.len(),
        "sandboxes": {
            "live": broker.live_sandboxes(),
            "max_live": broker.config.max_live_sandboxes,
        },
        "pool": {
            "ready": broker.pool.ready(),
            "starting": broker.pool.creating(),
            "target": broker.pool.target(),
        },
    });
    let status = if healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body))
}

/// Installed packages per language, read from the image once.
#[utoipa::path(
    get,
    path = "/libraries",
    tag = "meta",
    security(("api_key" = []), ("bearer" = [])),
    responses(
        (status = 200, description = "Packages per language", content_type = "application/json"),
        (status = 401, description = "Missing or invalid credentials", body = crate::http::openapi::ErrorBody),
        (status = 503, description = "The sandbox image cannot be read", body = crate::http::openapi::ErrorBody),
    )
)]
async fn libraries(State(state): State<AppState>) -> AppResult<Json<serde_json::Value>> {
    Ok(Json(state.broker.libraries().await?))
}

/// Prometheus metrics in the text format: sessions, containers, pool, execs and their
/// latency by language and outcome, limits hit, bytes moved, Docker errors, 429s.
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "meta",
    security(("api_key" = []), ("bearer" = [])),
    responses(
        (status = 200, description = "OpenMetrics text", content_type = "application/openmetrics-text"),
        (status = 401, description = "Missing or invalid credentials", body = crate::http::openapi::ErrorBody),
    )
)]
async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    let broker = &state.broker;
    let sessions = broker.registry.all();
    let containers = sessions
        .iter()
        .filter(|s| s.sandbox().is_some_and(|sb| sb.is_alive()))
        .count();
    let text = broker
        .metrics
        .render(sessions.len(), containers, broker.pool.ready());
    (
        [(
            axum::http::header::CONTENT_TYPE,
            crate::metrics::CONTENT_TYPE,
        )],
        text,
    )
}
