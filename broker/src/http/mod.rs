//! The HTTP API: one module per resource, each with its `router()`, merged here and served
//! at `/` and again under `/v1` (LibreChat's default base URL ends in `/v1`).

pub mod exec;
pub mod files;
pub mod health;
pub mod lobe;
pub mod openapi;
pub mod playground;
pub mod programmatic;

use crate::auth::require_auth;
use crate::broker::Broker;
use crate::error::AppError;
use axum::body::Bytes;
use axum::extract::{FromRequest, Request, State};
use axum::Router;
use serde::de::DeserializeOwned;
use std::sync::Arc;

/// What every handler gets.
#[derive(Clone)]
pub struct AppState {
    /// The core.
    pub broker: Arc<Broker>,
    /// Programmatic runs waiting for their clients' tool results.
    pub runs: Arc<programmatic::Runs>,
    /// Cancelled when the server stops: ends open MCP streams, which would otherwise hold
    /// up the graceful shutdown.
    pub shutdown: tokio_util::sync::CancellationToken,
}

impl AppState {
    pub fn new(broker: Arc<Broker>) -> AppState {
        AppState {
            broker,
            runs: Arc::default(),
            shutdown: tokio_util::sync::CancellationToken::new(),
        }
    }
}

/// Every route, at the root and under `/v1`.
pub fn router(state: AppState) -> Router {
    let protected = Router::new()
        .merge(exec::router())
        .merge(programmatic::router())
        .merge(files::router())
        .merge(health::protected_router())
        .merge(crate::mcp::router(&state))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_auth,
        ));
    let routes: Router<AppState> = Router::new()
        .merge(protected)
        .merge(health::public_router())
        .merge(openapi::router())
        .merge(playground::router())
        .merge(lobe::router(&state));
    let body_limit = state.broker.config.max_body_mb * 1024 * 1024;
    Router::new()
        .merge(routes.clone())
        .nest("/v1", routes)
        .fallback(|| async { AppError::NotFound("no such route".into()) })
        .layer(axum::extract::DefaultBodyLimit::max(body_limit))
        .layer(axum::middleware::map_response_with_state(
            state.clone(),
            count_refusals,
        ))
        .layer(tower_http::trace::TraceLayer::new_for_http())
        .with_state(state)
}

/// Counts the 429s every route answers (rate and capacity limits) for `/metrics`.
async fn count_refusals(
    State(state): State<AppState>,
    response: axum::response::Response,
) -> axum::response::Response {
    if response.status() == axum::http::StatusCode::TOO_MANY_REQUESTS {
        state.broker.metrics.rate_limited();
    }
    response
}

/// A JSON body read whatever its `Content-Type`, with errors in the API's envelope:
/// malformed JSON is 400, well-formed JSON of the wrong shape 422.
pub struct ApiJson<T>(pub T);

impl<T, S> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = AppError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(|e| match e.status() {
                axum::http::StatusCode::PAYLOAD_TOO_LARGE => {
                    AppError::PayloadTooLarge("request body too large".into())
                }
                _ => AppError::BadRequest(format!("cannot read the request body: {e}")),
            })?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Err(AppError::BadRequest(
                "the request body is empty; send JSON".into(),
            ));
        }
        serde_json::from_slice(&bytes).map(ApiJson).map_err(|e| {
            use serde_json::error::Category;
            match e.classify() {
                Category::Data => AppError::Unprocessable(format!("invalid request: {e}")),
                _ => AppError::BadRequest(format!("malformed JSON: {e}")),
            }
        })
    }
}
