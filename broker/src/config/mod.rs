//! Long: one doc comment per setting, and those comments are the `--help` text.
//!
//! Every setting of the broker: one struct with a flattened group per component, read from
//! flags and `CODEBROKER_*` variables. The doc comments are the `--help` text.

use clap::Parser;
use std::net::SocketAddr;
use std::path::PathBuf;

/// A setting clap accepted that the broker cannot run with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct InvalidConfig {
    /// The environment variable at fault (the flag is its lower-case form).
    pub setting: &'static str,
    /// Why, in words an operator acts on.
    pub reason: String,
}

impl InvalidConfig {
    pub(crate) fn new(setting: &'static str, reason: impl Into<String>) -> InvalidConfig {
        InvalidConfig {
            setting,
            reason: reason.into(),
        }
    }
}

/// How the broker writes its log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Lines for people.
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

mod access;
mod caps;
mod e2b;
mod egress;
mod exec;
mod jupyter;
mod sandbox;
mod units;

pub use access::*;
pub use caps::*;
pub use e2b::*;
pub use egress::*;
pub use exec::*;
pub use jupyter::*;
pub use sandbox::*;
pub(crate) use units::*;

/// codebroker: a self-hosted code interpreter for chat assistants.
#[derive(Debug, Clone, Parser)]
#[command(name = "codebroker", version, about)]
pub struct Config {
    /// Address to listen on.
    #[arg(long, env = "CODEBROKER_LISTEN", default_value = "127.0.0.1:8000")]
    pub listen: SocketAddr,

    /// Who may call the broker: API keys and JWTs.
    #[command(flatten)]
    pub access: AuthConfig,

    /// Directory holding every session's workspace and file index. Bind mounts name it on
    /// the host, so when the broker runs in a container it must have the same path inside
    /// and outside.
    #[arg(long, env = "CODEBROKER_DATA_DIR", default_value = "./data")]
    pub data_dir: PathBuf,

    /// The sandbox profile: image, resources, confinement, labels, file path.
    #[command(flatten)]
    pub sandbox: SandboxProfile,

    /// Where sandboxes run: `docker` (containers on the Docker engine beside the broker)
    /// or `kubernetes` (one pod per session through the Kubernetes API, settings
    /// CODEBROKER_K8S_*; files always move through the runner, as the broker cannot see
    /// a pod's disk).
    #[arg(long, env = "CODEBROKER_BACKEND", default_value = "docker", value_enum)]
    pub backend: BackendKind,

    /// The Kubernetes backend: namespace, runtime class, readiness bound, mode.
    #[command(flatten)]
    pub kubernetes: KubernetesConfig,

    /// What one exec may take: its time, its output, its displays and files.
    #[command(flatten)]
    pub exec_limits: ExecLimits,

    /// How long containers, files, continuations and a stopping broker wait.
    #[command(flatten)]
    pub lifecycle: Lifecycle,

    /// Seconds of silence after which `/exec/stream` sends a keep-alive (an SSE comment, or
    /// a `{"event":"heartbeat","data":null}` NDJSON line), and again after as many more, so
    /// that a proxy's idle timeout does not cut a long run that prints nothing. 15 stays
    /// under the 30 to 60 s such timeouts usually are; lower it behind a stricter proxy.
    #[arg(
        long,
        env = "CODEBROKER_STREAM_KEEPALIVE_SECS",
        default_value_t = 15,
        value_parser = clap::value_parser!(u64).range(1..=600)
    )]
    pub stream_keepalive_secs: u64,

    /// Caps on what callers may take of the host.
    #[command(flatten)]
    pub caps: Caps,

    /// The pool of ready containers.
    #[command(flatten)]
    pub pool: PoolConfig,

    /// Seconds a client has to send a request's headers (and, without a credential header,
    /// its body); an idle keep-alive connection is closed after the same time. A response
    /// under way (a long exec, a stream) is not cut by it.
    #[arg(
        long,
        env = "CODEBROKER_HEADER_READ_TIMEOUT_SECS",
        default_value_t = 20
    )]
    pub header_read_timeout_secs: u64,

    /// Seconds an answer may wait for the client to read any of it; then the connection is
    /// reset. A client that sends requests and never reads the answers would otherwise
    /// hold its connection forever. Only a blocked write counts: a long exec or a quiet
    /// stream, with nothing waiting to be sent, is never cut. Also the connections'
    /// TCP_USER_TIMEOUT: a peer that stopped acknowledging is dropped after as long.
    #[arg(
        long,
        env = "CODEBROKER_WRITE_TIMEOUT_SECS",
        default_value_t = 30,
        value_parser = clap::value_parser!(u64).range(1..=MAX_MILLIS / 1000)
    )]
    pub write_timeout_secs: u64,

    /// Python state across sandboxes: saved when a container goes, restored in the next.
    #[command(flatten)]
    pub state: StateConfig,

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
    /// any. Add the name clients use (a compose service name, a proxy's host). Under
    /// CODEBROKER_AUTH=none every route checks `Host` and a browser's `Origin` against it.
    #[arg(
        long,
        env = "CODEBROKER_MCP_ALLOWED_HOSTS",
        value_delimiter = ',',
        default_value = "localhost,127.0.0.1,::1"
    )]
    pub mcp_allowed_hosts: Vec<String>,

    /// Code mode: its functions and their limits.
    #[command(flatten)]
    pub code_mode: CodeModeConfig,

    /// Egress: the hosts sandboxes may reach through the broker's proxy, and its caps.
    #[command(flatten)]
    pub egress: EgressConfig,

    /// E2B's SDKs: whether `/e2b` is served, its templates, timeouts and domain.
    #[command(flatten)]
    pub e2b: E2bConfig,

    /// Jupyter's kernel protocol: whether `/jupyter` is served.
    #[command(flatten)]
    pub jupyter: JupyterConfig,

    /// Log format: `text` or `json`.
    #[arg(
        long,
        env = "CODEBROKER_LOG_FORMAT",
        default_value = "text",
        value_enum
    )]
    pub log_format: LogFormat,

    /// Append-only JSONL audit log (one record per session create, exec, upload, download,
    /// delete and expiry), so who ran what can be traced later; empty: off.
    #[arg(long, env = "CODEBROKER_AUDIT_LOG", default_value = "")]
    pub audit_log: String,

    /// Put the code itself in the audit log's exec records; off, only its SHA-256 is kept,
    /// which proves what ran without storing users' code.
    #[arg(long, env = "CODEBROKER_AUDIT_CODE", default_value_t = false, action = clap::ArgAction::Set)]
    pub audit_code: bool,
}

impl Config {
    /// Who owns the broker's copy of each workspace's files: the sandbox uid on Docker,
    /// whose containers mount that directory, and the broker itself on Kubernetes, where no
    /// sandbox sees it (files move through the runner) and the broker needs no capability
    /// to hand it over.
    pub(crate) fn workspace_uid(&self) -> u32 {
        self.sandbox_uids().resting()
    }

    /// Which uids the sandboxes of this broker's workspaces run as: on Kubernetes no
    /// sandbox sees the broker's copy, which stays the broker's own.
    pub(crate) fn sandbox_uids(&self) -> SandboxUids {
        match self.backend {
            BackendKind::Docker => self.sandbox.sandbox_uids(),
            BackendKind::Kubernetes => SandboxUids::Shared(crate::workspace::euid()),
        }
    }

    /// The longest an exec may hold its session's turn, in ms: a plain exec's longest
    /// timeout, or code mode's when it is on and longer.
    pub(crate) fn longest_exec_ms(&self) -> u64 {
        let mut longest = self.exec_limits.max_exec_timeout_ms;
        if self.code_mode.codemode {
            longest = longest.max(self.code_mode.codemode_timeout_ms);
        }
        longest
    }

    /// Connections one client address may hold: the setting, or half of all of them.
    pub(crate) fn connections_per_peer(&self) -> usize {
        match self.caps.max_connections_per_peer {
            0 => self.caps.max_connections.div_ceil(2).max(1),
            n => n.min(self.caps.max_connections.max(1)),
        }
    }

    /// Checks settings that clap cannot check on its own.
    pub(crate) fn validate(&self) -> Result<(), InvalidConfig> {
        self.access.validate_tenants()?;
        if self.access.auth == AuthMode::Key
            && self.access.api_keys().next().is_none()
            && self.access.tenant_keys().next().is_none()
            && self.access.jwt_key_entries().next().is_none()
        {
            return Err(InvalidConfig::new(
                "CODEBROKER_API_KEY",
                "no API key: set CODEBROKER_API_KEY (or CODEBROKER_JWT_PUBLIC_KEYS), or \
                 CODEBROKER_AUTH=none to run without authentication",
            ));
        }
        if self.exec_limits.exec_timeout_ms == 0 || self.exec_limits.max_exec_timeout_ms == 0 {
            return Err(InvalidConfig::new(
                "CODEBROKER_EXEC_TIMEOUT_MS",
                "exec timeouts must be above 0",
            ));
        }
        if self.sandbox.cpus.is_nan() || self.sandbox.cpus <= 0.0 {
            return Err(InvalidConfig::new(
                "CODEBROKER_CPUS",
                "CODEBROKER_CPUS must be above 0",
            ));
        }
        if !(self.public_url.starts_with("http://") || self.public_url.starts_with("https://")) {
            return Err(InvalidConfig::new(
                "CODEBROKER_PUBLIC_URL",
                "CODEBROKER_PUBLIC_URL must start with http:// or https://",
            ));
        }
        if self.backend == BackendKind::Kubernetes {
            self.validate_kubernetes()?;
        }
        self.validate_egress()?;
        self.validate_sandbox_uids()?;
        self.validate_codemode_mcp_uid()
    }

    /// The egress allowlist and pins parse, the registries are URLs, and the backend can
    /// carry the transport asked for.
    fn validate_egress(&self) -> Result<(), InvalidConfig> {
        let egress = &self.egress;
        crate::egress::policy::EgressPolicy::from_settings(&egress.egress, &egress.egress_resolve)
            .map_err(|reason| InvalidConfig::new("CODEBROKER_EGRESS", reason))?;
        for (setting, url) in [
            ("CODEBROKER_PIP_INDEX_URL", &egress.pip_index_url),
            ("CODEBROKER_NPM_REGISTRY", &egress.npm_registry),
        ] {
            let url = url.trim();
            if url.is_empty() {
                continue;
            }
            match reqwest::Url::parse(url) {
                Ok(u) if matches!(u.scheme(), "http" | "https") && u.host_str().is_some() => {}
                _ => {
                    return Err(InvalidConfig::new(
                        setting,
                        format!("{setting} must be an http:// or https:// URL, not {url:?}"),
                    ))
                }
            }
        }
        if egress.egress_transport == Some(EgressTransport::Socket)
            && self.backend == BackendKind::Kubernetes
        {
            return Err(InvalidConfig::new(
                "CODEBROKER_EGRESS_TRANSPORT",
                "CODEBROKER_EGRESS_TRANSPORT=socket needs CODEBROKER_BACKEND=docker: a pod \
                 cannot mount the broker's socket; use runner (or leave it empty)",
            ));
        }
        Ok(())
    }

    /// The egress transport in effect: the one set, else the backend's own.
    pub(crate) fn egress_transport(&self) -> EgressTransport {
        self.egress.egress_transport.unwrap_or(match self.backend {
            BackendKind::Docker => EgressTransport::Socket,
            BackendKind::Kubernetes => EgressTransport::Runner,
        })
    }

    /// A cap on live containers that the uid range could not serve would refuse sandboxes
    /// with "every uid in use" before the cap is reached: refused at start instead.
    fn validate_sandbox_uids(&self) -> Result<(), InvalidConfig> {
        if let (BackendKind::Docker, SandboxUids::Own(range), ContainerCap::Count(cap)) = (
            self.backend,
            self.sandbox.sandbox_uids(),
            &self.caps.max_containers,
        ) {
            let uids = (range.last - range.first) as usize;
            if *cap > uids {
                return Err(InvalidConfig::new(
                    "CODEBROKER_MAX_CONTAINERS",
                    format!(
                    "CODEBROKER_MAX_CONTAINERS ({cap}) is more than the {uids} sandbox uids of \
                     CODEBROKER_SANDBOX_UIDS ({range}); widen the range"
                ),
                ));
            }
        }
        Ok(())
    }

    /// Stdio upstream servers run as a uid of their own: never root, nor a uid a sandbox
    /// may run as (the code could then reach the upstream's processes and files).
    fn validate_codemode_mcp_uid(&self) -> Result<(), InvalidConfig> {
        let mcp_uid = self.code_mode.codemode_mcp_uid;
        let a_sandbox_uid = match self.sandbox.sandbox_uids() {
            SandboxUids::Shared(uid) => uid == mcp_uid,
            SandboxUids::Own(range) => range.contains(mcp_uid),
        };
        if mcp_uid == 0 || a_sandbox_uid || mcp_uid == self.sandbox.pod_uid() {
            return Err(InvalidConfig::new(
                "CODEBROKER_CODEMODE_MCP_UID",
                format!(
                    "CODEBROKER_CODEMODE_MCP_UID={mcp_uid}: stdio upstream servers must run \
                     as neither root nor a sandbox uid"
                ),
            ));
        }
        Ok(())
    }

    /// Checks the settings the Kubernetes backend needs: names it puts in labels must be
    /// label values, and what it cannot do is refused rather than ignored.
    fn validate_kubernetes(&self) -> Result<(), InvalidConfig> {
        if self.kubernetes.k8s_mode == KubernetesMode::AgentSandbox {
            let template = self.kubernetes.k8s_sandbox_template.trim();
            if !is_dns_subdomain(template) {
                return Err(InvalidConfig::new(
                    "CODEBROKER_K8S_SANDBOX_TEMPLATE",
                    format!(
                        "CODEBROKER_K8S_SANDBOX_TEMPLATE {template:?} is not a resource name \
                         (at most 253 of [a-z0-9-.], beginning and ending with a letter or \
                         digit)"
                    ),
                ));
            }
        }
        if !is_label_value(&self.sandbox.instance) {
            return Err(InvalidConfig::new(
                "CODEBROKER_INSTANCE",
                format!(
                    "CODEBROKER_INSTANCE {:?} is not a Kubernetes label value (at most 63 \
                     of [A-Za-z0-9-_.], beginning and ending with a letter or digit)",
                    self.sandbox.instance
                ),
            ));
        }
        if self.sandbox.pod_uid() == 0 {
            return Err(InvalidConfig::new(
                "CODEBROKER_SANDBOX_UID",
                "CODEBROKER_SANDBOX_UID must not be 0: sandbox pods run as non-root",
            ));
        }
        // Empty (a blank line in an env file): unset.
        if let Some(namespace) = self
            .kubernetes
            .k8s_namespace
            .as_ref()
            .filter(|n| !n.trim().is_empty())
        {
            if !is_dns_label(namespace) {
                return Err(InvalidConfig::new(
                    "CODEBROKER_K8S_NAMESPACE",
                    format!(
                        "CODEBROKER_K8S_NAMESPACE {namespace:?} is not a namespace name \
                         (at most 63 of [a-z0-9-], beginning and ending with a letter or \
                         digit)"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// A configuration for tests: no auth, defaults elsewhere, data in `data_dir`. Not in
    /// the release binary (feature `test-support`, which the suites turn on).
    #[cfg(any(test, feature = "test-support"))]
    pub fn for_tests(data_dir: PathBuf, instance: &str) -> Config {
        let mut config = Config::parse_from(["codebroker"]);
        config.access.auth = AuthMode::None;
        config.data_dir = data_dir;
        config.sandbox.instance = instance.to_string();
        config.listen = "127.0.0.1:0".parse().expect("literal address");
        // Tests on a loaded machine may take longer than the single-use TTL between two
        // execs of one session; the tests of that rule turn it on themselves.
        config.lifecycle.single_use_ttl_secs = 0;
        // Tests start many sessions and execs as one unnamed caller on purpose; the
        // shipped caps are tested on their own (tests/hostile_caps.rs).
        config.caps.rate_execs_per_minute = 0;
        config.caps.max_sessions_per_user = 0;
        config.caps.max_containers = ContainerCap::Count(0);
        config
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_example_lists_every_setting() {
        use clap::CommandFactory;
        let example = include_str!("../../../.env.example");
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
    fn the_user_share_is_a_percentage() {
        let parse = |v: &str| Config::try_parse_from(["codebroker", "--user-share-percent", v]);
        assert_eq!(parse("25").expect("valid").caps.user_share_percent, 25);
        assert_eq!(parse("100").expect("valid").caps.user_share_percent, 100);
        for bad in ["0", "101", "-1", "quarter"] {
            assert!(parse(bad).is_err(), "{bad}");
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
    fn a_fresh_install_caps_rate_sessions_and_containers() {
        let config = Config::try_parse_from(["codebroker"]).expect("defaults parse");
        assert_eq!(config.caps.rate_execs_per_minute, 120);
        assert_eq!(config.caps.max_sessions_per_user, 8);
        assert_eq!(config.caps.max_containers, ContainerCap::Auto);
        assert_eq!(config.sandbox.seccomp, SeccompChoice::Builtin);
        let gib = 1u64 << 30;
        // 24 GiB host, 1 GiB sandboxes: 18 may fill their memory in the host's 3/4.
        assert_eq!(ContainerCap::Auto.resolve(Some(24 * gib), 1024), 18);
        assert_eq!(ContainerCap::Auto.resolve(Some(24 * gib), 512), 36);
        // Small or unknown hosts still run two.
        assert_eq!(ContainerCap::Auto.resolve(Some(gib), 1024), 2);
        assert_eq!(ContainerCap::Auto.resolve(None, 1024), 2);
        assert_eq!(ContainerCap::Count(0).resolve(Some(24 * gib), 1024), 0);
        assert_eq!(ContainerCap::Count(5).resolve(None, 1024), 5);
        let parsed = Config::try_parse_from(["codebroker", "--max-containers", "7"]);
        assert_eq!(
            parsed.expect("a number").caps.max_containers,
            ContainerCap::Count(7)
        );
        let parsed = Config::try_parse_from(["codebroker", "--max-containers", "AUTO"]);
        assert_eq!(
            parsed.expect("auto").caps.max_containers,
            ContainerCap::Auto
        );
        assert!(Config::try_parse_from(["codebroker", "--max-containers", "lots"]).is_err());
    }

    #[test]
    fn preload_takes_module_names_and_refuses_anything_else() {
        let parse = |v: &str| {
            Config::try_parse_from(["codebroker", "--preload", v]).map(|c| c.pool.preload)
        };
        let defaults = Config::try_parse_from(["codebroker"]).expect("defaults parse");
        assert_eq!(
            defaults.pool.preload.names(),
            ["numpy", "pandas", "matplotlib.pyplot"]
        );
        assert!(parse("").expect("empty").names().is_empty());
        assert!(parse(" , ,").expect("blanks").names().is_empty());
        assert_eq!(
            parse(" numpy , scipy.stats,numpy,_private")
                .expect("names")
                .names(),
            ["numpy", "scipy.stats", "_private"]
        );
        for garbage in [
            "os; rm -rf /",
            "numpy pandas",
            "numpy,pan das",
            "os.system('x')",
            "a..b",
            ".relative",
            "trailing.",
            "1digit",
            "numpy\nimport os",
            "pändas",
            "$(id)",
        ] {
            let err = parse(garbage).expect_err(garbage).to_string();
            assert!(err.contains("not a Python module name"), "{garbage}: {err}");
        }
        let long = "a".repeat(MAX_PRELOAD_NAME + 1);
        assert!(parse(&long).is_err());
        assert!(parse(&"a".repeat(MAX_PRELOAD_NAME)).is_ok());
        let many: Vec<String> = (0..=MAX_PRELOAD_MODULES).map(|i| format!("m{i}")).collect();
        assert!(parse(&many.join(",")).is_err());
        assert!(parse(&many[..MAX_PRELOAD_MODULES].join(",")).is_ok());
    }

    #[test]
    fn seccomp_choices() {
        let parse = |v: &str| {
            Config::try_parse_from(["codebroker", "--seccomp", v]).map(|c| c.sandbox.seccomp)
        };
        assert_eq!(parse("daemon").expect("daemon"), SeccompChoice::Daemon);
        assert_eq!(parse("builtin").expect("builtin"), SeccompChoice::Builtin);
        assert_eq!(
            parse("/etc/codebroker/seccomp.json").expect("a path"),
            SeccompChoice::File("/etc/codebroker/seccomp.json".into())
        );
        assert!(parse(" ").is_err());
    }

    /// Sizes and timeouts are bounded where they are read, so that the byte counts and
    /// deadlines made from them cannot overflow (in release builds they would wrap).
    #[test]
    fn sizes_and_timeouts_are_bounded_at_parse() {
        let huge = u64::MAX.to_string();
        for flag in [
            "--memory-mb",
            "--max-upload-mb",
            "--max-body-mb",
            "--max-output-file-mb",
            "--exec-timeout-ms",
            "--max-exec-timeout-ms",
            "--max-programmatic-timeout-ms",
            "--codemode-timeout-ms",
            "--codemode-call-timeout-ms",
            "--continuation-ttl-secs",
            "--shutdown-grace",
        ] {
            let err = Config::try_parse_from(["codebroker", flag, &huge]);
            assert!(err.is_err(), "{flag} accepted u64::MAX");
        }
        // The largest accepted values convert without overflow.
        let config = Config::try_parse_from([
            "codebroker",
            "--memory-mb",
            &MAX_MEBIBYTES.to_string(),
            "--max-upload-mb",
            &MAX_MEBIBYTES.to_string(),
            "--max-body-mb",
            &MAX_BODY_MB.to_string(),
            "--max-output-file-mb",
            &MAX_MEBIBYTES.to_string(),
            "--max-exec-timeout-ms",
            &MAX_MILLIS.to_string(),
        ])
        .expect("the maxima parse");
        assert!(i64::try_from(config.sandbox.memory_mb * 1024 * 1024).is_ok());
        assert!(config.caps.max_upload_mb.checked_mul(1024 * 1024).is_some());
        assert!(config.caps.max_body_mb.checked_mul(1024 * 1024).is_some());
        assert!(config
            .exec_limits
            .max_output_file_mb
            .checked_mul(1024 * 1024)
            .is_some());
        let deadline = std::time::Duration::from_millis(config.exec_limits.max_exec_timeout_ms);
        assert!(tokio::time::Instant::now().checked_add(deadline).is_some());
        assert!(std::time::Instant::now().checked_add(deadline).is_some());
        // Below Docker's smallest memory limit, and a zero timeout, are refused too.
        assert!(Config::try_parse_from(["codebroker", "--memory-mb", "1"]).is_err());
        assert!(Config::try_parse_from(["codebroker", "--exec-timeout-ms", "0"]).is_err());
        assert!(Config::try_parse_from(["codebroker", "--max-body-mb", "0"]).is_err());
    }

    #[test]
    fn egress_settings_are_checked_at_start() {
        let check = |extra: &[&str]| {
            let mut args = vec!["codebroker", "--auth", "none"];
            args.extend_from_slice(extra);
            Config::try_parse_from(args).expect("parses").validate()
        };
        assert_eq!(check(&[]), Ok(()));
        assert_eq!(
            check(&["--egress", "pypi.org,files.pythonhosted.org,*.npmjs.org"]),
            Ok(())
        );
        let err = check(&["--egress", "*"]).expect_err("a bare star");
        assert_eq!(err.setting, "CODEBROKER_EGRESS", "{err}");
        let err = check(&[
            "--egress",
            "mirror.test",
            "--egress-resolve",
            "other.test=10.0.0.1",
        ])
        .expect_err("a pin no pattern covers");
        assert_eq!(err.setting, "CODEBROKER_EGRESS", "{err}");
        let err = check(&["--egress", "pypi.org", "--pip-index-url", "pypi.org/simple"])
            .expect_err("not a URL");
        assert_eq!(err.setting, "CODEBROKER_PIP_INDEX_URL", "{err}");
        let err = check(&["--npm-registry", "ftp://registry.test/"]).expect_err("not http");
        assert_eq!(err.setting, "CODEBROKER_NPM_REGISTRY", "{err}");
        // A pod cannot mount the socket: the runner channel carries its egress, and asking
        // for the socket there is refused at start, not ignored.
        let k8s = ["--backend", "kubernetes", "--egress", "pypi.org"];
        assert_eq!(check(&k8s), Ok(()));
        let err = check(&[&k8s[..], &["--egress-transport", "socket"]].concat())
            .expect_err("a socket on Kubernetes");
        assert_eq!(err.setting, "CODEBROKER_EGRESS_TRANSPORT", "{err}");
        assert_eq!(
            check(&[&k8s[..], &["--egress-transport", "runner"]].concat()),
            Ok(())
        );
        let parsed = |extra: &[&str]| {
            let mut args = vec!["codebroker"];
            args.extend_from_slice(extra);
            Config::try_parse_from(args)
                .expect("parses")
                .egress_transport()
        };
        assert_eq!(parsed(&[]), EgressTransport::Socket);
        assert_eq!(
            parsed(&["--backend", "kubernetes"]),
            EgressTransport::Runner
        );
        assert_eq!(
            parsed(&["--egress-transport", "runner"]),
            EgressTransport::Runner
        );
    }

    #[test]
    fn kubernetes_settings_are_checked_at_start() {
        let defaults = Config::try_parse_from(["codebroker"]).expect("defaults parse");
        assert_eq!(defaults.backend, BackendKind::Docker);
        assert_eq!(defaults.kubernetes.k8s_mode, KubernetesMode::Pods);
        assert_eq!(defaults.kubernetes.k8s_ready_timeout_secs, 120);
        assert_eq!(defaults.kubernetes.k8s_namespace, None);
        assert_eq!(defaults.kubernetes.k8s_runtime_class, "");
        let check = |extra: &[&str]| {
            let mut args = vec!["codebroker", "--auth", "none", "--backend", "kubernetes"];
            args.extend_from_slice(extra);
            Config::try_parse_from(args).expect("parses").validate()
        };
        assert_eq!(check(&[]), Ok(()));
        assert_eq!(check(&["--k8s-namespace", "sandboxes"]), Ok(()));
        assert_eq!(check(&["--k8s-namespace", ""]), Ok(()));
        assert_eq!(
            defaults.kubernetes.k8s_sandbox_template,
            "codebroker-sandbox"
        );
        assert_eq!(check(&["--k8s-mode", "agent-sandbox"]), Ok(()));
        let err = check(&[
            "--k8s-mode",
            "agent-sandbox",
            "--k8s-sandbox-template",
            "Codebroker_Sandbox",
        ])
        .expect_err("not a name");
        assert_eq!(err.setting, "CODEBROKER_K8S_SANDBOX_TEMPLATE", "{err}");
        // Only agent-sandbox mode reads it.
        assert_eq!(check(&["--k8s-sandbox-template", ""]), Ok(()));
        let err = check(&["--instance", "my broker"]).expect_err("not a label");
        assert_eq!(err.setting, "CODEBROKER_INSTANCE", "{err}");
        let err = check(&["--sandbox-uid", "0"]).expect_err("root");
        assert_eq!(err.setting, "CODEBROKER_SANDBOX_UID", "{err}");
        assert!(err.reason.contains("non-root"), "{err}");
        let err = check(&["--k8s-namespace", "Sandboxes"]).expect_err("not a name");
        assert_eq!(err.setting, "CODEBROKER_K8S_NAMESPACE", "{err}");
        // Docker never looks at them.
        let docker =
            Config::try_parse_from(["codebroker", "--auth", "none", "--instance", "my broker"]);
        assert_eq!(docker.expect("parses").validate(), Ok(()));
        assert!(Config::try_parse_from(["codebroker", "--k8s-ready-timeout-secs", "0"]).is_err());
        assert!(Config::try_parse_from(["codebroker", "--backend", "podman"]).is_err());
    }

    #[test]
    fn label_values_follow_kubernetes_rules() {
        for good in ["codebroker", "a", "a.b_c-d", "A1", &"x".repeat(63)] {
            assert!(is_label_value(good), "{good}");
        }
        for bad in ["", "-a", "a-", "_a", "a b", "a/b", "ä", &"x".repeat(64)] {
            assert!(!is_label_value(bad), "{bad}");
        }
    }

    #[test]
    fn refuses_to_start_without_key() {
        let config = Config::parse_from(["codebroker"]);
        assert!(config.validate().is_err());
        let config = Config::parse_from(["codebroker", "--api-key", "a, b"]);
        assert!(config.validate().is_ok());
        assert_eq!(config.access.api_keys().collect::<Vec<_>>(), ["a", "b"]);
        let config = Config::parse_from(["codebroker", "--auth", "none"]);
        assert!(config.validate().is_ok());
        // A JWT key alone is enough too.
        let config = Config::parse_from(["codebroker", "--jwt-public-keys", "k=/keys/lc.pem"]);
        assert!(config.validate().is_ok());
        assert_eq!(
            config.access.jwt_key_entries().collect::<Vec<_>>(),
            ["k=/keys/lc.pem"]
        );
    }

    #[test]
    fn workspaces_belong_to_the_sandbox_on_docker_and_to_the_broker_on_kubernetes() {
        let mut config = Config::for_tests("/data".into(), "t");
        // At rest, a workspace is the range's first uid, which no sandbox runs as.
        assert_eq!(
            config.sandbox.sandbox_uids(),
            SandboxUids::Own(UidRange {
                first: 200_000,
                last: 265_535
            })
        );
        assert_eq!(config.workspace_uid(), 200_000);
        config.sandbox.sandbox_uid = Some(10001);
        assert_eq!(config.sandbox.sandbox_uids(), SandboxUids::Shared(10001));
        assert_eq!(config.workspace_uid(), 10001);
        config.backend = BackendKind::Kubernetes;
        assert_eq!(config.workspace_uid(), crate::workspace::euid());
        assert_eq!(config.sandbox.pod_uid(), 10001);
        config.sandbox.sandbox_uid = None;
        assert_eq!(config.sandbox.pod_uid(), DEFAULT_POD_UID);
    }

    #[test]
    fn uid_ranges_leave_a_sandbox_uid_and_never_root() {
        let range: UidRange = "200000-265535".parse().expect("range");
        assert_eq!((range.first, range.last), (200_000, 265_535));
        assert!(range.contains(200_000) && range.contains(265_535));
        assert!(!range.contains(199_999) && !range.contains(265_536));
        assert_eq!(range.to_string(), "200000-265535");
        assert!("5-6".parse::<UidRange>().is_ok());
        for bad in [
            "",
            "200000",
            "0-10",
            "7-7",
            "9-8",
            "a-b",
            "1-4294967295",
            "-1-5",
        ] {
            assert!(bad.parse::<UidRange>().is_err(), "{bad:?}");
        }
        let config = Config::try_parse_from(["codebroker", "--sandbox-uids", "10-10"]);
        assert!(config.is_err());
        // A container cap the range cannot serve is refused; one it can, or a shared uid, is not.
        let mut config = Config::for_tests("/data".into(), "t");
        config.sandbox.sandbox_uids = "100-102".parse().expect("range");
        config.caps.max_containers = ContainerCap::Count(3);
        let err = config.validate().expect_err("too small a range");
        assert_eq!(err.setting, "CODEBROKER_MAX_CONTAINERS", "{err}");
        assert!(
            err.reason.contains("CODEBROKER_SANDBOX_UIDS (100-102)"),
            "{err}"
        );
        config.caps.max_containers = ContainerCap::Count(2);
        assert!(config.validate().is_ok());
        config.caps.max_containers = ContainerCap::Count(3);
        config.sandbox.sandbox_uid = Some(10001);
        assert!(config.validate().is_ok());
    }
}
