//! Host-based routing, as E2B's SDKs address sandboxes when `E2B_DOMAIN` is set (the way
//! that outlasts `E2B_API_URL`, which the SDKs mark deprecated): behind a TLS proxy with
//! a wildcard certificate, `api.<domain>` is the control plane and
//! `<port>-<sandbox id>.<domain>` a sandbox's envd (49983) or interpreter (49999). The
//! request is rewritten onto the path routes (`/e2b`, `/e2b/sandbox`) before routing.

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use serde_json::json;
use std::sync::Arc;

/// `app` with host routing for `domain` in front of it (unchanged when it is empty).
pub(crate) fn with_host_routing(app: Router, domain: &str) -> Router {
    let domain = domain.trim().trim_matches('.').to_ascii_lowercase();
    if domain.is_empty() {
        return app;
    }
    let layered = tower::ServiceBuilder::new()
        .layer(axum::middleware::from_fn_with_state(
            Arc::new(domain),
            route_by_host,
        ))
        .service(app);
    Router::new().fallback_service(layered)
}

/// Where a `Host` leads.
#[derive(Debug, PartialEq, Eq)]
enum Target {
    /// `api.<domain>`.
    Control,
    /// `<port>-<id>.<domain>`.
    Sandbox { port: String, id: String },
}

/// The target of `host` (port stripped, any case) under `domain`.
fn target(host: &str, domain: &str) -> Option<Target> {
    let host = host.rsplit_once(':').map_or(host, |(h, p)| {
        if p.bytes().all(|b| b.is_ascii_digit()) {
            h
        } else {
            host
        }
    });
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    let label = host.strip_suffix(domain)?.strip_suffix('.')?;
    if label == "api" {
        return Some(Target::Control);
    }
    let (port, id) = label.split_once('-')?;
    let valid = !port.is_empty()
        && port.len() <= 5
        && port.bytes().all(|b| b.is_ascii_digit())
        && !id.is_empty()
        && id.len() <= 63
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    valid.then(|| Target::Sandbox {
        port: port.to_string(),
        id: id.to_string(),
    })
}

async fn route_by_host(
    State(domain): State<Arc<String>>,
    mut request: Request,
    next: Next,
) -> Response {
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or_else(|| request.uri().authority().map(|a| a.to_string()))
        .unwrap_or_default();
    let prefix = match target(&host, &domain) {
        None => return next.run(request).await,
        Some(Target::Control) => "/e2b",
        Some(Target::Sandbox { port, id }) => {
            for (name, value) in [("e2b-sandbox-id", &id), ("e2b-sandbox-port", &port)] {
                let sent = request.headers().get(name).and_then(|v| v.to_str().ok());
                if sent.is_some_and(|s| s.trim() != value) {
                    return (
                        StatusCode::BAD_REQUEST,
                        Json(json!({
                            "code": 400,
                            "message": format!("{name} does not match the host {host}"),
                        })),
                    )
                        .into_response();
                }
                if let Ok(value) = HeaderValue::from_str(value) {
                    request.headers_mut().insert(name, value);
                }
            }
            "/e2b/sandbox"
        }
    };
    let path_and_query = request
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    match Uri::try_from(format!("{prefix}{path_and_query}")) {
        Ok(uri) => *request.uri_mut() = uri,
        Err(_) => return StatusCode::BAD_REQUEST.into_response(),
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_lead_to_the_control_plane_or_a_sandbox_port() {
        let d = "e2b.example.com";
        assert_eq!(target("api.e2b.example.com", d), Some(Target::Control));
        assert_eq!(target("API.e2b.example.com:443", d), Some(Target::Control));
        assert_eq!(
            target("49983-abc123.e2b.example.com", d),
            Some(Target::Sandbox {
                port: "49983".into(),
                id: "abc123".into()
            })
        );
        assert_eq!(target("e2b.example.com", d), None);
        assert_eq!(target("other.example.com", d), None);
        assert_eq!(target("x.api.e2b.example.com", d), None);
        assert_eq!(target("49983-abc_1.e2b.example.com", d), None);
        assert_eq!(target("49983-a.b.e2b.example.com", d), None);
        assert_eq!(target("notaport-abc.e2b.example.com", d), None);
        assert_eq!(target("49983-abc.e2b.example.com.evil", d), None);
    }
}
