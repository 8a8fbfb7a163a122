//! How files move between the broker's store and a sandbox's `/mnt/data`, written once for
//! every backend: on the host (the broker sees the directory the sandbox mounts, read and
//! written beneath-only, `crate::workspace`) or through the runner over the attached
//! channel (`super::runner_files`: a remote engine, or `CODEBROKER_FILE_TRANSFER=runner`).
//! [`SandboxBackend`] is what the core holds: an engine and its transport.

use super::engine::SandboxEngine;
use super::{runner_files, Sandbox};
use crate::workspace::{FileIndex, FileRecord, HarvestLimits, HarvestReport, Stamp, Workspace};
use std::io;
use std::path::Path;
use std::sync::Arc;

/// The two ways files reach a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FileTransport {
    /// The broker reads and writes the directory the sandbox mounts.
    Host,
    /// Files move through the runner; what waits for a sandbox is kept as pending moves.
    Runner,
}

/// What bringing a sandbox up to date with its session's files did.
#[derive(Debug, Default)]
pub(crate) struct Settled {
    /// Whether the index changed (and must be saved).
    pub(crate) index_changed: bool,
    /// Notes for the exec's stderr.
    pub(crate) notes: Vec<String>,
    /// Whether the sandbox's disk started without the session's files (a new pod): what
    /// else the session carries across sandboxes (its installs) goes in now.
    pub(crate) new_disk: bool,
}

/// Where a session's files are: its workspace (the broker's index and blob store; on
/// the host path also the directory the sandbox mounts) and its live sandbox, if it has one.
#[derive(Clone)]
pub(crate) struct SandboxFiles {
    /// The session's workspace.
    pub(crate) workspace: Workspace,
    /// The session's sandbox while its runner can be reached.
    pub(crate) sandbox: Option<Arc<Sandbox>>,
}

/// A backend as the core holds it: its engine, and the transport its files take.
///
/// The file methods block (they read and write files, or wait on a runner): call them off
/// the async threads, with the session's turn held.
pub(crate) struct SandboxBackend {
    /// Creates, finds and removes the sandboxes.
    engine: Box<dyn SandboxEngine>,
    /// How files reach them, as the engine said at start.
    transport: FileTransport,
}

impl SandboxBackend {
    pub(crate) fn new(engine: Box<dyn SandboxEngine>) -> SandboxBackend {
        let transport = engine.file_transport();
        SandboxBackend { engine, transport }
    }

    /// The engine: create, adopt, remove, list, health.
    pub(crate) fn engine(&self) -> &dyn SandboxEngine {
        &*self.engine
    }

    /// Whether the broker sees the directory sandboxes mount (the host path): then a
    /// read-only file it placed stays as placed if the code runs as another uid.
    pub(crate) fn files_on_host(&self) -> bool {
        self.transport == FileTransport::Host
    }

    /// Places the stored `blob` at `name` below `/mnt/data` (see
    /// `Workspace::place_blob`); returns the placed file's stamp.
    pub(crate) fn place_file(
        &self,
        at: &SandboxFiles,
        blob: &Path,
        name: &Path,
        read_only: bool,
    ) -> io::Result<Stamp> {
        match self.transport {
            FileTransport::Host => {
                let owner = self.engine.workspace_owner(&at.workspace)?;
                at.workspace.place_blob(blob, name, owner, read_only)
            }
            FileTransport::Runner => runner_files::place_file(
                &at.workspace,
                at.sandbox.as_deref(),
                blob,
                name,
                read_only,
            ),
        }
    }

    /// Finds the files an exec created or changed (see `Workspace::harvest`).
    pub(crate) fn harvest(
        &self,
        at: &SandboxFiles,
        index: &mut FileIndex,
        limits: HarvestLimits,
    ) -> io::Result<HarvestReport> {
        match (self.transport, &at.sandbox) {
            (FileTransport::Host, _) => at.workspace.harvest(index, limits),
            (FileTransport::Runner, Some(sandbox)) => {
                let mut files = runner_files::RunnerFiles { sandbox };
                at.workspace.harvest_from(&mut files, index, limits)
            }
            // The sandbox is gone (it broke during the exec): its files are looked at by
            // the next one's harvest.
            (FileTransport::Runner, None) => Ok(HarvestReport::default()),
        }
    }

    /// Reads the file `name` below `/mnt/data`; `None` when it has more than `max_bytes`.
    pub(crate) fn read_file(
        &self,
        at: &SandboxFiles,
        name: &str,
        max_bytes: u64,
    ) -> io::Result<Option<Vec<u8>>> {
        match (self.transport, &at.sandbox) {
            (FileTransport::Host, _) => {
                let (file, _) = at.workspace.open_file(name)?;
                let mut bytes = Vec::new();
                io::Read::read_to_end(&mut io::Read::take(file, max_bytes + 1), &mut bytes)?;
                Ok((bytes.len() as u64 <= max_bytes).then_some(bytes))
            }
            (FileTransport::Runner, Some(sandbox)) => {
                runner_files::read_file(sandbox, name, max_bytes)
            }
            (FileTransport::Runner, None) => Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "the session has no live sandbox",
            )),
        }
    }

    /// Removes the file of `record` if it is still that version.
    pub(crate) fn remove_file(&self, at: &SandboxFiles, record: &FileRecord) -> io::Result<()> {
        match self.transport {
            FileTransport::Host => at.workspace.remove_if_unchanged(record),
            FileTransport::Runner => {
                runner_files::remove_file(&at.workspace, at.sandbox.as_deref(), record)
            }
        }
    }

    /// Brings a newly attached sandbox up to date with its session's files: the moves that
    /// waited for it, and, the first time the engine sees it, the session's current files
    /// its disk lacks.
    pub(crate) fn settle_files(
        &self,
        at: &SandboxFiles,
        index: &mut FileIndex,
    ) -> io::Result<Settled> {
        let mut settled = Settled::default();
        let (FileTransport::Runner, Some(sandbox)) = (self.transport, &at.sandbox) else {
            return Ok(settled);
        };
        (settled.index_changed, settled.notes) =
            runner_files::apply_pending(&at.workspace, sandbox, index)?;
        if self.engine.first_settle(&sandbox.container_id) {
            let (restored, more) = runner_files::restore_missing(&at.workspace, sandbox, index)?;
            settled.index_changed |= restored;
            settled.notes.extend(more);
            settled.new_disk = true;
            self.engine.settled(&sandbox.container_id);
        }
        Ok(settled)
    }

    /// Whether a sandbox's disk outlives it (see [`SandboxEngine::disk_outlives_sandbox`]).
    pub(crate) fn disk_outlives_sandbox(&self) -> bool {
        self.engine.disk_outlives_sandbox()
    }

    /// Whether a pooled sandbox can be handed to a session that has files already.
    pub(crate) fn hands_over_pooled(&self) -> bool {
        self.engine.hands_over_pooled()
    }

    /// Hands the pooled workspace's sandbox to `session` (see
    /// [`SandboxEngine::take_pooled_workspace`]).
    pub(crate) fn take_pooled_workspace(
        &self,
        session: &Workspace,
        pooled: &Workspace,
    ) -> io::Result<()> {
        self.engine.take_pooled_workspace(session, pooled)
    }
}
