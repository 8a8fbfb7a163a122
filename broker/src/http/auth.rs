//! Who is calling: API keys (headers, HTTP Basic credentials, or LibreChat's body field),
//! LibreChat-minted JWTs, the tenant they act in, and the end user (docs/API.md, "Identity
//! and auth").
//!
//! Under a JWT the user is its `sub`, whatever else the request says; under an API key the
//! caller is a trusted server and names the user itself (`User-Id`, body `user_id`,
//! `?kind=user&id=U`). The tenant is a boundary: a JWT's `tenant_id`, the named tenant of
//! the key (CODEBROKER_TENANT_API_KEYS), or else the key itself. Sessions, their files
//! and the skill and agent files shared in a tenant are found only by its callers, and a
//! user is a user of one tenant.

use crate::config::AuthMode;
use crate::http::error::AppError;
use crate::http::jwt::looks_like_jwt;
use crate::http::AppState;
use crate::sync::LockExt as _;
use axum::body::{Body, Bytes};
use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use bytes::BytesMut;
use http_body_util::BodyExt;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Put in the request's extensions by [`require_auth`] when a JWT authenticated it: the
/// token's `sub`, which the [`Caller`] extractor then takes over anything the request says.
#[derive(Debug, Clone)]
pub(crate) struct JwtUser(pub String);

/// The tenant a request acts in, put in its extensions by [`require_auth`]: every caller
/// of one tenant may read the files shared in it (skills, agent files), and no caller of
/// another tenant sees them. JWT tenants and key tenants are kept apart by a prefix, so no
/// `tenant_id` claim can name a key's tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Tenant(pub(crate) String);

/// The tenant LibreChat puts in its tokens when it has none of its own (`packages/api`
/// `buildClaims`: `CODEAPI_JWT_SINGLE_TENANT_ID ?? 'legacy'`); a token without the claim is
/// in it too.
pub(crate) const LIBRECHAT_DEFAULT_TENANT: &str = "legacy";

/// Longest `tenant_id` claim accepted (it is stored with every shared session).
pub(crate) const MAX_TENANT_ID_CHARS: usize = 256;

impl Tenant {
    /// A JWT's tenant: its `tenant_id` claim, else LibreChat's default.
    pub(crate) fn of_jwt(claim: Option<&str>) -> Tenant {
        let id = claim
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .unwrap_or(LIBRECHAT_DEFAULT_TENANT);
        Tenant(format!("jwt:{id}"))
    }

    /// The tenant of everyone who holds `key`: a digest, so the key itself is never stored
    /// or logged.
    pub(crate) fn of_key(key: &str) -> Tenant {
        let digest = Sha256::digest(key.as_bytes());
        Tenant(format!("key:{}", hex::encode(&digest[..8])))
    }

    /// The tenant of the keys configured as `name` (CODEBROKER_TENANT_API_KEYS). Its own
    /// prefix, so that no key digest or `tenant_id` claim can name it.
    pub(crate) fn named(name: &str) -> Tenant {
        Tenant(format!("tenant:{name}"))
    }

    /// The one tenant of a broker without authentication.
    pub(crate) fn open() -> Tenant {
        Tenant("open".into())
    }
}

/// Every configured API key with its tenant: each of CODEBROKER_API_KEY its own, each of
/// CODEBROKER_TENANT_API_KEYS its named one.
fn configured_keys(config: &crate::config::Config) -> Vec<(&str, Tenant)> {
    let access = &config.access;
    access
        .api_keys()
        .map(|key| (key, Tenant::of_key(key)))
        .chain(
            access
                .tenant_keys()
                .map(|(tenant, key)| (key, Tenant::named(tenant))),
        )
        .collect()
}

/// The broker's only tenant, when it has exactly one: auth off, or API keys of one tenant
/// and no JWT keys (a JWT may name any tenant). Sessions saved before tenants were
/// recorded go to it.
pub(crate) fn sole_tenant(config: &crate::config::Config) -> Option<Tenant> {
    if config.access.auth == AuthMode::None {
        return Some(Tenant::open());
    }
    if config.access.jwt_key_entries().next().is_some() {
        return None;
    }
    let keys = configured_keys(config);
    let first = keys.first()?.1.clone();
    keys.iter().all(|(_, t)| *t == first).then_some(first)
}

/// What the headers proved.
enum HeaderAuth {
    /// A configured API key, whose tenant this is.
    Key(Tenant),
    /// A valid JWT, for this user in this tenant.
    Jwt(String, Tenant),
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
    let config = broker.config();
    if config.access.auth == AuthMode::None {
        request.extensions_mut().insert(Tenant::open());
        return next.run(request).await;
    }
    match header_auth(&state, request.headers()) {
        Ok(HeaderAuth::Key(tenant)) => {
            request.extensions_mut().insert(tenant);
            return next.run(request).await;
        }
        Ok(HeaderAuth::Jwt(user, tenant)) => {
            request.extensions_mut().insert(JwtUser(user));
            request.extensions_mut().insert(tenant);
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

/// Bytes per permit of [`PreauthBudget`].
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

/// The bytes of unauthenticated request bodies the broker holds at once
/// (CODEBROKER_PREAUTH_BODY_BUDGET), reserved as they arrive: a body announced but not
/// sent holds nothing. One peer address may hold at most half of it, so one client's
/// stalled bodies cannot lock out every body-key caller.
pub(crate) struct PreauthBudget {
    /// The whole budget, in [`BUDGET_UNIT`]s.
    units: Arc<Semaphore>,
    /// Most units one peer address may hold.
    per_peer: u32,
    /// Units held per peer address; an address leaves the map when it holds none.
    held: Mutex<HashMap<IpAddr, u32>>,
}

/// Why a [`Reservation`] could not grow.
#[derive(Debug, PartialEq, Eq)]
enum Shortfall {
    /// The peer holds its share already.
    Peer,
    /// No room came free in time.
    Budget,
}

/// The part of a [`PreauthBudget`] one request holds; given back on drop.
struct Reservation {
    /// The budget it came from.
    budget: Arc<PreauthBudget>,
    /// Units taken from the whole budget.
    permit: Option<OwnedSemaphorePermit>,
    /// Whose share the units count against (`None`: a request with no peer address,
    /// served outside the accept loop).
    peer: Option<IpAddr>,
    /// Units held.
    units: u32,
}

impl PreauthBudget {
    /// A budget of `bytes`, rounded up to whole units (a budget that is not a whole number
    /// of units still holds a body of its full size).
    pub(crate) fn new(bytes: u64) -> PreauthBudget {
        let units = bytes.max(BUDGET_UNIT).div_ceil(BUDGET_UNIT);
        let units = u32::try_from(units)
            .unwrap_or(u32::MAX)
            .min(u32::try_from(Semaphore::MAX_PERMITS).unwrap_or(u32::MAX));
        PreauthBudget {
            units: Arc::new(Semaphore::new(units as usize)),
            per_peer: units.div_ceil(2),
            held: Mutex::default(),
        }
    }

    /// An empty reservation for a request from `peer`.
    fn reserve(self: &Arc<Self>, peer: Option<IpAddr>) -> Reservation {
        Reservation {
            budget: self.clone(),
            permit: None,
            peer: peer.map(|ip| ip.to_canonical()),
            units: 0,
        }
    }

    fn held(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, u32>> {
        self.held.locked()
    }
}

impl Reservation {
    /// Grows the reservation to cover `bytes`, waiting until `deadline` for room in the
    /// whole budget; the peer's share is checked at once.
    async fn cover(&mut self, bytes: u64, deadline: tokio::time::Instant) -> Result<(), Shortfall> {
        let needed = u32::try_from(bytes.div_ceil(BUDGET_UNIT)).unwrap_or(u32::MAX);
        let more = needed.saturating_sub(self.units);
        if more == 0 {
            return Ok(());
        }
        if let Some(peer) = self.peer {
            let mut held = self.budget.held();
            let mine = held.entry(peer).or_insert(0);
            if mine.saturating_add(more) > self.budget.per_peer {
                if *mine == 0 {
                    held.remove(&peer);
                }
                return Err(Shortfall::Peer);
            }
            // Counted before the wait, so two requests of one peer cannot both pass.
            *mine += more;
        }
        let acquired =
            tokio::time::timeout_at(deadline, self.budget.units.clone().acquire_many_owned(more))
                .await;
        match acquired {
            Ok(Ok(permit)) => {
                match self.permit.as_mut() {
                    Some(held) => held.merge(permit),
                    None => self.permit = Some(permit),
                }
                self.units += more;
                Ok(())
            }
            _ => {
                self.uncount(more);
                Err(Shortfall::Budget)
            }
        }
    }

    /// Takes `units` off the peer's count.
    fn uncount(&self, units: u32) {
        let Some(peer) = self.peer else { return };
        let mut held = self.budget.held();
        if let Some(mine) = held.get_mut(&peer) {
            *mine = mine.saturating_sub(units);
            if *mine == 0 {
                held.remove(&peer);
            }
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.uncount(self.units);
    }
}

/// No credential header: the key may be in a JSON body (LibreChat 0.8.5). The body is read
/// once, within the pre-auth byte budget shared by all such requests (reserved as bytes
/// arrive, half of it at most per peer), scanned for the key without building a tree, and
/// handed on unchanged.
async fn body_key_auth(state: &AppState, request: Request, next: Next) -> Response {
    let config = state.broker.config();
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
    let limit = limit.min(budget);
    let too_large = || {
        AppError::too_large(format!("request body over {} MiB", limit / (1024 * 1024)))
            .into_response()
    };
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return too_large();
    }
    let peer = request
        .extensions()
        .get::<axum::extract::ConnectInfo<SocketAddr>>()
        .map(|info| info.0.ip());
    // The body has the header timeout to arrive, room in the budget included.
    let deadline =
        tokio::time::Instant::now() + Duration::from_secs(config.header_read_timeout_secs.max(1));
    let (parts, body) = request.into_parts();
    let mut reservation = state.preauth_budget.reserve(peer);
    let bytes = match read_reserved(body, limit, &mut reservation, deadline).await {
        Ok(bytes) => bytes,
        Err(BodyRead::TooLarge) => return too_large(),
        Err(BodyRead::Short(Shortfall::Peer)) => {
            return AppError::unavailable(
                "too many request bodies without a credential header are being read from \
                 this address; send the key in a header, or retry shortly"
                    .into(),
            )
            .into_response()
        }
        Err(BodyRead::Short(Shortfall::Budget)) => {
            return AppError::unavailable(
                "too many requests without a credential header are being read; retry shortly"
                    .into(),
            )
            .into_response()
        }
        Err(BodyRead::Failed(err)) => {
            return AppError::bad_request(format!("cannot read the request body: {err}"))
                .into_response()
        }
        Err(BodyRead::Late) => {
            return AppError::bad_request("the request body did not arrive in time".into())
                .into_response()
        }
    };
    let tenant = key_in_body(&bytes).and_then(|key| key_tenant(config, &key));
    match tenant {
        Some(tenant) => {
            // Authenticated now: the budget is for reading unauthenticated bytes.
            drop(reservation);
            let mut request = Request::from_parts(parts, Body::from(bytes));
            request.extensions_mut().insert(tenant);
            next.run(request).await
        }
        None => AppError::Unauthorized.into_response(),
    }
}

/// Why an unauthenticated body was not read whole.
enum BodyRead {
    /// Over the limit.
    TooLarge,
    /// The budget had no room for the next bytes.
    Short(Shortfall),
    /// The connection failed.
    Failed(axum::Error),
    /// It was not all there by the deadline.
    Late,
}

/// The whole body in one buffer by `deadline`, each chunk covered by `reservation` before
/// it is kept; an error past `limit` bytes.
async fn read_reserved(
    mut body: Body,
    limit: u64,
    reservation: &mut Reservation,
    deadline: tokio::time::Instant,
) -> Result<Bytes, BodyRead> {
    let mut buf = BytesMut::new();
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Ok(Some(frame)) => frame,
            Ok(None) => break,
            Err(_) => return Err(BodyRead::Late),
        };
        let Ok(data) = frame.map_err(BodyRead::Failed)?.into_data() else {
            continue;
        };
        let total = (buf.len() + data.len()) as u64;
        if total > limit {
            return Err(BodyRead::TooLarge);
        }
        reservation
            .cover(total, deadline)
            .await
            .map_err(BodyRead::Short)?;
        buf.extend_from_slice(&data);
    }
    Ok(buf.freeze())
}

/// The `LIBRECHAT_CODE_API_KEY` of a JSON object, read without building a tree.
fn key_in_body(bytes: &[u8]) -> Option<String> {
    // Only an object carries the field (serde would also read a struct from an array).
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return None;
    }
    serde_json::from_slice::<BodyKey>(bytes).ok()?.key
}

/// Whether the request's headers carry valid credentials (or auth is off): what a public
/// route may show more to.
pub(crate) fn authenticated(state: &AppState, headers: &HeaderMap) -> bool {
    state.broker.config().access.auth == AuthMode::None
        || matches!(
            header_auth(state, headers),
            Ok(HeaderAuth::Key(_) | HeaderAuth::Jwt(..))
        )
}

/// Checks the credentials in the headers. A bearer token that is a JWT (and not one of
/// the API keys) must verify; otherwise `X-API-Key`, else the bearer token, else the HTTP
/// Basic credentials, must hold a key.
fn header_auth(state: &AppState, headers: &HeaderMap) -> Result<HeaderAuth, AppError> {
    let broker = &state.broker;
    let config = broker.config();
    if let Some(token) = bearer_token(headers) {
        if !state.jwt.is_empty()
            && looks_like_jwt(token)
            && !key_matches(configured_keys(config).iter().map(|(k, _)| *k), token)
        {
            return match state.jwt.verify(token) {
                Ok(verified) if !verified.tenant_allowed => {
                    tracing::info!(tenant = ?verified.tenant_id, "JWT refused: its key may not sign for its tenant");
                    Err(AppError::forbidden(
                        "the key that signed this token may not sign for its tenant_id".into(),
                    ))
                }
                Ok(verified) => {
                    tracing::debug!(user = %verified.user, tenant = ?verified.tenant_id, "JWT accepted");
                    let tenant = Tenant::of_jwt(verified.tenant_id.as_deref());
                    Ok(HeaderAuth::Jwt(verified.user, tenant))
                }
                Err(reason) => {
                    state.auth_failures.failed("JWT rejected", &reason);
                    Err(AppError::Unauthorized)
                }
            };
        }
    }
    if let Some(key) = header_key(headers) {
        return key_tenant(config, key)
            .map(HeaderAuth::Key)
            .ok_or(AppError::Unauthorized);
    }
    match basic_credentials(headers) {
        None => Ok(HeaderAuth::Absent),
        Some(Err(why)) => Err(AppError::BadBasicCredentials(why.to_string())),
        Some(Ok(credentials)) => basic_key(config, &credentials)
            .map(HeaderAuth::Key)
            .map_err(AppError::BadBasicCredentials),
    }
}

/// Authentication failures logged per second at most; the others are counted and summed
/// up in one line when the next second starts (and by [`FailureLog::flush`]).
pub(crate) const LOGGED_FAILURES_PER_SEC: u32 = 5;

/// Longest piece of client-supplied text (a `kid`, a user name, a header value) a log line
/// carries, in bytes.
pub(crate) const MAX_LOGGED_TEXT: usize = 64;

/// `text` cut to at most `max` bytes on a character boundary, with `…` when cut.
pub(crate) fn clip(text: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if text.len() <= max {
        return text.into();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end]).into()
}

/// The log of authentication failures: at most [`LOGGED_FAILURES_PER_SEC`] lines a second
/// plus one line counting the rest, so a flood of bad credentials costs the log a few
/// lines a second however fast it comes (the metric counts every one).
#[derive(Default)]
pub(crate) struct FailureLog {
    /// The current one-second window.
    window: Mutex<FailureWindow>,
}

/// One second of [`FailureLog`].
#[derive(Default)]
struct FailureWindow {
    /// When it started; `None` before the first failure.
    started: Option<Instant>,
    /// Lines logged in it.
    logged: u32,
    /// Failures not logged since the last summary.
    unlogged: u64,
}

impl FailureLog {
    /// Logs a failure (`what`, and why: client text in it is cut to a few times
    /// [`MAX_LOGGED_TEXT`]) unless this second's lines are used up.
    pub(crate) fn failed(&self, what: &str, reason: &str) {
        let (summary, log) = {
            let mut window = self.window.locked();
            let now = Instant::now();
            let summary = window.roll(now);
            let log = window.logged < LOGGED_FAILURES_PER_SEC;
            if log {
                window.logged += 1;
            } else {
                window.unlogged += 1;
            }
            (summary, log)
        };
        report_unlogged(summary);
        if log {
            tracing::info!(reason = %clip(reason, 3 * MAX_LOGGED_TEXT), "{what}");
        }
    }

    /// Logs the count of failures not logged, once their second is over; for a timer, so
    /// the last burst is reported even when no failure follows it.
    pub(crate) fn flush(&self) {
        let summary = self.window.locked().roll(Instant::now());
        report_unlogged(summary);
    }
}

impl FailureWindow {
    /// Starts a new window when the current one is over; the failures it did not log.
    fn roll(&mut self, now: Instant) -> u64 {
        let over = self
            .started
            .is_none_or(|started| now.duration_since(started) >= Duration::from_secs(1));
        if !over {
            return 0;
        }
        self.started = Some(now);
        self.logged = 0;
        std::mem::take(&mut self.unlogged)
    }
}

/// The line that sums up failures not logged one by one.
fn report_unlogged(count: u64) {
    if count > 0 {
        tracing::info!(
            count,
            "{count} more authentication failures not logged (at most {LOGGED_FAILURES_PER_SEC} a second)"
        );
    }
}

/// The tenant of the configured key that `given` is, or `None` when it is none of them.
pub(crate) fn key_tenant(config: &crate::config::Config, given: &str) -> Option<Tenant> {
    let keys = configured_keys(config);
    let index = matching_key(keys.iter().map(|(k, _)| *k), given)?;
    keys.into_iter().nth(index).map(|(_, tenant)| tenant)
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

/// Most bytes of `Authorization: Basic` credentials read, encoded: room for a long key and
/// a user name; anything longer is refused before it is decoded.
const MAX_BASIC_CREDENTIALS: usize = 4096;

/// The decoded credentials of `Authorization: Basic <base64>`: `None` without that
/// scheme, an error (for the client) when they cannot be read.
fn basic_credentials(headers: &HeaderMap) -> Option<Result<String, &'static str>> {
    let value = headers.get(header::AUTHORIZATION)?;
    let value = match value.to_str() {
        Ok(v) => v.trim(),
        // Not visible ASCII: not base64 either, if it is Basic at all.
        Err(_) => {
            let raw = value.as_bytes();
            let basic = raw.len() >= 6 && raw[..6].eq_ignore_ascii_case(b"basic ");
            return basic.then_some(Err("HTTP Basic credentials must be base64"));
        }
    };
    let (scheme, encoded) = value.split_once(' ').unwrap_or((value, ""));
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let encoded = encoded.trim();
    Some(decode_basic(encoded))
}

/// `base64(credentials)` as text, with or without padding.
fn decode_basic(encoded: &str) -> Result<String, &'static str> {
    const _: () = assert!(MAX_BASIC_CREDENTIALS == 4096, "the message below says 4096");
    if encoded.len() > MAX_BASIC_CREDENTIALS {
        return Err("HTTP Basic credentials are over 4096 bytes");
    }
    let engine = base64::engine::GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        base64::engine::GeneralPurposeConfig::new()
            .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
    );
    let bytes = engine
        .decode(encoded)
        .map_err(|_| "HTTP Basic credentials must be base64")?;
    let text = String::from_utf8(bytes).map_err(|_| "HTTP Basic credentials must be UTF-8")?;
    if text.is_empty() || text == ":" {
        return Err(
            "HTTP Basic credentials are empty: send the API key as the user name \
                    or the password (https://<key>@host/v1)",
        );
    }
    Ok(text)
}

/// The tenant of the key HTTP Basic credentials carry, whichever part holds it: all of
/// them (`key`, as node-fetch 2 sends a base URL's `key@`), the user name (`key:`, as
/// axios sends it) or the password (`:key`, `user:key`). Every part is compared with
/// every key; parts that name two different keys are refused. Each part is also compared
/// percent-decoded: the userinfo of a URL is percent-encoded (`https://a%2Fb@host`), and
/// some clients send it as written (axios), others decoded (node-fetch 2).
fn basic_key(config: &crate::config::Config, credentials: &str) -> Result<Tenant, String> {
    let (user, password) = credentials.split_once(':').unwrap_or((credentials, ""));
    let keys = configured_keys(config);
    let mut found = None;
    let mut ambiguous = false;
    for part in [credentials, user, password] {
        let decoded = percent_encoding::percent_decode_str(part)
            .decode_utf8()
            .ok()
            .filter(|d| d != part);
        for candidate in std::iter::once(part).chain(decoded.as_deref()) {
            if let Some(index) = matching_key(keys.iter().map(|(k, _)| *k), candidate) {
                ambiguous |= found.is_some_and(|f| f != index);
                found = Some(index);
            }
        }
    }
    match found {
        Some(index) if !ambiguous => keys
            .into_iter()
            .nth(index)
            .map(|(_, tenant)| tenant)
            .ok_or_else(|| "no configured API key".to_string()),
        Some(_) => Err(
            "the user name and the password of the HTTP Basic credentials are two different \
             API keys"
                .into(),
        ),
        None => Err(
            "the HTTP Basic credentials hold no configured API key (send it as the user name \
             or the password)"
                .into(),
        ),
    }
}

/// Whether `given` is one of `keys`.
fn key_matches<'a>(keys: impl Iterator<Item = &'a str>, given: &str) -> bool {
    matching_key(keys, given).is_some()
}

/// The position of `given` among `keys`. Every key is compared in full, without an early
/// exit on the first differing byte or on a match, so timing does not reveal how much of a
/// key was right, nor which one.
fn matching_key<'a>(keys: impl Iterator<Item = &'a str>, given: &str) -> Option<usize> {
    let mut found = None;
    for (position, key) in keys.enumerate() {
        let (a, b) = (key.as_bytes(), given.as_bytes());
        let mut diff = (a.len() ^ b.len()) as u8 | u8::from(a.len() != b.len());
        for (i, x) in a.iter().enumerate() {
            diff |= x ^ b.get(i).copied().unwrap_or(0);
        }
        if diff == 0 && found.is_none() {
            found = Some(position);
        }
    }
    found
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
    /// The tenant whose shared files (skills, agent files) the request may read; `None`
    /// (a route outside the auth layer): none.
    pub(crate) tenant: Option<String>,
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
        let tenant = parts.extensions.get::<Tenant>().map(|t| t.0.clone());
        if let Some(JwtUser(user)) = parts.extensions.get::<JwtUser>() {
            return Ok(Caller {
                user: Some(user.clone()),
                authoritative: true,
                tenant,
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
            tenant,
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

    fn two_keys() -> crate::config::Config {
        let mut config = crate::config::Config::for_tests("/tmp".into(), "t");
        config.access.api_key = vec!["key-one".into(), " key-two ".into()];
        config
    }

    fn basic(credentials: &[u8]) -> HeaderMap {
        let encoded = base64::engine::general_purpose::STANDARD.encode(credentials);
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            format!("Basic {encoded}").parse().unwrap(),
        );
        h
    }

    fn basic_tenant(config: &crate::config::Config, h: &HeaderMap) -> Result<Tenant, String> {
        let credentials = basic_credentials(h).expect("Basic")?;
        basic_key(config, &credentials)
    }

    #[test]
    fn basic_credentials_carry_the_key_in_any_part() {
        let config = two_keys();
        let one = Tenant::of_key("key-one");
        // node-fetch 2 (`key@`), axios (`key:`), a password (`:key`), a user and a password.
        for sent in [
            &b"key-one"[..],
            b"key-one:",
            b":key-one",
            b"librechat:key-one",
        ] {
            let h = basic(sent);
            assert_eq!(basic_tenant(&config, &h), Ok(one.clone()), "{sent:?}");
        }
        assert_eq!(
            basic_tenant(&config, &basic(b"key-two:")),
            Ok(Tenant::of_key("key-two"))
        );
        assert_ne!(one, Tenant::of_key("key-two"), "each key is its own tenant");
        // Without padding, and with the scheme in any case.
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, "basic a2V5LW9uZTo".parse().unwrap());
        assert_eq!(basic_tenant(&config, &h), Ok(one));
    }

    #[test]
    fn a_percent_encoded_key_in_the_credentials_is_found() {
        let mut config = crate::config::Config::for_tests("/tmp".into(), "t");
        config.access.api_key = vec!["a/b=c@d:e".into()];
        let key = Ok(Tenant::of_key("a/b=c@d:e"));
        // As axios sends `https://a%2Fb%3Dc%40d%3Ae@host` (encoded) and as node-fetch 2
        // sends it (decoded: the key then spans the user name and the password).
        assert_eq!(basic_tenant(&config, &basic(b"a%2Fb%3Dc%40d%3Ae:")), key);
        assert_eq!(basic_tenant(&config, &basic(b"a/b=c@d:e")), key);
        assert_eq!(
            basic_tenant(&config, &basic(b"user:a%2Fb%3Dc%40d%3Ae")),
            key
        );
        // Not a way around the comparison: a wrong key stays wrong, decoded or not.
        assert!(basic_tenant(&config, &basic(b"a%2Fb%3Dc%40d%3Af:")).is_err());
    }

    #[test]
    fn bad_basic_credentials_say_why() {
        let config = two_keys();
        let why = |h: HeaderMap| basic_tenant(&config, &h).expect_err("refused");
        assert!(why(basic(b"wrong")).contains("no configured API key"));
        assert!(why(basic(b"user:wrong")).contains("no configured API key"));
        assert!(why(basic(b"key-one:key-two")).contains("two different"));
        assert!(why(basic(b"")).contains("empty"));
        assert!(why(basic(b":")).contains("empty"));
        assert!(why(basic(b"\xff\xfe")).contains("UTF-8"));
        let header = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::AUTHORIZATION, v.parse().unwrap());
            h
        };
        assert!(why(header("Basic not*base64")).contains("base64"));
        assert!(why(header("Basic")).contains("empty"));
        assert!(why(header(&format!("Basic {}", "A".repeat(5000)))).contains("4096"));
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            axum::http::HeaderValue::from_bytes(b"Basic \xe9t\xe9").unwrap(),
        );
        assert!(why(h).contains("base64"));
        // Other schemes are not Basic.
        assert!(basic_credentials(&header("Bearer key-one")).is_none());
        assert!(basic_credentials(&HeaderMap::new()).is_none());
    }

    #[test]
    fn keys_of_a_named_tenant_share_it_and_plain_keys_stay_apart() {
        let mut config = two_keys();
        config.access.auth = AuthMode::Key;
        config.access.tenant_api_keys = vec![
            "acme:acme-1".into(),
            " acme : acme-2 ".into(),
            "globex:g:with:colons".into(),
        ];
        assert!(config.validate().is_ok(), "{:?}", config.validate());
        let acme = Tenant::named("acme");
        assert_eq!(key_tenant(&config, "acme-1"), Some(acme.clone()));
        assert_eq!(key_tenant(&config, "acme-2"), Some(acme.clone()));
        assert_eq!(
            key_tenant(&config, "g:with:colons"),
            Some(Tenant::named("globex"))
        );
        assert_eq!(
            key_tenant(&config, "key-one"),
            Some(Tenant::of_key("key-one"))
        );
        assert_ne!(
            key_tenant(&config, "key-one"),
            key_tenant(&config, "key-two")
        );
        assert_eq!(
            key_tenant(&config, "acme"),
            None,
            "a tenant's name is no key"
        );
        assert_eq!(key_tenant(&config, "acme:acme-1"), None);
        assert_eq!(basic_tenant(&config, &basic(b"acme-2:")), Ok(acme.clone()));
        assert_ne!(Tenant::of_jwt(Some("tenant:acme")), acme);
        assert_eq!(sole_tenant(&config), None, "several tenants");

        // Bad entries stop the start.
        for bad in ["no-colon", ":key", "bad name:key", "acme:", "acme:key-one"] {
            let mut config = two_keys();
            config.access.tenant_api_keys = vec![bad.into()];
            assert!(config.validate().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_broker_of_one_tenant_has_a_sole_tenant() {
        let mut config = crate::config::Config::for_tests("/tmp".into(), "t");
        config.access.auth = AuthMode::Key;
        config.access.api_key = vec!["only".into()];
        assert_eq!(sole_tenant(&config), Some(Tenant::of_key("only")));
        config.access.api_key = vec![];
        config.access.tenant_api_keys = vec!["acme:a".into(), "acme:b".into()];
        assert_eq!(sole_tenant(&config), Some(Tenant::named("acme")));
        config.access.jwt_public_keys = vec!["k=/some.pem".into()];
        assert_eq!(sole_tenant(&config), None, "JWTs may name any tenant");
        config.access.auth = AuthMode::None;
        assert_eq!(sole_tenant(&config), Some(Tenant::open()));
    }

    #[test]
    fn tenants_of_jwts_and_keys_never_meet() {
        assert_eq!(Tenant::of_jwt(None), Tenant::of_jwt(Some("legacy")));
        assert_eq!(Tenant::of_jwt(Some("  ")), Tenant::of_jwt(None));
        assert_ne!(Tenant::of_jwt(Some("t1")), Tenant::of_jwt(Some("t2")));
        let key = Tenant::of_key("secret");
        assert!(!key.0.contains("secret"), "the key is never stored");
        let forged = key.0.trim_start_matches("key:");
        assert_ne!(Tenant::of_jwt(Some(&key.0)), key);
        assert_ne!(Tenant::of_jwt(Some(forged)), key);
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

    #[tokio::test]
    async fn the_unauthenticated_budget_is_taken_as_bytes_arrive_and_halved_per_peer() {
        let budget = Arc::new(PreauthBudget::new(4 * BUDGET_UNIT));
        let (a, b, c): (IpAddr, IpAddr, IpAddr) = (
            "10.0.0.1".parse().expect("ip"),
            "10.0.0.2".parse().expect("ip"),
            "10.0.0.3".parse().expect("ip"),
        );
        let soon = || tokio::time::Instant::now() + Duration::from_millis(200);
        // Nothing is held before bytes arrive.
        let mut first = budget.reserve(Some(a));
        assert_eq!(budget.units.available_permits(), 4);
        first.cover(1, soon()).await.expect("one byte");
        first
            .cover(BUDGET_UNIT, soon())
            .await
            .expect("still one unit");
        assert_eq!(budget.units.available_permits(), 3);
        // A peer holds at most half, across its requests; the check does not wait.
        first.cover(2 * BUDGET_UNIT, soon()).await.expect("half");
        let mut again = budget.reserve(Some(a));
        let started = std::time::Instant::now();
        assert_eq!(again.cover(1, soon()).await, Err(Shortfall::Peer));
        assert!(started.elapsed() < Duration::from_millis(100));
        // Another peer takes the other half; a third waits, then is refused.
        let mut other = budget.reserve(Some(b));
        other
            .cover(2 * BUDGET_UNIT, soon())
            .await
            .expect("the other half");
        let mut third = budget.reserve(Some(c));
        let started = std::time::Instant::now();
        assert_eq!(third.cover(1, soon()).await, Err(Shortfall::Budget));
        assert!(started.elapsed() >= Duration::from_millis(150));
        // Room comes back when a request ends, and the peer counts with it.
        drop(first);
        third.cover(1, soon()).await.expect("room again");
        again
            .cover(1, soon())
            .await
            .expect("the peer's share is free again");
        drop((again, other, third));
        assert_eq!(budget.units.available_permits(), 4);
        assert!(budget.held().is_empty(), "no peer left counted");
    }

    #[test]
    fn client_text_is_clipped_on_a_character_boundary() {
        assert_eq!(clip("short", 64), "short");
        let long = "é".repeat(100);
        let clipped = clip(&long, MAX_LOGGED_TEXT);
        assert!(clipped.len() <= MAX_LOGGED_TEXT + '…'.len_utf8());
        assert!(clipped.ends_with('…'));
    }

    #[test]
    fn failures_past_the_rate_are_counted_not_logged() {
        let mut window = FailureWindow::default();
        let start = Instant::now();
        assert_eq!(window.roll(start), 0, "the first failure opens a window");
        window.logged = LOGGED_FAILURES_PER_SEC;
        window.unlogged = 1995;
        assert_eq!(window.roll(start + Duration::from_millis(500)), 0);
        assert_eq!(window.roll(start + Duration::from_secs(1)), 1995);
        assert_eq!(window.logged, 0);
        assert_eq!(window.roll(start + Duration::from_secs(3)), 0);
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

        assert_eq!(by_key.tenant, None, "outside the auth layer: no tenant");

        let nobody = Caller::default();
        assert_eq!(nobody.user_or(Some(" bob ")).as_deref(), Some("bob"));
        assert_eq!(nobody.user_or(Some("  ")), None);
    }
}
