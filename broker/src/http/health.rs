//! `GET /health` (no auth) and `GET /libraries`.

use super::AppState;
use crate::http::error::AppResult;
use crate::sync::LockExt as _;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use futures::future::{BoxFuture, FutureExt, Shared};
use sandbox_runner::Language;
use serde_json::json;
use std::future::Future;
use std::time::Duration;
use tokio::time::Instant;

/// Routes that need no key: monitors and load balancers call them.
pub(crate) fn public_router() -> Router<AppState> {
    Router::new().route("/health", get(health))
}

/// Routes behind the key.
pub(crate) fn protected_router() -> Router<AppState> {
    Router::new()
        .route("/libraries", get(libraries))
        .route("/metrics", get(metrics))
}

/// Whether Docker answers and the image is present, and the languages; with credentials
/// (or auth off) also sessions, live sandboxes and pool. No auth. The Docker probe is
/// cached for a second.
#[utoipa::path(
    get,
    path = "/health",
    tag = "meta",
    responses(
        (status = 200, description = "`{status: ok, version, docker, image, languages}`, plus `sessions, sandboxes, pool` with credentials", content_type = "application/json"),
        (status = 503, description = "Degraded: the same body with `status: degraded`", content_type = "application/json"),
    )
)]
async fn health(State(state): State<AppState>, headers: HeaderMap) -> impl IntoResponse {
    let broker = &state.broker;
    let (docker_ok, image_ok) = state
        .health
        .get(|| {
            let broker = broker.clone();
            async move { broker.engine_status().await }
        })
        .await;
    let healthy = docker_ok && image_ok;
    let mut body = json!({
        "status": if healthy { "ok" } else { "degraded" },
        "version": env!("CARGO_PKG_VERSION"),
        // `docker` is kept for clients of the Docker-only broker; `backend` says which.
        "docker": { "reachable": docker_ok },
        "backend": { "kind": broker.config().backend.name(), "reachable": docker_ok },
        "image": { "name": broker.config().sandbox.image, "present": image_ok },
        "languages": Language::ALL.iter().map(|l| l.as_str()).collect::<Vec<_>>(),
    });
    // How busy the broker is only to callers that could see it anyway.
    if crate::http::auth::authenticated(&state, &headers) {
        body["sessions"] = json!(broker.session_count());
        body["sandboxes"] = json!({
            "live": broker.live_sandboxes(),
            "max_live": broker.config().caps.max_live_sandboxes,
        });
        let pool = broker.pool_status();
        body["pool"] = json!({
            "ready": pool.ready,
            "preloading": pool.preloading,
            "starting": pool.starting,
            "target": pool.target,
        });
    }
    let status = if healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body))
}

/// How long one Docker probe answers `/health`.
const HEALTH_TTL: Duration = Duration::from_secs(1);

/// The probe behind `/health` (Docker reachable, image present), run at most once per
/// [`HEALTH_TTL`] however many callers ask: concurrent callers share one probe.
#[derive(Default)]
pub(crate) struct HealthCache {
    /// The probe of the current period, shared by its callers, and when it started.
    current: std::sync::Mutex<Option<(Instant, SharedProbe)>>,
}

/// One probe's answer, awaited by every caller of its period.
type SharedProbe = Shared<BoxFuture<'static, (bool, bool)>>;

impl HealthCache {
    /// The answer of this period's probe, starting one with `probe` when there is none.
    pub(crate) async fn get<F, Fut>(&self, probe: F) -> (bool, bool)
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = (bool, bool)> + Send + 'static,
    {
        let shared = {
            let mut current = self.current.locked();
            match current.as_ref() {
                Some((at, shared)) if at.elapsed() < HEALTH_TTL => shared.clone(),
                _ => {
                    let shared = probe().boxed().shared();
                    *current = Some((Instant::now(), shared.clone()));
                    shared
                }
            }
        };
        shared.await
    }
}

/// Installed packages per language, read from the image once.
#[utoipa::path(
    get,
    path = "/libraries",
    tag = "meta",
    security(("api_key" = []), ("bearer" = [])),
    responses(
        (status = 200, description = "Packages per language", content_type = "application/json"),
        crate::http::openapi::Unauthorized,
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
        crate::http::openapi::Unauthorized,
    )
)]
async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    let broker = &state.broker;
    let text = broker.metrics_text();
    (
        [(
            axum::http::header::CONTENT_TYPE,
            crate::metrics::CONTENT_TYPE,
        )],
        text,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[tokio::test(start_paused = true)]
    async fn the_docker_probe_runs_once_per_second() {
        let cache = HealthCache::default();
        let probes = Arc::new(AtomicUsize::new(0));
        let probe = || {
            let probes = probes.clone();
            async move {
                probes.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(50)).await;
                (true, true)
            }
        };
        // Concurrent callers share one probe.
        let answers = futures::future::join_all((0..100).map(|_| cache.get(probe))).await;
        assert!(answers.iter().all(|a| *a == (true, true)));
        assert_eq!(probes.load(Ordering::SeqCst), 1);
        tokio::time::advance(Duration::from_millis(500)).await;
        cache.get(probe).await;
        assert_eq!(probes.load(Ordering::SeqCst), 1);
        tokio::time::advance(Duration::from_millis(600)).await;
        cache.get(probe).await;
        assert_eq!(probes.load(Ordering::SeqCst), 2);
    }
}
