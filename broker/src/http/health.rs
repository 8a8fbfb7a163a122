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
    Router::new().route("/libraries", get(libraries))
}

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
        "pool": { "ready": broker.pool.ready(), "target": broker.pool.target() },
    });
    let status = if healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body))
}

async fn libraries(State(state): State<AppState>) -> AppResult<Json<serde_json::Value>> {
    Ok(Json(state.broker.libraries().await?))
}
