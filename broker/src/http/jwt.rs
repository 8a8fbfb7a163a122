//! LibreChat-minted JWTs (`Authorization: Bearer <JWT>`): the configured public keys and
//! the checks a token must pass (docs/API.md, "Identity and auth").
//!
//! A token is accepted when its header's `alg` is the one its key is for (EdDSA for an
//! Ed25519 key, RS256 for an RSA key; `none` and everything else never), its signature
//! verifies with a configured key (the one its `kid` names, when it names one), `iss` and
//! `aud` are the configured ones, `exp` and `nbf` hold now, `sub` names the user, and it
//! is used at most [`MAX_LIFETIME_SECS`] after it was issued.

use crate::config::AuthConfig;
use anyhow::{bail, Context};
use jsonwebtoken::{decode, decode_header, Algorithm, DecodingKey, Validation};
use serde::Deserialize;
use std::time::{SystemTime, UNIX_EPOCH};

/// Longest a token is accepted: `exp - iat` may not exceed it, and no token is accepted
/// later than this after its `iat` (the leeway on `exp` included); without `iat`, from
/// now until `exp` plus the leeway may not exceed it. LibreChat mints short-lived tokens;
/// a long-lived one is a leaked or forged one.
pub(crate) const MAX_LIFETIME_SECS: u64 = 300;

/// Clock skew tolerated between LibreChat and the broker, on `exp`, `nbf` and `iat`; it
/// never extends a token past [`MAX_LIFETIME_SECS`] after its `iat`.
pub(crate) const LEEWAY_SECS: u64 = 30;

/// One trusted public key.
struct PublicKey {
    /// The `kid` tokens name it by; a key without one is tried for any token.
    kid: Option<String>,
    /// The only algorithm accepted with this key.
    alg: Algorithm,
    /// The key itself, parsed once at start-up.
    key: DecodingKey,
    /// Where it came from (a path, or "inline"), for the log.
    source: String,
    /// The tenants it may sign for (CODEBROKER_JWT_KEY_TENANTS); `None`: any. Whoever
    /// holds the private half of a key bound to one tenant cannot act in another.
    tenants: Option<Vec<String>>,
}

/// The configured keys plus the claims every token must carry.
#[derive(Default)]
pub(crate) struct JwtKeys {
    /// Trusted keys; empty when JWTs are not accepted at all.
    keys: Vec<PublicKey>,
    /// The required `iss`.
    issuer: String,
    /// The required `aud`.
    audience: String,
}

/// What a verified token says about the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Verified {
    /// The end user (`sub`); it decides which sessions and files are visible.
    pub(crate) user: String,
    /// LibreChat's tenant, when it sends one: who shares skill and agent files.
    pub(crate) tenant_id: Option<String>,
    /// Whether the key that signed the token may sign for its tenant (see
    /// `PublicKey::tenants`); a token that verifies but may not is refused with 403.
    pub(crate) tenant_allowed: bool,
}

/// The claims the broker reads; `iss`, `aud` and `nbf` are checked by `jsonwebtoken`.
#[derive(Debug, Deserialize)]
struct Claims {
    /// The user id.
    sub: String,
    /// Expiry, seconds since the epoch.
    exp: u64,
    /// Issue time, seconds since the epoch.
    iat: Option<u64>,
    /// LibreChat's tenant id.
    tenant_id: Option<String>,
}

impl JwtKeys {
    /// Loads `CODEBROKER_JWT_PUBLIC_KEYS`: each entry is a PEM file path or an inline PEM
    /// (with `\n` escapes allowed), optionally `kid=` first.
    pub(crate) fn load(config: &AuthConfig) -> anyhow::Result<JwtKeys> {
        let mut keys = Vec::new();
        for entry in config.jwt_key_entries() {
            let key = parse_entry(entry)
                .with_context(|| format!("bad CODEBROKER_JWT_PUBLIC_KEYS entry {entry:?}"))?;
            keys.push(key);
        }
        for (kid, tenants) in config.jwt_tenant_entries() {
            let mut bound = keys
                .iter_mut()
                .filter(|k| k.kid.as_deref() == Some(kid))
                .peekable();
            if bound.peek().is_none() {
                bail!(
                    "CODEBROKER_JWT_KEY_TENANTS names kid {kid:?}, which no key of \
                     CODEBROKER_JWT_PUBLIC_KEYS has"
                );
            }
            for key in bound {
                key.tenants
                    .get_or_insert_with(Vec::new)
                    .extend(tenants.iter().map(|t| t.to_string()));
            }
        }
        Ok(JwtKeys {
            keys,
            issuer: config.jwt_issuer.clone(),
            audience: config.jwt_audience.clone(),
        })
    }

    /// Logs which keys are trusted, once, when the broker starts serving.
    pub(crate) fn log_loaded(&self) {
        for key in &self.keys {
            tracing::info!(kid = ?key.kid, alg = ?key.alg, source = %key.source, "JWT public key loaded");
        }
    }

    /// Whether no key is configured (JWTs are then not accepted).
    pub(crate) fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Verifies `token` now. The error is a reason for the log, never for the client.
    pub(crate) fn verify(&self, token: &str) -> Result<Verified, String> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        self.verify_at(token, now)
    }

    fn verify_at(&self, token: &str, now: u64) -> Result<Verified, String> {
        // `alg: none` (and any name the crate does not know) fails here.
        let header = decode_header(token).map_err(|e| format!("unreadable header: {e}"))?;
        let named: Vec<&PublicKey> = match header.kid.as_deref() {
            Some(kid) => self
                .keys
                .iter()
                .filter(|k| k.kid.as_deref() == Some(kid))
                .collect(),
            None => Vec::new(),
        };
        let candidates: Vec<&PublicKey> = if named.is_empty() {
            self.keys
                .iter()
                .filter(|k| k.kid.is_none() || header.kid.is_none())
                .collect()
        } else {
            named
        };
        if candidates.is_empty() {
            // The kid is the client's text, and this reason goes to the log.
            let kid = header.kid.unwrap_or_default();
            return Err(format!(
                "unknown kid {:?}",
                crate::http::auth::clip(&kid, crate::http::auth::MAX_LOGGED_TEXT)
            ));
        }
        let mut last_error = format!("alg {:?} is not configured for that key", header.alg);
        for key in candidates.into_iter().filter(|k| k.alg == header.alg) {
            let mut validation = Validation::new(key.alg);
            validation.leeway = LEEWAY_SECS;
            validation.validate_exp = true;
            validation.validate_nbf = true;
            validation.validate_aud = true;
            validation.set_issuer(&[&self.issuer]);
            validation.set_audience(&[&self.audience]);
            validation.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
            match decode::<Claims>(token, &key.key, &validation) {
                Ok(data) => {
                    let mut verified = check_claims(data.claims, now)?;
                    verified.tenant_allowed = key.may_sign_for(verified.tenant_id.as_deref());
                    return Ok(verified);
                }
                Err(err) => last_error = err.to_string(),
            }
        }
        Err(last_error)
    }
}

/// The checks `jsonwebtoken` does not make: a user is named, and the lifetime is short.
fn check_claims(claims: Claims, now: u64) -> Result<Verified, String> {
    let user = claims.sub.trim();
    if user.is_empty() {
        return Err("empty sub".into());
    }
    match claims.iat {
        Some(iat) => {
            let lifetime = claims.exp.saturating_sub(iat);
            if lifetime > MAX_LIFETIME_SECS {
                return Err(format!(
                    "lifetime {lifetime} s is over {MAX_LIFETIME_SECS} s"
                ));
            }
            if iat > now.saturating_add(LEEWAY_SECS) {
                return Err(format!("issued {} s in the future", iat - now));
            }
            // The leeway on `exp` is for clock skew, not for more life: a token is never
            // accepted more than the bound after it was issued.
            if now > iat.saturating_add(MAX_LIFETIME_SECS) {
                return Err(format!(
                    "issued {} s ago, over {MAX_LIFETIME_SECS} s",
                    now - iat
                ));
            }
        }
        // Without `iat`, the window from now to `exp` plus its leeway is the bound. The sums
        // saturate: a signed `exp` near `u64::MAX` must not wrap round into the window.
        None => {
            if claims.exp.saturating_add(LEEWAY_SECS) > now.saturating_add(MAX_LIFETIME_SECS) {
                return Err(format!(
                    "expires {} s from now, over {} s without iat",
                    claims.exp.saturating_sub(now),
                    MAX_LIFETIME_SECS - LEEWAY_SECS
                ));
            }
        }
    }
    let max = crate::http::auth::MAX_TENANT_ID_CHARS;
    if claims
        .tenant_id
        .as_ref()
        .is_some_and(|t| t.chars().count() > max)
    {
        return Err(format!("tenant_id over {max} characters"));
    }
    Ok(Verified {
        user: user.to_string(),
        tenant_id: claims.tenant_id,
        tenant_allowed: true,
    })
}

impl PublicKey {
    /// Whether this key may sign for the tenant a token's `tenant_id` claim names (the
    /// claim as the tenant is made of it: trimmed, LibreChat's default when absent).
    fn may_sign_for(&self, claim: Option<&str>) -> bool {
        let Some(tenants) = &self.tenants else {
            return true;
        };
        let tenant = claim
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .unwrap_or(crate::http::auth::LIBRECHAT_DEFAULT_TENANT);
        tenants.iter().any(|t| t == tenant)
    }
}

/// Whether a bearer token looks like a JWT (three base64url parts, a JSON header) rather
/// than an API key.
pub(crate) fn looks_like_jwt(token: &str) -> bool {
    token.starts_with("eyJ") && token.split('.').count() == 3
}

/// One `[kid=]path-or-PEM` entry.
fn parse_entry(entry: &str) -> anyhow::Result<PublicKey> {
    let (kid, rest) = split_kid(entry);
    let (pem, source) = if rest.starts_with("-----BEGIN") {
        (rest.replace("\\n", "\n"), "inline".to_string())
    } else {
        let pem = std::fs::read_to_string(rest).with_context(|| format!("cannot read {rest}"))?;
        (pem, rest.to_string())
    };
    let (alg, key) = if let Ok(key) = DecodingKey::from_ed_pem(pem.as_bytes()) {
        (Algorithm::EdDSA, key)
    } else if let Ok(key) = DecodingKey::from_rsa_pem(pem.as_bytes()) {
        (Algorithm::RS256, key)
    } else {
        bail!("{source} holds no Ed25519 or RSA public key in PEM form (a private key is not accepted: give its public half)");
    };
    Ok(PublicKey {
        kid,
        alg,
        key,
        source,
        tenants: None,
    })
}

/// Splits an optional `kid=` prefix off. A path that holds `=` in its first part needs a
/// `/` before it (`./a=b.pem`).
fn split_kid(entry: &str) -> (Option<String>, &str) {
    let entry = entry.trim();
    if entry.starts_with("-----") {
        return (None, entry);
    }
    match entry.split_once('=') {
        Some((kid, rest))
            if !kid.is_empty() && !kid.contains('/') && !kid.contains(char::is_whitespace) =>
        {
            (Some(kid.to_string()), rest.trim())
        }
        _ => (None, entry),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use jsonwebtoken::{encode, EncodingKey, Header};
    use serde_json::{json, Value};

    const ED_A: &str = include_str!("../../../tests/keys/ed25519_a.pem");
    const ED_A_PUB: &str = include_str!("../../../tests/keys/ed25519_a.pub.pem");
    const ED_B: &str = include_str!("../../../tests/keys/ed25519_b.pem");
    const ED_B_PUB: &str = include_str!("../../../tests/keys/ed25519_b.pub.pem");
    const RSA_A: &str = include_str!("../../../tests/keys/rsa_a.pem");
    const RSA_A_PUB: &str = include_str!("../../../tests/keys/rsa_a.pub.pem");

    fn now() -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("clock after 1970")
            .as_secs()
    }

    fn load(entries: &[String]) -> JwtKeys {
        let mut config = Config::for_tests("/tmp".into(), "jwt-test");
        config.access.jwt_public_keys = entries.to_vec();
        JwtKeys::load(&config.access).expect("keys load")
    }

    /// Ed25519 key A as `ed-a`, RSA key A as `rsa-a`, both inline.
    fn trusted() -> JwtKeys {
        load(&[
            format!("ed-a={}", ED_A_PUB.replace('\n', "\\n")),
            format!("rsa-a={}", RSA_A_PUB.replace('\n', "\\n")),
        ])
    }

    fn claims(sub: &str) -> Value {
        let now = now();
        json!({
            "iss": "librechat", "aud": "codeapi", "sub": sub,
            "iat": now, "nbf": now, "exp": now + 300,
            "jti": "j1", "tenant_id": "t1",
        })
    }

    fn sign(alg: Algorithm, kid: Option<&str>, private_pem: &str, claims: &Value) -> String {
        let key = match alg {
            Algorithm::EdDSA => EncodingKey::from_ed_pem(private_pem.as_bytes()),
            _ => EncodingKey::from_rsa_pem(private_pem.as_bytes()),
        }
        .expect("private key");
        let mut header = Header::new(alg);
        header.kid = kid.map(str::to_string);
        encode(&header, claims, &key).expect("sign")
    }

    fn remove(claims: &mut Value, name: &str) {
        if let Some(object) = claims.as_object_mut() {
            object.remove(name);
        }
    }

    fn ed(claims: &Value) -> String {
        sign(Algorithm::EdDSA, Some("ed-a"), ED_A, claims)
    }

    #[test]
    fn valid_eddsa_and_rs256() {
        let keys = trusted();
        let ok = keys.verify(&ed(&claims("alice"))).expect("EdDSA verifies");
        assert_eq!(ok.user, "alice");
        assert_eq!(ok.tenant_id.as_deref(), Some("t1"));
        let rs = sign(Algorithm::RS256, Some("rsa-a"), RSA_A, &claims("bob"));
        assert_eq!(keys.verify(&rs).expect("RS256 verifies").user, "bob");
        // No kid: every key of the token's algorithm is tried.
        let no_kid = sign(Algorithm::RS256, None, RSA_A, &claims("carol"));
        assert_eq!(keys.verify(&no_kid).expect("verifies").user, "carol");
        assert!(looks_like_jwt(&no_kid));
        assert!(!looks_like_jwt("an-api-key"));
    }

    #[test]
    fn keys_from_files_with_and_without_kid() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("ed.pem");
        std::fs::write(&path, ED_A_PUB).expect("write");
        let unnamed = load(&[path.display().to_string()]);
        // A key without a kid takes tokens whatever kid they name.
        assert!(unnamed.verify(&ed(&claims("u"))).is_ok());
        let named = load(&[format!("main={}", path.display())]);
        assert!(
            named.verify(&ed(&claims("u"))).is_err(),
            "kid ed-a is unknown"
        );
        let token = sign(Algorithm::EdDSA, Some("main"), ED_A, &claims("u"));
        assert!(named.verify(&token).is_ok());
    }

    #[test]
    fn bad_entries_are_start_up_errors() {
        let mut config = Config::for_tests("/tmp".into(), "jwt-test");
        config.access.jwt_public_keys = vec!["/no/such/key.pem".into()];
        assert!(JwtKeys::load(&config.access).is_err());
        // A private key is refused: the broker only ever needs the public half.
        config.access.jwt_public_keys = vec![ED_A.replace('\n', "\\n")];
        assert!(JwtKeys::load(&config.access).is_err());
        assert_eq!(split_kid("k=./a.pem"), (Some("k".into()), "./a.pem"));
        assert_eq!(split_kid("./a=b.pem"), (None, "./a=b.pem"));
        assert_eq!(split_kid(" /etc/k.pem "), (None, "/etc/k.pem"));
    }

    #[test]
    fn expired_and_not_yet_valid() {
        let keys = trusted();
        let mut c = claims("u");
        c["iat"] = json!(now() - 400);
        c["nbf"] = json!(now() - 400);
        c["exp"] = json!(now() - 120);
        let err = keys.verify(&ed(&c)).expect_err("expired");
        assert!(err.contains("Expired"), "{err}");

        let mut c = claims("u");
        c["nbf"] = json!(now() + 120);
        let err = keys.verify(&ed(&c)).expect_err("nbf in the future");
        assert!(err.contains("Immature"), "{err}");
    }

    #[test]
    fn wrong_audience_or_issuer() {
        let keys = trusted();
        let mut c = claims("u");
        c["aud"] = json!("someone-else");
        assert!(keys.verify(&ed(&c)).is_err());
        let mut c = claims("u");
        c["iss"] = json!("evil");
        assert!(keys.verify(&ed(&c)).is_err());
        let mut c = claims("u");
        remove(&mut c, "aud");
        assert!(keys.verify(&ed(&c)).is_err(), "aud is required");
        let mut c = claims("u");
        c["sub"] = json!("  ");
        assert!(keys.verify(&ed(&c)).is_err(), "sub must name a user");
    }

    #[test]
    fn configurable_issuer_and_audience() {
        let mut config = Config::for_tests("/tmp".into(), "jwt-test");
        config.access.jwt_public_keys = vec![ED_A_PUB.replace('\n', "\\n")];
        config.access.jwt_issuer = "me".into();
        config.access.jwt_audience = "broker".into();
        let keys = JwtKeys::load(&config.access).expect("keys");
        assert!(keys.verify(&ed(&claims("u"))).is_err());
        let mut c = claims("u");
        c["iss"] = json!("me");
        c["aud"] = json!("broker");
        assert!(keys.verify(&ed(&c)).is_ok());
    }

    #[test]
    fn signed_by_another_key() {
        let keys = trusted();
        // Key B claiming to be key A.
        let forged = sign(Algorithm::EdDSA, Some("ed-a"), ED_B, &claims("u"));
        assert!(keys.verify(&forged).is_err());
        let forged = sign(Algorithm::EdDSA, None, ED_B, &claims("u"));
        assert!(keys.verify(&forged).is_err());
        // Trusting B as well makes its tokens good.
        let both = load(&[
            format!("ed-a={}", ED_A_PUB.replace('\n', "\\n")),
            format!("ed-b={}", ED_B_PUB.replace('\n', "\\n")),
        ]);
        let token = sign(Algorithm::EdDSA, Some("ed-b"), ED_B, &claims("u"));
        assert!(both.verify(&token).is_ok());
    }

    #[test]
    fn alg_none_and_other_algs_are_refused() {
        let keys = trusted();
        let good = ed(&claims("u"));
        let payload = good.split('.').nth(1).expect("payload");
        // {"alg":"none","typ":"JWT"} and {"alg":"none","kid":"ed-a"}
        for header in [
            "eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0",
            "eyJhbGciOiJub25lIiwia2lkIjoiZWQtYSJ9",
        ] {
            assert!(keys.verify(&format!("{header}.{payload}.")).is_err());
        }
        // HS256 keyed with the public key's text: the classic algorithm confusion.
        let mut header = Header::new(Algorithm::HS256);
        header.kid = Some("ed-a".into());
        let hs = encode(
            &header,
            &claims("u"),
            &EncodingKey::from_secret(ED_A_PUB.as_bytes()),
        )
        .expect("sign");
        let err = keys.verify(&hs).expect_err("HS256");
        assert!(err.contains("not configured"), "{err}");
        // RS256 under the Ed25519 key's kid.
        let rs = sign(Algorithm::RS256, Some("ed-a"), RSA_A, &claims("u"));
        assert!(keys.verify(&rs).is_err());
    }

    #[test]
    fn lifetime_over_300_seconds() {
        let keys = trusted();
        let now = now();
        let mut c = claims("u");
        c["exp"] = json!(now + 301);
        let err = keys.verify(&ed(&c)).expect_err("exp - iat > 300");
        assert!(err.contains("lifetime"), "{err}");
        // Issued long ago, still inside exp: the lifetime counts, not what is left.
        let mut c = claims("u");
        c["iat"] = json!(now - 3600);
        c["exp"] = json!(now + 60);
        assert!(keys.verify(&ed(&c)).is_err());
        // No iat: exp - now is the bound.
        let mut c = claims("u");
        remove(&mut c, "iat");
        c["exp"] = json!(now + 400);
        assert!(keys.verify(&ed(&c)).is_err());
        c["exp"] = json!(now + 200);
        assert!(keys.verify(&ed(&c)).is_ok());
        // Exactly 300 s is fine.
        let mut c = claims("u");
        c["iat"] = json!(now);
        c["exp"] = json!(now + 300);
        assert!(keys.verify(&ed(&c)).is_ok());
    }

    #[test]
    fn never_accepted_more_than_300_seconds_after_issue() {
        let keys = trusted();
        let now = now();
        // Within the leeway of `exp`, but issued 320 s ago.
        let mut c = claims("u");
        c["iat"] = json!(now - 320);
        c["nbf"] = json!(now - 320);
        c["exp"] = json!(now - 20);
        let err = keys.verify(&ed(&c)).expect_err("issued 320 s ago");
        assert!(err.contains("ago"), "{err}");
        // Issued 280 s ago: fine.
        c["iat"] = json!(now - 280);
        c["nbf"] = json!(now - 280);
        c["exp"] = json!(now + 20);
        assert!(keys.verify(&ed(&c)).is_ok());
        // Issued in the future beyond the clock skew.
        c["iat"] = json!(now + 60);
        c["nbf"] = json!(now);
        c["exp"] = json!(now + 120);
        assert!(keys.verify(&ed(&c)).is_err());
        // Without iat: at most 270 s to exp, so exp + leeway stays within 300 s.
        let mut c = claims("u");
        remove(&mut c, "iat");
        c["exp"] = json!(now + 280);
        assert!(keys.verify(&ed(&c)).is_err());
        c["exp"] = json!(now + 260);
        assert!(keys.verify(&ed(&c)).is_ok());
    }

    #[test]
    fn an_exp_near_the_end_of_time_is_refused() {
        let keys = trusted();
        for exp in [u64::MAX, u64::MAX - LEEWAY_SECS + 1, u64::MAX - 1] {
            let mut c = claims("u");
            remove(&mut c, "iat");
            c["exp"] = json!(exp);
            let err = keys
                .verify(&ed(&c))
                .expect_err("exp near u64::MAX without iat");
            assert!(err.contains("without iat"), "{exp}: {err}");
        }
        // With an `iat` the lifetime rule refuses it.
        let mut c = claims("u");
        c["exp"] = json!(u64::MAX);
        let err = keys.verify(&ed(&c)).expect_err("exp near u64::MAX");
        assert!(err.contains("lifetime"), "{err}");
        // An `iat` near the end of time is in the future.
        let mut c = claims("u");
        c["iat"] = json!(u64::MAX - 10);
        c["exp"] = json!(u64::MAX);
        assert!(keys.verify(&ed(&c)).is_err());
    }

    #[test]
    fn unknown_kid() {
        let keys = trusted();
        let token = sign(Algorithm::EdDSA, Some("nobody"), ED_A, &claims("u"));
        let err = keys.verify(&token).expect_err("unknown kid");
        assert!(err.contains("unknown kid"), "{err}");
        assert!(
            JwtKeys::default().verify(&token).is_err(),
            "no keys, no JWTs"
        );
    }

    #[test]
    fn tenant_ids_are_optional_and_bounded() {
        let keys = trusted();
        let mut c = claims("u");
        remove(&mut c, "tenant_id");
        assert_eq!(keys.verify(&ed(&c)).expect("no tenant").tenant_id, None);
        c["tenant_id"] = json!("t".repeat(256));
        assert!(keys.verify(&ed(&c)).is_ok());
        c["tenant_id"] = json!("t".repeat(257));
        let err = keys.verify(&ed(&c)).expect_err("too long");
        assert!(err.contains("tenant_id"), "{err}");
    }

    /// A key bound to tenants verifies tokens for those only; an unbound key, for any.
    #[test]
    fn a_key_bound_to_tenants_signs_for_those_only() {
        let mut config = Config::for_tests("/tmp".into(), "jwt-test");
        config.access.jwt_public_keys = vec![
            format!("ed-a={}", ED_A_PUB.replace('\n', "\\n")),
            format!("ed-b={}", ED_B_PUB.replace('\n', "\\n")),
        ];
        config.access.jwt_key_tenants = vec!["ed-a=t1|legacy".into()];
        let keys = JwtKeys::load(&config.access).expect("keys load");
        let for_tenant = |kid: &str, private: &str, tenant: Option<&str>| {
            let mut c = claims("alice");
            match tenant {
                Some(t) => c["tenant_id"] = json!(t),
                None => remove(&mut c, "tenant_id"),
            }
            keys.verify(&sign(Algorithm::EdDSA, Some(kid), private, &c))
                .expect("verifies")
                .tenant_allowed
        };
        assert!(for_tenant("ed-a", ED_A, Some("t1")));
        assert!(for_tenant("ed-a", ED_A, Some(" t1 ")));
        assert!(for_tenant("ed-a", ED_A, None), "no claim: legacy");
        assert!(!for_tenant("ed-a", ED_A, Some("t2")));
        assert!(!for_tenant("ed-a", ED_A, Some("T1")));
        assert!(for_tenant("ed-b", ED_B, Some("t2")), "unbound: any tenant");

        // A binding that names no key, or no tenant, stops the start.
        config.access.jwt_key_tenants = vec!["nokey=t1".into()];
        assert!(JwtKeys::load(&config.access).is_err());
        config.access.jwt_key_tenants = vec!["ed-a=".into()];
        assert!(config.validate().is_err());
    }
}
