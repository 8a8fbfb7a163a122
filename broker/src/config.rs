//! Every setting of the broker: one struct, read from flags and `CODEBROKER_*` variables.
//! The doc comments are the `--help` text.

use clap::Parser;
use std::net::SocketAddr;
use std::path::PathBuf;

/// codebroker: a self-hosted code interpreter for chat assistants.
#[derive(Debug, Clone, Parser)]
#[command(name = "codebroker", version, about)]
pub struct Config {
    /// Address to listen on.
    #[arg(long, env = "CODEBROKER_LISTEN", default_value = "127.0.0.1:8000")]
    pub listen: SocketAddr,

    /// API key(s) clients must send (`X-API-Key`, `Authorization: Bearer`), comma-separated.
    #[arg(
        long,
        env = "CODEBROKER_API_KEY",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub api_key: Vec<String>,

    /// Authentication mode: `key` (the default; refuses to start without a key) or `none`
    /// (anyone who can reach the port may run code).
    #[arg(long, env = "CODEBROKER_AUTH", default_value = "key")]
    pub auth: AuthMode,

    /// Directory holding every session's workspace and file index. Bind mounts name it on
    /// the host, so when the broker runs in a container it must have the same path inside
    /// and outside.
    #[arg(long, env = "CODEBROKER_DATA_DIR", default_value = "./data")]
    pub data_dir: PathBuf,

    /// The sandbox image every session's container starts from.
    #[arg(
        long,
        env = "CODEBROKER_IMAGE",
        default_value = "codebroker-sandbox:latest"
    )]
    pub image: String,

    /// Name of this broker; containers carry it as a label so that a restarted broker
    /// finds its own and leaves other brokers' alone.
    #[arg(long, env = "CODEBROKER_INSTANCE", default_value = "codebroker")]
    pub instance: String,

    /// Wall-time limit of an exec when the request names none, in milliseconds.
    #[arg(long, env = "CODEBROKER_EXEC_TIMEOUT_MS", default_value_t = 30_000)]
    pub exec_timeout_ms: u64,

    /// Upper bound on the wall-time limit a request may ask for, in milliseconds.
    #[arg(long, env = "CODEBROKER_MAX_EXEC_TIMEOUT_MS", default_value_t = 30_000)]
    pub max_exec_timeout_ms: u64,

    /// Upper bound on the wall-time limit of a programmatic run (code that calls tools,
    /// waiting for the client's results included), in milliseconds.
    #[arg(
        long,
        env = "CODEBROKER_MAX_PROGRAMMATIC_TIMEOUT_MS",
        default_value_t = 300_000
    )]
    pub max_programmatic_timeout_ms: u64,

    /// Seconds a continuation token of a programmatic run stays valid; a run whose client
    /// does not come back in time is stopped.
    #[arg(long, env = "CODEBROKER_CONTINUATION_TTL_SECS", default_value_t = 300)]
    pub continuation_ttl_secs: u64,

    /// Cap on each of stdout and stderr of one exec, in bytes; the rest is dropped.
    #[arg(long, env = "CODEBROKER_MAX_OUTPUT_BYTES", default_value_t = 64 * 1024)]
    pub max_output_bytes: u64,

    /// Memory limit of a sandbox, in MiB (swap is not allowed on top of it).
    #[arg(long, env = "CODEBROKER_MEMORY_MB", default_value_t = 1024)]
    pub memory_mb: u64,

    /// CPUs a sandbox may use (fractions allowed).
    #[arg(long, env = "CODEBROKER_CPUS", default_value_t = 1.0)]
    pub cpus: f64,

    /// Maximum number of processes and threads in a sandbox.
    #[arg(long, env = "CODEBROKER_PIDS_LIMIT", default_value_t = 256)]
    pub pids_limit: i64,

    /// Size of the sandbox's `/tmp` tmpfs, in MiB (compilers work there).
    #[arg(long, env = "CODEBROKER_TMP_MB", default_value_t = 512)]
    pub tmp_mb: u64,

    /// Size of the sandbox's `/dev/shm` tmpfs, in MiB.
    #[arg(long, env = "CODEBROKER_SHM_MB", default_value_t = 64)]
    pub shm_mb: u64,

    /// Open files per process in a sandbox (`nofile` ulimit).
    #[arg(long, env = "CODEBROKER_NOFILE", default_value_t = 1024)]
    pub nofile: i64,

    /// Largest file a sandbox process may write, in MiB (`fsize` ulimit).
    #[arg(long, env = "CODEBROKER_FSIZE_MB", default_value_t = 1024)]
    pub fsize_mb: i64,

    /// Most a session's workspace (`/mnt/data`) may hold, in allocated bytes: `1073741824`,
    /// or with a unit (`64MiB`, `1GiB`, `500M`). The sandbox's runner watches it during each
    /// exec and stops an exec that grows it past the quota (`Disk quota exceeded`); no
    /// single file may be larger (`fsize` ulimit). 0: no quota.
    #[arg(long, env = "CODEBROKER_WORKSPACE_QUOTA", default_value = "1GiB", value_parser = parse_size)]
    pub workspace_quota: u64,

    /// Most files and directories a session's workspace may hold, watched like the quota.
    /// 0: no cap.
    #[arg(
        long,
        env = "CODEBROKER_WORKSPACE_MAX_FILES",
        default_value_t = 100_000
    )]
    pub workspace_max_files: u64,

    /// Free space the data directory's volume must have for a new session to start, as for
    /// the quota (`1GiB`); below it new sessions get 503, existing ones keep running.
    /// 0: never refuse.
    #[arg(long, env = "CODEBROKER_MIN_FREE_DISK", default_value = "1GiB", value_parser = parse_size)]
    pub min_free_disk: u64,

    /// Uid and gid the sandboxed code runs as; workspaces are owned by it.
    #[arg(long, env = "CODEBROKER_SANDBOX_UID", default_value_t = 10001)]
    pub sandbox_uid: u32,

    /// Give sandboxes no network at all (`NetworkMode=none`). Turn off only for trusted use.
    #[arg(long, env = "CODEBROKER_NETWORK_NONE", default_value_t = true, action = clap::ArgAction::Set)]
    pub network_none: bool,

    /// Mount the sandbox's root filesystem read-only.
    #[arg(long, env = "CODEBROKER_READONLY_ROOTFS", default_value_t = true, action = clap::ArgAction::Set)]
    pub readonly_rootfs: bool,

    /// Drop every Linux capability and forbid gaining privileges in sandboxes.
    #[arg(long, env = "CODEBROKER_DROP_CAPABILITIES", default_value_t = true, action = clap::ArgAction::Set)]
    pub drop_capabilities: bool,

    /// OCI runtime of the sandbox containers (`HostConfig.Runtime`), e.g. `runsc` (gVisor) or
    /// `kata-runtime`, registered with the Docker daemon first; empty: the daemon's default
    /// (runc). A user-space kernel is what stands between code and a host kernel bug.
    #[arg(long, env = "CODEBROKER_RUNTIME", default_value = "")]
    pub runtime: String,

    /// Seconds a session's container may sit idle before it is removed (its files stay).
    #[arg(long, env = "CODEBROKER_IDLE_TTL_SECS", default_value_t = 600)]
    pub idle_ttl_secs: u64,

    /// How often the reaper looks for idle containers, in seconds.
    #[arg(long, env = "CODEBROKER_REAP_INTERVAL_SECS", default_value_t = 10)]
    pub reap_interval_secs: u64,

    /// Started containers kept ready for new sessions (0 turns the pool off).
    #[arg(long, env = "CODEBROKER_POOL_SIZE", default_value_t = 2)]
    pub pool_size: usize,

    /// Started containers kept ready at most: after a burst of new sessions the pool grows
    /// to the burst's size, up to this, and shrinks back to CODEBROKER_POOL_SIZE five
    /// minutes after the last one (each ready container holds about 6 MiB). Set it to
    /// CODEBROKER_POOL_SIZE for a fixed pool.
    #[arg(long, env = "CODEBROKER_POOL_MAX", default_value_t = 16)]
    pub pool_max: usize,

    /// Pooled containers started at once while refilling, so a burst of new sessions does
    /// not stall the engine for the sessions already running.
    #[arg(long, env = "CODEBROKER_POOL_REFILL_CONCURRENCY", default_value_t = 2)]
    pub pool_refill_concurrency: usize,

    /// Session containers kept alive at once (0: no cap). Starting one more removes the
    /// least recently used idle one (its files stay; its next exec starts a new container).
    /// Unlike CODEBROKER_MAX_CONTAINERS this never refuses a request.
    #[arg(long, env = "CODEBROKER_MAX_LIVE_SANDBOXES", default_value_t = 64)]
    pub max_live_sandboxes: usize,

    /// Seconds a container whose session ran only one exec may sit idle (0: only the idle
    /// TTL applies). Clients that send no session id start a session per call, and most
    /// are never used again.
    #[arg(long, env = "CODEBROKER_SINGLE_USE_TTL_SECS", default_value_t = 30)]
    pub single_use_ttl_secs: u64,

    /// Seconds a file version is kept after it was written or uploaded; then its id answers
    /// 404 and its space is freed (LibreChat re-uploads after 23 hours).
    #[arg(long, env = "CODEBROKER_FILE_TTL_SECS", default_value_t = 86_400)]
    pub file_ttl_secs: u64,

    /// Largest uploaded file, in MiB (over it: 413).
    #[arg(long, env = "CODEBROKER_MAX_UPLOAD_MB", default_value_t = 100)]
    pub max_upload_mb: u64,

    /// Largest request body, in MiB.
    #[arg(long, env = "CODEBROKER_MAX_BODY_MB", default_value_t = 16)]
    pub max_body_mb: usize,

    /// Most files one exec reports as generated; the rest are named in stderr.
    #[arg(long, env = "CODEBROKER_MAX_OUTPUT_FILES", default_value_t = 50)]
    pub max_output_files: usize,

    /// Largest generated file reported, in MiB; larger ones are named in stderr.
    #[arg(long, env = "CODEBROKER_MAX_OUTPUT_FILE_MB", default_value_t = 10)]
    pub max_output_file_mb: u64,

    /// Seconds a stopping broker (SIGTERM, ctrl-c) lets running requests finish after it
    /// stops taking new ones; then it stops anyway.
    #[arg(long, env = "CODEBROKER_SHUTDOWN_GRACE", default_value_t = 30)]
    pub shutdown_grace: u64,

    /// What a stopping broker does with session containers: `keep` leaves them for the next
    /// start to re-attach to (Python state survives a restart or an upgrade), `remove`
    /// removes them (nothing keeps running unsupervised). Pooled containers are always
    /// removed.
    #[arg(
        long,
        env = "CODEBROKER_SHUTDOWN_CONTAINERS",
        default_value = "keep",
        value_enum
    )]
    pub shutdown_containers: ShutdownContainers,

    /// Public keys that verify LibreChat-minted JWTs (`Authorization: Bearer <JWT>`),
    /// comma-separated: each a PEM file path or an inline PEM (`\n` escapes allowed),
    /// optionally named by the tokens' `kid` header as `kid=path`. Ed25519 keys verify
    /// EdDSA tokens, RSA keys RS256. Empty: JWTs are not accepted.
    #[arg(long, env = "CODEBROKER_JWT_PUBLIC_KEYS", value_delimiter = ',')]
    pub jwt_public_keys: Vec<String>,

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

    /// Execs each user may start per minute (0: no limit). Callers that name no user share
    /// one budget. Over it: 429 with `retry_after_seconds`.
    #[arg(long, env = "CODEBROKER_RATE_EXECS_PER_MINUTE", default_value_t = 0)]
    pub rate_execs_per_minute: u32,

    /// Execs a user may start at once after a pause (0: as many as the per-minute rate).
    #[arg(long, env = "CODEBROKER_RATE_BURST", default_value_t = 0)]
    pub rate_burst: u32,

    /// Sessions with a running sandbox one user may have at once (0: no limit). Over it: 429
    /// until one of them has been idle for CODEBROKER_IDLE_TTL_SECS.
    #[arg(long, env = "CODEBROKER_MAX_SESSIONS_PER_USER", default_value_t = 0)]
    pub max_sessions_per_user: usize,

    /// Session sandboxes this broker runs at once, all users together (0: no limit; pooled
    /// ones waiting for a session are not counted). Over it: 429.
    #[arg(long, env = "CODEBROKER_MAX_CONTAINERS", default_value_t = 0)]
    pub max_containers: usize,

    /// The broker's URL as clients and browsers reach it, e.g. `https://code.example.com`:
    /// download links in MCP results and LobeChat answers, and the LobeChat manifest's API
    /// URL, start with it.
    #[arg(
        long,
        env = "CODEBROKER_PUBLIC_URL",
        default_value = "http://127.0.0.1:8000"
    )]
    pub public_url: String,

    /// `Host` header values `/mcp` accepts (`name` or `name:port`), comma-separated, against
    /// DNS rebinding; the host of CODEBROKER_PUBLIC_URL is always accepted, and `*` accepts
    /// any. Add the name clients use (a compose service name, a proxy's host).
    #[arg(
        long,
        env = "CODEBROKER_MCP_ALLOWED_HOSTS",
        value_delimiter = ',',
        default_value = "localhost,127.0.0.1,::1"
    )]
    pub mcp_allowed_hosts: Vec<String>,

    /// Offer code mode on `/mcp`: the tools `execute` (code that calls the functions below,
    /// served by the broker itself) and `search` (find those functions).
    #[arg(long, env = "CODEBROKER_CODEMODE", default_value_t = true, action = clap::ArgAction::Set)]
    pub codemode: bool,

    /// Code mode: hosts (`name` or `name:port`) `codemode.http.fetch` may reach,
    /// comma-separated; the broker makes the request. Empty: no HTTP at all.
    #[arg(long, env = "CODEBROKER_CODEMODE_HTTP_ALLOW", value_delimiter = ',')]
    pub codemode_http_allow: Vec<String>,

    /// Code mode: environment variables of the broker `codemode.env.get` may read,
    /// comma-separated.
    #[arg(long, env = "CODEBROKER_CODEMODE_ENV_ALLOW", value_delimiter = ',')]
    pub codemode_env_allow: Vec<String>,

    /// Code mode: upstream MCP servers whose tools the code calls as
    /// `codemode.<name>.<tool>`, comma-separated `name=http://host:port/mcp` (streamable
    /// HTTP) or `name=stdio:command args` (a child process).
    #[arg(long, env = "CODEBROKER_CODEMODE_MCP_SERVERS", value_delimiter = ',')]
    pub codemode_mcp_servers: Vec<String>,

    /// Code mode: largest HTTP body (request or response) `codemode.http.fetch` passes, in
    /// bytes.
    #[arg(long, env = "CODEBROKER_CODEMODE_HTTP_MAX_BYTES", default_value_t = 1024 * 1024)]
    pub codemode_http_max_bytes: u64,

    /// Code mode: how long one function call (an HTTP request, an upstream tool) may take,
    /// in milliseconds.
    #[arg(
        long,
        env = "CODEBROKER_CODEMODE_CALL_TIMEOUT_MS",
        default_value_t = 30_000
    )]
    pub codemode_call_timeout_ms: u64,

    /// Code mode: wall-time limit of one `execute`, calls included, in milliseconds.
    #[arg(long, env = "CODEBROKER_CODEMODE_TIMEOUT_MS", default_value_t = 60_000)]
    pub codemode_timeout_ms: u64,

    /// Log format: `text` or `json`.
    #[arg(long, env = "CODEBROKER_LOG_FORMAT", default_value = "text")]
    pub log_format: String,

    /// Append-only JSONL audit log (one record per session create, exec, upload, download,
    /// delete and expiry), so who ran what can be traced later; empty: off.
    #[arg(long, env = "CODEBROKER_AUDIT_LOG", default_value = "")]
    pub audit_log: String,

    /// Put the code itself in the audit log's exec records; off, only its SHA-256 is kept,
    /// which proves what ran without storing users' code.
    #[arg(long, env = "CODEBROKER_AUDIT_CODE", default_value_t = false, action = clap::ArgAction::Set)]
    pub audit_code: bool,
}

/// A size in bytes: a number, optionally followed by a unit (`k`, `M`, `G`, `T`, with or
/// without `iB`/`B`; all powers of 1024).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size such as 1073741824 or 1GiB"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        other => return Err(format!("unknown size unit {other:?} in {text:?}")),
    };
    number
        .checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// What happens to session containers when the broker stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ShutdownContainers {
    /// Leave them running; the next start re-attaches to them (or removes them when their
    /// session is gone).
    Keep,
    /// Remove them; their files stay in the data directory.
    Remove,
}

/// How callers prove who they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AuthMode {
    /// An API key is required.
    Key,
    /// No authentication at all: an explicit choice for a trusted network.
    None,
}

impl Config {
    /// Checks settings that clap cannot check on its own.
    pub fn validate(&self) -> Result<(), String> {
        if self.auth == AuthMode::Key
            && self.api_keys().next().is_none()
            && self.jwt_key_entries().next().is_none()
        {
            return Err(
                "no API key: set CODEBROKER_API_KEY (or CODEBROKER_JWT_PUBLIC_KEYS), or \
                 CODEBROKER_AUTH=none to run without authentication"
                    .into(),
            );
        }
        if self.exec_timeout_ms == 0 || self.max_exec_timeout_ms == 0 {
            return Err("exec timeouts must be above 0".into());
        }
        if self.cpus.is_nan() || self.cpus <= 0.0 {
            return Err("CODEBROKER_CPUS must be above 0".into());
        }
        if !(self.public_url.starts_with("http://") || self.public_url.starts_with("https://")) {
            return Err("CODEBROKER_PUBLIC_URL must start with http:// or https://".into());
        }
        Ok(())
    }

    /// The configured API keys, blanks dropped.
    pub fn api_keys(&self) -> impl Iterator<Item = &str> {
        self.api_key
            .iter()
            .map(|k| k.trim())
            .filter(|k| !k.is_empty())
    }

    /// The configured JWT public key entries, blanks dropped.
    pub fn jwt_key_entries(&self) -> impl Iterator<Item = &str> {
        self.jwt_public_keys
            .iter()
            .map(|k| k.trim())
            .filter(|k| !k.is_empty())
    }

    /// A configuration for tests: no auth, defaults elsewhere, data in `data_dir`.
    pub fn for_tests(data_dir: PathBuf, instance: &str) -> Config {
        let mut config = Config::parse_from(["codebroker"]);
        config.auth = AuthMode::None;
        config.data_dir = data_dir;
        config.instance = instance.to_string();
        config.listen = "127.0.0.1:0".parse().expect("literal address");
        // Tests on a loaded machine may take longer than the single-use TTL between two
        // execs of one session; the tests of that rule turn it on themselves.
        config.single_use_ttl_secs = 0;
        config
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_example_lists_every_setting() {
        use clap::CommandFactory;
        let example = include_str!("../../.env.example");
        for arg in Config::command().get_arguments() {
            if let Some(env) = arg.get_env() {
                let name = env.to_string_lossy();
                assert!(
                    example.contains(&format!("{name}=")),
                    ".env.example lacks {name}"
                );
            }
        }
    }

    #[test]
    fn sizes_take_units() {
        assert_eq!(parse_size("1073741824"), Ok(1 << 30));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size(" 512 kb "), Ok(512 << 10));
        assert_eq!(parse_size("0"), Ok(0));
        assert!(parse_size("1 parsec").is_err());
        assert!(parse_size("GiB").is_err());
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn refuses_to_start_without_key() {
        let config = Config::parse_from(["codebroker"]);
        assert!(config.validate().is_err());
        let config = Config::parse_from(["codebroker", "--api-key", "a, b"]);
        assert!(config.validate().is_ok());
        assert_eq!(config.api_keys().collect::<Vec<_>>(), ["a", "b"]);
        let config = Config::parse_from(["codebroker", "--auth", "none"]);
        assert!(config.validate().is_ok());
        // A JWT key alone is enough too.
        let config = Config::parse_from(["codebroker", "--jwt-public-keys", "k=/keys/lc.pem"]);
        assert!(config.validate().is_ok());
        assert_eq!(
            config.jwt_key_entries().collect::<Vec<_>>(),
            ["k=/keys/lc.pem"]
        );
    }
}
