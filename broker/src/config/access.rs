//! Who may call the broker (keys, JWTs, tenants) and what code mode may reach.

use super::*;

/// How callers prove who they are: API keys, JWTs, the mode.
#[derive(Debug, Clone, clap::Args)]
pub struct AuthConfig {
    /// API key(s) clients must send (`X-API-Key`, `Authorization: Bearer`, or HTTP Basic as
    /// the user name or the password), comma-separated. Each key is a tenant of its own:
    /// the skill and agent files uploaded with it are shared by its callers only.
    #[arg(
        long,
        env = "CODEBROKER_API_KEY",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub api_key: Vec<String>,

    /// API keys grouped into named tenants, comma-separated `tenant:key` (the tenant up to
    /// 64 letters, digits, `.`, `_` or `-`; the key everything after the first `:`). The
    /// callers of all keys of one tenant find one another's sessions and shared files, as
    /// callers of one key do; a key of CODEBROKER_API_KEY is a tenant of its own, and no
    /// tenant ever finds another's sessions.
    #[arg(
        long,
        env = "CODEBROKER_TENANT_API_KEYS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub tenant_api_keys: Vec<String>,

    /// Authentication mode: `key` (the default; refuses to start without a key) or `none`
    /// (anyone who can reach the port may run code).
    #[arg(long, env = "CODEBROKER_AUTH", default_value = "key")]
    pub auth: AuthMode,

    /// Public keys that verify LibreChat-minted JWTs (`Authorization: Bearer <JWT>`),
    /// comma-separated: each a PEM file path or an inline PEM (`\n` escapes allowed),
    /// optionally named by the tokens' `kid` header as `kid=path`. Ed25519 keys verify
    /// EdDSA tokens, RSA keys RS256. Empty: JWTs are not accepted.
    #[arg(long, env = "CODEBROKER_JWT_PUBLIC_KEYS", value_delimiter = ',')]
    pub jwt_public_keys: Vec<String>,

    /// The tenants a JWT key may sign for, comma-separated `kid=tenant|tenant`, naming keys
    /// of CODEBROKER_JWT_PUBLIC_KEYS by their `kid`. A token that key signed for another
    /// `tenant_id` (`legacy` when it has none) gets 403. A key not named here may sign for
    /// any tenant.
    #[arg(long, env = "CODEBROKER_JWT_KEY_TENANTS", value_delimiter = ',')]
    pub jwt_key_tenants: Vec<String>,

    /// The `iss` claim a JWT must carry (LibreChat's default).
    #[arg(long, env = "CODEBROKER_JWT_ISSUER", default_value = "librechat")]
    pub jwt_issuer: String,

    /// The `aud` claim a JWT must carry (LibreChat's default).
    #[arg(long, env = "CODEBROKER_JWT_AUDIENCE", default_value = "codeapi")]
    pub jwt_audience: String,

    /// Accept the API key in the `LIBRECHAT_CODE_API_KEY` field of a JSON body (LibreChat
    /// 0.8.5 sends it there instead of a header).
    #[arg(long, env = "CODEBROKER_BODY_API_KEY", default_value_t = true, action = clap::ArgAction::Set)]
    pub body_api_key: bool,
}

impl AuthConfig {
    /// The configured API keys, blanks dropped.
    pub(crate) fn api_keys(&self) -> impl Iterator<Item = &str> {
        self.api_key
            .iter()
            .map(|k| k.trim())
            .filter(|k| !k.is_empty())
    }

    /// The `tenant:key` entries of CODEBROKER_TENANT_API_KEYS as (tenant, key), blanks
    /// dropped; an entry without a `:` has an empty tenant (refused by `validate`).
    pub(crate) fn tenant_keys(&self) -> impl Iterator<Item = (&str, &str)> {
        self.tenant_api_keys
            .iter()
            .map(|k| k.trim())
            .filter(|k| !k.is_empty())
            .map(|k| {
                let (tenant, key) = k.split_once(':').unwrap_or(("", k));
                (tenant.trim(), key.trim())
            })
    }

    /// The `kid=tenant|tenant` entries of CODEBROKER_JWT_KEY_TENANTS, blanks dropped.
    pub(crate) fn jwt_tenant_entries(&self) -> impl Iterator<Item = (&str, Vec<&str>)> {
        self.jwt_key_tenants
            .iter()
            .map(|e| e.trim())
            .filter(|e| !e.is_empty())
            .map(|e| {
                let (kid, tenants) = e.split_once('=').unwrap_or((e, ""));
                let tenants = tenants
                    .split('|')
                    .map(str::trim)
                    .filter(|t| !t.is_empty())
                    .collect();
                (kid.trim(), tenants)
            })
    }

    /// Checks the tenant settings: names of tenants well formed, every key configured once.
    pub(crate) fn validate_tenants(&self) -> Result<(), InvalidConfig> {
        let mut seen = std::collections::HashSet::new();
        for key in self.api_keys() {
            if !seen.insert(key) {
                return Err(InvalidConfig::new(
                    "CODEBROKER_API_KEY",
                    "an API key is configured twice",
                ));
            }
        }
        for (tenant, key) in self.tenant_keys() {
            if !is_tenant_name(tenant) {
                return Err(InvalidConfig::new(
                    "CODEBROKER_TENANT_API_KEYS",
                    "CODEBROKER_TENANT_API_KEYS: each entry is `tenant:key`, the tenant up to \
                     64 letters, digits, `.`, `_` or `-`",
                ));
            }
            if key.is_empty() {
                return Err(InvalidConfig::new(
                    "CODEBROKER_TENANT_API_KEYS",
                    format!("CODEBROKER_TENANT_API_KEYS: tenant {tenant} has an empty key"),
                ));
            }
            if !seen.insert(key) {
                return Err(InvalidConfig::new(
                    "CODEBROKER_TENANT_API_KEYS",
                    "an API key is configured twice (in CODEBROKER_API_KEY or \
                     CODEBROKER_TENANT_API_KEYS)",
                ));
            }
        }
        for (kid, tenants) in self.jwt_tenant_entries() {
            if kid.is_empty() || tenants.is_empty() {
                return Err(InvalidConfig::new(
                    "CODEBROKER_JWT_KEY_TENANTS",
                    format!(
                        "CODEBROKER_JWT_KEY_TENANTS: each entry is `kid=tenant|tenant`, not \
                         {kid:?}"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The configured JWT public key entries, blanks dropped.
    pub(crate) fn jwt_key_entries(&self) -> impl Iterator<Item = &str> {
        self.jwt_public_keys
            .iter()
            .map(|k| k.trim())
            .filter(|k| !k.is_empty())
    }
}

/// Code mode on `/mcp`: whether it is offered, what its functions may reach, its time
/// limits.
#[derive(Debug, Clone, clap::Args)]
pub struct CodeModeConfig {
    /// Offer code mode on `/mcp`: the tools `execute` (code that calls the functions below,
    /// served by the broker itself) and `search` (find those functions).
    #[arg(long, env = "CODEBROKER_CODEMODE", default_value_t = true, action = clap::ArgAction::Set)]
    pub codemode: bool,

    /// Code mode: hosts (`name` or `name:port`) `codemode.http.fetch` may reach,
    /// comma-separated; the broker makes the request. A `name` without a port allows ports
    /// 80 and 443 only. Names that resolve to a loopback, private, link-local or other
    /// non-public address are refused unless that address is itself on the list (or
    /// `CODEBROKER_CODEMODE_HTTP_ALLOW_PRIVATE` is set). Empty: no HTTP at all.
    #[arg(long, env = "CODEBROKER_CODEMODE_HTTP_ALLOW", value_delimiter = ',')]
    pub codemode_http_allow: Vec<String>,

    /// Code mode: let names on `CODEBROKER_CODEMODE_HTTP_ALLOW` reach loopback, private,
    /// link-local and other non-public addresses (a service on the compose network). Off:
    /// a name that resolves (or re-binds) to one is refused, so an allowed name cannot
    /// lead the code to the host, the metadata service or the broker's network.
    #[arg(long, env = "CODEBROKER_CODEMODE_HTTP_ALLOW_PRIVATE", default_value_t = false, action = clap::ArgAction::Set)]
    pub codemode_http_allow_private: bool,

    /// Code mode: environment variables of the broker `codemode.env.get` may read,
    /// comma-separated.
    #[arg(long, env = "CODEBROKER_CODEMODE_ENV_ALLOW", value_delimiter = ',')]
    pub codemode_env_allow: Vec<String>,

    /// Code mode: upstream MCP servers whose tools the code calls as
    /// `codemode.<name>.<tool>`, comma-separated `name=http://host:port/mcp` (streamable
    /// HTTP) or `name=stdio:command args` (a child process).
    #[arg(long, env = "CODEBROKER_CODEMODE_MCP_SERVERS", value_delimiter = ',')]
    pub codemode_mcp_servers: Vec<String>,

    /// Code mode: variables of the broker's environment a `stdio:` upstream server gets
    /// besides `PATH`, `HOME`, `LANG`, `LC_ALL`, `TZ` and `TMPDIR`, comma-separated. The
    /// rest (API keys, JWT settings) is not passed: the code drives these servers.
    #[arg(long, env = "CODEBROKER_CODEMODE_MCP_ENV", value_delimiter = ',')]
    pub codemode_mcp_env: Vec<String>,

    /// Code mode: the uid (and gid) `stdio:` upstream servers run as, in no supplementary
    /// group and with no capabilities: not the broker's, which owns every session's data
    /// and may reach the Docker socket. The broker needs root or CAP_SETUID and
    /// CAP_SETGID to switch (the broker image gives it them); set this to the broker's
    /// own uid to run them as the broker instead. Their `HOME` is then a directory of
    /// their own, `$TMPDIR/codebroker-mcp-<uid>`. Neither 0 nor the sandbox uid.
    #[arg(long, env = "CODEBROKER_CODEMODE_MCP_UID", default_value_t = 10003)]
    pub codemode_mcp_uid: u32,

    /// Code mode: largest HTTP body (request or response) `codemode.http.fetch` passes, in
    /// bytes.
    #[arg(long, env = "CODEBROKER_CODEMODE_HTTP_MAX_BYTES", default_value_t = 1024 * 1024)]
    pub codemode_http_max_bytes: u64,

    /// Code mode: bytes of function results (HTTP bodies, upstream tool results) one
    /// `execute` may receive in all; a call past it fails with an error saying so. With at
    /// most 8 calls in flight per `execute`, this bounds what the code makes the broker
    /// hold and pass on.
    #[arg(
        long,
        env = "CODEBROKER_CODEMODE_MAX_RESULT_BYTES",
        default_value_t = 32 * 1024 * 1024,
        value_parser = clap::value_parser!(u64).range(1..=MAX_MEBIBYTES << 20)
    )]
    pub codemode_max_result_bytes: u64,

    /// Code mode: how long one function call (an HTTP request, an upstream tool) may take,
    /// in milliseconds.
    #[arg(
        long,
        env = "CODEBROKER_CODEMODE_CALL_TIMEOUT_MS",
        default_value_t = 30_000,
        value_parser = millis()
    )]
    pub codemode_call_timeout_ms: u64,

    /// Code mode: wall-time limit of one `execute`, calls included, in milliseconds.
    #[arg(long, env = "CODEBROKER_CODEMODE_TIMEOUT_MS", default_value_t = 60_000, value_parser = millis())]
    pub codemode_timeout_ms: u64,
}

/// Whether `text` may name a tenant of keys: 1 to 64 letters, digits, `.`, `_` or `-`.
pub(crate) fn is_tenant_name(text: &str) -> bool {
    (1..=64).contains(&text.len())
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// How callers prove who they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AuthMode {
    /// An API key is required.
    Key,
    /// No authentication at all: an explicit choice for a trusted network.
    None,
}
