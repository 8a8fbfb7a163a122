//! Who is calling: API keys (headers, or LibreChat's body field), LibreChat-minted JWTs,
//! and the end user (docs/API.md, "Identity and auth").
//!
//! Under a JWT the user is its `sub`, whatever else the request says; under an API key the
//! caller is a trusted server and names the user itself (`User-Id`, body `user_id`,
//! `?kind=user&id=U`).

use crate::config::AuthMode;
use crate::http::error::AppError;
use crate::http::jwt::looks_like_jwt;
use crate::http::AppState;
use axum::body::{Body, Bytes};
use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use bytes::BytesMut;
use http_body_util::BodyExt;
use serde::Deserialize;
use std::time::Duration;

/// Put in the request's extensions by [`require_auth`] when a JWT authenticated it: the
/// token's `sub`, which the [`Caller`] extractor then takes over anything the request says.
#[derive(Debug, Clone)]
pub(crate) struct JwtUser(pub String);

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
pub(crate) async fn require_auth(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Response {
    let broker = &state.broker;
    let config = &broker.config;
    if config.access.auth == AuthMode::None {
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
    if !config.access.body_api_key {
        return AppError::Unauthorized.into_response();
    }
    body_key_auth(&state, request, next).await
}

/// Bytes per permit of [`AppState::preauth_budget`](crate::http::AppState).
pub(crate) const BUDGET_UNIT: u64 = 1024;

/// What the body-key path reads of a JSON body: only the key. Every other field is
/// skipped by serde's `IgnoredAny`, which allocates nothing, so a hostile document costs
/// no more than its bytes.
#[derive(Deserialize)]
struct BodyKey {
    /// The field LibreChat 0.8.5 sends the key in, where the header was dropped.
    #[serde(rename = "LIBRECHAT_CODE_API_KEY", default)]
    key: Option<String>,
}

/// No credential header: the key may be in a JSON body (LibreChat 0.8.5). The body is read
/// once, within the pre-auth byte budget shared by all such requests, scanned for the key
/// without building a tree, and handed on unchanged.
async fn body_key_auth(state: &AppState, request: Request, next: Next) -> Response {
    let config = &state.broker.config;
    let is_json = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !is_json {
        return AppError::Unauthorized.into_response();
    }
    let limit = config.caps.max_body_mb as u64 * 1024 * 1024;
    let budget = config.caps.preauth_body_budget.max(BUDGET_UNIT);
    let too_large = || {
        AppError::PayloadTooLarge(format!(
            "request body over {} MiB",
            limit.min(budget) / (1024 * 1024)
        ))
        .into_response()
    };
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    // Room for the whole body is taken before a byte is read: a body of unknown length
    // takes the most it may be.
    let reserve = declared.unwrap_or(limit).min(limit).min(budget);
    if declared.is_some_and(|n| n > reserve) {
        return too_large();
    }
    let units = u32::try_from(reserve.div_ceil(BUDGET_UNIT).max(1)).unwrap_or(u32::MAX);
    let wait = Duration::from_secs(config.header_read_timeout_secs.max(1));
    let permit =
        match tokio::time::timeout(wait, state.preauth_budget.clone().acquire_many_owned(units))
            .await
        {
            Ok(Ok(permit)) => permit,
            _ => {
                return AppError::Unavailable(
                    "too many requests without a credential header are being read; retry shortly"
                        .into(),
                )
                .into_response()
            }
        };
    let (parts, body) = request.into_parts();
    let capacity = declared.unwrap_or(0).min(reserve) as usize;
    let bytes = match tokio::time::timeout(wait, read_bounded(body, reserve, capacity)).await {
        Ok(Ok(Some(bytes))) => bytes,
        Ok(Ok(None)) => return too_large(),
        Ok(Err(err)) => {
            return AppError::BadRequest(format!("cannot read the request body: {err}"))
                .into_response()
        }
        Err(_) => {
            return AppError::BadRequest("the request body did not arrive in time".into())
                .into_response()
        }
    };
    let body_key = key_in_body(&bytes);
    match body_key {
        Some(key) if key_matches(config.access.api_keys(), &key) => {
            // Authenticated now: the budget is for reading unauthenticated bytes.
            drop(permit);
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        _ => AppError::Unauthorized.into_response(),
    }
}

/// The `LIBRECHAT_CODE_API_KEY` of a JSON object, read without building a tree.
fn key_in_body(bytes: &[u8]) -> Option<String> {
    // Only an object carries the field (serde would also read a struct from an array).
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return None;
    }
    serde_json::from_slice::<BodyKey>(bytes).ok()?.key
}

/// The whole body in one buffer, or `None` past `limit` bytes.
async fn read_bounded(
    mut body: Body,
    limit: u64,
    capacity: usize,
) -> Result<Option<Bytes>, axum::Error> {
    let mut buf = BytesMut::with_capacity(capacity);
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        if (buf.len() + data.len()) as u64 > limit {
            return Ok(None);
        }
        buf.extend_from_slice(&data);
    }
    Ok(Some(buf.freeze()))
}

/// Whether the request's headers carry valid credentials (or auth is off): what a public
/// route may show more to.
pub(crate) fn authenticated(state: &AppState, headers: &HeaderMap) -> bool {
    state.broker.config.access.auth == AuthMode::None
        || matches!(
            header_auth(state, headers),
            Ok(HeaderAuth::Key | HeaderAuth::Jwt(_))
        )
}

/// Checks the credentials in the headers. A bearer token that is a JWT (and not one of
/// the API keys) must verify; otherwise `X-API-Key`, else the bearer token, must be a key.
fn header_auth(state: &AppState, headers: &HeaderMap) -> Result<HeaderAuth, AppError> {
    let broker = &state.broker;
    let config = &broker.config;
    if let Some(token) = bearer_token(headers) {
        if !state.jwt.is_empty()
            && looks_like_jwt(token)
            && !key_matches(config.access.api_keys(), token)
        {
            return match state.jwt.verify(token) {
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
        Some(key) if key_matches(config.access.api_keys(), key) => Ok(HeaderAuth::Key),
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
pub(crate) struct Caller {
    /// Whose sessions and files the request may see; `None`: the API key's whole scope.
    pub(crate) user: Option<String>,
    /// Set when `user` comes from a verified JWT: nothing in the request may change it.
    pub(crate) authoritative: bool,
}

impl Caller {
    /// The caller's user, or `body_user` when the headers named none (never over a JWT's).
    pub(crate) fn user_or(&self, body_user: Option<&str>) -> Option<String> {
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
    fn the_body_key_is_found_in_objects_only() {
        let key = |b: &str| key_in_body(b.as_bytes());
        assert_eq!(
            key(r#" {"lang":"py","code":"1","files":[{"id":"a"}],"LIBRECHAT_CODE_API_KEY":"k1"}"#)
                .as_deref(),
            Some("k1")
        );
        assert_eq!(key(r#"{"lang":"py"}"#), None);
        assert_eq!(key(r#"["k1"]"#), None);
        assert_eq!(key("[0,0,0]"), None);
        assert_eq!(key(r#"{"LIBRECHAT_CODE_API_KEY":5}"#), None);
        assert_eq!(key("{not json"), None);
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
