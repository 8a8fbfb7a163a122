//! Python state across sandboxes: before the broker removes a sandbox whose kernel holds
//! state, it asks the runner to have the kernel save its globals to the runner's state
//! file ([`SaveStateRequest`]), then reads the file's bytes in chunks ([`ReadStateRequest`])
//! and keeps them for the session. Before the session's next Python exec, in a new sandbox,
//! it writes them back ([`WriteStateRequest`]) and has the kernel load them
//! ([`RestoreStateRequest`]). The bytes are pickles: only the kernel reads them, in the
//! sandbox of the session that saved them; to the broker they are opaque and bounded.
//!
//! The state file lives in the runner's temp directory ([`STATE_DIR`], not the workspace, so
//! no harvest sees it), mode 0600 in a 0700 directory.

use serde::{Deserialize, Serialize};

/// The directory of the state file, below the runner's temp directory (`/tmp`).
pub const STATE_DIR: &str = ".codebroker-state";

/// The state file's name in [`STATE_DIR`].
pub const STATE_FILE: &str = "state";

/// Most names a save or restore answer lists as not kept; the kernel says how many more.
pub const MAX_NOT_KEPT: usize = 101;

/// Longest name or reason in an answer, in bytes.
pub const MAX_NOT_KEPT_TEXT: usize = 400;

/// Have the kernel save its globals to the state file, within bounds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SaveStateRequest {
    /// Largest state file, in bytes: a name whose pickle would go over it is left out.
    pub max_bytes: u64,
    /// How long the kernel may pickle: past it the rest of the names are left out. The
    /// runner waits a little longer for the answer, then kills the kernel.
    pub timeout_ms: u64,
}

/// What a save did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StateSaved {
    /// Size of the state file; 0 when nothing was saved (no kernel, no state, a failure).
    pub bytes: u64,
    /// Values pickled.
    pub saved: u32,
    /// Modules recorded by name, imported again at the restore.
    pub modules: u32,
    /// Names left out, with why (an open file, too large, the error pickling gave).
    #[serde(default)]
    pub skipped: Vec<NotKept>,
    /// Why nothing could be saved, when so.
    #[serde(default)]
    pub error: Option<String>,
    /// How long the save took in the sandbox.
    pub duration_ms: u64,
}

/// A global that did not make it across, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NotKept {
    /// The global's name.
    pub name: String,
    /// What it is, or what went wrong.
    pub why: String,
}

/// Send up to `len` bytes of a file of the state directory from `offset` (answered with a
/// [`crate::files::FileChunk`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReadStateRequest {
    /// Which file: the Python state unless said (the field came with the installs).
    #[serde(default)]
    pub file: crate::StateFile,
    /// Where to start reading.
    pub offset: u64,
    /// How many bytes at most (capped at [`crate::files::MAX_CHUNK_BYTES`]).
    pub len: u32,
}

/// Write a piece of a file of the state directory (answered with a
/// [`crate::files::FileWritten`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WriteStateRequest {
    /// Which file: the Python state unless said.
    #[serde(default)]
    pub file: crate::StateFile,
    /// Where the bytes go.
    pub offset: u64,
    /// The bytes (at most [`crate::files::MAX_CHUNK_BYTES`]).
    #[serde(with = "crate::files::base64")]
    pub data: Vec<u8>,
    /// The first piece: any earlier state file is replaced.
    pub create: bool,
}

/// Have the kernel load the state file into its globals: before it runs code (a kernel
/// that has is refused), starting it when none runs. The file is removed afterwards.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RestoreStateRequest {
    /// Largest state file the kernel accepts, in bytes.
    pub max_bytes: u64,
    /// How long the load may take before the runner kills the kernel (a fresh one runs
    /// the next exec).
    pub timeout_ms: u64,
}

/// What a restore did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StateRestored {
    /// Globals restored, modules included. More than 0: the next exec's `runtime_status`
    /// is `reused`.
    pub restored: u32,
    /// Names that could not be loaded, with why.
    #[serde(default)]
    pub failed: Vec<NotKept>,
    /// Why nothing could be restored, when so (a damaged file, a kernel that had run code).
    #[serde(default)]
    pub error: Option<String>,
    /// How long the restore took in the sandbox.
    pub duration_ms: u64,
}

/// `text` cut to at most `max` bytes on a character boundary.
pub fn clip(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// The names of a kernel answer (`[[name, why], ...]`) as [`NotKept`], bounded in count
/// and length whatever the kernel sent.
pub fn not_kept(pairs: &[Vec<String>]) -> Vec<NotKept> {
    pairs
        .iter()
        .take(MAX_NOT_KEPT)
        .map(|pair| NotKept {
            name: clip(pair.first().map_or("?", String::as_str), MAX_NOT_KEPT_TEXT).to_string(),
            why: clip(pair.get(1).map_or("", String::as_str), MAX_NOT_KEPT_TEXT).to_string(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_answers_are_bounded() {
        let long = "é".repeat(1000);
        let pairs: Vec<Vec<String>> = (0..500)
            .map(|i| vec![format!("n{i}"), long.clone()])
            .chain([vec![], vec!["only".into()]])
            .collect();
        let kept = not_kept(&pairs);
        assert_eq!(kept.len(), MAX_NOT_KEPT);
        assert!(kept.iter().all(|k| k.why.len() <= MAX_NOT_KEPT_TEXT));
        assert_eq!(not_kept(&[vec![]])[0].name, "?");
        assert_eq!(clip("aé", 2), "a");
    }
}
