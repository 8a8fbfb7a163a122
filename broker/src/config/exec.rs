//! The limits of one exec, and the lifecycle of what the broker keeps.

use super::*;

/// What one exec may take: wall time, output, display events, generated files. The core's
/// exec reads these.
#[derive(Debug, Clone, clap::Args)]
pub struct ExecLimits {
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

    /// Most files one exec reports as generated; the rest are named in stderr.
    #[arg(long, env = "CODEBROKER_MAX_OUTPUT_FILES", default_value_t = 50)]
    pub max_output_files: usize,

    /// Largest generated file reported, in MiB; larger ones are named in stderr.
    #[arg(long, env = "CODEBROKER_MAX_OUTPUT_FILE_MB", default_value_t = 10, value_parser = mebibytes(0))]
    pub max_output_file_mb: u64,
}

/// How long what the broker keeps lives: idle and single-use containers, file versions,
/// programmatic continuations, and a stopping broker's grace.
#[derive(Debug, Clone, clap::Args)]
pub struct Lifecycle {
    /// Seconds a continuation token of a programmatic run stays valid; a run whose client
    /// does not come back in time is stopped.
    #[arg(long, env = "CODEBROKER_CONTINUATION_TTL_SECS", default_value_t = 300, value_parser = secs())]
    pub continuation_ttl_secs: u64,

    /// Seconds a session's container may sit idle before it is removed (its files stay).
    #[arg(long, env = "CODEBROKER_IDLE_TTL_SECS", default_value_t = 600)]
    pub idle_ttl_secs: u64,

    /// How often the reaper looks for idle containers, in seconds.
    #[arg(long, env = "CODEBROKER_REAP_INTERVAL_SECS", default_value_t = 10)]
    pub reap_interval_secs: u64,

    /// Seconds a container whose session ran only one exec may sit idle (0: only the idle
    /// TTL applies). Clients that send no session id start a session per call, and most
    /// are never used again.
    #[arg(long, env = "CODEBROKER_SINGLE_USE_TTL_SECS", default_value_t = 30)]
    pub single_use_ttl_secs: u64,

    /// Seconds a file version is kept after it was written or uploaded; then its id answers
    /// 404 and its space is freed (LibreChat re-uploads after 23 hours).
    #[arg(long, env = "CODEBROKER_FILE_TTL_SECS", default_value_t = 86_400)]
    pub file_ttl_secs: u64,

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
