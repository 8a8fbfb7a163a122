//! Programmatic runs (code that calls tools the client runs) parked between the client's
//! requests: the code runs until it calls tools; the calls made since the last answer go
//! to the client as one batch under a single-use continuation token; the client's results
//! continue the run. A parked run holds no thread: it is a task blocked on a channel, kept
//! here by token (and by the request ids its requests named, for cancelling).

use crate::core::error::{Error, Result};
use crate::core::{Broker, ExecHooks, ExecInput, ExecOutput, ExecRun, SessionChoice, ToolBridge};
use crate::ids::new_id;
use crate::session::{same_tenant, visible, OwnerKey};
use crate::sync::LockExt as _;
use dashmap::DashMap;
use sandbox_runner::{ToolCall, ToolResult, ToolSpec};
use serde_json::Value;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Results of the client's tool calls on their way to the sandbox; more wait for room.
const RESULT_QUEUE: usize = 64;
/// After a first tool call, how long to wait for more before answering: calls made in
/// parallel (`asyncio.gather`) arrive within microseconds of each other. A run starts with
/// this window, and comes back to it whenever a batch had several calls.
const BATCH_WINDOW: Duration = Duration::from_millis(2);

/// The shortest window: a run whose batches keep holding one call (a sequential loop)
/// halves its window down to this, so each round trip waits less. A parallel batch cut
/// short by it is still correct; its other calls come in the next answer.
const MIN_BATCH_WINDOW: Duration = Duration::from_micros(250);

/// How long a batch waits for the rest of the calls the code made in one step (see
/// [`sandbox_runner::BatchHint`]): they are already on their way, so this bounds a
/// host's scheduling delay, not the code.
const GROUP_WAIT: Duration = Duration::from_millis(500);

/// Whether `batch` holds some but not all calls of a step.
fn group_incomplete(batch: &[ToolCall]) -> bool {
    let mut seen: std::collections::HashMap<&str, (u32, u32)> = Default::default();
    for hint in batch.iter().filter_map(|c| c.batch.as_ref()) {
        let entry = seen.entry(hint.id.as_str()).or_insert((0, hint.size));
        entry.0 += 1;
    }
    seen.values().any(|(got, size)| got < size)
}

/// The window after a batch of `calls` calls, from the window it was collected with.
fn next_window(window: Duration, calls: usize) -> Duration {
    if calls > 1 {
        BATCH_WINDOW
    } else {
        (window / 2).max(MIN_BATCH_WINDOW)
    }
}

/// Remembered used tokens, so a reused one is told apart (409) from an unknown one (404).
const USED_TOKENS_KEPT: usize = 10_000;

/// The programmatic runs waiting for their clients.
#[derive(Default)]
pub(crate) struct ParkedRuns {
    /// Runs by their current continuation token.
    by_token: DashMap<String, Arc<Run>>,
    /// Runs by the user who started them and a request id their requests named, for the
    /// cancel route. Request ids are chosen by clients, so one user's id never reaches
    /// (or replaces) another user's run.
    by_request: DashMap<RequestKey, Arc<Run>>,
    /// Tokens already used, with when, to answer a replay with 409.
    used: DashMap<String, Instant>,
}

/// A run's request id, with the tenant and user it belongs to.
type RequestKey = (OwnerKey, String);

/// One programmatic run.
pub(crate) struct Run {
    /// The session it runs in.
    session_id: String,
    /// The user its first request named; only they (or their tenant's whole scope) may
    /// continue or cancel it.
    user: Option<String>,
    /// The tenant of its first request: no caller of another tenant continues or cancels
    /// it, whatever user it names.
    tenant: Option<String>,
    /// Tool calls the code made and the client has not seen yet.
    calls: Mutex<Option<mpsc::UnboundedReceiver<ToolCall>>>,
    /// Where the client's results go.
    results: mpsc::Sender<ToolResult>,
    /// Calls handed to the client and not answered yet.
    pending: Mutex<HashSet<String>>,
    /// The exec; taken when it has finished.
    task: Mutex<Option<ExecRun>>,
    /// Stops the exec (cancel route, expired token).
    cancel: CancellationToken,
    /// How long the next batch waits for more calls after its first (see `next_window`).
    window: Mutex<Duration>,
}

/// Where a run stands after [`Broker::advance_programmatic`].
pub(crate) enum Step {
    /// The code called tools: the client answers `calls` under `token`.
    ToolCalls {
        /// The session the run is in.
        session_id: String,
        /// The single-use continuation token.
        token: String,
        /// The calls made since the last answer.
        calls: Vec<ToolCall>,
    },
    /// The code ended.
    Ended(ExecOutput),
}

impl Run {
    /// Who it belongs to, as its request id is kept under.
    fn owner(&self) -> OwnerKey {
        (self.tenant.clone(), self.user.clone())
    }
}

impl Broker {
    /// Starts the code of a first request with the client's `tools`; `request_id` names
    /// it for cancelling.
    pub(crate) async fn start_programmatic(
        self: &Arc<Self>,
        choice: &SessionChoice,
        input: ExecInput,
        tools: Vec<ToolSpec>,
        request_id: Option<String>,
    ) -> Result<Arc<Run>> {
        let (calls_tx, calls_rx) = mpsc::unbounded_channel();
        let (results_tx, results_rx) = mpsc::channel(RESULT_QUEUE);
        let cancel = CancellationToken::new();
        let hooks = ExecHooks {
            events: None,
            tools: Some(ToolBridge {
                specs: tools,
                calls: calls_tx,
                results: results_rx,
            }),
            cancel: Some(cancel.clone()),
            stdin: None,
        };
        let task = self.start_exec(choice, input, hooks).await?;
        let session_id = task.session.id().to_string();
        let run = Arc::new(Run {
            session_id,
            user: choice.user.clone(),
            tenant: choice.tenant.clone(),
            calls: Mutex::new(Some(calls_rx)),
            results: results_tx,
            pending: Mutex::new(HashSet::new()),
            task: Mutex::new(Some(task)),
            cancel,
            window: Mutex::new(BATCH_WINDOW),
        });
        if let Some(id) = request_id {
            self.programmatic
                .by_request
                .insert((run.owner(), id), run.clone());
        }
        Ok(run)
    }

    /// Hands the client's results to the waiting run named by `token` (single use; a
    /// replay is a conflict). Another user's token is unknown to `user`, and stays usable
    /// by its owner. `request_id`: the id this continuation is named by, for cancelling.
    pub(crate) fn continue_programmatic(
        &self,
        tenant: Option<&str>,
        user: Option<&str>,
        token: String,
        results: Vec<ToolResult>,
        request_id: Option<String>,
    ) -> Result<Arc<Run>> {
        let runs = &self.programmatic;
        let mine = |_: &String, run: &Arc<Run>| {
            same_tenant(tenant, run.tenant.as_deref()) && visible(user, run.user.as_deref())
        };
        let Some((_, run)) = runs.by_token.remove_if(&token, mine) else {
            if !runs.by_token.contains_key(&token) && runs.used.contains_key(&token) {
                return Err(Error::Conflict(
                    "this continuation token was already used".into(),
                ));
            }
            return Err(Error::NotFound(
                "unknown or expired continuation token".into(),
            ));
        };
        remember_used(runs, token);
        let mut pending = run.pending.locked();
        let mut answers = Vec::new();
        for result in results {
            if !pending.remove(&result.call_id) {
                tracing::debug!(call_id = %result.call_id, "result for a call that is not pending");
                continue;
            }
            answers.push(result);
        }
        // A call the client left unanswered would wait forever: answer it with an error.
        for call_id in pending.drain() {
            answers.push(ToolResult {
                call_id,
                result: Value::Null,
                is_error: true,
                error_message: Some("No result was given for this tool call".into()),
            });
        }
        drop(pending);
        hand_over(&run.results, answers);
        if let Some(id) = request_id {
            runs.by_request.insert((run.owner(), id), run.clone());
        }
        Ok(run)
    }

    /// Runs until the code calls tools (a batch under a new token) or ends.
    pub(crate) async fn advance_programmatic(&self, run: Arc<Run>) -> Result<Step> {
        let mut calls = run
            .calls
            .locked()
            .take()
            .ok_or_else(|| Error::Conflict("this run is already being continued".into()))?;
        let mut task = run
            .task
            .locked()
            .take()
            .ok_or_else(|| Error::Conflict("this run has ended".into()))?;
        // A client that goes away while its run waits here stops the run: nobody could
        // continue it.
        let stop_if_dropped = run.cancel.clone().drop_guard();
        let outcome = tokio::select! {
            Some(first) = calls.recv() => {
                let mut batch = vec![first];
                let window = *run.window.locked();
                let group_deadline = tokio::time::Instant::now() + GROUP_WAIT;
                loop {
                    // Calls the code made in one step are answered together, however the
                    // host schedules their arrival; others only within the window.
                    let wait = if group_incomplete(&batch) {
                        group_deadline.saturating_duration_since(tokio::time::Instant::now())
                    } else {
                        window
                    };
                    match tokio::time::timeout(wait, calls.recv()).await {
                        Ok(Some(more)) => batch.push(more),
                        _ => break,
                    }
                }
                *run.window.locked() = next_window(window, batch.len());
                Ok(batch)
            }
            joined = &mut task => Err(joined),
        };
        stop_if_dropped.disarm();
        match outcome {
            Ok(batch) => {
                *run.calls.locked() = Some(calls);
                *run.task.locked() = Some(task);
                run.pending
                    .locked()
                    .extend(batch.iter().map(|c| c.call_id.clone()));
                let token = new_id();
                self.programmatic
                    .by_token
                    .insert(token.clone(), run.clone());
                self.expire_token_later(token.clone(), run.clone());
                Ok(Step::ToolCalls {
                    session_id: run.session_id.clone(),
                    token,
                    calls: batch,
                })
            }
            Err(joined) => {
                self.forget_run(&run);
                Ok(Step::Ended(joined?))
            }
        }
    }

    /// Stops the run a request of `user` named `request_id`; returns its session id.
    /// With no user, the tenant's whole scope: its own run of that id if there is one,
    /// else the one run of that id in the tenant whoever started it (several users' runs
    /// under one id: which one is meant is unknown, so none).
    pub(crate) fn cancel_programmatic(
        &self,
        tenant: Option<&str>,
        user: Option<&str>,
        request_id: &str,
    ) -> Result<String> {
        let runs = &self.programmatic;
        let not_found = || Error::NotFound(format!("no run with request id {request_id}"));
        let tenant = tenant.map(str::to_string);
        let key = match user {
            Some(user) => ((tenant, Some(user.to_string())), request_id.to_string()),
            None => {
                let mut matching = runs
                    .by_request
                    .iter()
                    .filter(|e| {
                        e.key().1 == request_id
                            && same_tenant(tenant.as_deref(), e.key().0 .0.as_deref())
                    })
                    .map(|e| e.key().clone())
                    .collect::<Vec<_>>();
                if matching.iter().any(|((_, u), _)| u.is_none()) {
                    ((tenant, None), request_id.to_string())
                } else if matching.len() == 1 {
                    matching.remove(0)
                } else {
                    return Err(not_found());
                }
            }
        };
        let (_, run) = runs.by_request.remove(&key).ok_or_else(not_found)?;
        run.cancel.cancel();
        // Answer the calls it is waiting on, so it can stop at once.
        let answers = run
            .pending
            .locked()
            .drain()
            .map(|call_id| ToolResult {
                call_id,
                result: Value::Null,
                is_error: true,
                error_message: Some("The run was cancelled".into()),
            })
            .collect();
        hand_over(&run.results, answers);
        Ok(run.session_id.clone())
    }

    /// Stops a run whose client did not come back within the token TTL.
    fn expire_token_later(&self, token: String, run: Arc<Run>) {
        let ttl = Duration::from_secs(self.config.lifecycle.continuation_ttl_secs.max(1));
        let runs = self.programmatic.clone();
        tokio::spawn(async move {
            tokio::time::sleep(ttl).await;
            if runs.by_token.remove(&token).is_some() {
                tracing::info!(session = %run.session_id, "continuation token expired; stopping the run");
                run.cancel.cancel();
                runs.by_request.retain(|_, r| !Arc::ptr_eq(r, &run));
            }
        });
    }

    /// Drops every request id that names `run` (the first request's and its
    /// continuations').
    fn forget_run(&self, run: &Arc<Run>) {
        self.programmatic
            .by_request
            .retain(|_, r| !Arc::ptr_eq(r, run));
    }
}

/// Sends `answers` to the exec in order, as its bounded queue takes them.
fn hand_over(results: &mpsc::Sender<ToolResult>, answers: Vec<ToolResult>) {
    let results = results.clone();
    tokio::spawn(async move {
        for answer in answers {
            if results.send(answer).await.is_err() {
                break;
            }
        }
    });
}

/// Remembers a used token, so a replay is told apart (409) from an unknown token (404).
fn remember_used(runs: &ParkedRuns, token: String) {
    if runs.used.len() >= USED_TOKENS_KEPT {
        // Forget the oldest half; a very old replay then reads as unknown (404).
        let mut ages: Vec<(String, Instant)> = runs
            .used
            .iter()
            .map(|e| (e.key().clone(), *e.value()))
            .collect();
        ages.sort_by_key(|(_, t)| *t);
        for (t, _) in ages.into_iter().take(USED_TOKENS_KEPT / 2) {
            runs.used.remove(&t);
        }
    }
    runs.used.insert(token, Instant::now());
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_batch_waits_for_every_call_of_a_step() {
        let call = |id: &str, hint: Option<(&str, u32)>| ToolCall {
            call_id: id.into(),
            name: "add".into(),
            input: json!({}),
            batch: hint.map(|(id, size)| sandbox_runner::BatchHint {
                id: id.into(),
                size,
            }),
        };
        assert!(!group_incomplete(&[call("1", None)]));
        assert!(group_incomplete(&[call("1", Some(("a", 2)))]));
        assert!(!group_incomplete(&[
            call("1", Some(("a", 2))),
            call("2", Some(("a", 2)))
        ]));
        assert!(group_incomplete(&[
            call("1", Some(("a", 2))),
            call("2", Some(("a", 2))),
            call("3", Some(("b", 3)))
        ]));
    }

    #[test]
    fn the_batch_window_shrinks_for_single_calls_and_resets_for_parallel_ones() {
        let mut w = BATCH_WINDOW;
        for _ in 0..20 {
            w = next_window(w, 1);
        }
        assert_eq!(w, MIN_BATCH_WINDOW);
        assert_eq!(next_window(BATCH_WINDOW, 1), BATCH_WINDOW / 2);
        assert_eq!(next_window(w, 2), BATCH_WINDOW);
    }
}
