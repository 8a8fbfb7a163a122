//! What a session installed, across sandboxes whose disk goes with them (a Kubernetes pod's
//! `emptyDir`): `pip install` puts packages in the workspace's user base (`.local`), `npm
//! install` in its `node_modules`, both hidden from the file listing, so the files the
//! broker keeps do not carry them. Before the broker removes such a sandbox it asks the
//! runner to pack those directories into one archive in the runner's state directory
//! ([`PackInstallsRequest`]), and reads it in chunks ([`crate::ReadStateRequest`] naming
//! [`StateFile::Installs`]); in the session's next sandbox it writes the archive back and
//! has the runner unpack it ([`UnpackInstallsRequest`]) before the first exec.
//!
//! To the broker the archive is opaque and bounded; the runner unpacks only entries below
//! [`INSTALL_DIRS`], and only into the workspace of the session that packed them.

use serde::{Deserialize, Serialize};

/// The workspace directories that hold installs: pip's user base (`PYTHONUSERBASE`) and
/// npm's packages.
pub const INSTALL_DIRS: &[&str] = &[".local", "node_modules"];

/// The archive's name in the runner's state directory ([`crate::STATE_DIR`]).
pub const INSTALLS_FILE: &str = "installs.tar";

/// Which file of the runner's state directory a read or write concerns.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StateFile {
    /// The Python kernel's saved globals ([`crate::STATE_FILE`]).
    #[default]
    Python,
    /// The archive of the session's installs ([`INSTALLS_FILE`]).
    Installs,
}

impl StateFile {
    /// The file's name in the state directory.
    pub fn name(self) -> &'static str {
        match self {
            StateFile::Python => crate::STATE_FILE,
            StateFile::Installs => INSTALLS_FILE,
        }
    }
}

/// Pack the install directories into the archive, within a size bound (answered with
/// [`InstallsPacked`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PackInstallsRequest {
    /// Largest archive, in bytes: past it nothing is kept, and the answer says why.
    pub max_bytes: u64,
}

/// What a pack did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct InstallsPacked {
    /// Size of the archive; 0 when there was nothing to pack, or it failed.
    pub bytes: u64,
    /// Entries (files, directories, links) in it.
    pub entries: u64,
    /// Why nothing could be packed, when so (too large, no room in `/tmp`).
    #[serde(default)]
    pub error: Option<String>,
    /// Whether the installs went past the request's `max_bytes` (the broker names the
    /// setting or budget that set it).
    #[serde(default)]
    pub over_bound: bool,
    /// How long the pack took in the sandbox.
    pub duration_ms: u64,
}

/// Unpack the archive written before into the workspace, then remove it (answered with
/// [`InstallsUnpacked`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UnpackInstallsRequest {
    /// Largest archive the runner accepts, in bytes.
    pub max_bytes: u64,
}

/// What an unpack did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct InstallsUnpacked {
    /// Entries written into the workspace.
    pub entries: u64,
    /// Entries left out: outside the install directories, or of a kind not unpacked.
    pub skipped: u64,
    /// Why the installs could not be (wholly) unpacked, when so.
    #[serde(default)]
    pub error: Option<String>,
    /// How long the unpack took in the sandbox.
    pub duration_ms: u64,
}
