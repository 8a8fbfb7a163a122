//! What the core asks of wherever sandboxes run: one trait, so that the core holds an
//! `Arc<dyn SandboxBackend>` and a backend whose sandboxes run elsewhere (pods on other
//! nodes, whose disks the broker cannot see) needs no change to it.
//!
//! Sandboxes are created, attached, removed and found again after a restart; the backend
//! says whether its engine is healthy and whether a sandbox ended out of memory. Files move
//! between the broker's store and a sandbox's `/mnt/data` through the backend too: Docker
//! reads and writes the mounted directory on this host, beneath-only
//! (`crate::workspace`), or, with `CODEBROKER_FILE_TRANSFER=runner`, through the runner
//! (`super::runner_files`), the path a remote backend takes.

use super::{runner_files, CpuWeight, DockerBackend, Listed, Sandbox, Warmup};
use crate::config::FileTransfer;
use crate::workspace::{FileIndex, FileRecord, HarvestLimits, HarvestReport, Stamp, Workspace};
use std::io;
use std::path::Path;
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

/// Where a session's files are: its workspace (the broker's index and blob store; on
/// Docker also the directory the sandbox mounts) and its live sandbox, if it has one.
#[derive(Clone)]
pub(crate) struct SandboxFiles {
    /// The session's workspace.
    pub(crate) workspace: Workspace,
    /// The session's sandbox while its runner can be reached.
    pub(crate) sandbox: Option<Arc<Sandbox>>,
}

/// Creates, finds and removes sandboxes, and moves files in and out of them.
///
/// The file methods block (they read and write files, or wait on a runner): call them off
/// the async threads, with the session's turn held.
#[async_trait::async_trait]
pub(crate) trait SandboxBackend: Send + Sync {
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

    /// Sets how much CPU a sandbox gets against the others when the host is busy (a
    /// pooled sandbox preloads at the lowest); whether it was set (failures are logged).
    async fn set_cpu_weight(&self, sandbox_id: &str, weight: CpuWeight) -> bool;

    /// Removes a sandbox, whatever state it is in; failures are logged.
    async fn remove(&self, sandbox_id: &str);

    /// Every sandbox of this broker instance.
    async fn list_own(&self) -> anyhow::Result<Vec<Listed>>;

    /// Whether the engine answers.
    async fn ping(&self) -> bool;

    /// Whether the sandbox image is present.
    async fn image_present(&self) -> bool;

    /// Whether the sandbox `sandbox_id` ended because it ran out of memory since `since`;
    /// `oom_before`: its runner already reported a process of an earlier exec killed for
    /// memory (see [`Sandbox::had_an_oom_kill`]).
    ///
    /// [`Sandbox::had_an_oom_kill`]: super::Sandbox::had_an_oom_kill
    async fn ended_out_of_memory(
        &self,
        sandbox_id: &str,
        since: SystemTime,
        oom_before: bool,
    ) -> bool;

    /// Reads one file out of the sandbox image.
    async fn read_image_file(&self, path: &str) -> anyhow::Result<Vec<u8>>;

    /// The memory of the machine sandboxes run on, when known (`CODEBROKER_MAX_CONTAINERS
    /// auto`).
    fn host_memory(&self) -> Option<u64>;

    /// Who hears of failed engine calls (the broker's metrics); set once, at start.
    fn observe(&self, observer: Arc<dyn EngineObserver>);

    /// Places the stored `blob` at `name` below `/mnt/data` (see
    /// `Workspace::place_blob`); returns the placed file's stamp.
    fn place_file(
        &self,
        at: &SandboxFiles,
        blob: &Path,
        name: &Path,
        read_only: bool,
    ) -> io::Result<Stamp>;

    /// Finds the files an exec created or changed (see `Workspace::harvest`).
    fn harvest(
        &self,
        at: &SandboxFiles,
        index: &mut FileIndex,
        limits: HarvestLimits,
    ) -> io::Result<HarvestReport>;

    /// Reads the file `name` below `/mnt/data`; `None` when it has more than `max_bytes`.
    fn read_file(
        &self,
        at: &SandboxFiles,
        name: &str,
        max_bytes: u64,
    ) -> io::Result<Option<Vec<u8>>>;

    /// Removes the file of `record` if it is still that version.
    fn remove_file(&self, at: &SandboxFiles, record: &FileRecord) -> io::Result<()>;

    /// Whether a pooled sandbox can be handed to a session that has files already
    /// ([`SandboxBackend::take_pooled_workspace`]); if not, such a session starts its own.
    fn hands_over_pooled(&self) -> bool;

    /// Hands the sandbox of the pooled workspace `pooled` to the session of `session`,
    /// with the session's files; on an error the pooled sandbox is not used, and the
    /// session keeps every file (in its own directory, or in the pooled one that took its
    /// place if only handing them to the pooled sandbox's uid failed).
    fn take_pooled_workspace(&self, session: &Workspace, pooled: &Workspace) -> io::Result<()>;

    /// Brings a newly attached sandbox up to date with its session's files (moves that
    /// waited for it); returns whether `index` changed, and notes for stderr.
    fn settle_files(
        &self,
        at: &SandboxFiles,
        index: &mut FileIndex,
    ) -> io::Result<(bool, Vec<String>)>;
}

#[async_trait::async_trait]
impl SandboxBackend for DockerBackend {
    async fn create(
        &self,
        session_id: &str,
        workspace: &Workspace,
        warmup: Warmup,
    ) -> anyhow::Result<Sandbox> {
        DockerBackend::create(self, session_id, workspace, warmup).await
    }

    async fn adopt(&self, sandbox_id: &str) -> anyhow::Result<Sandbox> {
        DockerBackend::adopt(self, sandbox_id).await
    }

    async fn set_cpu_weight(&self, sandbox_id: &str, weight: CpuWeight) -> bool {
        DockerBackend::set_cpu_weight(self, sandbox_id, weight).await
    }

    async fn remove(&self, sandbox_id: &str) {
        DockerBackend::remove(self, sandbox_id).await
    }

    async fn list_own(&self) -> anyhow::Result<Vec<Listed>> {
        DockerBackend::list_own(self).await
    }

    async fn ping(&self) -> bool {
        DockerBackend::ping(self).await
    }

    async fn image_present(&self) -> bool {
        DockerBackend::image_present(self).await
    }

    /// The engine's `oom` events are timed, so an earlier OOM kill does not count.
    async fn ended_out_of_memory(
        &self,
        sandbox_id: &str,
        since: SystemTime,
        _oom_before: bool,
    ) -> bool {
        DockerBackend::ended_out_of_memory(self, sandbox_id, since).await
    }

    async fn read_image_file(&self, path: &str) -> anyhow::Result<Vec<u8>> {
        DockerBackend::read_image_file(self, path).await
    }

    fn host_memory(&self) -> Option<u64> {
        self.host_memory
    }

    fn observe(&self, observer: Arc<dyn EngineObserver>) {
        // Only the first observer counts: the broker installs it once, at start.
        let _ = self.observer.set(observer);
    }

    fn place_file(
        &self,
        at: &SandboxFiles,
        blob: &Path,
        name: &Path,
        read_only: bool,
    ) -> io::Result<Stamp> {
        match self.file_transfer() {
            FileTransfer::Host => {
                let owner = self.workspace_owner(&at.workspace)?;
                at.workspace.place_blob(blob, name, owner, read_only)
            }
            FileTransfer::Runner => runner_files::place_file(
                &at.workspace,
                at.sandbox.as_deref(),
                blob,
                name,
                read_only,
            ),
        }
    }

    fn harvest(
        &self,
        at: &SandboxFiles,
        index: &mut FileIndex,
        limits: HarvestLimits,
    ) -> io::Result<HarvestReport> {
        match (self.file_transfer(), &at.sandbox) {
            (FileTransfer::Host, _) => at.workspace.harvest(index, limits),
            (FileTransfer::Runner, Some(sandbox)) => {
                let mut files = runner_files::RunnerFiles { sandbox };
                at.workspace.harvest_from(&mut files, index, limits)
            }
            // The sandbox is gone (it broke during the exec): its files are looked at by
            // the next one's harvest.
            (FileTransfer::Runner, None) => Ok(HarvestReport::default()),
        }
    }

    fn read_file(
        &self,
        at: &SandboxFiles,
        name: &str,
        max_bytes: u64,
    ) -> io::Result<Option<Vec<u8>>> {
        match (self.file_transfer(), &at.sandbox) {
            (FileTransfer::Host, _) => {
                let (file, _) = at.workspace.open_file(name)?;
                let mut bytes = Vec::new();
                io::Read::read_to_end(&mut io::Read::take(file, max_bytes + 1), &mut bytes)?;
                Ok((bytes.len() as u64 <= max_bytes).then_some(bytes))
            }
            (FileTransfer::Runner, Some(sandbox)) => {
                runner_files::read_file(sandbox, name, max_bytes)
            }
            (FileTransfer::Runner, None) => Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "the session has no live sandbox",
            )),
        }
    }

    fn remove_file(&self, at: &SandboxFiles, record: &FileRecord) -> io::Result<()> {
        match self.file_transfer() {
            FileTransfer::Host => at.workspace.remove_if_unchanged(record),
            FileTransfer::Runner => {
                runner_files::remove_file(&at.workspace, at.sandbox.as_deref(), record)
            }
        }
    }

    fn hands_over_pooled(&self) -> bool {
        true
    }

    fn take_pooled_workspace(&self, session: &Workspace, pooled: &Workspace) -> io::Result<()> {
        // Whichever way files move, what a container mounts is the engine's business: the
        // directory behind the pooled container's mount becomes the session's (entries
        // are renamed, never opened), so a later container on the session's workspace
        // sees what this one wrote. The files the session's earlier sandboxes wrote, as
        // other uids, become the pooled sandbox's.
        session.take_files_dir_of(pooled)?;
        let owner = self.workspace_owner(session)?;
        session.hand_to(owner)
    }

    fn settle_files(
        &self,
        at: &SandboxFiles,
        index: &mut FileIndex,
    ) -> io::Result<(bool, Vec<String>)> {
        match (self.file_transfer(), &at.sandbox) {
            (FileTransfer::Runner, Some(sandbox)) => {
                runner_files::apply_pending(&at.workspace, sandbox, index)
            }
            _ => Ok((false, Vec::new())),
        }
    }
}
