//! One exec as a pipeline with typed hand-offs: what a front end asks for and the one way
//! to start it ([`Broker::start_exec`]: admission returns [`Admitted`], the only thing
//! the run takes), the run in stages (`run.rs`), the events front ends receive
//! (`events.rs`), the files it leaves (`collect.rs`), and the verdict on its output.

mod collect;
mod events;
pub(crate) mod rich;
mod run;

pub(crate) use events::{Display, ExecEvent, OutputStream};

use crate::core::error::{Error, Result};
use crate::core::limits::ContainerSlot;
use crate::core::{Broker, SessionChoice};
use crate::session::Session;
use crate::workspace::FileRecord;
use sandbox_runner::{Language, Limit, RuntimeStatus, ToolCall, ToolResult, ToolSpec};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// A reference to an input file, in either contract generation.
#[derive(Debug, Clone)]
pub(crate) struct InputFile {
    /// The file id.
    pub(crate) id: String,
    /// The session (classic `session_id`, new `storage_session_id`) that holds it.
    pub(crate) session_id: String,
    /// Where it goes under `/mnt/data` (may hold a relative path).
    pub(crate) name: String,
}

impl InputFile {
    /// How a note names the ref: its name, or its id when it carries none.
    pub(crate) fn shown_name(&self) -> &str {
        if self.name.is_empty() {
            &self.id
        } else {
            &self.name
        }
    }
}

/// One exec as the front ends ask for it.
#[derive(Debug, Clone)]
pub(crate) struct ExecInput {
    pub(crate) lang: Language,
    pub(crate) code: String,
    pub(crate) args: Vec<String>,
    /// Requested wall-time limit in ms; capped by the configuration.
    pub(crate) timeout_ms: Option<u64>,
    /// Files to place in `/mnt/data` first.
    pub(crate) files: Vec<InputFile>,
    /// The caller's tenant: whose shared files (skills, agent files) `files` may name.
    pub(crate) tenant: Option<String>,
    /// Python values as MIME bundles, exceptions as events (E2B's interpreter), instead
    /// of printed.
    pub(crate) rich: bool,
}

/// Whether `name` may be an environment variable's name: front ends write the variables a
/// client names into code (Bash exports, Python's `os.environ`).
pub(crate) fn is_env_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// What a front end attaches to an exec besides its input.
#[derive(Default)]
pub(crate) struct ExecHooks {
    /// Output chunks and displays as they happen (streaming); `None` collects output
    /// into the result instead. Bounded: a consumer that stops reading holds the exec
    /// back (down to the code's writes) rather than letting events pile up here.
    pub(crate) events: Option<mpsc::Sender<ExecEvent>>,
    /// Tools the code may call, and the way to their caller.
    pub(crate) tools: Option<ToolBridge>,
    /// Stops the exec when cancelled (a client gone, the cancel route).
    pub(crate) cancel: Option<CancellationToken>,
    /// The program's stdin (E2B's commands): what comes here is written to it, until a
    /// piece closes it. `None`: stdin is `/dev/null`.
    pub(crate) stdin: Option<mpsc::Receiver<sandbox_runner::StdinChunk>>,
}

/// The broker's side of programmatic tool calling for one exec.
pub(crate) struct ToolBridge {
    /// The tools the code is given.
    pub(crate) specs: Vec<ToolSpec>,
    /// Where the code's calls go.
    pub(crate) calls: mpsc::UnboundedSender<ToolCall>,
    /// Where their results come from. Bounded: a front end that answers faster than the
    /// sandbox takes the results waits, rather than piling them up here.
    pub(crate) results: mpsc::Receiver<ToolResult>,
}

/// What one exec produced.
#[derive(Debug, Clone)]
pub(crate) struct ExecOutput {
    pub(crate) session_id: String,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
    /// Files created or changed by this exec.
    pub(crate) files: Vec<FileRecord>,
    pub(crate) runtime_status: RuntimeStatus,
    pub(crate) exit_code: Option<i32>,
    pub(crate) duration_ms: u64,
    pub(crate) limits: Vec<Limit>,
    /// For compiled languages, whether the sandbox's compile cache had the program.
    pub(crate) compile_cached: Option<bool>,
    /// Input refs of this exec whose files the code removed from `/mnt/data`, by the
    /// names the refs carried: clients drop those refs instead of sending them again.
    /// Read-only inputs are never among them (they are put back).
    pub(crate) deleted_files: Vec<String>,
    /// How many of the files the exec created or changed were kept: clients tell the
    /// model which ones it cannot count on.
    pub(crate) delivery: Delivery,
}

/// Of the files one exec created or changed, how many the broker tried to keep and how
/// many it could not (over a cap, over the storage budget, an error).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Delivery {
    /// New or changed files found.
    pub(crate) attempted: usize,
    /// Those not kept; the rest are in the exec's `files`.
    pub(crate) failed: usize,
}

impl Delivery {
    /// Those kept.
    pub(crate) fn delivered(&self) -> usize {
        self.attempted - self.failed
    }
}

/// What collecting an exec's files found.
#[derive(Debug, Default)]
pub(crate) struct Collected {
    /// Versions the exec created or changed, kept.
    pub(crate) files: Vec<FileRecord>,
    /// Notes for stderr.
    pub(crate) notes: Vec<String>,
    /// Kept against tried.
    pub(crate) delivery: Delivery,
    /// Names whose files are gone from `/mnt/data` (read-only ones put back are not).
    pub(crate) gone: Vec<String>,
}

/// How an exec ended, read off its output. Every front end words its answer from this
/// one rule (a limit hit counts whatever the exit code).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Exit code 0 and no limit hit.
    Ok,
    /// Exited with this non-zero code.
    Failed(i32),
    /// Ended without an exit code: stopped, or the sandbox went away.
    Stopped,
    /// Hit these limits, in the order the runner reported them.
    Limit(Vec<Limit>),
}

impl Verdict {
    /// Whether the exec succeeded.
    pub(crate) fn is_ok(&self) -> bool {
        *self == Verdict::Ok
    }

    /// The `outcome` label of the metrics and the audit log.
    pub(crate) fn outcome(&self) -> &'static str {
        match self {
            Verdict::Ok => "ok",
            Verdict::Failed(_) | Verdict::Stopped => "error",
            Verdict::Limit(_) => "limit",
        }
    }
}

impl ExecOutput {
    /// How the exec ended.
    pub(crate) fn verdict(&self) -> Verdict {
        if !self.limits.is_empty() {
            return Verdict::Limit(self.limits.clone());
        }
        match self.exit_code {
            Some(0) => Verdict::Ok,
            Some(code) => Verdict::Failed(code),
            None => Verdict::Stopped,
        }
    }
}

/// An exec started by [`Broker::start_exec`], running in a task of its own so that the
/// session's turn is released properly even if its front end goes away. Awaiting it gives
/// the exec's output.
pub(crate) struct ExecRun {
    /// The session the exec runs in.
    pub(crate) session: Arc<Session>,
    /// The exec's task.
    task: JoinHandle<Result<ExecOutput>>,
    /// The exec's cancel signal, fired when the run is dropped unfinished (see
    /// [`ExecRun::cancel_on_drop`]); `None` leaves a dropped exec running to its end.
    cancel_on_drop: Option<CancellationToken>,
}

impl ExecRun {
    /// Stops the exec when this run is dropped before it finished (a client that went
    /// away), through the cancel signal of its hooks; without one it runs on.
    pub(crate) fn cancel_on_drop(mut self, cancel: Option<&CancellationToken>) -> ExecRun {
        self.cancel_on_drop = cancel.cloned();
        self
    }
}

impl Future for ExecRun {
    type Output = Result<ExecOutput>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.task).poll(cx).map(|joined| {
            joined
                .map_err(Error::task("exec"))
                .and_then(|output| output)
        })
    }
}

impl Drop for ExecRun {
    fn drop(&mut self) {
        if let Some(cancel) = self.cancel_on_drop.take() {
            if !self.task.is_finished() {
                cancel.cancel();
            }
        }
    }
}

/// An exec admitted by [`Broker::admit_exec`]: its session, and the reservation of the
/// container start a session made for it needs. Only admission makes one, and
/// [`Broker::spawn_exec`] takes only this: no front end can run code without the rate
/// check and the caps.
#[must_use = "the reservation ends when it is dropped"]
pub(crate) struct Admitted {
    /// The session the exec runs in.
    session: Arc<Session>,
    /// The container start reserved by admission, for a session it made without a
    /// sandbox; handed to [`Broker::sandbox_for`], so the caps are not checked again.
    slot: Option<ContainerSlot>,
}

impl AsRef<Session> for Admitted {
    fn as_ref(&self) -> &Session {
        &self.session
    }
}

impl Broker {
    /// The one way a front end runs code: the caller's exec rate, the session choice
    /// (with its input refs authorised), then the exec in a task of its own.
    pub(crate) async fn start_exec(
        self: &Arc<Self>,
        choice: &SessionChoice,
        input: ExecInput,
        hooks: ExecHooks,
    ) -> Result<ExecRun> {
        let admitted = self.admit_exec(choice, &input.files).await?;
        Ok(self.spawn_exec(admitted, input, hooks))
    }

    /// The first half of [`Broker::start_exec`], for a front end that holds on to the
    /// session before it starts the exec: the rate check, then the session choice.
    pub(crate) async fn admit_exec(
        &self,
        choice: &SessionChoice,
        files: &[InputFile],
    ) -> Result<Admitted> {
        self.limits
            .check_exec(&(choice.tenant.clone(), choice.user.clone()))?;
        let (session, slot) = self.choose_session(choice, files).await?;
        Ok(Admitted { session, slot })
    }

    /// The second half of [`Broker::start_exec`]: the admitted exec in a task of its own.
    pub(crate) fn spawn_exec(
        self: &Arc<Self>,
        admitted: Admitted,
        input: ExecInput,
        hooks: ExecHooks,
    ) -> ExecRun {
        let broker = self.clone();
        let session = admitted.session.clone();
        let task = tokio::spawn(async move { broker.exec(admitted, input, hooks).await });
        ExecRun {
            session,
            task,
            cancel_on_drop: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::is_env_name;

    #[test]
    fn env_names_are_checked() {
        assert!(is_env_name("FOO_1"));
        assert!(is_env_name("_x"));
        assert!(!is_env_name("1A"));
        assert!(!is_env_name("A;rm"));
        assert!(!is_env_name("A B"));
        assert!(!is_env_name(""));
    }
}
