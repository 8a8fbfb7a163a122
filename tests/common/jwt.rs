//! JWTs as LibreChat mints them, signed with the test keys in `tests/keys/` (the broker
//! under test is given the matching public keys with `key_path`).

use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
use serde_json::{json, Value};
use std::time::{SystemTime, UNIX_EPOCH};

/// The Ed25519 key the test brokers trust as kid `lc-ed`.
pub const ED_A: &[u8] = include_bytes!("../keys/ed25519_a.pem");
/// An Ed25519 key no test broker trusts by default.
pub const ED_B: &[u8] = include_bytes!("../keys/ed25519_b.pem");
/// The RSA key the JWT suites trust as an RS256 kid.
pub const RSA_A: &[u8] = include_bytes!("../keys/rsa_a.pem");

/// The path of a file in `tests/keys/`, for the broker's `CODEBROKER_JWT_PUBLIC_KEYS`.
pub fn key_path(name: &str) -> String {
    format!("{}/../tests/keys/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// `lc-ed=<path of ed25519_a's public key>`, the JWT key setting most suites use.
pub fn lc_ed_public_key() -> String {
    format!("lc-ed={}", key_path("ed25519_a.pub.pem"))
}

/// Seconds since the epoch.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs()
}

/// A JWT with the given claims, signed by `key` as `alg`.
pub fn sign(alg: Algorithm, key: &EncodingKey, kid: Option<&str>, claims: &Value) -> String {
    let mut header = Header::new(alg);
    header.kid = kid.map(str::to_string);
    encode(&header, claims, key).expect("sign")
}

/// LibreChat's claims for `sub`, issued now and expiring in `exp_in` seconds.
pub fn claims(sub: &str, exp_in: i64, aud: &str, iss: &str) -> Value {
    claims_issued(sub, unix_now(), exp_in, aud, iss)
}

/// LibreChat's claims for `sub`, issued at `issued` (seconds since the epoch) and
/// expiring `exp_in` seconds after that.
pub fn claims_issued(sub: &str, issued: u64, exp_in: i64, aud: &str, iss: &str) -> Value {
    json!({ "iss": iss, "aud": aud, "sub": sub, "iat": issued, "nbf": issued,
            "exp": issued.saturating_add_signed(exp_in), "jti": codebroker::ids::new_id(),
            "tenant_id": "default" })
}

/// A token as LibreChat mints it (`librechat` for `codeapi`), signed with the private key
/// `private_pem` (Ed25519 or RSA, as `alg` says) under `kid`.
pub fn token(alg: Algorithm, kid: &str, private_pem: &[u8], sub: &str, exp_in: i64) -> String {
    let key = match alg {
        Algorithm::EdDSA => EncodingKey::from_ed_pem(private_pem),
        _ => EncodingKey::from_rsa_pem(private_pem),
    }
    .expect("private key");
    sign(
        alg,
        &key,
        Some(kid),
        &claims(sub, exp_in, "codeapi", "librechat"),
    )
}

/// A LibreChat token for `sub`, valid for 5 minutes, signed by `ed25519_a` as `lc-ed`.
pub fn jwt(sub: &str) -> String {
    token(Algorithm::EdDSA, "lc-ed", ED_A, sub, 300)
}
