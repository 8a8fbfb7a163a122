//! One exec: what a front end asks for, the one way to start it ([`Broker::start_exec`]),
//! the exec itself against the session's sandbox, and the verdict on what it produced.

use crate::core::error::{Error, Result};
use crate::core::files::PlacedInput;
use crate::core::limits::ContainerSlot;
use crate::core::{Broker, SessionChoice};
use crate::sandbox::{docker::short, ChannelError, Sandbox};
use crate::sandbox::{SandboxBackend, SandboxFiles};
use crate::session::Session;
use crate::workspace::{FileIndex, FileRecord, HarvestLimits};
use sandbox_runner::{
    Admit, DisplayBudget, ExecRequest, Language, Limit, RuntimeStatus, ToolCall, ToolResult,
    ToolSpec, WorkerMessage,
};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// How much longer than the exec's own limit the broker waits for the runner before it
/// declares the sandbox broken.
const EXEC_GRACE: Duration = Duration::from_secs(15);

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
}

/// What a front end attaches to an exec besides its input.
#[derive(Default)]
pub(crate) struct ExecHooks {
    /// Output chunks and displays as they happen (streaming); `None` collects output
    /// into the result instead. Bounded: a consumer that stops reading holds the exec
    /// back (down to the code's writes) rather than letting events pile up here.
    pub(crate) events: Option<mpsc::Sender<WorkerMessage>>,
    /// Tools the code may call, and the way to their caller.
    pub(crate) tools: Option<ToolBridge>,
    /// Stops the exec when cancelled (a client gone, the cancel route).
    pub(crate) cancel: Option<CancellationToken>,
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

    /// Runs one exec in `session`, after the execs queued before it. `hooks` carry what a
    /// front end attaches: a stream for output, tools, a cancel signal. Call it from a task
    /// of its own: if it is dropped half-way the runner is told to stop.
    async fn exec(
        &self,
        admitted: Admitted,
        input: ExecInput,
        hooks: ExecHooks,
    ) -> Result<ExecOutput> {
        let Admitted { session, slot } = admitted;
        let _turn = session.acquire().await;
        // Containers evicted to make room for this exec are removed once it has ended.
        let _running = session.exec_running();
        // Used from now on: the idle reaper leaves the sandbox of a starting exec alone.
        session.touch();
        let observed = crate::core::observe::ExecObservation::start(
            &self.metrics,
            &self.audit,
            &session,
            &input,
        );
        let started = Instant::now();
        let mut notes = Vec::new();
        // One direction: the sandbox, what changed while it was away, then the inputs
        // straight into it.
        let sandbox = self.sandbox_for(&session, slot).await?;
        notes.extend(self.settle_files(&session).await);
        let inputs = self
            .place_inputs(&session, &input.files, input.tenant.as_deref(), &mut notes)
            .await?;
        if input.lang == Language::Py {
            // The variables of the session's last container, if it saved them.
            notes.extend(self.restore_state(&session, &sandbox).await);
        }
        let timeout_ms = self.exec_timeout_ms(input.timeout_ms, hooks.tools.is_some());
        let ExecHooks {
            events,
            tools,
            cancel,
        } = hooks;
        let (specs, calls_tx, mut results_rx) = match tools {
            Some(bridge) => (bridge.specs, Some(bridge.calls), Some(bridge.results)),
            None => (Vec::new(), None, None),
        };
        let known: std::collections::HashSet<String> =
            specs.iter().map(|t| t.name.clone()).collect();
        // Calls to tools the code was not given are answered here, never sent on.
        let (refusals_tx, mut refusals_rx) = mpsc::unbounded_channel::<ToolResult>();
        let request = ExecRequest {
            lang: input.lang,
            code: input.code,
            args: input.args,
            timeout_ms,
            max_output_bytes: self.config.exec_limits.max_output_bytes,
            stream: events.is_some(),
            tools: specs,
            max_display_events: self.config.exec_limits.max_display_events,
            max_display_bytes: self.config.exec_limits.max_display_bytes,
        };
        // The runner keeps the same budget; this one holds whatever the sandbox sends.
        let mut displays = DisplayBudget::of(&request);
        let job = sandbox.new_job();
        let guard = CancelOnDrop {
            sandbox: Some(sandbox.clone()),
            job,
        };
        let (mut streamed_out, mut streamed_err) = (String::new(), String::new());
        let on_event = |msg| {
            let other = match msg {
                WorkerMessage::ToolCall(call) => {
                    match &calls_tx {
                        Some(tx) if known.contains(&call.name) => {
                            let _ = tx.send(call);
                        }
                        _ => {
                            let _ = refusals_tx.send(ToolResult {
                                error_message: Some(format!("Unknown tool: '{}'", call.name)),
                                call_id: call.call_id,
                                result: serde_json::Value::Null,
                                is_error: true,
                            });
                        }
                    }
                    return None;
                }
                WorkerMessage::Display(display) => match displays.admit(&display) {
                    Admit::Keep => WorkerMessage::Display(display),
                    // Said once, as streamed stderr, so every front end shows it.
                    Admit::DropFirst(note) => WorkerMessage::Output(sandbox_runner::OutputChunk {
                        stream: sandbox_runner::Stream::Stderr,
                        data: format!("{note}\n"),
                    }),
                    Admit::Drop => return None,
                },
                other => other,
            };
            // Streamed output also goes into the final result.
            if let WorkerMessage::Output(chunk) = &other {
                match chunk.stream {
                    sandbox_runner::Stream::Stdout => streamed_out.push_str(&chunk.data),
                    sandbox_runner::Stream::Stderr => streamed_err.push_str(&chunk.data),
                }
            }
            Some(other)
        };
        // The events go to the front end through a bounded channel: the exec waits for a
        // consumer that is behind.
        let run = sandbox.exec_as(job, request, on_event, events.as_ref());
        let cancel = cancel.unwrap_or_default();
        let drive = async {
            tokio::pin!(run);
            let mut cancelled = false;
            loop {
                tokio::select! {
                    done = &mut run => return done,
                    Some(result) = recv_opt(&mut results_rx) => {
                        let _ = sandbox.tool_result(job, result).await;
                    }
                    Some(result) = refusals_rx.recv() => {
                        let _ = sandbox.tool_result(job, result).await;
                    }
                    _ = cancel.cancelled(), if !cancelled => {
                        cancelled = true;
                        let _ = sandbox.cancel(job).await;
                    }
                }
            }
        };
        let outcome =
            tokio::time::timeout(Duration::from_millis(timeout_ms) + EXEC_GRACE, drive).await;
        guard.disarm();
        let mut output = match outcome {
            Ok(Ok(done)) => ExecOutput {
                session_id: session.id().to_string(),
                stdout: done.stdout + &streamed_out,
                stderr: streamed_err + &done.stderr,
                files: Vec::new(),
                runtime_status: done.runtime_status,
                exit_code: done.exit_code,
                duration_ms: 0,
                limits: done.limits,
                compile_cached: done.compile_cached,
                deleted_files: Vec::new(),
                delivery: Delivery::default(),
            },
            Ok(Err(err)) => self.sandbox_failed(&session, &sandbox, err, started).await,
            Err(_) => {
                tracing::warn!(
                    session = session.id(),
                    "runner did not finish an exec in time; replacing the sandbox"
                );
                self.discard_sandbox(&session, &sandbox).await;
                failed_output(&session, Limit::Time.message(), vec![Limit::Time])
            }
        };

        self.collect_files(&session, &mut output, notes, &inputs)
            .await?;
        output.duration_ms = started.elapsed().as_millis() as u64;
        session.exec_done();
        if let Some(cached) = output.compile_cached {
            self.metrics.compile_cache(cached);
        }
        observed.finish(&output);
        Ok(output)
    }

    /// The exec's wall-time limit: the one asked for (else the default), capped by the
    /// setting for its kind of exec.
    fn exec_timeout_ms(&self, asked: Option<u64>, with_tools: bool) -> u64 {
        let cap = if with_tools {
            self.config.exec_limits.max_programmatic_timeout_ms
        } else {
            self.config.exec_limits.max_exec_timeout_ms
        };
        asked
            .filter(|t| *t > 0)
            .unwrap_or(self.config.exec_limits.exec_timeout_ms)
            .min(cap)
    }

    /// The output of an exec whose sandbox failed under it (the runner's channel broke):
    /// the sandbox is discarded, and the answer says whether memory ended it.
    async fn sandbox_failed(
        &self,
        session: &Arc<Session>,
        sandbox: &Arc<Sandbox>,
        err: ChannelError,
        started: Instant,
    ) -> ExecOutput {
        // Under gVisor a full memory cgroup ends the whole sandbox, runner included;
        // the engine says whether that is how it ended.
        let exec_start = std::time::SystemTime::now()
            .checked_sub(started.elapsed())
            .unwrap_or(std::time::UNIX_EPOCH);
        // Only a sandbox that went away can have been ended for memory: a refusal
        // or an odd answer comes from a runner still alive, not worth a wait.
        let oom = matches!(err, ChannelError::Closed(_))
            && self
                .backend
                .ended_out_of_memory(&sandbox.container_id, exec_start, sandbox.had_an_oom_kill())
                .await;
        tracing::warn!(session = session.id(), container = %short(&sandbox.container_id), error = %err, oom, "sandbox failed during an exec");
        self.discard_sandbox(session, sandbox).await;
        if oom {
            failed_output(
                session,
                &format!(
                    "Error: {}; the sandbox was ended and the next call starts a new one.",
                    Limit::Memory
                ),
                vec![Limit::Memory],
            )
        } else {
            failed_output(
                session,
                "The sandbox stopped unexpectedly; the next call starts a new one.",
                vec![],
            )
        }
    }

    /// Adds the files the exec created or changed to its output with how many could not
    /// be kept, the `inputs` it removed, and the notes of input placement and harvest to
    /// its stderr.
    async fn collect_files(
        &self,
        session: &Arc<Session>,
        output: &mut ExecOutput,
        mut notes: Vec<String>,
        inputs: &[PlacedInput],
    ) -> Result<()> {
        let limits = HarvestLimits {
            max_files: self.config.exec_limits.max_output_files,
            max_file_bytes: self
                .config
                .exec_limits
                .max_output_file_mb
                .saturating_mul(1024 * 1024),
            storage: self.storage_budget(session),
        };
        let collected = self.harvest(session, limits).await?;
        notes.extend(collected.notes);
        output.files = collected.files;
        output.delivery = collected.delivery;
        output.deleted_files = deleted_inputs(inputs, &collected.gone);
        for note in notes {
            if !output.stderr.is_empty() && !output.stderr.ends_with('\n') {
                output.stderr.push('\n');
            }
            output.stderr.push_str(&note);
            output.stderr.push('\n');
        }
        Ok(())
    }

    /// Carries out the file moves that waited for `session`'s sandbox (see
    /// `SandboxBackend::settle_files`) and saves the index when it changed; failures become
    /// notes, as a harvest's do.
    async fn settle_files(&self, session: &Arc<Session>) -> Vec<String> {
        let at = session.files();
        let mut index = session.index().clone();
        let backend = self.backend.clone();
        let settled = tokio::task::spawn_blocking(move || {
            let (changed, notes) = backend.settle_files(&at, &mut index)?;
            if changed {
                at.workspace.save_index(&index)?;
            }
            Ok::<_, std::io::Error>((changed.then_some(index), notes))
        })
        .await;
        match settled {
            Ok(Ok((index, notes))) => {
                if let Some(index) = index {
                    *session.index() = index;
                }
                notes
            }
            failed => {
                tracing::error!(session = session.id(), result = ?failed.map(|r| r.map(|_| ())), "cannot bring the sandbox's files up to date");
                vec!["Input files could not be placed".into()]
            }
        }
    }

    /// Finds the files the exec created or changed, puts back read-only files the code
    /// removed, and saves the index.
    pub(crate) async fn harvest(
        &self,
        session: &Arc<Session>,
        limits: HarvestLimits,
    ) -> Result<Collected> {
        let mut index = session.index().clone();
        let (at, backend) = (session.files(), self.backend.clone());
        let workspace = session.workspace.clone();
        let result = tokio::task::spawn_blocking(move || {
            let mut report = backend.harvest(&at, &mut index, limits)?;
            let put_back = put_back_read_only(&*backend, &at, &mut index, &mut report.vanished);
            let saved = if !report.files.is_empty() || report.index_changed {
                workspace.save_index(&index)
            } else {
                Ok(())
            };
            Ok::<_, std::io::Error>((index, report, put_back, saved))
        })
        .await
        .map_err(Error::task("harvest"))?;
        match result {
            Ok((index, mut report, put_back, Ok(()))) => {
                // Blobs go only once neither the saved nor the served index names them: a
                // download of a dropped version is a 404 from then on, never a lost blob.
                let unused = std::mem::take(&mut report.unused_blobs);
                if unused.is_empty() {
                    *session.index() = index;
                } else {
                    *session.index() = index.clone();
                    crate::core::files::delete_unused_blobs(&session.workspace, &index, unused)
                        .await;
                }
                let delivered = report.files.len();
                let mut notes = report.notes;
                notes.extend(put_back.iter().map(|name| {
                    format!("{name} is a read-only upload; it was put back in /mnt/data")
                }));
                Ok(Collected {
                    files: report.files.into_iter().map(|h| h.record).collect(),
                    notes,
                    delivery: Delivery {
                        attempted: delivered + report.not_kept,
                        failed: report.not_kept,
                    },
                    gone: report.vanished.into_iter().map(|r| r.name).collect(),
                })
            }
            Ok((_, report, _, Err(err))) => {
                // Nothing of this harvest is recorded: none of its files can be served.
                tracing::error!(session = session.id(), error = %err, "cannot save the file index after a harvest");
                let mut blobs = report.unused_blobs;
                blobs.extend(report.files.iter().map(|h| h.record.sha256.clone()));
                let index = session.index().clone();
                crate::core::files::delete_unused_blobs(&session.workspace, &index, blobs).await;
                let attempted = report.files.len() + report.not_kept;
                Ok(Collected {
                    notes: vec!["Generated files could not be recorded".into()],
                    delivery: Delivery {
                        attempted,
                        failed: attempted,
                    },
                    gone: report.vanished.into_iter().map(|r| r.name).collect(),
                    ..Collected::default()
                })
            }
            Err(err) => {
                tracing::error!(session = session.id(), error = %err, "harvest failed");
                Ok(Collected {
                    notes: vec!["Generated files could not be collected".into()],
                    ..Collected::default()
                })
            }
        }
    }
}

/// Places the read-only versions among `vanished` back at their names (read-only files
/// stay as uploaded: the code cannot remove them when the broker's uid is not the
/// sandbox's, and this keeps it so when it is, or when files move through the runner).
/// Those placed back leave `vanished`; returns their names.
fn put_back_read_only(
    backend: &dyn SandboxBackend,
    at: &SandboxFiles,
    index: &mut FileIndex,
    vanished: &mut Vec<FileRecord>,
) -> Vec<String> {
    let mut put_back = Vec::new();
    vanished.retain(|record| {
        if !record.read_only {
            return true;
        }
        let blob = at.workspace.blob_path(&record.sha256);
        match backend.place_file(at, &blob, std::path::Path::new(&record.name), true) {
            Ok(stamp) if index.reinstate(&record.id, stamp) => {
                put_back.push(record.name.clone());
                false
            }
            Ok(_) => true,
            Err(err) => {
                tracing::warn!(file = %record.name, error = %err, "cannot put a read-only file back");
                true
            }
        }
    });
    put_back
}

/// The names, as their refs carried them, of the `inputs` whose files are `gone`, each
/// once, in the order of the refs.
fn deleted_inputs(inputs: &[PlacedInput], gone: &[String]) -> Vec<String> {
    let gone: std::collections::HashSet<&str> = gone.iter().map(String::as_str).collect();
    let mut seen = std::collections::HashSet::new();
    inputs
        .iter()
        .filter(|input| gone.contains(input.name.as_str()))
        .filter(|input| seen.insert(input.sent_name.as_str()))
        .map(|input| input.sent_name.clone())
        .collect()
}

/// Receives from an optional channel; never resolves without one.
async fn recv_opt<T>(rx: &mut Option<mpsc::Receiver<T>>) -> Option<T> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

fn failed_output(session: &Session, message: &str, limits: Vec<Limit>) -> ExecOutput {
    ExecOutput {
        session_id: session.id().to_string(),
        stdout: String::new(),
        stderr: format!("{message}\n"),
        files: Vec::new(),
        runtime_status: RuntimeStatus::New,
        exit_code: None,
        duration_ms: 0,
        limits,
        compile_cached: None,
        deleted_files: Vec::new(),
        delivery: Delivery::default(),
    }
}

/// Tells the runner to stop a job when the exec future is dropped before it finished
/// (a client went away).
struct CancelOnDrop {
    sandbox: Option<Arc<Sandbox>>,
    job: sandbox_runner::JobId,
}

impl CancelOnDrop {
    fn disarm(mut self) {
        self.sandbox = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(sandbox) = self.sandbox.take() {
            let job = self.job;
            tokio::spawn(async move {
                let _ = sandbox.cancel(job).await;
            });
        }
    }
}
