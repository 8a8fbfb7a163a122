//! Running one admitted exec, in stages: the sandbox and the inputs, the request, the
//! drive (events, tool results, cancel, the deadline), then the files and the record.

use super::events::{EventRouter, ExecEvent};
use super::{Admitted, Delivery, ExecHooks, ExecInput, ExecOutput};
use crate::core::error::Result;
use crate::core::files::PlacedInput;
use crate::core::Broker;
use crate::sandbox::{short, ChannelError, Sandbox};
use crate::session::Session;
use sandbox_runner::{
    DisplayBudget, ExecRequest, ExecResponse, JobId, Language, Limit, RuntimeStatus, ToolResult,
};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// How much longer than the exec's own limit the broker waits for the runner before it
/// declares the sandbox broken.
const EXEC_GRACE: Duration = Duration::from_secs(15);

/// What the exec needs once its sandbox is ready: the sandbox, the inputs in place, and
/// the notes for its stderr so far.
struct Prepared {
    /// The session's live sandbox.
    sandbox: Arc<Sandbox>,
    /// The input refs placed in `/mnt/data`, for `deleted_files`.
    inputs: Vec<PlacedInput>,
    /// Notes of placement and state restore, appended to stderr at the end.
    notes: Vec<String>,
}

/// How the drive ended.
enum Driven {
    /// The runner answered.
    Done(ExecResponse),
    /// The runner's channel broke.
    Failed(ChannelError),
    /// The runner did not answer within the limit and its grace.
    TimedOut,
}

impl Broker {
    /// Runs one exec in its admitted session, after the execs queued before it. `hooks`
    /// carry what a front end attaches: a stream for events, tools, a cancel signal. Call
    /// it from a task of its own: if it is dropped half-way the runner is told to stop.
    pub(super) async fn exec(
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
        let prepared = self.prepare(&session, slot, &input).await?;
        let timeout_ms = self.exec_timeout_ms(input.timeout_ms, hooks.tools.is_some());
        let mut output = self
            .drive(
                &session,
                &prepared.sandbox,
                input,
                hooks,
                timeout_ms,
                started,
            )
            .await;
        self.collect_files(&session, &mut output, prepared.notes, &prepared.inputs)
            .await?;
        output.duration_ms = started.elapsed().as_millis() as u64;
        session.exec_done();
        if let Some(cached) = output.compile_cached {
            self.metrics.compile_cache(cached);
        }
        observed.finish(&output);
        Ok(output)
    }

    /// One direction: the sandbox (with the start admission reserved), what changed
    /// while it was away, the inputs straight into it, then Python's saved state.
    async fn prepare(
        &self,
        session: &Arc<Session>,
        slot: Option<crate::core::limits::ContainerSlot>,
        input: &ExecInput,
    ) -> Result<Prepared> {
        let sandbox = self.sandbox_for(session, slot).await?;
        let mut notes = self.settle_files(session).await;
        let inputs = self
            .place_inputs(session, &input.files, input.tenant.as_deref(), &mut notes)
            .await?;
        if input.lang == Language::Py {
            // The variables of the session's last container, if it saved them.
            notes.extend(self.restore_state(session, &sandbox).await);
        }
        Ok(Prepared {
            sandbox,
            inputs,
            notes,
        })
    }

    /// Sends the exec to the runner and drives it to its end: events routed to the
    /// front end, tool results and refusals answered, a cancel passed on, the deadline
    /// kept. Always an output: a broken or silent sandbox is discarded and said so.
    async fn drive(
        &self,
        session: &Arc<Session>,
        sandbox: &Arc<Sandbox>,
        input: ExecInput,
        hooks: ExecHooks,
        timeout_ms: u64,
        started: Instant,
    ) -> ExecOutput {
        let ExecHooks {
            events,
            tools,
            cancel,
            stdin,
        } = hooks;
        let (specs, calls, results) = match tools {
            Some(bridge) => (bridge.specs, Some(bridge.calls), Some(bridge.results)),
            None => (Vec::new(), None, None),
        };
        let known = specs.iter().map(|t| t.name.clone()).collect();
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
            rich: input.rich,
            stdin: stdin.is_some(),
        };
        // Calls to tools the code was not given are answered here, never sent on.
        let (refusals_tx, refusals) = mpsc::unbounded_channel::<ToolResult>();
        let mut router = EventRouter::new(known, calls, refusals_tx, DisplayBudget::of(&request));
        // The sandbox's proxy connections count against this exec while it runs.
        let _egress = sandbox.egress().map(|egress| {
            let (tenant, user) = session.owner_key();
            egress.begin_exec(crate::egress::gateway::ExecEgress {
                session: session.id().to_string(),
                user,
                tenant,
                budget: self.egress.exec_budget(session.egress_bytes()),
            })
        });
        let job = sandbox.new_job();
        let guard = CancelOnDrop {
            sandbox: Some(sandbox.clone()),
            job,
        };
        let driven = run_job(
            sandbox,
            job,
            request,
            &mut router,
            events.as_ref(),
            (results, refusals),
            stdin,
            cancel.unwrap_or_default(),
            Duration::from_millis(timeout_ms) + EXEC_GRACE,
        )
        .await;
        guard.disarm();
        match driven {
            Driven::Done(done) => ExecOutput {
                session_id: session.id().to_string(),
                // Streamed output also goes into the final result.
                stdout: done.stdout + &router.streamed_out,
                stderr: std::mem::take(&mut router.streamed_err) + &done.stderr,
                files: Vec::new(),
                runtime_status: done.runtime_status,
                exit_code: done.exit_code,
                duration_ms: 0,
                limits: done.limits,
                compile_cached: done.compile_cached,
                deleted_files: Vec::new(),
                delivery: Delivery::default(),
            },
            Driven::Failed(err) => self.sandbox_failed(session, sandbox, err, started).await,
            Driven::TimedOut => {
                tracing::warn!(
                    session = session.id(),
                    "runner did not finish an exec in time; replacing the sandbox"
                );
                self.discard_sandbox(session, sandbox).await;
                failed_output(session, Limit::Time.message(), vec![Limit::Time])
            }
        }
    }

    /// The exec's wall-time limit: the one asked for (else the default), capped by the
    /// setting for its kind of exec.
    fn exec_timeout_ms(&self, asked: Option<u64>, with_tools: bool) -> u64 {
        let limits = &self.config.exec_limits;
        let cap = if with_tools {
            limits.max_programmatic_timeout_ms
        } else {
            limits.max_exec_timeout_ms
        };
        asked
            .filter(|t| *t > 0)
            .unwrap_or(limits.exec_timeout_ms)
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
                .engine()
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
}

/// Runs `job` on `sandbox` until the runner answers or `deadline` passes, answering the
/// tool results and refusals as they come, passing stdin on, and a cancel once. The events go to
/// the front end through a bounded channel: the exec waits for a consumer that is behind.
#[allow(clippy::too_many_arguments)]
async fn run_job(
    sandbox: &Sandbox,
    job: JobId,
    request: ExecRequest,
    router: &mut EventRouter,
    events: Option<&mpsc::Sender<ExecEvent>>,
    (mut results, mut refusals): (
        Option<mpsc::Receiver<ToolResult>>,
        mpsc::UnboundedReceiver<ToolResult>,
    ),
    mut stdin: Option<mpsc::Receiver<sandbox_runner::StdinChunk>>,
    cancel: CancellationToken,
    deadline: Duration,
) -> Driven {
    let run = sandbox.exec_as(job, request, |msg| router.route(msg), events);
    let drive = async {
        tokio::pin!(run);
        let mut cancelled = false;
        loop {
            tokio::select! {
                done = &mut run => return done,
                Some(result) = recv_opt(&mut results) => {
                    let _ = sandbox.tool_result(job, result).await;
                }
                Some(result) = refusals.recv() => {
                    let _ = sandbox.tool_result(job, result).await;
                }
                Some(chunk) = recv_opt(&mut stdin) => {
                    let _ = sandbox.stdin(job, chunk).await;
                }
                _ = cancel.cancelled(), if !cancelled => {
                    cancelled = true;
                    let _ = sandbox.cancel(job).await;
                }
            }
        }
    };
    match tokio::time::timeout(deadline, drive).await {
        Ok(Ok(done)) => Driven::Done(done),
        Ok(Err(err)) => Driven::Failed(err),
        Err(_) => Driven::TimedOut,
    }
}

/// Receives from an optional channel; never resolves without one.
async fn recv_opt<T>(rx: &mut Option<mpsc::Receiver<T>>) -> Option<T> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// The output of an exec that ended without the runner's answer.
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
    /// The sandbox running the job; `None` once disarmed.
    sandbox: Option<Arc<Sandbox>>,
    /// The job to stop.
    job: JobId,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn recv_opt_without_a_channel_never_resolves() {
        let mut none: Option<mpsc::Receiver<u8>> = None;
        let waited = tokio::time::timeout(Duration::from_secs(3600), recv_opt(&mut none)).await;
        assert!(waited.is_err());
        let (tx, rx) = mpsc::channel(1);
        tx.send(7).await.expect("send");
        assert_eq!(recv_opt(&mut Some(rx)).await, Some(7));
    }
}
