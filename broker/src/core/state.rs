//! Python state across sandboxes, the rules: when a session's container is removed while
//! its kernel holds state (idle or single-use TTL, eviction under a cap, a stop with
//! `remove`), the state is saved first, within CODEBROKER_STATE_TIMEOUT_SECS, into the
//! session's workspace; before the session's next Python exec in a new container it is
//! loaded there, and the exec reports `runtime_status: "reused"`. What could not be kept or
//! loaded, and a save or restore that failed, is said in that exec's stderr.
//!
//! The broker only moves bytes (`sandbox::runner_state`) and keeps them
//! (`workspace::state`); it never unpickles: only the kernel of the session's own next
//! sandbox does.

use crate::config::StateConfig;
use crate::core::installs::{self, InstallRules};
use crate::core::Broker;
use crate::sandbox::{runner_state, Sandbox};
use crate::session::Session;
use crate::workspace::{SavedState, Workspace};
use sandbox_runner::{NotKept, StateFile};
use sha2::{Digest, Sha256};
use std::io::{self, Read};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Names a note lists; the rest are counted.
const NOTE_NAMES: usize = 20;

/// How long a removal waits, after the time bound, for a save to notice it is over (the
/// sandbox is closed then, so its last request fails at once) and leave its note.
const SAVE_WIND_DOWN: Duration = Duration::from_secs(2);

/// What the state rules take of the configuration: copied into removals that run in the
/// background, so they borrow nothing of the broker.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StateRules {
    /// Whether states are saved and restored at all.
    enabled: bool,
    /// Largest saved state, in bytes: CODEBROKER_STATE_MAX_BYTES, or less when the
    /// session's storage budget has less room left.
    max_bytes: u64,
    /// Whether `max_bytes` is the storage budget's room rather than the setting.
    bounded_by_budget: bool,
    /// The time bound of a save, and of a restore.
    timeout: Duration,
    /// How the session's installs go to its next sandbox, when its disk does not.
    installs: Option<InstallRules>,
}

impl StateRules {
    pub(crate) fn of(config: &StateConfig) -> StateRules {
        StateRules {
            enabled: config.enabled(),
            max_bytes: config.state_max_bytes,
            bounded_by_budget: false,
            timeout: Duration::from_secs(config.state_timeout_secs),
            installs: None,
        }
    }

    /// What bounds a saved state's size, for notes.
    fn bound(&self) -> String {
        if self.bounded_by_budget {
            format!(
                "the {} bytes left of the storage budget (CODEBROKER_SESSION_STORAGE, \
                 CODEBROKER_USER_STORAGE)",
                self.max_bytes
            )
        } else {
            format!("CODEBROKER_STATE_MAX_BYTES ({} bytes)", self.max_bytes)
        }
    }

    fn took_too_long(&self) -> String {
        format!(
            "it took longer than {} s (CODEBROKER_STATE_TIMEOUT_SECS)",
            self.timeout.as_secs()
        )
    }
}

/// Saves the state of `sandbox`'s kernel for `session`, whose container is about to be
/// removed, and its installs when its disk goes with it; returns within the time bounds
/// whatever the sandbox does. Call it holding the session's turn (no exec runs), before the
/// sandbox is closed.
pub(crate) async fn save_before_removal(
    rules: StateRules,
    session: &Session,
    sandbox: &Arc<Sandbox>,
) {
    save_state_before_removal(rules, session, sandbox).await;
    if let Some(installs) = rules.installs {
        installs::keep_before_removal(installs, session, sandbox).await;
    }
}

/// Runs `work` (which talks to `sandbox`) off the async threads within `bound`; past it
/// closes the sandbox, so that the request under way fails and `work` can leave its note,
/// and waits [`SAVE_WIND_DOWN`] more for that. `None` when even that did not come.
pub(crate) async fn within_bound<T: Send + 'static>(
    bound: Duration,
    sandbox: &Sandbox,
    why: &str,
    work: impl FnOnce() -> T + Send + 'static,
) -> Option<Result<T, tokio::task::JoinError>> {
    let mut task = tokio::task::spawn_blocking(work);
    match tokio::time::timeout(bound, &mut task).await {
        Ok(joined) => Some(joined),
        Err(_) => {
            sandbox.close(why);
            tokio::time::timeout(SAVE_WIND_DOWN, task).await.ok()
        }
    }
}

async fn save_state_before_removal(rules: StateRules, session: &Session, sandbox: &Arc<Sandbox>) {
    if !rules.enabled || !sandbox.is_alive() {
        return;
    }
    let started = Instant::now();
    let deadline = started + rules.timeout;
    let (workspace, moved) = (session.workspace.clone(), sandbox.clone());
    let Some(outcome) = within_bound(
        rules.timeout,
        sandbox,
        "the Python state took too long to save",
        move || save_blocking(rules, &workspace, &moved, deadline),
    )
    .await
    else {
        return;
    };
    let elapsed_ms = started.elapsed().as_millis() as u64;
    match outcome {
        Ok(Ok(Some(saved))) => tracing::info!(
            session = session.id(),
            bytes = saved.bytes,
            pickle_ms = saved.pickle_ms,
            values = saved.values,
            modules = saved.modules,
            left_out = saved.not_kept.len(),
            elapsed_ms,
            "saved the Python state"
        ),
        Ok(Ok(None)) => {}
        Ok(Err(err)) => {
            tracing::warn!(session = session.id(), error = %err, elapsed_ms, "cannot save the Python state")
        }
        Err(err) => {
            tracing::error!(session = session.id(), error = %err, "the state save task failed")
        }
    }
}

/// The save, off the async threads: `None` when the kernel held nothing. A failure is
/// recorded for the next exec's stderr.
fn save_blocking(
    rules: StateRules,
    workspace: &Workspace,
    sandbox: &Sandbox,
    deadline: Instant,
) -> io::Result<Option<SavedState>> {
    let started = Instant::now();
    let saved = pull_state(rules, workspace, sandbox, started, deadline);
    let failed = match saved {
        Ok(saved) => return Ok(saved),
        Err(err) if Instant::now() >= deadline => (rules.took_too_long(), err),
        Err(err) => (err.to_string(), err),
    };
    let note = SavedState {
        saved_ms: crate::clock::now_ms(),
        failed: Some(failed.0),
        ..SavedState::default()
    };
    workspace.keep_state(None, &note)?;
    Err(failed.1)
}

fn pull_state(
    rules: StateRules,
    workspace: &Workspace,
    sandbox: &Sandbox,
    started: Instant,
    deadline: Instant,
) -> io::Result<Option<SavedState>> {
    // The kernel pickles for half the bound at most: the rest is for moving the bytes.
    let answer = runner_state::save(sandbox, rules.max_bytes, rules.timeout / 2, deadline)?;
    let mut saved = SavedState {
        saved_ms: crate::clock::now_ms(),
        bytes: 0,
        sha256: None,
        values: answer.saved,
        modules: answer.modules,
        not_kept: answer.skipped,
        failed: answer.error,
        duration_ms: started.elapsed().as_millis() as u64,
        pickle_ms: answer.duration_ms,
    };
    if answer.bytes == 0 {
        if saved.failed.is_none() && saved.not_kept.is_empty() {
            return Ok(None); // no kernel, or one that held nothing
        }
        workspace.keep_state(None, &saved)?;
        return Ok(Some(saved));
    }
    let (part, file) = workspace.state_part()?;
    let mut out = io::BufWriter::with_capacity(1 << 20, file);
    let pulled = runner_state::pull(
        sandbox,
        StateFile::Python,
        &mut out,
        rules.max_bytes,
        deadline,
    )
    .and_then(|pulled| io::Write::flush(&mut out).map(|()| pulled));
    drop(out);
    let kept = match pulled {
        Ok(Some((sha256, size))) if size == answer.bytes && Instant::now() < deadline => {
            saved.bytes = size;
            saved.sha256 = Some(sha256);
            saved.duration_ms = started.elapsed().as_millis() as u64;
            workspace.keep_state(Some(&part), &saved)
        }
        Ok(Some(_)) if Instant::now() >= deadline => {
            Err(io::Error::new(io::ErrorKind::TimedOut, "out of time"))
        }
        Ok(Some((_, size))) => Err(io::Error::other(format!(
            "the sandbox sent {size} bytes, not the {} it saved",
            answer.bytes
        ))),
        Ok(None) => Err(io::Error::other(format!(
            "the sandbox sent more than {}",
            rules.bound()
        ))),
        Err(err) => Err(err),
    };
    if kept.is_err() {
        let _ = std::fs::remove_file(&part);
    }
    kept.map(|()| Some(saved))
}

impl Broker {
    /// The state rules of the configuration.
    pub(crate) fn state_rules(&self) -> StateRules {
        StateRules::of(&self.config.state)
    }

    /// The state rules for saving `session`'s state: a saved state counts against the
    /// storage budgets like the session's files, so it gets at most the room they leave.
    pub(crate) fn state_rules_for(&self, session: &Session) -> StateRules {
        let mut rules = self.state_rules();
        let room = self
            .storage_budget(session)
            .room
            .saturating_sub(session.index().stored_bytes());
        if room < rules.max_bytes {
            rules.max_bytes = room;
            rules.bounded_by_budget = true;
        }
        rules.installs = self.install_rules_for(session);
        rules
    }

    /// Saves the state of the session's sandbox, then discards the sandbox (see
    /// [`save_before_removal`]). Call it holding the session's turn.
    pub(crate) async fn retire_sandbox(&self, session: &Session, sandbox: &Arc<Sandbox>) {
        save_before_removal(self.state_rules_for(session), session, sandbox).await;
        self.discard_sandbox(session, sandbox).await;
    }

    /// Before a Python exec: loads the state saved from the session's last container into
    /// `sandbox`'s kernel, if one was saved; notes for the exec's stderr (what could not be
    /// kept or loaded). The saved state is used once: it is removed afterwards, whatever
    /// happened, unless it never reached the sandbox.
    pub(crate) async fn restore_state(
        &self,
        session: &Arc<Session>,
        sandbox: &Arc<Sandbox>,
    ) -> Vec<String> {
        let workspace = session.workspace.clone();
        let saved = match workspace.saved_state() {
            Ok(Some(saved)) => saved,
            Ok(None) => return Vec::new(),
            Err(err) => {
                tracing::warn!(session = session.id(), error = %err, "cannot read the saved Python state");
                let _ = workspace.forget_state();
                return vec![lost_note("its record is damaged")];
            }
        };
        let rules = self.state_rules();
        if !rules.enabled {
            // Turned off since it was saved: nothing of it is loaded.
            let _ = workspace.forget_state();
            return Vec::new();
        }
        if saved.bytes == 0 {
            let _ = workspace.forget_state();
            return vec![not_saved_note(&saved)];
        }
        let started = Instant::now();
        let (ws, sb) = (workspace.clone(), sandbox.clone());
        let task = tokio::task::spawn_blocking(move || {
            push_and_restore(rules, &ws, &sb, &saved, started + rules.timeout)
        });
        let outcome = task.await;
        let notes = match outcome {
            Ok(Ok(Restore::Done {
                restored,
                failed,
                not_kept,
            })) => {
                tracing::info!(
                    session = session.id(),
                    restored,
                    failed = failed.len(),
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "restored the Python state"
                );
                let left_out: Vec<NotKept> = not_kept.into_iter().chain(failed).collect();
                if left_out.is_empty() {
                    Vec::new()
                } else if restored == 0 {
                    vec![lost_note(&format!(
                        "none could be loaded: {}",
                        names_and_why(&left_out)
                    ))]
                } else {
                    vec![format!(
                        "Python variables of this session were restored in a new sandbox, \
                         except: {}.",
                        names_and_why(&left_out)
                    )]
                }
            }
            Ok(Ok(Restore::Refused(why))) => vec![lost_note(&why)],
            Ok(Err(err)) => {
                tracing::warn!(session = session.id(), error = %err, "cannot restore the Python state");
                if Instant::now() >= started + rules.timeout {
                    vec![lost_note(&rules.took_too_long())]
                } else {
                    vec![lost_note(&err.to_string())]
                }
            }
            Err(err) => {
                tracing::error!(session = session.id(), error = %err, "the state restore task failed");
                vec![lost_note("an internal error")]
            }
        };
        if let Err(err) = workspace.forget_state() {
            tracing::warn!(session = session.id(), error = %err, "cannot remove the saved Python state");
        }
        notes
    }
}

/// How a restore ended, when the sandbox could be reached.
enum Restore {
    /// The kernel loaded what it could.
    Done {
        /// Globals restored.
        restored: u32,
        /// Names the kernel could not load.
        failed: Vec<NotKept>,
        /// Names the save had left out.
        not_kept: Vec<NotKept>,
    },
    /// Nothing was loaded, for this reason.
    Refused(String),
}

/// Sends the saved bytes to the sandbox (re-hashing them: bytes changed on disk are not
/// loaded) and has its kernel load them.
fn push_and_restore(
    rules: StateRules,
    workspace: &Workspace,
    sandbox: &Sandbox,
    saved: &SavedState,
    deadline: Instant,
) -> io::Result<Restore> {
    let path = workspace.state_path();
    let size = std::fs::metadata(&path)?.len();
    if size > rules.max_bytes {
        return Ok(Restore::Refused(format!(
            "it has {size} bytes, more than CODEBROKER_STATE_MAX_BYTES ({})",
            rules.max_bytes
        )));
    }
    if size != saved.bytes || saved.sha256.as_deref() != Some(hash_file(&path)?.as_str()) {
        return Ok(Restore::Refused(
            "it changed on disk since it was saved".into(),
        ));
    }
    runner_state::push(sandbox, StateFile::Python, &path, deadline)?;
    let answer = runner_state::restore(sandbox, rules.max_bytes, deadline)?;
    if let Some(error) = answer.error {
        return Ok(Restore::Refused(error));
    }
    Ok(Restore::Done {
        restored: answer.restored,
        failed: answer.failed,
        not_kept: saved.not_kept.clone(),
    })
}

fn hash_file(path: &std::path::Path) -> io::Result<String> {
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            return Ok(hex::encode(hasher.finalize()));
        }
        hasher.update(&buf[..n]);
    }
}

/// `a (an open file), b (a generator)`, at most [`NOTE_NAMES`] of them.
fn names_and_why(names: &[NotKept]) -> String {
    let mut text = names
        .iter()
        .take(NOTE_NAMES)
        .map(|n| format!("{} ({})", printable(&n.name), printable(&n.why)))
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > NOTE_NAMES {
        text.push_str(&format!(" and {} more", names.len() - NOTE_NAMES));
    }
    text
}

/// What a sandbox said, without control characters (it ends up in an answer's text).
pub(crate) fn printable(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

/// The note of a save that kept nothing.
fn not_saved_note(saved: &SavedState) -> String {
    let why = match (&saved.failed, saved.not_kept.is_empty()) {
        (Some(error), _) => printable(error),
        (None, false) => format!("none could be pickled: {}", names_and_why(&saved.not_kept)),
        (None, true) => "nothing could be pickled".into(),
    };
    format!(
        "Python variables of this session could not be kept when its sandbox was removed \
         ({why}); this exec starts without them."
    )
}

/// The note of a restore that loaded nothing.
fn lost_note(why: &str) -> String {
    format!(
        "Python variables of this session could not be restored in its new sandbox \
         ({}); this exec starts without them.",
        printable(why)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn not_kept(name: &str, why: &str) -> NotKept {
        NotKept {
            name: name.into(),
            why: why.into(),
        }
    }

    #[test]
    fn notes_name_what_was_left_out_within_bounds() {
        let names: Vec<NotKept> = (0..30)
            .map(|i| not_kept(&format!("n{i}"), "a generator"))
            .collect();
        let text = names_and_why(&names);
        assert!(
            text.starts_with("n0 (a generator), n1 (a generator)"),
            "{text}"
        );
        assert!(text.ends_with("n19 (a generator) and 10 more"), "{text}");
        assert_eq!(
            names_and_why(&[not_kept("x\n\u{1b}[2J", "why\r")]),
            "x  [2J (why )"
        );
        let failed = SavedState {
            failed: Some("it took longer than 30 s".into()),
            ..SavedState::default()
        };
        assert!(not_saved_note(&failed).contains("(it took longer than 30 s)"));
        let unpicklable = SavedState {
            not_kept: vec![not_kept("f", "an open file")],
            ..SavedState::default()
        };
        assert!(not_saved_note(&unpicklable).contains("none could be pickled: f (an open file)"));
    }
}
