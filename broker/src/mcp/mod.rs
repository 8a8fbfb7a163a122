//! MCP over streamable HTTP at `/mcp` (docs/API.md, "MCP at /mcp"), with the official SDK `rmcp`.
//!
//! Tools: `execute_code`, `upload_file`, `list_files`, `read_file`; with code mode on
//! (`CODEBROKER_CODEMODE`) also `execute` and `search` ([`crate::mcp::codemode`]). The route sits behind the
//! same auth as the rest of the API; the caller (a JWT's user, or the one an API-key caller
//! names) comes from the HTTP request, which rmcp hands to each tool call.
//!
//! Sessions: an explicit `session_id` argument wins; else the codebroker session this MCP
//! session used last. rmcp makes one handler value per MCP session (at `initialize`), so
//! that handler's own field is the map from MCP session to codebroker session, and it goes
//! away with the MCP session. Clients on the session-less protocol (2026-07-28) get a new
//! codebroker session per call unless they pass `session_id`, which every result names.

pub mod codemode;
mod files;
mod tools;

pub(crate) use tools::CodeTools;

use crate::http::AppState;
use crate::mcp::codemode::CodeMode;
use axum::Router;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use std::sync::Arc;
use std::time::Duration;

/// An MCP session with no traffic for this long is closed (rmcp's default is 5 minutes,
/// shorter than a pause in a conversation); its client then starts a new one.
const MCP_SESSION_IDLE: Duration = Duration::from_secs(3600);

pub(crate) fn router(state: &AppState) -> Router<AppState> {
    let mut sessions = LocalSessionManager::default();
    sessions.session_config.keep_alive = Some(MCP_SESSION_IDLE);
    let sessions = Arc::new(sessions);
    let max = state.broker.config().caps.max_mcp_sessions;
    Router::new()
        .route_service("/mcp", service(state, sessions.clone()))
        .route_layer(axum::middleware::from_fn(move |request, next| {
            cap_sessions(sessions.clone(), max, request, next)
        }))
}

/// Refuses (503) a request that would open an MCP session (one without `Mcp-Session-Id`)
/// while CODEBROKER_MAX_MCP_SESSIONS are open; requests of open sessions pass. Concurrent
/// `initialize` calls can pass the cap by as many as arrive at once.
async fn cap_sessions(
    sessions: Arc<LocalSessionManager>,
    max: usize,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let opens = request.method() == axum::http::Method::POST
        && !request.headers().contains_key("mcp-session-id");
    if max > 0 && opens {
        let open = sessions.sessions.read().await.len();
        if open >= max {
            return crate::http::error::AppError::unavailable(format!(
                "{open} MCP sessions are open, the most this broker keeps \
                 (CODEBROKER_MAX_MCP_SESSIONS); close one or retry after idle ones expire"
            ))
            .into_response();
        }
    }
    next.run(request).await
}

/// The rmcp service: one [`CodeTools`] per MCP session, kept by `sessions`.
pub(crate) fn service(
    state: &AppState,
    sessions: Arc<LocalSessionManager>,
) -> StreamableHttpService<CodeTools, LocalSessionManager> {
    let config = state.broker.config();
    let mut http = StreamableHttpServerConfig::default()
        .with_cancellation_token(state.shutdown.child_token())
        .with_max_request_body_bytes(config.caps.max_body_mb * 1024 * 1024);
    let hosts = crate::http::allowed_hosts(&config.mcp_allowed_hosts, &config.public_url);
    http = match hosts {
        None => http.disable_allowed_hosts(),
        Some(hosts) => http.with_allowed_hosts(hosts),
    };
    let state = state.clone();
    let codemode = CodeMode::new(&config.code_mode);
    StreamableHttpService::new(
        move || Ok(CodeTools::new(state.clone(), codemode.clone())),
        sessions,
        http,
    )
}

#[cfg(test)]
mod tests {
    use crate::http::allowed_hosts;

    #[test]
    fn hosts_include_the_public_url() {
        let configured = vec!["localhost".to_string(), " 127.0.0.1 ".to_string()];
        assert_eq!(
            allowed_hosts(&configured, "https://code.example.com:8443/base"),
            Some(vec![
                "localhost".to_string(),
                "127.0.0.1".to_string(),
                "code.example.com:8443".to_string()
            ])
        );
        assert_eq!(allowed_hosts(&["*".to_string()], "http://x"), None);
        // The default list is split like a comma-separated setting.
        let config = <crate::config::Config as clap::Parser>::parse_from(["codebroker"]);
        assert_eq!(config.mcp_allowed_hosts, ["localhost", "127.0.0.1", "::1"]);
    }
}
