//! Who is calling: API keys (headers, or LibreChat's body field), LibreChat-minted JWTs,
//! and the end user (API.md, "Identity and auth").
//!
//! Under a JWT the user is its `sub`, whatever else the request says; under an API key the
//! caller is a trusted server and names the user itself (`User-Id`, body `user_id`,
//! `?kind=user&id=U`).

use crate::config::AuthMode;
use crate::error::AppError;
use crate::http::AppState;
use crate::jwt::looks_like_jwt;
use axum::body::{to_bytes, Body};
use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// The body field LibreChat 0.8.5 sends the key in, where the header was dropped.
const BODY_KEY_FIELD: &str = "LIBRECHAT_CODE_API_KEY";

/// Put in the request's extensions by [`require_auth`] when a JWT authenticated it: the
/// token's `sub`, which the [`Caller`] extractor then takes over anything the request says.
#[derive(Debug, Clone)]
pub struct JwtUser(pub String);

/// What the headers proved.
enum HeaderAuth {
    /// A configured API key.
    Key,
    /// A valid JWT, for this user.
    Jwt(String),
    /// No credentials in the headers (the body may hold the key).
    Absent,
}

/// Rejects requests without a valid key or token (unless auth is off).
pub async fn require_auth(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Response {
    let broker = &state.broker;
    let config = &broker.config;
    if config.auth == AuthMode::None {
        return next.run(request).await;
    }
    match header_auth(&state, request.headers()) {
        Ok(HeaderAuth::Key) => return next.run(request).await,
        Ok(HeaderAuth::Jwt(user)) => {
            request.extensions_mut().insert(JwtUser(user));
            return next.run(request).await;
        }
        Ok(HeaderAuth::Absent) => {}
        Err(err) => return err.into_response(),
    }
    if !config.body_api_key {
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

/// Checks the credentials in the headers. A bearer token that is a JWT (and not one of
/// the API keys) must verify; otherwise `X-API-Key`, else the bearer token, must be a key.
fn header_auth(state: &AppState, headers: &HeaderMap) -> Result<HeaderAuth, AppError> {
    let broker = &state.broker;
    let config = &broker.config;
    if let Some(token) = bearer_token(headers) {
        if !broker.jwt.is_empty() && looks_like_jwt(token) && !key_matches(config.api_keys(), token)
        {
            return match broker.jwt.verify(token) {
                Ok(verified) => {
                    tracing::debug!(user = %verified.user, tenant = ?verified.tenant_id, "JWT accepted");
                    Ok(HeaderAuth::Jwt(verified.user))
                }
                Err(reason) => {
                    tracing::info!(%reason, "JWT rejected");
                    Err(AppError::Unauthorized)
                }
            };
        }
    }
    match header_key(headers) {
        Some(key) if key_matches(config.api_keys(), key) => Ok(HeaderAuth::Key),
        Some(_) => Err(AppError::Unauthorized),
        None => Ok(HeaderAuth::Absent),
    }
}

/// The token of `Authorization: Bearer <token>`.
fn bearer_token(headers: &HeaderMap) -> Option<&str> {
    let auth = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = auth.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// The key from `X-API-Key` or `Authorization: Bearer`.
fn header_key(headers: &HeaderMap) -> Option<&str> {
    if let Some(key) = headers.get("x-api-key").and_then(|v| v.to_str().ok()) {
        return Some(key.trim());
    }
    bearer_token(headers)
}

/// Compares without an early exit on the first differing byte, so timing does not
/// reveal how much of a key was right.
pub(crate) fn key_matches<'a>(keys: impl Iterator<Item = &'a str>, given: &str) -> bool {
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

/// The end user of a request: a JWT's `sub`, or the one an API-key caller names
/// (`User-Id` header, or `?kind=user&id=U`). Handlers add a body `user_id` where their
/// body has one.
#[derive(Debug, Clone, Default)]
pub struct Caller {
    /// Whose sessions and files the request may see; `None`: the API key's whole scope.
    pub user: Option<String>,
    /// Set when `user` comes from a verified JWT: nothing in the request may change it.
    pub authoritative: bool,
}

impl Caller {
    /// The caller's user, or `body_user` when the headers named none (never over a JWT's).
    pub fn user_or(&self, body_user: Option<&str>) -> Option<String> {
        if self.authoritative {
            return self.user.clone();
        }
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
        if let Some(JwtUser(user)) = parts.extensions.get::<JwtUser>() {
            return Ok(Caller {
                user: Some(user.clone()),
                authoritative: true,
            });
        }
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
            authoritative: false,
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

    async fn caller_of(jwt_user: Option<&str>) -> Caller {
        let request = axum::http::Request::builder()
            .uri("/download/a/b?kind=user&id=bob")
            .header("user-id", "alice")
            .body(())
            .expect("request");
        let (mut parts, ()) = request.into_parts();
        if let Some(user) = jwt_user {
            parts.extensions.insert(JwtUser(user.to_string()));
        }
        Caller::from_request_parts(&mut parts, &())
            .await
            .expect("caller")
    }

    #[tokio::test]
    async fn a_jwt_user_overrides_whatever_the_request_names() {
        let by_key = caller_of(None).await;
        assert_eq!(by_key.user.as_deref(), Some("alice"));
        assert!(!by_key.authoritative);
        assert_eq!(by_key.user_or(Some("bob")).as_deref(), Some("alice"));

        let by_jwt = caller_of(Some("carol")).await;
        assert_eq!(by_jwt.user.as_deref(), Some("carol"));
        assert!(by_jwt.authoritative);
        assert_eq!(by_jwt.user_or(Some("alice")).as_deref(), Some("carol"));

        let nobody = Caller::default();
        assert_eq!(nobody.user_or(Some(" bob ")).as_deref(), Some("bob"));
        assert_eq!(nobody.user_or(Some("  ")), None);
    }
}
