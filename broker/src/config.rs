//! Long: one doc comment per setting, and those comments are the `--help` text.
//!
//! Every setting of the broker: one struct with a flattened group per component, read from
//! flags and `CODEBROKER_*` variables. The doc comments are the `--help` text.

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

    /// Wall-time limit of an exec when the request names none, in milliseconds.
    #[arg(long, env = "CODEBROKER_EXEC_TIMEOUT_MS", default_value_t = 30_000, value_parser = millis())]
    pub exec_timeout_ms: u64,

    /// Upper bound on the wall-time limit a request may ask for, in milliseconds.
    #[arg(long, env = "CODEBROKER_MAX_EXEC_TIMEOUT_MS", default_value_t = 30_000, value_parser = millis())]
    pub max_exec_timeout_ms: u64,

    /// Upper bound on the wall-time limit of a programmatic run (code that calls tools,
    /// waiting for the client's results included), in milliseconds.
    #[arg(
        long,
        env = "CODEBROKER_MAX_PROGRAMMATIC_TIMEOUT_MS",
        default_value_t = 300_000,
        value_parser = millis()
    )]
    pub max_programmatic_timeout_ms: u64,

    /// Seconds a continuation token of a programmatic run stays valid; a run whose client
    /// does not come back in time is stopped.
    #[arg(long, env = "CODEBROKER_CONTINUATION_TTL_SECS", default_value_t = 300, value_parser = secs())]
    pub continuation_ttl_secs: u64,

    /// Cap on each of stdout and stderr of one exec, in bytes; the rest is dropped.
    #[arg(long, env = "CODEBROKER_MAX_OUTPUT_BYTES", default_value_t = 64 * 1024)]
    pub max_output_bytes: u64,

    /// Display events (figures, rich values) one exec may send; the rest are dropped and
    /// the exec's stderr says so once.
    #[arg(long, env = "CODEBROKER_MAX_DISPLAY_EVENTS", default_value_t = 256)]
    pub max_display_events: u32,

    /// Bytes of display events one exec may send (`8MiB`, `1048576`), with the files
    /// `/exec/stream` inlines counted on their own against the same figure; the rest are
    /// dropped (a file is then named but not inlined).
    #[arg(long, env = "CODEBROKER_MAX_DISPLAY_BYTES", default_value = "8MiB", value_parser = parse_size)]
    pub max_display_bytes: u64,

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

    /// Seconds a session's container may sit idle before it is removed (its files stay).
    #[arg(long, env = "CODEBROKER_IDLE_TTL_SECS", default_value_t = 600)]
    pub idle_ttl_secs: u64,

    /// How often the reaper looks for idle containers, in seconds.
    #[arg(long, env = "CODEBROKER_REAP_INTERVAL_SECS", default_value_t = 10)]
    pub reap_interval_secs: u64,

    /// The pool of ready containers.
    #[command(flatten)]
    pub pool: PoolConfig,

    /// Seconds a container whose session ran only one exec may sit idle (0: only the idle
    /// TTL applies). Clients that send no session id start a session per call, and most
    /// are never used again.
    #[arg(long, env = "CODEBROKER_SINGLE_USE_TTL_SECS", default_value_t = 30)]
    pub single_use_ttl_secs: u64,

    /// Seconds a file version is kept after it was written or uploaded; then its id answers
    /// 404 and its space is freed (LibreChat re-uploads after 23 hours).
    #[arg(long, env = "CODEBROKER_FILE_TTL_SECS", default_value_t = 86_400)]
    pub file_ttl_secs: u64,

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

    /// Most files one exec reports as generated; the rest are named in stderr.
    #[arg(long, env = "CODEBROKER_MAX_OUTPUT_FILES", default_value_t = 50)]
    pub max_output_files: usize,

    /// Largest generated file reported, in MiB; larger ones are named in stderr.
    #[arg(long, env = "CODEBROKER_MAX_OUTPUT_FILE_MB", default_value_t = 10, value_parser = mebibytes(0))]
    pub max_output_file_mb: u64,

    /// Seconds a stopping broker (SIGTERM, ctrl-c) lets running requests finish after it
    /// stops taking new ones; then it stops anyway.
    #[arg(long, env = "CODEBROKER_SHUTDOWN_GRACE", default_value_t = 30, value_parser = secs())]
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
    pub(crate) shutdown_containers: ShutdownContainers,

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

/// What every sandbox container is: its image, its resources and its confinement, the
/// label that names its broker, and how files move in and out of it. The sandbox backend
/// takes this group.
#[derive(Debug, Clone, clap::Args)]
pub struct SandboxProfile {
    /// The sandbox image every session's container starts from.
    #[arg(
        long,
        env = "CODEBROKER_IMAGE",
        default_value = "codebroker-sandbox:latest"
    )]
    pub image: String,

    /// Memory limit of a sandbox, in MiB (swap is not allowed on top of it).
    #[arg(long, env = "CODEBROKER_MEMORY_MB", default_value_t = 1024, value_parser = mebibytes(6))]
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

    /// The uids sandboxes run as, `first-last`: each live sandbox runs as one of its own
    /// (its gid the same number), never two at once, so code that escapes one owns no
    /// other's processes or workspace and shares no per-uid kernel limit with them. The
    /// first is given to no sandbox: workspaces without a live sandbox are its. Far from
    /// real accounts by default; must not hold the broker's own uid, and must have a uid for
    /// each container CODEBROKER_MAX_CONTAINERS allows. Brokers sharing a Docker host need
    /// ranges that do not overlap: each only knows its own sandboxes. Docker only.
    #[arg(long, env = "CODEBROKER_SANDBOX_UIDS", default_value = "200000-265535")]
    pub sandbox_uids: UidRange,

    /// One uid (and gid) for every sandbox instead of CODEBROKER_SANDBOX_UIDS: sandboxes
    /// then share it, and code escaping one reaches the others. For a trial as your own
    /// user (`$(id -u)`), where read-only uploads are not protected either. On Kubernetes,
    /// the uid of every sandbox pod (unset: 10001).
    #[arg(long, env = "CODEBROKER_SANDBOX_UID")]
    pub sandbox_uid: Option<u32>,

    /// Give sandboxes no network at all (`NetworkMode=none`). Turn off only for trusted use.
    #[arg(long, env = "CODEBROKER_NETWORK_NONE", default_value_t = true, action = clap::ArgAction::Set)]
    pub network_none: bool,

    /// Mount the sandbox's root filesystem read-only.
    #[arg(long, env = "CODEBROKER_READONLY_ROOTFS", default_value_t = true, action = clap::ArgAction::Set)]
    pub readonly_rootfs: bool,

    /// Drop every Linux capability in sandboxes. Gaining privileges (setuid binaries,
    /// file capabilities) is forbidden either way (`no-new-privileges`).
    #[arg(long, env = "CODEBROKER_DROP_CAPABILITIES", default_value_t = true, action = clap::ArgAction::Set)]
    pub drop_capabilities: bool,

    /// The sandboxes' syscall filter: `builtin` (the broker's own profile: Docker's
    /// default less io_uring, ptrace, process_vm_*, sync and the TIOCSTI, TIOCSETD and
    /// TIOCLINUX ioctls; sockets of AF_UNIX, of AF_INET and AF_INET6 with TCP or UDP, and
    /// of AF_NETLINK with NETLINK_ROUTE only; see SECURITY.md), `daemon` (whatever the Docker daemon applies by
    /// default, which a daemon started with `seccomp=unconfined` turns off), or the path
    /// of a seccomp profile (JSON, Docker's format), read at start-up.
    #[arg(long, env = "CODEBROKER_SECCOMP", default_value = "builtin")]
    pub seccomp: SeccompChoice,

    /// OCI runtime of the sandbox containers (`HostConfig.Runtime`), e.g. `runsc` (gVisor) or
    /// `kata-runtime`, registered with the Docker daemon first; empty: the daemon's default
    /// (runc). A user-space kernel is what stands between code and a host kernel bug.
    #[arg(long, env = "CODEBROKER_RUNTIME", default_value = "")]
    pub runtime: String,

    /// Name of this broker; containers carry it as a label so that a restarted broker
    /// finds its own and leaves other brokers' alone.
    #[arg(long, env = "CODEBROKER_INSTANCE", default_value = "codebroker")]
    pub instance: String,

    /// How files move between the broker and a sandbox: `host` reads and writes the
    /// sandbox's mounted workspace directory on this host (symlink-safe, beneath-only),
    /// `runner` goes through the sandbox's runner over its channel and never touches that
    /// directory (the path of a backend whose sandboxes run on other machines). Under
    /// CODEBROKER_BACKEND=kubernetes always `runner`: the broker cannot see a pod's disk.
    #[arg(
        long,
        env = "CODEBROKER_FILE_TRANSFER",
        default_value = "host",
        value_enum
    )]
    pub file_transfer: FileTransfer,
}

/// Where sandboxes run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendKind {
    /// Containers on the Docker engine beside the broker.
    Docker,
    /// One pod per session through the Kubernetes API.
    Kubernetes,
}

impl BackendKind {
    /// The name `CODEBROKER_BACKEND` takes, as `/health` reports it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            BackendKind::Docker => "docker",
            BackendKind::Kubernetes => "kubernetes",
        }
    }
}

/// The Kubernetes backend (CODEBROKER_BACKEND=kubernetes): where its pods go and how long
/// one may take to start. The pods get the sandbox profile's image, limits and lockdown.
#[derive(Debug, Clone, clap::Args)]
pub struct KubernetesConfig {
    /// Namespace of the sandbox pods. Unset: the broker's own namespace when it runs in
    /// a pod (its service account's `namespace` file), else `codebroker`.
    #[arg(long, env = "CODEBROKER_K8S_NAMESPACE")]
    pub k8s_namespace: Option<String>,

    /// `runtimeClassName` of the sandbox pods, e.g. `gvisor` (a RuntimeClass the cluster
    /// defines); empty: the cluster's default runtime.
    #[arg(long, env = "CODEBROKER_K8S_RUNTIME_CLASS", default_value = "")]
    pub k8s_runtime_class: String,

    /// Seconds a new sandbox pod may take to be running and attached (scheduling and the
    /// image pull included); a pod that is not is deleted, and the request that waited
    /// for it gets 503 with the reason.
    #[arg(
        long,
        env = "CODEBROKER_K8S_READY_TIMEOUT_SECS",
        default_value_t = 120,
        value_parser = clap::value_parser!(u64).range(1..=3600)
    )]
    pub k8s_ready_timeout_secs: u64,

    /// How sandboxes are made on Kubernetes: `pods` (the broker creates one pod per
    /// session) or `agent-sandbox` (the broker creates a `SandboxClaim` per sandbox
    /// against CODEBROKER_K8S_SANDBOX_TEMPLATE and attaches to the pod the
    /// kubernetes-sigs/agent-sandbox controller binds it to, from a `SandboxWarmPool` when
    /// one is warm; targets agent-sandbox's v1alpha1 API, releases v0.1.x, installed with
    /// its extensions). In agent-sandbox mode the template says the pod (image, limits,
    /// lockdown, runtime class), not the CODEBROKER_* sandbox settings.
    #[arg(long, env = "CODEBROKER_K8S_MODE", default_value = "pods", value_enum)]
    pub k8s_mode: KubernetesMode,

    /// agent-sandbox mode: the `SandboxTemplate` (in the sandbox namespace) the broker's
    /// claims name; a claim not bound to a running pod within
    /// CODEBROKER_K8S_READY_TIMEOUT_SECS is deleted and reported.
    #[arg(
        long,
        env = "CODEBROKER_K8S_SANDBOX_TEMPLATE",
        default_value = "codebroker-sandbox"
    )]
    pub k8s_sandbox_template: String,
}

/// CODEBROKER_K8S_MODE: how the Kubernetes backend gets its sandboxes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KubernetesMode {
    /// One pod per session, created and deleted by the broker.
    Pods,
    /// `SandboxClaim`s against a `SandboxTemplate` of kubernetes-sigs/agent-sandbox.
    AgentSandbox,
}

/// Python state across sandboxes: what a session's kernel holds when its container is
/// removed, kept for the session's next container.
#[derive(Debug, Clone, clap::Args)]
pub struct StateConfig {
    /// Keep a session's Python variables when its container is removed while the kernel
    /// holds them (idle or single-use TTL, eviction under a cap, a stop with
    /// CODEBROKER_SHUTDOWN_CONTAINERS=remove): the kernel pickles its globals (cloudpickle;
    /// modules are imported again, open files, sockets, threads and generators are left
    /// out and named), the broker keeps the bytes in the session's data directory, and the
    /// session's next Python exec, in a new container, loads them first and reports
    /// `runtime_status: "reused"`. false: a new container starts with nothing.
    #[arg(long, env = "CODEBROKER_PERSIST_STATE", default_value_t = true, action = clap::ArgAction::Set)]
    pub persist_state: bool,

    /// Largest saved Python state of one session, as for the quota (`256MiB`): names whose
    /// pickles would go over it are left out, and the next exec's stderr names them. The
    /// file is pickled in the sandbox's `/tmp` (CODEBROKER_TMP_MB, charged to its memory),
    /// so keep it well under both. 0: nothing is kept (as CODEBROKER_PERSIST_STATE=false).
    #[arg(long, env = "CODEBROKER_STATE_MAX_BYTES", default_value = "256MiB", value_parser = parse_size)]
    pub state_max_bytes: u64,

    /// Seconds a save may take (pickling, half of it at most, and moving the bytes), and
    /// a restore: past it a save keeps nothing and the container goes anyway, a restore
    /// gives up and the exec runs in a fresh kernel; either is said in the next exec's
    /// stderr.
    #[arg(long, env = "CODEBROKER_STATE_TIMEOUT_SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub state_timeout_secs: u64,
}

impl StateConfig {
    /// Whether states are saved at all.
    pub(crate) fn enabled(&self) -> bool {
        self.persist_state && self.state_max_bytes > 0
    }
}

/// The pool of started containers kept ready for new sessions.
#[derive(Debug, Clone, clap::Args)]
pub struct PoolConfig {
    /// Started containers kept ready for new sessions (0 turns the pool off). Three: a
    /// pooled container is preloaded about 1.3 s after the take that asked for it, so at a
    /// chat's pace (two new sessions a second) the third new session after a quiet spell
    /// would otherwise find its container still importing.
    #[arg(long, env = "CODEBROKER_POOL_SIZE", default_value_t = 3)]
    pub pool_size: usize,

    /// Started containers kept ready at most: after a burst of new sessions the pool grows
    /// to the burst's size, up to this, and shrinks back to CODEBROKER_POOL_SIZE five
    /// minutes after the last one (each ready container holds about 6 MiB, about 66 MiB with
    /// the default CODEBROKER_PRELOAD, and while pooled kernels preload and the pool is taken
    /// from it keeps two more on the way). Set it to CODEBROKER_POOL_SIZE for a fixed pool.
    #[arg(long, env = "CODEBROKER_POOL_MAX", default_value_t = 16)]
    pub pool_max: usize,

    /// Pooled containers started at once while refilling, so a burst of new sessions does
    /// not stall the engine for the sessions already running.
    #[arg(long, env = "CODEBROKER_POOL_REFILL_CONCURRENCY", default_value_t = 2)]
    pub pool_refill_concurrency: usize,

    /// Python modules a pooled container's kernel imports in the background while it waits
    /// for its session, comma-separated (empty: none). Most first calls of a chat import
    /// pandas and plot; preloaded, that import is already done when the session takes the
    /// container. Costs memory per ready container (see docs/PERFORMANCE.md) and CPU per
    /// refill, taken at the lowest CPU weight, two pooled kernels at a time; the session's
    /// first exec stops a preload still under way, and a container started for a waiting
    /// request (not pooled) preloads nothing. A module that fails to import is logged and
    /// skipped.
    #[arg(
        long,
        env = "CODEBROKER_PRELOAD",
        default_value = "numpy,pandas,matplotlib.pyplot"
    )]
    pub preload: PreloadModules,
}

/// CODEBROKER_PRELOAD: dotted Python module names, checked at start so that anything but
/// names (`os; rm -rf /`) is refused before a kernel sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PreloadModules(Vec<String>);

/// Most modules CODEBROKER_PRELOAD may name: a data stack, not an installation. With
/// [`MAX_PRELOAD_NAME`] it keeps the runner's preload request to its kernel within one
/// atomic pipe write (4096 bytes).
pub(crate) const MAX_PRELOAD_MODULES: usize = 32;

/// Longest module name CODEBROKER_PRELOAD may hold.
pub(crate) const MAX_PRELOAD_NAME: usize = 100;

impl PreloadModules {
    /// The module names, in order, without duplicates.
    pub fn names(&self) -> &[String] {
        &self.0
    }
}

impl std::str::FromStr for PreloadModules {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let mut names: Vec<String> = Vec::new();
        for entry in text.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let is_identifier = |part: &str| {
                let mut chars = part.chars();
                chars
                    .next()
                    .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                    && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
            };
            if entry.len() > MAX_PRELOAD_NAME || !entry.split('.').all(is_identifier) {
                let shown: String = entry.chars().take(60).collect();
                return Err(format!(
                    "`{shown}` is not a Python module name: give dotted names separated by \
                     commas, e.g. `numpy,pandas,matplotlib.pyplot` (at most \
                     {MAX_PRELOAD_NAME} characters each), or nothing for no preload"
                ));
            }
            if !names.iter().any(|n| n == entry) {
                names.push(entry.to_string());
            }
        }
        if names.len() > MAX_PRELOAD_MODULES {
            return Err(format!(
                "{} modules: at most {MAX_PRELOAD_MODULES} may be preloaded",
                names.len()
            ));
        }
        Ok(PreloadModules(names))
    }
}

/// What one user, or every caller together, may take of the host: rates, sessions,
/// containers, storage, connections and request sizes.
#[derive(Debug, Clone, clap::Args)]
pub struct Caps {
    /// Free space the data directory's volume must have for a new session to start, as for
    /// the quota (`1GiB`); below it new sessions get 503, existing ones keep running.
    /// 0: never refuse.
    #[arg(long, env = "CODEBROKER_MIN_FREE_DISK", default_value = "1GiB", value_parser = parse_size)]
    pub min_free_disk: u64,

    /// Session containers kept alive at once (0: no cap). Starting one more removes the
    /// least recently used idle one (its files stay; its next exec starts a new container).
    /// Unlike CODEBROKER_MAX_CONTAINERS this never refuses a request.
    #[arg(long, env = "CODEBROKER_MAX_LIVE_SANDBOXES", default_value_t = 64)]
    pub max_live_sandboxes: usize,

    /// Most the broker keeps of one session's file versions (the copies that file ids
    /// download from, uploads included, and each copy of an upload or an input file the
    /// broker places in `/mnt/data`, which the workspace quota does not see), as for the
    /// quota (`256MiB`). An upload whose files together are over it is refused while it is
    /// read. A new version that
    /// would go over it first drops versions that are no longer current, oldest first
    /// (their ids then answer 404); if it still does not fit it is not kept, and the exec's
    /// stderr says so in one line. An upload that does not fit gets 413. The default keeps
    /// a session's directory on the broker's disk (workspace plus versions) well under half
    /// of a full workspace quota. 0: no budget.
    #[arg(long, env = "CODEBROKER_SESSION_STORAGE", default_value = "256MiB", value_parser = parse_size)]
    pub session_storage: u64,

    /// Most the broker keeps of file versions for one user, all their sessions together,
    /// counted like CODEBROKER_SESSION_STORAGE; a session's new versions drop only its own
    /// old ones. Sessions of callers that name no user have only the per-session budget.
    /// 0: no budget.
    #[arg(long, env = "CODEBROKER_USER_STORAGE", default_value = "1GiB", value_parser = parse_size)]
    pub user_storage: u64,

    /// Largest uploaded file, in MiB (over it: 413).
    #[arg(long, env = "CODEBROKER_MAX_UPLOAD_MB", default_value_t = 100, value_parser = mebibytes(1))]
    pub max_upload_mb: u64,

    /// An upload's body must bring at least 64 KiB every this many seconds, or it is cut
    /// with 408: a client that drips its body cannot hold a connection and a staged file
    /// for ever. 0: no such limit.
    #[arg(long, env = "CODEBROKER_UPLOAD_STALL_SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(0..=3600))]
    pub upload_stall_secs: u64,

    /// Largest request body, in MiB.
    #[arg(long, env = "CODEBROKER_MAX_BODY_MB", default_value_t = 16, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=MAX_BODY_MB))]
    pub max_body_mb: usize,

    /// HTTP connections open at once. Over it the broker stops accepting: further clients
    /// wait in the listen backlog, costing the broker nothing, until a connection closes.
    /// Streams (`/exec/stream`, `/mcp`) hold one each while open.
    #[arg(long, env = "CODEBROKER_MAX_CONNECTIONS", default_value_t = 512)]
    pub max_connections: usize,

    /// HTTP connections one client address may hold at once (0: half of
    /// CODEBROKER_MAX_CONNECTIONS), so one client cannot take them all. Over it a
    /// connection gets 503 and is closed. Behind a reverse proxy every client has the
    /// proxy's address: set it to CODEBROKER_MAX_CONNECTIONS there.
    #[arg(long, env = "CODEBROKER_MAX_CONNECTIONS_PER_PEER", default_value_t = 0)]
    pub max_connections_per_peer: usize,

    /// Request bytes the broker reads at once from callers that sent no credential header,
    /// looking for LibreChat 0.8.5's key in the JSON body (CODEBROKER_BODY_API_KEY), as for
    /// the quota (`32MiB`). Further such requests wait for room (up to
    /// CODEBROKER_HEADER_READ_TIMEOUT_SECS, then 503) without being read.
    #[arg(long, env = "CODEBROKER_PREAUTH_BODY_BUDGET", default_value = "32MiB", value_parser = parse_size)]
    pub preauth_body_budget: u64,

    /// MCP sessions open at once (0: no cap). Each is kept until its client closes it or
    /// it has been idle for an hour; over the cap, `initialize` gets 503.
    #[arg(long, env = "CODEBROKER_MAX_MCP_SESSIONS", default_value_t = 1024)]
    pub max_mcp_sessions: usize,

    /// Execs each user may start per minute, uploads that create a session included (0:
    /// no limit). Callers that name no user share one budget. Over it: 429 with
    /// `retry_after_seconds`. 120: a chat turn runs a few execs, each after a model
    /// round trip, so even an agent looping on code stays well under it, while a script
    /// flooding the broker is held to two a second.
    #[arg(long, env = "CODEBROKER_RATE_EXECS_PER_MINUTE", default_value_t = 120)]
    pub rate_execs_per_minute: u32,

    /// Execs a user may start at once after a pause (0: as many as the per-minute rate).
    #[arg(long, env = "CODEBROKER_RATE_BURST", default_value_t = 0)]
    pub rate_burst: u32,

    /// Sessions with a running sandbox one user may have at once (0: no limit); never
    /// more than CODEBROKER_USER_SHARE_PERCENT of CODEBROKER_MAX_CONTAINERS, so one user
    /// leaves room for others. A user is counted in their tenant; the callers of a tenant
    /// that name no user count as one. At the cap a new one takes the place of the user's least recently used idle one
    /// (its files stay); only when all of them are running code: 429 with
    /// `retry_after_seconds`. 8: more chats than one person keeps going, each keeping its
    /// Python state.
    #[arg(long, env = "CODEBROKER_MAX_SESSIONS_PER_USER", default_value_t = 8)]
    pub max_sessions_per_user: usize,

    /// The most of CODEBROKER_MAX_CONTAINERS one user may hold, in percent (at least one
    /// container). 25: it takes four users at their cap to fill the host, so two or three
    /// busy users leave room for everyone else, while on a host of eight sandboxes a user
    /// still keeps two chats with their Python state.
    #[arg(long, env = "CODEBROKER_USER_SHARE_PERCENT", default_value_t = 25, value_parser = clap::value_parser!(u8).range(1..=100))]
    pub user_share_percent: u8,

    /// Session sandboxes this broker runs at once, all users together: a number (0: no
    /// cap), or `auto`: by the memory the Docker host has now. With `auto` on the Docker
    /// host (the broker's /proc shows the engine's memory), a new sandbox is admitted while
    /// the host's available memory, less 256 MiB for each sandbox being started, stays
    /// above a quarter of the host and the host is not under memory pressure (PSI), up to
    /// a ceiling of three quarters of the host over 64 MiB (an idle sandbox); each
    /// sandbox keeps its own CODEBROKER_MEMORY_MB limit. Elsewhere (a remote engine)
    /// `auto` is three quarters of the host over CODEBROKER_MEMORY_MB (at least 2).
    /// Pooled sandboxes waiting for a session are not counted. At the cap, or short of
    /// memory, a new one takes the place of the least recently used idle one (its files
    /// stay); only when all are running code: 429 with `retry_after_seconds`.
    #[arg(long, env = "CODEBROKER_MAX_CONTAINERS", default_value = "auto")]
    pub max_containers: ContainerCap,

    /// The Docker host's proc directory, read by CODEBROKER_MAX_CONTAINERS=auto
    /// (`meminfo`, `pressure/memory`): the broker's own /proc, which in a container shows
    /// the host's memory; point it at a mount of the host's /proc where it does not (LXCFS).
    #[arg(long, env = "CODEBROKER_HOST_PROC", default_value = "/proc")]
    pub host_proc: PathBuf,
}

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
    fn validate_tenants(&self) -> Result<(), String> {
        let mut seen = std::collections::HashSet::new();
        for key in self.api_keys() {
            if !seen.insert(key) {
                return Err("an API key is configured twice".into());
            }
        }
        for (tenant, key) in self.tenant_keys() {
            if !is_tenant_name(tenant) {
                return Err(
                    "CODEBROKER_TENANT_API_KEYS: each entry is `tenant:key`, the tenant up to \
                     64 letters, digits, `.`, `_` or `-`"
                        .into(),
                );
            }
            if key.is_empty() {
                return Err(format!(
                    "CODEBROKER_TENANT_API_KEYS: tenant {tenant} has an empty key"
                ));
            }
            if !seen.insert(key) {
                return Err("an API key is configured twice (in CODEBROKER_API_KEY or \
                            CODEBROKER_TENANT_API_KEYS)"
                    .into());
            }
        }
        for (kid, tenants) in self.jwt_tenant_entries() {
            if kid.is_empty() || tenants.is_empty() {
                return Err(format!(
                    "CODEBROKER_JWT_KEY_TENANTS: each entry is `kid=tenant|tenant`, not {kid:?}"
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

/// Whether `text` may be a Kubernetes label value (empty aside): at most 63 characters of
/// `[A-Za-z0-9-_.]`, beginning and ending with a letter or digit.
pub(crate) fn is_label_value(text: &str) -> bool {
    let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    !text.is_empty()
        && text.len() <= 63
        && alnum(text.chars().next())
        && alnum(text.chars().last())
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// Whether `text` is a DNS label (RFC 1123), what namespace names are.
fn is_dns_label(text: &str) -> bool {
    let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    !text.is_empty()
        && text.len() <= 63
        && alnum(text.chars().next())
        && alnum(text.chars().last())
        && text
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
}

/// Whether `text` is a DNS subdomain (RFC 1123), what most resource names are: dot-separated
/// DNS labels, at most 253 characters in all.
fn is_dns_subdomain(text: &str) -> bool {
    text.len() <= 253 && text.split('.').all(is_dns_label)
}

/// The uid of every Kubernetes sandbox pod unless CODEBROKER_SANDBOX_UID names another:
/// the image's `sandbox` user.
pub(crate) const DEFAULT_POD_UID: u32 = 10001;

/// The highest uid a sandbox may be given: uids are 32-bit, but `(uid_t)-1` means "no
/// change" to the kernel and some programs take uids for signed numbers.
const MAX_SANDBOX_UID: u32 = i32::MAX as u32;

/// A range of uids, both ends included (CODEBROKER_SANDBOX_UIDS): the first is the
/// workspaces' at rest, the others are handed to sandboxes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UidRange {
    /// The lowest uid of the range: given to no sandbox, owner of idle workspaces.
    pub first: u32,
    /// The highest uid of the range.
    pub last: u32,
}

impl UidRange {
    /// Whether `uid` is in the range.
    pub(crate) fn contains(&self, uid: u32) -> bool {
        (self.first..=self.last).contains(&uid)
    }
}

impl std::fmt::Display for UidRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.first, self.last)
    }
}

impl std::str::FromStr for UidRange {
    type Err = String;

    /// `first-last`: 1 <= first < last <= 2^31 - 1, so that at least one uid is left for a
    /// sandbox besides the first.
    fn from_str(text: &str) -> Result<UidRange, String> {
        let bad = || format!("{text:?} is not a uid range such as 200000-265535");
        let (first, last) = text.trim().split_once('-').ok_or_else(bad)?;
        let first: u32 = first.trim().parse().map_err(|_| bad())?;
        let last: u32 = last.trim().parse().map_err(|_| bad())?;
        if first == 0 || first >= last || last > MAX_SANDBOX_UID {
            return Err(format!(
                "uid range {text:?}: needs 1 <= first < last <= {MAX_SANDBOX_UID} (root is never \
                 a sandbox's, and the first uid is given to none)"
            ));
        }
        Ok(UidRange { first, last })
    }
}

/// Which uids sandboxes run as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SandboxUids {
    /// One uid for every sandbox (CODEBROKER_SANDBOX_UID).
    Shared(u32),
    /// A uid of its own for each live sandbox, from this range (CODEBROKER_SANDBOX_UIDS).
    Own(UidRange),
}

impl SandboxUids {
    /// Who a workspace without a live sandbox is handed to: the shared uid, or the first
    /// of the range, which no sandbox runs as.
    pub(crate) fn resting(&self) -> u32 {
        match self {
            SandboxUids::Shared(uid) => *uid,
            SandboxUids::Own(range) => range.first,
        }
    }
}

impl SandboxProfile {
    /// Which uids Docker sandboxes run as: the one of CODEBROKER_SANDBOX_UID when it is
    /// set, else each its own from CODEBROKER_SANDBOX_UIDS.
    pub(crate) fn sandbox_uids(&self) -> SandboxUids {
        match self.sandbox_uid {
            Some(uid) => SandboxUids::Shared(uid),
            None => SandboxUids::Own(self.sandbox_uids),
        }
    }

    /// The uid of every Kubernetes sandbox pod.
    pub(crate) fn pod_uid(&self) -> u32 {
        self.sandbox_uid.unwrap_or(DEFAULT_POD_UID)
    }
}

/// A size in bytes: a number, optionally followed by a unit (`k`, `M`, `G`, `T`, with or
/// without `iB`/`B`; all powers of 1024).
pub(crate) fn parse_size(text: &str) -> Result<u64, String> {
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

/// Longest timeout any `*_MS` setting may hold: a day. Far above any real use, and far
/// enough below `u64::MAX` that no deadline arithmetic can overflow.
pub(crate) const MAX_MILLIS: u64 = 86_400_000;

/// Largest size any `*_MB` setting may hold: 1 TiB, so that converting it to bytes cannot
/// overflow (and no host has more).
pub(crate) const MAX_MEBIBYTES: u64 = 1 << 20;

/// Largest request body: bodies are buffered in memory, so 4 GiB is already absurd.
pub(crate) const MAX_BODY_MB: u64 = 4096;

/// A `*_MS` setting: 1 ms to [`MAX_MILLIS`].
fn millis() -> clap::builder::RangedU64ValueParser<u64> {
    clap::value_parser!(u64).range(1..=MAX_MILLIS)
}

/// A `*_SECS` setting: 0 to a day.
fn secs() -> clap::builder::RangedU64ValueParser<u64> {
    clap::value_parser!(u64).range(0..=MAX_MILLIS / 1000)
}

/// A `*_MB` setting: `min` to [`MAX_MEBIBYTES`].
fn mebibytes(min: u64) -> clap::builder::RangedU64ValueParser<u64> {
    clap::value_parser!(u64).range(min..=MAX_MEBIBYTES)
}

/// CODEBROKER_MAX_CONTAINERS: derived from the host's memory, or a number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContainerCap {
    /// Three quarters of the Docker host's memory over the sandbox memory limit.
    Auto,
    /// This many (0: no cap).
    Count(usize),
}

impl std::str::FromStr for ContainerCap {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let text = text.trim();
        if text.eq_ignore_ascii_case("auto") {
            return Ok(ContainerCap::Auto);
        }
        text.parse()
            .map(ContainerCap::Count)
            .map_err(|_| format!("{text:?} is neither `auto` nor a number of containers"))
    }
}

/// The fewest containers `auto` gives: one user at work and one more.
pub(crate) const AUTO_CONTAINERS_MIN: usize = 2;

/// `auto`'s hard ceiling on a Docker host of `host_memory` bytes whose memory the broker
/// reads (`core::capacity`): three quarters of it over what an idle sandbox holds.
pub(crate) fn auto_ceiling(host_memory: u64) -> usize {
    let idle = crate::core::capacity::IDLE_SANDBOX_BYTES;
    usize::try_from(host_memory / 4 * 3 / idle)
        .unwrap_or(usize::MAX)
        .max(AUTO_CONTAINERS_MIN)
}

impl ContainerCap {
    /// The cap in containers (0: none), for a Docker host with `host_memory` bytes of RAM
    /// (`None`: unknown, which gives the minimum) and sandboxes of `memory_mb` MiB each.
    pub(crate) fn resolve(self, host_memory: Option<u64>, memory_mb: u64) -> usize {
        match self {
            ContainerCap::Count(n) => n,
            ContainerCap::Auto => {
                let sandbox = memory_mb.max(1).saturating_mul(1 << 20);
                let usable = host_memory.unwrap_or(0) / 4 * 3;
                usize::try_from(usable / sandbox)
                    .unwrap_or(usize::MAX)
                    .max(AUTO_CONTAINERS_MIN)
            }
        }
    }
}

/// CODEBROKER_SECCOMP: which syscall filter sandboxes get.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SeccompChoice {
    /// The profile compiled into the broker (`sandbox/seccomp.json`).
    Builtin,
    /// The Docker daemon's default (no `seccomp=` option is sent).
    Daemon,
    /// A profile read from this file at start-up.
    File(PathBuf),
}

impl std::str::FromStr for SeccompChoice {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.trim() {
            "" => Err("empty: use `builtin`, `daemon` or a file path".into()),
            t if t.eq_ignore_ascii_case("builtin") => Ok(SeccompChoice::Builtin),
            t if t.eq_ignore_ascii_case("daemon") => Ok(SeccompChoice::Daemon),
            path => Ok(SeccompChoice::File(PathBuf::from(path))),
        }
    }
}

/// What happens to session containers when the broker stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum ShutdownContainers {
    /// Leave them running; the next start re-attaches to them (or removes them when their
    /// session is gone).
    Keep,
    /// Remove them; their files stay in the data directory.
    Remove,
}

/// How files move between the broker and a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum FileTransfer {
    /// Through the workspace directory the sandbox mounts, on this host.
    Host,
    /// Through the sandbox's runner, over its channel.
    Runner,
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
        let mut longest = self.max_exec_timeout_ms;
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
    pub(crate) fn validate(&self) -> Result<(), String> {
        self.access.validate_tenants()?;
        if self.access.auth == AuthMode::Key
            && self.access.api_keys().next().is_none()
            && self.access.tenant_keys().next().is_none()
            && self.access.jwt_key_entries().next().is_none()
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
        if self.sandbox.cpus.is_nan() || self.sandbox.cpus <= 0.0 {
            return Err("CODEBROKER_CPUS must be above 0".into());
        }
        if !(self.public_url.starts_with("http://") || self.public_url.starts_with("https://")) {
            return Err("CODEBROKER_PUBLIC_URL must start with http:// or https://".into());
        }
        if self.backend == BackendKind::Kubernetes {
            self.validate_kubernetes()?;
        }
        self.validate_sandbox_uids()?;
        self.validate_codemode_mcp_uid()
    }

    /// A cap on live containers that the uid range could not serve would refuse sandboxes
    /// with "every uid in use" before the cap is reached: refused at start instead.
    fn validate_sandbox_uids(&self) -> Result<(), String> {
        if let (BackendKind::Docker, SandboxUids::Own(range), ContainerCap::Count(cap)) = (
            self.backend,
            self.sandbox.sandbox_uids(),
            &self.caps.max_containers,
        ) {
            let uids = (range.last - range.first) as usize;
            if *cap > uids {
                return Err(format!(
                    "CODEBROKER_MAX_CONTAINERS ({cap}) is more than the {uids} sandbox uids of \
                     CODEBROKER_SANDBOX_UIDS ({range}); widen the range"
                ));
            }
        }
        Ok(())
    }

    /// Stdio upstream servers run as a uid of their own: never root, nor a uid a sandbox
    /// may run as (the code could then reach the upstream's processes and files).
    fn validate_codemode_mcp_uid(&self) -> Result<(), String> {
        let mcp_uid = self.code_mode.codemode_mcp_uid;
        let a_sandbox_uid = match self.sandbox.sandbox_uids() {
            SandboxUids::Shared(uid) => uid == mcp_uid,
            SandboxUids::Own(range) => range.contains(mcp_uid),
        };
        if mcp_uid == 0 || a_sandbox_uid || mcp_uid == self.sandbox.pod_uid() {
            return Err(format!(
                "CODEBROKER_CODEMODE_MCP_UID={mcp_uid}: stdio upstream servers must run as \
                 neither root nor a sandbox uid"
            ));
        }
        Ok(())
    }

    /// Checks the settings the Kubernetes backend needs: names it puts in labels must be
    /// label values, and what it cannot do is refused rather than ignored.
    fn validate_kubernetes(&self) -> Result<(), String> {
        if self.kubernetes.k8s_mode == KubernetesMode::AgentSandbox {
            let template = self.kubernetes.k8s_sandbox_template.trim();
            if !is_dns_subdomain(template) {
                return Err(format!(
                    "CODEBROKER_K8S_SANDBOX_TEMPLATE {template:?} is not a resource name \
                     (at most 253 of [a-z0-9-.], beginning and ending with a letter or digit)"
                ));
            }
        }
        if !is_label_value(&self.sandbox.instance) {
            return Err(format!(
                "CODEBROKER_INSTANCE {:?} is not a Kubernetes label value (at most 63 of \
                 [A-Za-z0-9-_.], beginning and ending with a letter or digit)",
                self.sandbox.instance
            ));
        }
        if self.sandbox.pod_uid() == 0 {
            return Err(
                "CODEBROKER_SANDBOX_UID must not be 0: sandbox pods run as non-root".into(),
            );
        }
        // Empty (a blank line in an env file): unset.
        if let Some(namespace) = self
            .kubernetes
            .k8s_namespace
            .as_ref()
            .filter(|n| !n.trim().is_empty())
        {
            if !is_dns_label(namespace) {
                return Err(format!(
                    "CODEBROKER_K8S_NAMESPACE {namespace:?} is not a namespace name \
                     (at most 63 of [a-z0-9-], beginning and ending with a letter or digit)"
                ));
            }
        }
        Ok(())
    }

    /// A configuration for tests: no auth, defaults elsewhere, data in `data_dir`.
    pub fn for_tests(data_dir: PathBuf, instance: &str) -> Config {
        let mut config = Config::parse_from(["codebroker"]);
        config.access.auth = AuthMode::None;
        config.data_dir = data_dir;
        config.sandbox.instance = instance.to_string();
        config.listen = "127.0.0.1:0".parse().expect("literal address");
        // Tests on a loaded machine may take longer than the single-use TTL between two
        // execs of one session; the tests of that rule turn it on themselves.
        config.single_use_ttl_secs = 0;
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
        assert!(config.max_output_file_mb.checked_mul(1024 * 1024).is_some());
        let deadline = std::time::Duration::from_millis(config.max_exec_timeout_ms);
        assert!(tokio::time::Instant::now().checked_add(deadline).is_some());
        assert!(std::time::Instant::now().checked_add(deadline).is_some());
        // Below Docker's smallest memory limit, and a zero timeout, are refused too.
        assert!(Config::try_parse_from(["codebroker", "--memory-mb", "1"]).is_err());
        assert!(Config::try_parse_from(["codebroker", "--exec-timeout-ms", "0"]).is_err());
        assert!(Config::try_parse_from(["codebroker", "--max-body-mb", "0"]).is_err());
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
        assert!(err.contains("CODEBROKER_K8S_SANDBOX_TEMPLATE"), "{err}");
        // Only agent-sandbox mode reads it.
        assert_eq!(check(&["--k8s-sandbox-template", ""]), Ok(()));
        let err = check(&["--instance", "my broker"]).expect_err("not a label");
        assert!(err.contains("CODEBROKER_INSTANCE"), "{err}");
        let err = check(&["--sandbox-uid", "0"]).expect_err("root");
        assert!(err.contains("non-root"), "{err}");
        let err = check(&["--k8s-namespace", "Sandboxes"]).expect_err("not a name");
        assert!(err.contains("CODEBROKER_K8S_NAMESPACE"), "{err}");
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
        assert!(err.contains("CODEBROKER_SANDBOX_UIDS (100-102)"), "{err}");
        config.caps.max_containers = ContainerCap::Count(2);
        assert!(config.validate().is_ok());
        config.caps.max_containers = ContainerCap::Count(3);
        config.sandbox.sandbox_uid = Some(10001);
        assert!(config.validate().is_ok());
    }
}
