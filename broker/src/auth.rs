//! Who is calling: API keys (header or LibreChat's body field) and the end user they name.

use crate::config::AuthMode;
use crate::error::AppError;
use crate::http::AppState;
use axum::body::{to_bytes, Body};
use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// The body field LibreChat 0.8.5 sends the key in, where the header was dropped.
const BODY_KEY_FIELD: &str = "LIBRECHAT_CODE_API_KEY";

/// Rejects requests without a valid key (unless auth is off).
pub async fn require_auth(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let config = &state.broker.config;
    if config.auth == AuthMode::None {
        return next.run(request).await;
    }
    if let Some(key) = header_key(request.headers()) {
        if key_matches(config.api_keys(), key) {
            return next.run(request).await;
        }
        return AppError::Unauthorized.into_response();
    }
    // No header: the key may be in a JSON body. The body is read once and put back.
    let is_json = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !is_json {
        return AppError::Unauthorized.into_response();
    }
    let (parts, body) = request.into_parts();
    let limit = config.max_body_mb * 1024 * 1024;
    let bytes = match to_bytes(body, limit).await {
        Ok(b) => b,
        Err(_) => {
            return AppError::PayloadTooLarge(format!(
                "request body over {} MiB",
                config.max_body_mb
            ))
            .into_response()
        }
    };
    let body_key = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| v.get(BODY_KEY_FIELD)?.as_str().map(str::to_string));
    match body_key {
        Some(key) if key_matches(config.api_keys(), &key) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        _ => AppError::Unauthorized.into_response(),
    }
}

/// The key from `X-API-Key` or `Authorization: Bearer`.
fn header_key(headers: &HeaderMap) -> Option<&str> {
    if let Some(key) = headers.get("x-api-key").and_then(|v| v.to_str().ok()) {
        return Some(key.trim());
    }
    let auth = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = auth.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Compares without an early exit on the first differing byte, so timing does not
/// reveal how much of a key was right.
fn key_matches<'a>(keys: impl Iterator<Item = &'a str>, given: &str) -> bool {
    let mut ok = false;
    for key in keys {
        let (a, b) = (key.as_bytes(), given.as_bytes());
        let mut diff = (a.len() ^ b.len()) as u8 | u8::from(a.len() != b.len());
        for (i, x) in a.iter().enumerate() {
            diff |= x ^ b.get(i).copied().unwrap_or(0);
        }
        ok |= diff == 0;
    }
    ok
}

/// The end user a request names (`User-Id` header, or `?kind=user&id=U`). Handlers add
/// a body `user_id` where their body has one.
#[derive(Debug, Clone, Default)]
pub struct Caller {
    pub user: Option<String>,
}

impl Caller {
    /// The caller's user, or `body_user` when the headers named none.
    pub fn user_or(&self, body_user: Option<&str>) -> Option<String> {
        self.user.clone().or_else(|| {
            body_user
                .map(str::trim)
                .filter(|u| !u.is_empty())
                .map(str::to_string)
        })
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = AppError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let header_user = parts
            .headers
            .get("user-id")
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(str::to_string);
        let query_user = parts.uri.query().and_then(|q| {
            let pairs: Vec<(String, String)> = form_pairs(q);
            let kind_is_user = pairs.iter().any(|(k, v)| k == "kind" && v == "user");
            kind_is_user
                .then(|| {
                    pairs
                        .iter()
                        .find(|(k, _)| k == "id")
                        .map(|(_, v)| v.clone())
                })
                .flatten()
                .filter(|u| !u.is_empty())
        });
        Ok(Caller {
            user: header_user.or(query_user),
        })
    }
}

fn form_pairs(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter_map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            Some((percent_decode(k)?, percent_decode(v)?))
        })
        .collect()
}

fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_match_exactly() {
        let keys = ["secret", "other"];
        assert!(key_matches(keys.iter().copied(), "secret"));
        assert!(key_matches(keys.iter().copied(), "other"));
        assert!(!key_matches(keys.iter().copied(), "secre"));
        assert!(!key_matches(keys.iter().copied(), "secretx"));
        assert!(!key_matches(keys.iter().copied(), ""));
        assert!(!key_matches(std::iter::empty(), ""));
    }

    #[test]
    fn bearer_and_header_keys() {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, "Bearer k1".parse().unwrap());
        assert_eq!(header_key(&h), Some("k1"));
        h.insert("x-api-key", "k2".parse().unwrap());
        assert_eq!(header_key(&h), Some("k2"));
    }

    #[test]
    fn query_decoding() {
        assert_eq!(percent_decode("a%20b+c").as_deref(), Some("a b c"));
        assert_eq!(percent_decode("%zz"), None);
        assert_eq!(percent_decode("100%"), Some("100%".into()));
    }
}
