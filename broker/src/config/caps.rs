//! Caps on what callers may take of the host, the pool, and Python state.

use super::*;

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

    /// Largest archive of a session's installs (`pip install`, `npm install`) kept across
    /// sandboxes whose disk goes with them (Kubernetes pods): before such a sandbox is
    /// removed (idle TTL, eviction, a stop with remove), its `.local` and `node_modules` are
    /// packed in its `/tmp` (charged to its memory), kept beside the session's files, and
    /// unpacked into the session's next sandbox before its first exec, within
    /// CODEBROKER_STATE_TIMEOUT_SECS each way. Installs over it are not kept, which the next
    /// exec's stderr says. The storage budgets bound it too. 0: installs are not kept. On
    /// Docker the workspace outlives its container and installs stay without it.
    #[arg(long, env = "CODEBROKER_INSTALLS_MAX_BYTES", default_value = "256MiB", value_parser = parse_size)]
    pub installs_max_bytes: u64,
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
