//! A session's saved Python state on the host, beside its other metadata (the root is
//! the broker's alone, 0700): `python-state.bin`, the bytes the kernel of its last
//! container wrote (pickles, which the broker never reads: only the session's next kernel
//! does, in its sandbox), and `python-state.json`, what that save said. Both 0600. They go
//! when the state is restored (or found unusable), or with the session.

use super::fs::write_atomic;
use super::Workspace;
use sandbox_runner::NotKept;
use serde::{Deserialize, Serialize};
use std::io;
use std::path::PathBuf;

/// The saved bytes, in the session's root.
const STATE_BYTES: &str = "python-state.bin";

/// The bytes while they come in, renamed to [`STATE_BYTES`] when complete.
const STATE_PART: &str = "python-state.bin.part";

/// What the save said, in the session's root.
const STATE_META: &str = "python-state.json";

/// The archive of the session's installs, from its last sandbox whose disk went with it
/// (see `sandbox_runner::installs`), in the session's root.
const INSTALLS: &str = "installs.tar";

/// The archive while it comes in, renamed to [`INSTALLS`] when complete.
const INSTALLS_PART: &str = "installs.tar.part";

/// Why the last pack kept nothing, for the next exec's stderr.
const INSTALLS_NOTE: &str = "installs-note.txt";

/// What a save of the session's Python state kept, and what it left out.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct SavedState {
    /// Milliseconds since the epoch of the save.
    pub(crate) saved_ms: u64,
    /// Size of the saved bytes; 0 when the save kept nothing (the note says why).
    pub(crate) bytes: u64,
    /// SHA-256 of the saved bytes, so that bytes that changed on disk are not sent.
    #[serde(default)]
    pub(crate) sha256: Option<String>,
    /// Values the kernel pickled.
    pub(crate) values: u32,
    /// Modules it recorded by name.
    pub(crate) modules: u32,
    /// Names it left out, and why, for the next exec's stderr.
    #[serde(default)]
    pub(crate) not_kept: Vec<NotKept>,
    /// Why nothing was kept, when a save failed.
    #[serde(default)]
    pub(crate) failed: Option<String>,
    /// How long the save took, pickling and moving the bytes (for operators).
    #[serde(default)]
    pub(crate) duration_ms: u64,
    /// Of which the kernel's pickling (and writing to `/tmp`).
    #[serde(default)]
    pub(crate) pickle_ms: u64,
}

impl Workspace {
    /// Where the saved bytes are.
    pub(crate) fn state_path(&self) -> PathBuf {
        self.root.join(STATE_BYTES)
    }

    /// A new, empty file for saved bytes to come into (0600), replacing an unfinished one.
    pub(crate) fn state_part(&self) -> io::Result<(PathBuf, std::fs::File)> {
        self.fresh_part(STATE_PART)
    }

    /// A new, empty 0600 file `name` in the root, replacing an unfinished one.
    fn fresh_part(&self, name: &str) -> io::Result<(PathBuf, std::fs::File)> {
        let path = self.root.join(name);
        let _ = std::fs::remove_file(&path);
        let file = super::create_private(&path)?;
        Ok((path, file))
    }

    /// Records a save: the bytes that came into `part` (none: the save kept nothing) and
    /// what it said. Replaces an earlier state.
    pub(crate) fn keep_state(&self, part: Option<&PathBuf>, saved: &SavedState) -> io::Result<()> {
        match part {
            Some(part) => std::fs::rename(part, self.state_path())?,
            None => remove_if_there(self.state_path())?,
        }
        write_atomic(&self.root.join(STATE_META), &serde_json::to_vec(saved)?)
    }

    /// The size of the saved bytes (0: none), which count against the storage budgets.
    pub(crate) fn saved_state_bytes(&self) -> u64 {
        std::fs::metadata(self.state_path()).map_or(0, |m| m.len())
    }

    /// The state saved for the session, if any.
    pub(crate) fn saved_state(&self) -> io::Result<Option<SavedState>> {
        match self.load_meta(STATE_META) {
            Ok(saved) => Ok(Some(saved)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Removes the saved state (restored, or unusable).
    pub(crate) fn forget_state(&self) -> io::Result<()> {
        remove_if_there(self.root.join(STATE_META))?;
        remove_if_there(self.root.join(STATE_PART))?;
        remove_if_there(self.state_path())
    }
}

impl Workspace {
    /// Where the archive of the session's installs is, when one was kept.
    pub(crate) fn installs_path(&self) -> PathBuf {
        self.root.join(INSTALLS)
    }

    /// A new, empty file for an archive of installs to come into (0600), replacing an
    /// unfinished one.
    pub(crate) fn installs_part(&self) -> io::Result<(PathBuf, std::fs::File)> {
        self.fresh_part(INSTALLS_PART)
    }

    /// Records what a pack kept: the archive that came into `part`, or none (nothing was
    /// installed: an earlier archive goes). A part that did not come whole is dropped and
    /// the earlier archive stays.
    pub(crate) fn keep_installs(&self, part: Option<&PathBuf>) -> io::Result<()> {
        match part {
            Some(part) => std::fs::rename(part, self.installs_path()),
            None => remove_if_there(self.installs_path()),
        }
    }

    /// Drops an archive that did not come whole.
    pub(crate) fn drop_installs_part(&self) {
        let _ = std::fs::remove_file(self.root.join(INSTALLS_PART));
    }

    /// Records why the installs were not kept (`None`: they were, or nothing was
    /// installed), for the next exec to say.
    pub(crate) fn note_installs(&self, why: Option<&str>) -> io::Result<()> {
        match why {
            Some(why) => write_atomic(&self.root.join(INSTALLS_NOTE), why.as_bytes()),
            None => remove_if_there(self.root.join(INSTALLS_NOTE)),
        }
    }

    /// Why the installs were not kept, said once: the note goes as it is read.
    pub(crate) fn take_installs_note(&self) -> Option<String> {
        let path = self.root.join(INSTALLS_NOTE);
        let why = std::fs::read_to_string(&path).ok()?;
        let _ = std::fs::remove_file(path);
        Some(why.chars().take(1000).collect())
    }

    /// The size of the kept archive (0: none), which counts against the storage budgets.
    pub(crate) fn installs_bytes(&self) -> u64 {
        std::fs::metadata(self.installs_path()).map_or(0, |m| m.len())
    }
}

fn remove_if_there(path: PathBuf) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt as _;

    #[test]
    fn kept_installs_are_the_brokers_alone_and_their_note_is_said_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ws = Workspace::new(dir.path(), "s");
        ws.create(10001).expect("create");
        assert_eq!(ws.installs_bytes(), 0);
        let (part, mut file) = ws.installs_part().expect("part");
        std::io::Write::write_all(&mut file, b"tar bytes").expect("write");
        ws.keep_installs(Some(&part)).expect("keep");
        assert_eq!(ws.installs_bytes(), 9);
        let mode = std::fs::metadata(ws.installs_path()).expect("kept").mode();
        assert_eq!(mode & 0o777, 0o600);
        // Not among the files the sandbox mounts.
        assert!(!ws.files_dir().join(INSTALLS).exists());
        ws.note_installs(Some("too large")).expect("note");
        assert_eq!(ws.take_installs_note().as_deref(), Some("too large"));
        assert_eq!(ws.take_installs_note(), None);
        ws.keep_installs(None).expect("forget");
        assert_eq!(ws.installs_bytes(), 0);
    }

    #[test]
    fn a_saved_state_is_the_brokers_alone_and_goes_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ws = Workspace::new(dir.path(), "s");
        ws.create(10001).expect("create");
        assert_eq!(ws.saved_state().expect("read"), None);
        let (part, mut file) = ws.state_part().expect("part");
        std::io::Write::write_all(&mut file, b"pickles").expect("write");
        let saved = SavedState {
            bytes: 7,
            values: 1,
            not_kept: vec![NotKept {
                name: "f".into(),
                why: "an open file".into(),
            }],
            ..SavedState::default()
        };
        ws.keep_state(Some(&part), &saved).expect("keep");
        assert_eq!(ws.saved_state().expect("read"), Some(saved));
        for path in [ws.state_path(), ws.root().join(STATE_META)] {
            let meta = std::fs::metadata(&path).expect("meta");
            assert_eq!(meta.mode() & 0o777, 0o600, "{}", path.display());
        }
        assert!(
            !ws.files_dir().join(STATE_BYTES).exists(),
            "never in the sandbox's view"
        );
        // A save that kept nothing replaces the bytes with its note.
        let failed = SavedState {
            failed: Some("took too long".into()),
            ..SavedState::default()
        };
        ws.keep_state(None, &failed).expect("keep");
        assert!(!ws.state_path().exists());
        assert_eq!(ws.saved_state().expect("read"), Some(failed));
        ws.forget_state().expect("forget");
        assert_eq!(ws.saved_state().expect("read"), None);
        ws.forget_state().expect("twice is fine");
    }
}
