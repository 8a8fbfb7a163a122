//! A session's installs across sandboxes whose disk goes with them (Kubernetes pods): what
//! `pip install` and `npm install` put in the workspace's hidden `.local` and
//! `node_modules` is not among the files the broker keeps, so before such a sandbox is
//! removed the runner packs it into one archive (`sandbox_runner::installs`), which the
//! broker keeps beside the session's files (`installs.tar`, counted against the storage
//! budgets); the session's next sandbox gets it unpacked before its first exec. On Docker
//! the workspace outlives the container and none of this runs.
//!
//! What could not be kept or unpacked is said in the next exec's stderr; the exec runs
//! anyway, and the model installs again.

use crate::core::state::{printable, within_bound};
use crate::core::Broker;
use crate::sandbox::{runner_state, Sandbox, SandboxFiles};
use crate::session::Session;
use crate::workspace::Workspace;
use sandbox_runner::{InstallsPacked, StateFile};
use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What carrying a session's installs takes of the configuration, copied into removals.
#[derive(Debug, Clone, Copy)]
pub(crate) struct InstallRules {
    /// Largest archive: CODEBROKER_INSTALLS_MAX_BYTES, or the room the storage budgets
    /// leave when that is less.
    max_bytes: u64,
    /// Whether `max_bytes` is the storage budget's room rather than the setting.
    bounded_by_budget: bool,
    /// The time bound of a pack with its pull, and of a push with its unpack.
    timeout: Duration,
}

impl InstallRules {
    fn bound(&self) -> &'static str {
        if self.bounded_by_budget {
            "the room left of the storage budget (CODEBROKER_SESSION_STORAGE, CODEBROKER_USER_STORAGE)"
        } else {
            "CODEBROKER_INSTALLS_MAX_BYTES"
        }
    }
}

impl Broker {
    /// The rules for carrying `session`'s installs to its next sandbox; `None` when the
    /// engine's sandboxes keep their disk, or installs are not kept.
    pub(crate) fn install_rules_for(&self, session: &Session) -> Option<InstallRules> {
        let setting = self.config.state.installs_max_bytes;
        if setting == 0 || self.backend.disk_outlives_sandbox() {
            return None;
        }
        let room = self
            .storage_budget(session)
            .room
            .saturating_sub(session.index().stored_bytes())
            .saturating_sub(session.workspace.saved_state_bytes());
        Some(InstallRules {
            max_bytes: setting.min(room),
            bounded_by_budget: room < setting,
            timeout: Duration::from_secs(self.config.state.state_timeout_secs),
        })
    }
}

/// Packs and keeps the installs of `sandbox`, which is about to be removed; returns within
/// the time bound whatever the sandbox does. Call it holding the session's turn.
pub(crate) async fn keep_before_removal(
    rules: InstallRules,
    session: &Session,
    sandbox: &Arc<Sandbox>,
) {
    if !sandbox.is_alive() {
        return;
    }
    let started = Instant::now();
    let deadline = started + rules.timeout;
    let (workspace, moved) = (session.workspace.clone(), sandbox.clone());
    let outcome = within_bound(
        rules.timeout,
        sandbox,
        "the installs took too long to pack",
        move || pack_and_pull(rules, &workspace, &moved, deadline),
    )
    .await
    .unwrap_or_else(|| Ok(Err(io::Error::new(io::ErrorKind::TimedOut, "out of time"))));
    let elapsed_ms = started.elapsed().as_millis() as u64;
    let failed = match outcome {
        Ok(Ok(Some(packed))) => {
            tracing::info!(
                session = session.id(),
                bytes = packed.bytes,
                entries = packed.entries,
                pack_ms = packed.duration_ms,
                elapsed_ms,
                "kept the installs"
            );
            None
        }
        Ok(Ok(None)) => None,
        Ok(Err(err)) if Instant::now() >= deadline => Some(format!(
            "it took longer than {} s (CODEBROKER_STATE_TIMEOUT_SECS): {err}",
            rules.timeout.as_secs()
        )),
        Ok(Err(err)) => Some(err.to_string()),
        Err(err) => {
            tracing::error!(session = session.id(), error = %err, "the installs task failed");
            Some("an internal error".into())
        }
    };
    if let Some(why) = failed {
        tracing::warn!(session = session.id(), why = %why, elapsed_ms, "cannot keep the installs");
        session.workspace.drop_installs_part();
        // An earlier archive is not what the session has now: it goes too.
        let _ = session.workspace.keep_installs(None);
        if let Err(err) = session.workspace.note_installs(Some(&why)) {
            tracing::warn!(session = session.id(), error = %err, "cannot record why the installs were not kept");
        }
    }
}

/// The pack and the pull, off the async threads: `None` when nothing was installed.
fn pack_and_pull(
    rules: InstallRules,
    workspace: &Workspace,
    sandbox: &Sandbox,
    deadline: Instant,
) -> io::Result<Option<InstallsPacked>> {
    let packed = runner_state::pack_installs(sandbox, rules.max_bytes, deadline)?;
    if let Some(error) = &packed.error {
        let bound = if packed.over_bound {
            format!(" ({})", rules.bound())
        } else {
            String::new()
        };
        return Err(io::Error::other(format!("{}{bound}", printable(error))));
    }
    if packed.bytes == 0 {
        workspace.keep_installs(None)?;
        workspace.note_installs(None)?;
        return Ok(None);
    }
    let (part, file) = workspace.installs_part()?;
    let mut out = io::BufWriter::with_capacity(1 << 20, file);
    let pulled = runner_state::pull(
        sandbox,
        StateFile::Installs,
        &mut out,
        rules.max_bytes,
        deadline,
    )
    .and_then(|pulled| io::Write::flush(&mut out).map(|()| pulled));
    drop(out);
    match pulled? {
        Some((_, size)) if size == packed.bytes => {
            workspace.keep_installs(Some(&part))?;
            workspace.note_installs(None)?;
            Ok(Some(packed))
        }
        Some((_, size)) => Err(io::Error::other(format!(
            "the sandbox sent {size} bytes, not the {} it packed",
            packed.bytes
        ))),
        None => Err(io::Error::other(format!(
            "the sandbox sent more than {}",
            rules.bound()
        ))),
    }
}

/// Brings the session's installs into its new sandbox (whose disk started empty): what the
/// last pack kept, unpacked before the first exec. Blocks: call it off the async threads,
/// with the session's turn held. Notes for the exec's stderr.
pub(crate) fn restore_into_new_sandbox(at: &SandboxFiles, timeout: Duration) -> Vec<String> {
    let Some(sandbox) = at.sandbox.as_deref() else {
        return Vec::new();
    };
    let workspace = &at.workspace;
    let mut notes = Vec::new();
    if let Some(why) = workspace.take_installs_note() {
        notes.push(format!(
            "Packages installed earlier in this session were not kept when its sandbox was \
             removed ({}); install them again.",
            printable(&why)
        ));
    }
    let path = workspace.installs_path();
    let Ok(size) = std::fs::metadata(&path).map(|m| m.len()) else {
        return notes;
    };
    let deadline = Instant::now() + timeout;
    let restored = runner_state::push(sandbox, StateFile::Installs, &path, deadline)
        .and_then(|()| runner_state::unpack_installs(sandbox, size, deadline));
    match restored {
        Ok(unpacked) => {
            tracing::info!(
                entries = unpacked.entries,
                skipped = unpacked.skipped,
                unpack_ms = unpacked.duration_ms,
                "restored the installs"
            );
            if let Some(error) = unpacked.error {
                notes.push(not_restored_note(&error));
            }
        }
        Err(err) => {
            tracing::warn!(error = %err, "cannot restore the installs");
            notes.push(not_restored_note(&err.to_string()));
        }
    }
    notes
}

fn not_restored_note(why: &str) -> String {
    format!(
        "Packages installed earlier in this session could not all be restored in its new \
         sandbox ({}); install what is missing again.",
        printable(why)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_say_what_bounds_the_installs_and_carry_no_control_characters() {
        let budget = InstallRules {
            max_bytes: 10,
            bounded_by_budget: true,
            timeout: Duration::from_secs(1),
        };
        assert!(budget.bound().contains("CODEBROKER_SESSION_STORAGE"));
        let setting = InstallRules {
            bounded_by_budget: false,
            ..budget
        };
        assert_eq!(setting.bound(), "CODEBROKER_INSTALLS_MAX_BYTES");
        let note = not_restored_note("disk\nfull\u{1b}[2J");
        assert!(note.contains("(disk full [2J)"), "{note}");
    }
}
