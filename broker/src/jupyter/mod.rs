//! Jupyter's kernel protocol at `/jupyter`, for Open WebUI's code interpreter and Jupyter
//! Server's gateway client (docs/JUPYTER.md): the REST API of kernels and kernel specs
//! (`rest.rs`), and each kernel's WebSocket, the messaging protocol 5.3 on one multiplexed
//! socket (`channels.rs`, framed by `messages.rs`, cells run by `cell.rs`).
//!
//! A kernel is a codebroker session with its sandbox, taken from the pool when one is
//! ready; deleting the kernel ends the session. Code runs only through the core's exec, so
//! rate limits, caps, metrics and the audit log apply. The token is a codebroker API key,
//! from `?token=` (Open WebUI) or `Authorization: token` (Jupyter's clients); a JWT as a
//! bearer token works as on every route.

mod cell;
mod channels;
mod messages;
mod rest;

use crate::core::Broker;
use crate::http::auth::{require_auth, Caller};
use crate::http::AppState;
use crate::session::Session;
use crate::sync::LockExt as _;
use axum::extract::Request;
use axum::http::{header, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;
use axum::Router;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio_util::sync::CancellationToken;

/// The Jupyter routes (none when `CODEBROKER_JUPYTER=false`), behind the token check.
pub(crate) fn router(state: &AppState) -> Router<AppState> {
    if !state.broker.config().jupyter.jupyter {
        return Router::new();
    }
    let config = state.broker.config();
    let kernels = Arc::new(Kernels {
        broker: state.broker.clone(),
        kernels: Mutex::default(),
        sessions: Mutex::default(),
        max_message_bytes: config.caps.max_body_mb * 1024 * 1024,
        shutdown: state.shutdown.child_token(),
        started_ms: crate::clock::now_ms(),
    });
    Router::new().nest(
        "/jupyter",
        rest::router()
            .merge(channels::router())
            .route_layer(axum::middleware::from_fn_with_state(
                state.clone(),
                require_auth,
            ))
            // Runs first: the token becomes the credentials `require_auth` reads.
            .route_layer(axum::middleware::from_fn(token_credentials))
            .merge(rest::public_router())
            .layer(axum::Extension(kernels)),
    )
}

/// Turns Jupyter's ways of sending the token into the bearer token every route reads:
/// `Authorization: token KEY` (Jupyter's clients, Jupyter Server's gateway client), and
/// `?token=KEY` when the headers carry no credentials (Open WebUI, on its REST calls and
/// its WebSocket). A bearer token that is a JWT is checked as a JWT.
async fn token_credentials(mut request: Request, next: Next) -> Response {
    let headers = request.headers();
    let scheme_token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("token"))
        .map(|(_, token)| token.trim().to_string());
    let has_credentials =
        headers.contains_key(header::AUTHORIZATION) || headers.contains_key("x-api-key");
    let token = match scheme_token {
        Some(token) => Some(token),
        None if !has_credentials => query_token(request.uri().query().unwrap_or("")),
        None => None,
    };
    if let Some(value) = token.and_then(|t| HeaderValue::from_str(&format!("Bearer {t}")).ok()) {
        request.headers_mut().insert(header::AUTHORIZATION, value);
    }
    next.run(request).await
}

/// The `token` parameter of a query string, percent-decoded. A `+` stays a `+`: Open WebUI
/// writes the token into its WebSocket URL unencoded, and no key holds a space.
fn query_token(query: &str) -> Option<String> {
    query.split('&').find_map(|pair| {
        let (name, value) = pair.split_once('=')?;
        (name == "token").then(|| {
            percent_encoding::percent_decode_str(value)
                .decode_utf8_lossy()
                .into_owned()
        })
    })
}

/// The kernels this broker serves, and Jupyter's sessions over them.
pub(crate) struct Kernels {
    /// The core every operation goes through.
    broker: Arc<Broker>,
    /// Kernels by id.
    kernels: Mutex<HashMap<String, Arc<Kernel>>>,
    /// Jupyter sessions (`/api/sessions`): a notebook path bound to a kernel, by id.
    sessions: Mutex<HashMap<String, rest::JupyterSession>>,
    /// Largest message a socket answers (CODEBROKER_MAX_BODY_MB, as an exec's body); a
    /// larger one gets an error reply, and one over twice that closes the socket.
    max_message_bytes: usize,
    /// Cancelled when the server stops: open sockets close.
    shutdown: CancellationToken,
    /// When the routes were made (`/api/status`'s `started`).
    started_ms: u64,
}

/// One kernel: a codebroker session and what Jupyter's API says about it.
pub(crate) struct Kernel {
    /// Its id, a UUID (jupyter_server routes kernels by UUID).
    id: String,
    /// Its kernel spec's name.
    name: String,
    /// The session it runs in.
    session: Arc<Session>,
    /// The tenant of the key that made it: only that tenant sees it.
    tenant: Option<String>,
    /// The user of the JWT that made it: only that user sees it (an API key's caller is a
    /// trusted server: any caller of the tenant).
    user: Option<String>,
    /// The `session` of the headers it sends (Jupyter's kernel session).
    kernel_session: String,
    /// Environment variables the create asked for, set before the first cell and again in
    /// each new sandbox (the saved Python state does not hold `os.environ`).
    env: std::collections::BTreeMap<String, String>,
    /// The sandbox (container id) whose Python has `env`; `None`: none yet.
    env_in: Mutex<Option<String>>,
    /// When a client last used it (ms since the epoch).
    last_activity_ms: AtomicU64,
    /// Whether a cell runs (`busy`) or not (`idle`).
    busy: AtomicBool,
    /// Open WebSockets.
    connections: AtomicUsize,
    /// Cells run since the start or the last restart (`execution_count`).
    execution_count: AtomicU64,
    /// Stops the cell running now (interrupt, restart, delete).
    running: Mutex<Option<CancellationToken>>,
    /// One cell at a time, in the order they arrive, whatever socket sent them.
    turn: tokio::sync::Mutex<()>,
    /// Cancelled when the kernel is deleted: its sockets close.
    ended: CancellationToken,
    /// Sockets open on it, for the iopub messages every client of a kernel sees.
    subscribers: Mutex<Vec<channels::Subscriber>>,
}

impl Kernel {
    fn touch(&self) {
        self.last_activity_ms
            .store(crate::clock::now_ms(), Ordering::SeqCst);
    }

    /// Stops the cell running now, if one is.
    fn interrupt(&self) -> bool {
        match self.running.locked().as_ref() {
            Some(cancel) => {
                cancel.cancel();
                true
            }
            None => false,
        }
    }

    /// `busy` or `idle`.
    fn execution_state(&self) -> &'static str {
        if self.busy.load(Ordering::SeqCst) {
            "busy"
        } else {
            "idle"
        }
    }

    /// Whether `caller` may see it: its tenant, and under a JWT its user.
    fn visible_to(&self, caller: &Caller) -> bool {
        crate::session::same_tenant(caller.tenant.as_deref(), self.tenant.as_deref())
            && (!caller.authoritative || caller.user == self.user)
    }
}

impl Kernels {
    /// The kernel `id` as `caller` may see it; `None` when it is unknown, another's, or
    /// its session is gone.
    fn get(&self, caller: &Caller, id: &str) -> Option<Arc<Kernel>> {
        let kernel = self.kernels.locked().get(id).cloned()?;
        if !kernel.visible_to(caller) {
            return None;
        }
        self.live(kernel)
    }

    /// `kernel` while its session lives; a session the core removed (idle expiry) ends
    /// the kernel.
    fn live(&self, kernel: Arc<Kernel>) -> Option<Arc<Kernel>> {
        if self
            .broker
            .tenant_session(kernel.tenant.as_deref(), kernel.session.id())
            .is_some()
        {
            return Some(kernel);
        }
        self.forget(&kernel);
        None
    }

    /// Every kernel `caller` may see.
    fn visible(&self, caller: &Caller) -> Vec<Arc<Kernel>> {
        let all: Vec<_> = self.kernels.locked().values().cloned().collect();
        let mut visible: Vec<_> = all
            .into_iter()
            .filter(|k| k.visible_to(caller))
            .filter_map(|k| self.live(k))
            .collect();
        visible.sort_by(|a, b| a.id.cmp(&b.id));
        visible
    }

    /// Takes `kernel` out of the registry and its sessions; its sockets close.
    fn forget(&self, kernel: &Kernel) -> bool {
        let known = self.kernels.locked().remove(&kernel.id).is_some();
        self.sessions
            .locked()
            .retain(|_, s| s.kernel_id != kernel.id);
        kernel.ended.cancel();
        kernel.interrupt();
        known
    }

    /// Deletes a kernel: it is gone at once, and its session (container, files) ends in
    /// the background, so the client's round trip does not wait for the engine.
    fn delete(&self, kernel: &Arc<Kernel>) -> bool {
        let known = self.forget(kernel);
        let (broker, session) = (self.broker.clone(), kernel.session.clone());
        tokio::spawn(async move {
            broker.delete_session(&session).await;
        });
        known
    }
}

/// A timestamp as Jupyter writes them, always with microseconds (jupyter_server parses
/// `last_activity` with `%Y-%m-%dT%H:%M:%S.%fZ`).
pub(super) fn timestamp(ms: u64) -> String {
    let format = time::macros::format_description!(
        "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:6]Z"
    );
    time::OffsetDateTime::from_unix_timestamp_nanos(ms as i128 * 1_000_000)
        .ok()
        .and_then(|t| t.format(&format).ok())
        .unwrap_or_default()
}

/// Client text cut for an error message.
fn clip(text: &str) -> std::borrow::Cow<'_, str> {
    crate::http::auth::clip(text, crate::http::auth::MAX_LOGGED_TEXT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_always_have_microseconds() {
        assert_eq!(timestamp(0), "1970-01-01T00:00:00.000000Z");
        assert_eq!(timestamp(1_000_123), "1970-01-01T00:16:40.123000Z");
    }

    #[test]
    fn the_query_token_is_decoded() {
        assert_eq!(query_token("token=abc"), Some("abc".into()));
        assert_eq!(query_token("a=1&token=k%2Fy"), Some("k/y".into()));
        assert_eq!(query_token("token=a+b"), Some("a+b".into()));
        assert_eq!(query_token("token=a%2Bb"), Some("a+b".into()));
        assert_eq!(query_token("tokens=1"), None);
        assert_eq!(query_token(""), None);
    }
}
