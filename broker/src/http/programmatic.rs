//! `POST /exec/programmatic`: code that calls tools the client runs (LibreChat's
//! programmatic tool calling). The code runs until it calls tools; the calls made since
//! the last answer go to the client as one batch with a continuation token; the client
//! answers with their results and the same route continues the run.
//!
//! A waiting run holds no thread: it is a task blocked on a channel, kept here by token.

use super::exec::{Args, ExecBody, FileRef};
use super::{ApiJson, AppState};
use crate::core::{ExecHooks, ExecOutput, ExecRun, ToolBridge};
use crate::http::auth::Caller;
use crate::http::error::{AppError, AppResult};
use crate::ids::new_id;
use crate::render::output_json;
use crate::session::{same_tenant, visible, OwnerKey};
use crate::sync::LockExt as _;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::post;
use axum::{Json, Router};
use dashmap::DashMap;
use sandbox_runner::{ToolCall, ToolResult, ToolSpec};
use serde::Deserialize;
use serde_json::{json, Value};
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

pub(crate) fn router() -> Router<AppState> {
    Router::new()
        .route("/exec/programmatic", post(programmatic))
        .route("/exec/programmatic/cancel", post(cancel))
}

/// The programmatic runs waiting for their clients.
#[derive(Default)]
pub(crate) struct Runs {
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
struct Run {
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

/// A tool as the client describes it.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
struct ToolBody {
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    parameters: Option<Value>,
}

/// A tool result as the client sends it.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
struct ToolResultBody {
    call_id: String,
    #[serde(default)]
    result: Value,
    #[serde(default)]
    is_error: bool,
    #[serde(default)]
    error_message: Option<String>,
}

/// Both shapes of the request: a first request, or a continuation.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
struct ProgrammaticBody {
    code: Option<String>,
    #[serde(default)]
    tools: Vec<ToolBody>,
    session_id: Option<String>,
    entity_id: Option<String>,
    user_id: Option<String>,
    timeout: Option<f64>,
    files: Option<Vec<FileRef>>,
    lang: Option<String>,
    args: Option<Args>,
    continuation_token: Option<String>,
    tool_results: Option<Vec<ToolResultBody>>,
}

/// Runs code that calls tools the client runs: answers `tool_call_required` with a
/// `continuation_token` and the batch of `tool_calls`, until `completed` or `error`.
#[utoipa::path(
    post,
    path = "/exec/programmatic",
    tag = "exec",
    security(("api_key" = []), ("bearer" = [])),
    request_body = ProgrammaticBody,
    responses(
        (status = 200, description = "`{status: tool_call_required | completed | error, continuation_token?, tool_calls?, ...the /exec response}`", content_type = "application/json"),
        (status = 400, description = "Malformed request or unsupported language", body = crate::http::openapi::ErrorBody),
        crate::http::openapi::Unauthorized,
        (status = 404, description = "Unknown continuation token", body = crate::http::openapi::ErrorBody),
        (status = 409, description = "Continuation token already used", body = crate::http::openapi::ErrorBody),
        crate::http::openapi::WrongShape,
        crate::http::openapi::RateLimited,
    )
)]
async fn programmatic(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    ApiJson(body): ApiJson<ProgrammaticBody>,
) -> AppResult<Json<Value>> {
    let run = match body.continuation_token.clone() {
        Some(token) => {
            let user = caller.user_or(body.user_id.as_deref());
            let run = continue_run(
                &state,
                caller.tenant.as_deref(),
                user.as_deref(),
                token,
                body.tool_results.unwrap_or_default(),
            )?;
            // LibreChat names each continuation with a request id of its own, and cancels
            // by that id.
            if let Some(id) = request_id(&headers) {
                state.runs.by_request.insert((run.owner(), id), run.clone());
            }
            run
        }
        None => start_run(&state, &caller, &headers, body).await?,
    };
    advance(&state, run).await.map(Json)
}

/// Starts the code of a first request.
async fn start_run(
    state: &AppState,
    caller: &Caller,
    headers: &HeaderMap,
    body: ProgrammaticBody,
) -> AppResult<Arc<Run>> {
    let code = body.code.filter(|c| !c.trim().is_empty()).ok_or_else(|| {
        AppError::Unprocessable(
            "send `code` (a first request) or `continuation_token` (a continuation)".into(),
        )
    })?;
    let mut names = HashSet::new();
    let mut specs = Vec::new();
    for tool in body.tools {
        if tool.name.trim().is_empty() || !names.insert(tool.name.clone()) {
            return Err(AppError::Unprocessable(format!(
                "tool names must be non-empty and distinct: {:?}",
                tool.name
            )));
        }
        specs.push(ToolSpec {
            name: tool.name,
            description: tool.description.unwrap_or_default(),
            parameters: tool.parameters.unwrap_or_else(|| json!({"type": "object"})),
        });
    }
    let exec_body = ExecBody {
        lang: body.lang.unwrap_or_else(|| "py".into()),
        code,
        args: body.args,
        session_id: body.session_id,
        entity_id: body.entity_id,
        user_id: body.user_id,
        runtime_session_hint: None,
        // LibreChat's default for this tool is 60 s.
        timeout: Some(body.timeout.unwrap_or(60_000.0)),
        files: body.files,
    };
    let (choice, input) = exec_body.into_parts(caller)?;
    let request_id = request_id(headers);

    let (calls_tx, calls_rx) = mpsc::unbounded_channel();
    let (results_tx, results_rx) = mpsc::channel(RESULT_QUEUE);
    let cancel = CancellationToken::new();
    let hooks = ExecHooks {
        events: None,
        tools: Some(ToolBridge {
            specs,
            calls: calls_tx,
            results: results_rx,
        }),
        cancel: Some(cancel.clone()),
    };
    let task = state.broker.start_exec(&choice, input, hooks).await?;
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
        state.runs.by_request.insert((run.owner(), id), run.clone());
    }
    Ok(run)
}

impl Run {
    /// Who it belongs to, as its request id is kept under.
    fn owner(&self) -> OwnerKey {
        (self.tenant.clone(), self.user.clone())
    }
}

/// The request id a client names its request by (LibreChat's header, or the generic one).
fn request_id(headers: &HeaderMap) -> Option<String> {
    ["x-librechat-code-request-id", "x-codeapi-request-id"]
        .iter()
        .find_map(|h| headers.get(*h)?.to_str().ok())
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

/// Hands the client's results to the waiting run named by `token` (single use). Another
/// user's token is unknown to `user`, and stays usable by its owner.
fn continue_run(
    state: &AppState,
    tenant: Option<&str>,
    user: Option<&str>,
    token: String,
    results: Vec<ToolResultBody>,
) -> AppResult<Arc<Run>> {
    let mine = |_: &String, run: &Arc<Run>| {
        same_tenant(tenant, run.tenant.as_deref()) && visible(user, run.user.as_deref())
    };
    let Some((_, run)) = state.runs.by_token.remove_if(&token, mine) else {
        if state.runs.by_token.contains_key(&token) {
            return Err(AppError::not_found(
                "unknown or expired continuation token".into(),
            ));
        }
        if state.runs.used.contains_key(&token) {
            return Err(AppError::conflict(
                "this continuation token was already used".into(),
            ));
        }
        return Err(AppError::not_found(
            "unknown or expired continuation token".into(),
        ));
    };
    remember_used(&state.runs, token);
    let mut pending = run.pending.locked();
    let mut answers = Vec::new();
    for r in results {
        if !pending.remove(&r.call_id) {
            tracing::debug!(call_id = %r.call_id, "result for a call that is not pending");
            continue;
        }
        answers.push(ToolResult {
            call_id: r.call_id,
            result: r.result,
            is_error: r.is_error,
            error_message: r.error_message,
        });
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
    Ok(run)
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

fn remember_used(runs: &Runs, token: String) {
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

/// Runs until the code calls tools (answering with the batch and a new token) or ends.
async fn advance(state: &AppState, run: Arc<Run>) -> AppResult<Value> {
    let mut calls = run
        .calls
        .locked()
        .take()
        .ok_or_else(|| AppError::conflict("this run is already being continued".into()))?;
    let mut task = run
        .task
        .locked()
        .take()
        .ok_or_else(|| AppError::conflict("this run has ended".into()))?;
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
            state.runs.by_token.insert(token.clone(), run.clone());
            expire_token_later(state, token.clone(), run.clone());
            let tool_calls: Vec<Value> = batch
                .into_iter()
                .map(|c| json!({ "id": c.call_id, "name": c.name, "input": c.input }))
                .collect();
            Ok(json!({
                "status": "tool_call_required",
                "session_id": run.session_id,
                "continuation_token": token,
                "tool_calls": tool_calls,
            }))
        }
        Err(joined) => {
            forget(state, &run);
            let output = joined?;
            Ok(final_json(&output))
        }
    }
}

/// Stops a run whose client did not come back within the token TTL.
fn expire_token_later(state: &AppState, token: String, run: Arc<Run>) {
    let ttl = Duration::from_secs(state.broker.config().lifecycle.continuation_ttl_secs.max(1));
    let runs = state.runs.clone();
    tokio::spawn(async move {
        tokio::time::sleep(ttl).await;
        if runs.by_token.remove(&token).is_some() {
            tracing::info!(session = %run.session_id, "continuation token expired; stopping the run");
            run.cancel.cancel();
            runs.by_request.retain(|_, r| !Arc::ptr_eq(r, &run));
        }
    });
}

/// Drops every request id that names `run` (the first request's and its continuations').
fn forget(state: &AppState, run: &Arc<Run>) {
    state.runs.by_request.retain(|_, r| !Arc::ptr_eq(r, run));
}

/// `completed`, or `error` with LibreChat's words for what went wrong.
fn final_json(output: &ExecOutput) -> Value {
    let error = crate::render::verdict_text(output);
    let mut body = output_json(output);
    match error {
        None => body["status"] = json!("completed"),
        Some(error) => {
            body["status"] = json!("error");
            body["error"] = json!(error);
        }
    }
    body
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
struct CancelBody {
    request_id: String,
    /// The user, for an API-key caller that names them in the body (as in the run's).
    #[serde(default)]
    user_id: Option<String>,
}

/// `POST /exec/programmatic/cancel {"request_id"}`: stops the run its first request named.
#[utoipa::path(
    post,
    path = "/exec/programmatic/cancel",
    tag = "exec",
    security(("api_key" = []), ("bearer" = [])),
    request_body = CancelBody,
    responses(
        (status = 200, description = "The run is stopped", content_type = "application/json"),
        crate::http::openapi::Unauthorized,
        (status = 404, description = "No run with that request id", body = crate::http::openapi::ErrorBody),
        crate::http::openapi::WrongShape,
    )
)]
async fn cancel(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(body): ApiJson<CancelBody>,
) -> AppResult<Json<Value>> {
    let user = caller.user_or(body.user_id.as_deref());
    let tenant = caller.tenant.clone();
    let not_found = || AppError::not_found(format!("no run with request id {}", body.request_id));
    let run = match user {
        Some(user) => state
            .runs
            .by_request
            .remove(&((tenant, Some(user)), body.request_id.clone()))
            .map(|(_, run)| run)
            .ok_or_else(not_found)?,
        // The tenant's whole scope: its own run of that id if there is one, else the one
        // run of that id in the tenant whoever started it. Several users' runs under one
        // id: which one is meant is unknown, so none.
        None => {
            let mut matching = state
                .runs
                .by_request
                .iter()
                .filter(|e| {
                    e.key().1 == body.request_id
                        && same_tenant(tenant.as_deref(), e.key().0 .0.as_deref())
                })
                .map(|e| e.key().clone())
                .collect::<Vec<_>>();
            let key = if matching.iter().any(|((_, u), _)| u.is_none()) {
                ((tenant.clone(), None), body.request_id.clone())
            } else if matching.len() == 1 {
                matching.remove(0)
            } else {
                return Err(not_found());
            };
            state
                .runs
                .by_request
                .remove(&key)
                .map(|(_, run)| run)
                .ok_or_else(not_found)?
        }
    };
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
    Ok(Json(json!({
        "message": "cancelled",
        "request_id": body.request_id,
        "session_id": run.session_id,
    })))
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandbox_runner::{Limit, RuntimeStatus};

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

    fn output(exit_code: Option<i32>, limits: Vec<Limit>) -> ExecOutput {
        ExecOutput {
            session_id: "s".into(),
            stdout: "out".into(),
            stderr: "err".into(),
            files: vec![],
            runtime_status: RuntimeStatus::New,
            exit_code,
            duration_ms: 1,
            limits,
            compile_cached: None,
            deleted_files: vec![],
            delivery: Default::default(),
        }
    }

    #[test]
    fn final_status_uses_librechat_words() {
        assert_eq!(final_json(&output(Some(0), vec![]))["status"], "completed");
        let e = final_json(&output(Some(2), vec![]));
        assert_eq!(
            (e["status"].as_str(), e["error"].as_str()),
            (Some("error"), Some("Sandbox exited with code 2"))
        );
        let t = final_json(&output(None, vec![Limit::Time]));
        assert_eq!(t["error"], "Time limit exceeded");
        let m = final_json(&output(None, vec![Limit::Memory]));
        assert_eq!(m["error"], "Out of memory");
        let x = final_json(&output(None, vec![]));
        assert_eq!(x["error"], "Execution failed or timed out");
        assert_eq!(x["stderr"], "err");
    }

    #[test]
    fn the_final_answer_carries_deleted_files_and_artifact_delivery() {
        let mut done = output(Some(0), vec![]);
        done.deleted_files = vec!["input.txt".into()];
        done.delivery = crate::core::Delivery {
            attempted: 2,
            failed: 2,
        };
        let body = final_json(&done);
        assert_eq!(body["status"], "completed");
        assert_eq!(body["deleted_files"], serde_json::json!(["input.txt"]));
        assert_eq!(body["artifact_delivery"]["status"], "failed");
    }
}
