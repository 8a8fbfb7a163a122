//! The HTTP API: one module per resource, each with its `router()`, merged here and served
//! at `/` and again under `/v1` (LibreChat's default base URL ends in `/v1`).

pub(crate) mod auth;
pub(crate) mod error;
pub(crate) mod exec;
pub(crate) mod files;
pub(crate) mod health;
pub(crate) mod jwt;
pub(crate) mod lobe;
pub(crate) mod openapi;
pub(crate) mod playground;
pub(crate) mod programmatic;
pub(crate) mod server;
pub(crate) mod stream;

use crate::config::AuthMode;
use crate::core::Broker;
use crate::http::auth::{require_auth, FailureLog, PreauthBudget};
use crate::http::error::AppError;
use axum::body::Bytes;
use axum::extract::{FromRequest, Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use serde::de::DeserializeOwned;
use std::sync::Arc;

/// What every handler gets.
#[derive(Clone)]
pub(crate) struct AppState {
    /// The core.
    pub(crate) broker: Arc<Broker>,
    /// Cancelled when the server stops: ends open MCP streams, which would otherwise hold
    /// up the graceful shutdown.
    pub(crate) shutdown: tokio_util::sync::CancellationToken,
    /// Bytes of request bodies being read before their caller is known (the body-key
    /// path): CODEBROKER_PREAUTH_BODY_BUDGET, shared by all and capped per peer.
    pub(crate) preauth_budget: Arc<PreauthBudget>,
    /// Authentication failures, logged a few a second at most: a flood of bad
    /// credentials cannot fill the disk the log is on.
    pub(crate) auth_failures: Arc<FailureLog>,
    /// The last Docker probe of `/health`, so a flood of health checks is not a flood of
    /// Docker calls.
    pub(crate) health: Arc<health::HealthCache>,
    /// Public keys that verify LibreChat's JWTs; empty unless configured.
    pub(crate) jwt: Arc<jwt::JwtKeys>,
}

impl AppState {
    pub(crate) fn new(broker: Arc<Broker>, jwt: jwt::JwtKeys) -> AppState {
        let preauth_budget = Arc::new(PreauthBudget::new(broker.config().caps.preauth_body_budget));
        AppState {
            broker,
            preauth_budget,
            auth_failures: Arc::default(),
            health: Arc::default(),
            shutdown: tokio_util::sync::CancellationToken::new(),
            jwt: Arc::new(jwt),
        }
    }
}

/// Every route, at the root and under `/v1`; `mounted` are the protected routes of other
/// front ends (MCP), which depend on this layer, not it on them; `own_auth` are front
/// ends that check credentials themselves (E2B's), served at the root only.
pub(crate) fn router(
    state: AppState,
    mounted: Router<AppState>,
    own_auth: Router<AppState>,
) -> Router {
    let protected = Router::new()
        .merge(exec::router())
        .merge(programmatic::router())
        .merge(files::router())
        .merge(health::protected_router())
        .merge(mounted)
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
    let body_limit = state.broker.config().caps.max_body_mb * 1024 * 1024;
    let mut app = Router::new()
        .merge(routes.clone())
        .nest("/v1", routes)
        .merge(own_auth)
        .fallback(|| async { AppError::not_found("no such route".into()) });
    // Without credentials, a web page the user visits could reach the broker through a
    // rebound DNS name and read the answers: only the known names are served.
    let config = state.broker.config();
    // `*` serves any Host, but a browser's Origin must still be the page's own host.
    if config.access.auth == AuthMode::None {
        let hosts = allowed_hosts(&config.mcp_allowed_hosts, &config.public_url);
        app = app.layer(axum::middleware::from_fn_with_state(
            Arc::new(hosts),
            require_known_host,
        ));
    }
    // Under any auth mode: a browser that once sent a key as Basic credentials resends
    // them to the broker from any page, so they count only from the broker's own pages.
    let known = Arc::new(allowed_hosts(&config.mcp_allowed_hosts, &config.public_url));
    app = app.layer(axum::middleware::from_fn_with_state(
        known,
        refuse_cross_site_credentials,
    ));
    app.layer(axum::extract::DefaultBodyLimit::max(body_limit))
        .layer(axum::middleware::map_response_with_state(
            state.clone(),
            count_refusals,
        ))
        .layer(tower_http::trace::TraceLayer::new_for_http().make_span_with(request_span))
        .with_state(state)
}

/// The span of one request: its method and path, never its query, which may carry a
/// token (Jupyter's `?token=`).
fn request_span<B>(request: &axum::http::Request<B>) -> tracing::Span {
    tracing::debug_span!(
        "request",
        method = %request.method(),
        path = %request.uri().path(),
        version = ?request.version(),
    )
}

/// Counts the 429s every route answers (rate and capacity limits) and the authentication
/// failures (401) for `/metrics`. A 401 also closes the connection: requests a client
/// pipelined behind a refused one are never read.
async fn count_refusals(
    State(state): State<AppState>,
    mut response: axum::response::Response,
) -> axum::response::Response {
    match response.status() {
        axum::http::StatusCode::TOO_MANY_REQUESTS => state
            .broker
            .count_refusal(crate::core::Refusal::RateLimited),
        axum::http::StatusCode::UNAUTHORIZED => {
            state
                .broker
                .count_refusal(crate::core::Refusal::Unauthenticated);
            response.headers_mut().insert(
                header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
        }
        _ => {}
    }
    response
}

/// Refuses (403) HTTP Basic credentials on a request a browser sent from a page of another
/// site: `Sec-Fetch-Site: cross-site`, or an `Origin` that is neither the request's `Host`
/// nor a known host (CODEBROKER_MCP_ALLOWED_HOSTS, CODEBROKER_PUBLIC_URL). A browser
/// caches Basic credentials per origin and sends them with any page's form or `fetch`
/// that needs no preflight (a multipart upload, a `text/plain` post); the header keys and
/// tokens need a preflight, which the broker never grants. Servers (LibreChat) send
/// neither header, and the playground's own requests are same-origin.
async fn refuse_cross_site_credentials(
    State(known): State<Arc<Option<Vec<String>>>>,
    request: Request,
    next: Next,
) -> Response {
    let headers = request.headers();
    let basic = headers.get(header::AUTHORIZATION).is_some_and(|v| {
        v.as_bytes().len() >= 6 && v.as_bytes()[..6].eq_ignore_ascii_case(b"basic ")
    });
    if !basic {
        return next.run(request).await;
    }
    let cross_site = headers
        .get("sec-fetch-site")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"cross-site"));
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let foreign_origin = headers.get(header::ORIGIN).is_some_and(|origin| {
        let authority = origin_authority(origin.to_str().unwrap_or(""));
        let own = [host.to_string()];
        !(host_allowed(authority, &own)
            || known
                .as_deref()
                .is_some_and(|hosts| host_allowed(authority, hosts)))
    });
    if cross_site || foreign_origin {
        return AppError::forbidden(
            "HTTP Basic credentials are not accepted from another site's page; send the key \
             in the X-API-Key header from a server"
                .into(),
        )
        .into_response();
    }
    next.run(request).await
}

/// The `host[:port]` of an `Origin` value (`null` and other opaque origins: empty).
fn origin_authority(origin: &str) -> &str {
    origin
        .split_once("://")
        .map_or("", |(_, rest)| rest)
        .split('/')
        .next()
        .unwrap_or("")
}

/// The `Host` values to accept: the configured ones plus the public URL's host; `None`
/// (any) when the list holds `*`.
pub(crate) fn allowed_hosts(configured: &[String], public_url: &str) -> Option<Vec<String>> {
    let mut hosts: Vec<String> = configured
        .iter()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .collect();
    if hosts.iter().any(|h| h == "*") {
        return None;
    }
    let authority = public_url
        .split_once("://")
        .map_or(public_url, |(_, rest)| rest)
        .split(['/', '?', '#'])
        .next()
        .unwrap_or_default();
    let authority = authority.rsplit('@').next().unwrap_or(authority);
    if !authority.is_empty() {
        hosts.push(authority.to_string());
    }
    Some(hosts)
}

/// Under `CODEBROKER_AUTH=none`: refuses (403) a request whose `Host` is not one of
/// CODEBROKER_MCP_ALLOWED_HOSTS or the host of CODEBROKER_PUBLIC_URL (DNS rebinding), or
/// that a browser sent from a page of another origin (`Origin`: a cross-site form or
/// `fetch` that needs no preflight). Servers and command-line clients send no `Origin`.
async fn require_known_host(
    State(hosts): State<Arc<Option<Vec<String>>>>,
    request: Request,
    next: Next,
) -> Response {
    let headers = request.headers();
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    // Under `*` (no list) the request's own Host is the one origin served.
    let own = [host.to_string()];
    let hosts: &[String] = hosts.as_ref().as_deref().unwrap_or(&own);
    if !host_allowed(host, hosts) {
        return AppError::forbidden(format!(
            "Host {host:?} is not served; add it to CODEBROKER_MCP_ALLOWED_HOSTS"
        ))
        .into_response();
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = origin.to_str().unwrap_or("");
        if !host_allowed(origin_authority(origin), hosts) {
            return AppError::forbidden(format!(
                "requests from pages of {origin:?} are not served; add its host to \
                 CODEBROKER_MCP_ALLOWED_HOSTS"
            ))
            .into_response();
        }
    }
    next.run(request).await
}

/// Whether a `Host` header names an allowed host: an entry `name` allows any port,
/// `name:port` that port only (as rmcp matches them on `/mcp`).
fn host_allowed(host: &str, allowed: &[String]) -> bool {
    let Ok(host) = host.trim().parse::<axum::http::uri::Authority>() else {
        return false;
    };
    let name = |h: &str| h.trim_matches(['[', ']']).to_ascii_lowercase();
    allowed.iter().any(|entry| {
        let entry = entry.trim();
        let (entry_host, entry_port) = match entry.parse::<axum::http::uri::Authority>() {
            Ok(a) => (name(a.host()), a.port_u16()),
            Err(_) => (name(entry), None),
        };
        entry_host == name(host.host()) && entry_port.is_none_or(|p| host.port_u16() == Some(p))
    })
}

/// A JSON body, sent as `Content-Type: application/json` (else 415: a web page can send
/// `text/plain` across origins without asking, never `application/json`), with errors in
/// the API's envelope: malformed JSON is 400, well-formed JSON of the wrong shape 422.
pub(crate) struct ApiJson<T>(pub T);

impl<T, S> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = AppError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let content_type = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let essence = content_type.split(';').next().unwrap_or("").trim();
        if !essence.eq_ignore_ascii_case("application/json") {
            return Err(AppError::UnsupportedMediaType(format!(
                "send the body as Content-Type: application/json (got {content_type:?})"
            )));
        }
        json_body(req, state).await.map(ApiJson)
    }
}

/// A JSON body whatever its `Content-Type`, for `/lobe/run` only: LobeChat's plugin
/// gateway posts the arguments as a string, so `text/plain`. Cross-site pages cannot use
/// that: with auth on they cannot send the key header without a preflight, and with auth
/// off [`require_known_host`] refuses their `Origin`.
pub(crate) struct GatewayJson<T>(pub T);

impl<T, S> FromRequest<S> for GatewayJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = AppError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        json_body(req, state).await.map(GatewayJson)
    }
}

/// Reads and parses a JSON body (malformed: 400, wrong shape: 422).
async fn json_body<T: DeserializeOwned, S: Send + Sync>(
    req: Request,
    state: &S,
) -> Result<T, AppError> {
    let bytes = Bytes::from_request(req, state)
        .await
        .map_err(|e| match e.status() {
            axum::http::StatusCode::PAYLOAD_TOO_LARGE => {
                AppError::too_large("request body too large".into())
            }
            _ => AppError::bad_request(format!("cannot read the request body: {e}")),
        })?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(AppError::bad_request(
            "the request body is empty; send JSON".into(),
        ));
    }
    serde_json::from_slice(&bytes).map_err(|e| {
        use serde_json::error::Category;
        match e.classify() {
            Category::Data => AppError::Unprocessable(format!("invalid request: {e}")),
            _ => AppError::bad_request(format!("malformed JSON: {e}")),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::host_allowed;

    #[test]
    fn hosts_match_by_name_and_optional_port() {
        let allowed: Vec<String> = ["localhost", "127.0.0.1", "::1", "code.example:8443"]
            .map(String::from)
            .to_vec();
        assert!(host_allowed("localhost", &allowed));
        assert!(host_allowed("LOCALHOST:8000", &allowed));
        assert!(host_allowed("127.0.0.1:39123", &allowed));
        assert!(host_allowed("[::1]:8000", &allowed));
        assert!(host_allowed("code.example:8443", &allowed));
        assert!(!host_allowed("code.example:8000", &allowed));
        assert!(!host_allowed("evil.example", &allowed));
        assert!(!host_allowed("localhost.evil.example", &allowed));
        assert!(!host_allowed("", &allowed));
    }
}
