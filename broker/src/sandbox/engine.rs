//! What the core asks of wherever sandboxes run, as one trait of engine methods: create,
//! adopt, remove, list, ping, the image, how a sandbox ended. A backend (Docker, Kubernetes,
//! a microVM, a remote runner) is a folder with one impl of it; how files reach its
//! sandboxes is not its business but its [`FileTransport`]'s (`files.rs`), written once.

use super::files::FileTransport;
use super::{CpuWeight, Listed, Sandbox, Warmup};
use crate::workspace::Workspace;
use std::io;
use std::sync::Arc;
use std::time::SystemTime;

/// Hears what a backend's engine does wrong, so an engine in trouble shows on `/metrics`
/// without the sandbox layer knowing the metrics' types.
pub(crate) trait EngineObserver: Send + Sync {
    /// One failed engine call of the operation `op` (`create`, `attach`, `remove`, ...).
    fn api_error(&self, op: &str);
}

/// Why a sandbox cannot be had now, in words a client may read: an orchestrator that
/// refuses the broker (RBAC) or cannot be reached, a sandbox that did not start in time.
/// The core answers such a failure with 503 and this reason; other failures of a backend
/// stay in the log.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct SandboxUnavailable(pub(crate) String);

/// Creates, finds and removes sandboxes. The methods with a body have a default for an
/// engine with nothing to say.
#[async_trait::async_trait]
pub(crate) trait SandboxEngine: Send + Sync {
    /// Creates and starts a sandbox for `session_id` on `workspace`, attached before it
    /// starts, and waits for its runner to answer (after asking it for `warmup`).
    async fn create(
        &self,
        session_id: &str,
        workspace: &Workspace,
        warmup: Warmup,
    ) -> anyhow::Result<Sandbox>;

    /// Re-attaches to a running sandbox of ours (after a broker restart).
    async fn adopt(&self, sandbox_id: &str) -> anyhow::Result<Sandbox>;

    /// Removes a sandbox, whatever state it is in; failures are logged.
    async fn remove(&self, sandbox_id: &str);

    /// Every sandbox of this broker instance.
    async fn list_own(&self) -> anyhow::Result<Vec<Listed>>;

    /// Whether the engine answers.
    async fn ping(&self) -> bool;

    /// Whether the sandbox image is present.
    async fn image_present(&self) -> bool;

    /// Reads one file out of the sandbox image.
    async fn read_image_file(&self, path: &str) -> anyhow::Result<Vec<u8>>;

    /// Whether the sandbox `sandbox_id` ended because it ran out of memory since `since`;
    /// `oom_before`: its runner already reported a process of an earlier exec killed for
    /// memory (see [`Sandbox::had_an_oom_kill`]). Without a better source, that report.
    ///
    /// [`Sandbox::had_an_oom_kill`]: super::Sandbox::had_an_oom_kill
    async fn ended_out_of_memory(
        &self,
        _sandbox_id: &str,
        _since: SystemTime,
        oom_before: bool,
    ) -> bool {
        oom_before
    }

    /// Sets how much CPU a sandbox gets against the others when the host is busy (a
    /// pooled sandbox preloads at the lowest); whether it was set. None by default.
    async fn set_cpu_weight(&self, _sandbox_id: &str, _weight: CpuWeight) -> bool {
        false
    }

    /// The memory of the machine sandboxes run on, when known (`CODEBROKER_MAX_CONTAINERS
    /// auto`); unknown by default.
    fn host_memory(&self) -> Option<u64> {
        None
    }

    /// Who hears of failed engine calls (the broker's metrics); set once, at start.
    fn observe(&self, _observer: Arc<dyn EngineObserver>) {}

    /// The egress gateway its sandboxes' proxy connections go to; set once, at start. An
    /// engine that cannot carry them ignores it (the configuration refuses egress there).
    fn carry_egress(&self, _gateway: Arc<crate::egress::gateway::Gateway>) {}

    /// How files reach this engine's sandboxes.
    fn file_transport(&self) -> FileTransport;

    /// Who the files placed for the code in `workspace` belong to, on the host path: the
    /// broker itself unless the engine says otherwise.
    fn workspace_owner(&self, _workspace: &Workspace) -> io::Result<u32> {
        Ok(crate::workspace::euid())
    }

    /// Whether a pooled sandbox can be handed to a session that has files already
    /// ([`SandboxEngine::take_pooled_workspace`]); if not, such a session starts its own.
    fn hands_over_pooled(&self) -> bool {
        false
    }

    /// Hands the sandbox of the pooled workspace `pooled` to the session of `session`,
    /// with the session's files; on an error the pooled sandbox is not used, and the
    /// session keeps every file.
    fn take_pooled_workspace(&self, _session: &Workspace, _pooled: &Workspace) -> io::Result<()> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "this backend cannot hand a pooled sandbox over",
        ))
    }

    /// Whether a sandbox's disk outlives it (a Docker bind mount of the session's
    /// directory); if not (a pod's `emptyDir`), what the broker does not keep as files,
    /// the session's installs, is carried to the next sandbox by the runner.
    fn disk_outlives_sandbox(&self) -> bool {
        true
    }

    /// Whether `sandbox_id` is new to the files: its disk may lack the session's current
    /// files (a new pod after an eviction), which the runner transport then restores and
    /// reports with [`SandboxEngine::settled`]. An engine whose sandboxes mount the
    /// session's directory never needs it.
    fn first_settle(&self, _sandbox_id: &str) -> bool {
        false
    }

    /// The session's files were restored into `sandbox_id`.
    fn settled(&self, _sandbox_id: &str) {}
}
