//! `POST /exec/programmatic`: code that calls tools the client runs (LibreChat's
//! programmatic tool calling). The code runs until it calls tools; the calls made since
//! the last answer go to the client as one batch with a continuation token; the client
//! answers with their results and the same route continues the run.
//!
//! The parked runs, their tokens and batching are the core's (`core/programmatic.rs`);
//! this is the contract's JSON.

use super::exec::{Args, ExecBody, FileRef};
use super::{ApiJson, AppState};
use crate::core::programmatic::{Run, Step};
use crate::core::ExecOutput;
use crate::http::auth::Caller;
use crate::http::error::{AppError, AppResult};
use crate::render::output_json;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::post;
use axum::{Json, Router};
use sandbox_runner::{ToolResult, ToolSpec};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::HashSet;
use std::sync::Arc;

pub(crate) fn router() -> Router<AppState> {
    Router::new()
        .route("/exec/programmatic", post(programmatic))
        .route("/exec/programmatic/cancel", post(cancel))
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
        crate::http::openapi::BadExec,
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
            let results = body
                .tool_results
                .unwrap_or_default()
                .into_iter()
                .map(|r| ToolResult {
                    call_id: r.call_id,
                    result: r.result,
                    is_error: r.is_error,
                    error_message: r.error_message,
                })
                .collect();
            // LibreChat names each continuation with a request id of its own, and cancels
            // by that id.
            state.broker.continue_programmatic(
                caller.tenant.as_deref(),
                user.as_deref(),
                token,
                results,
                request_id(&headers),
            )?
        }
        None => start_run(&state, &caller, &headers, body).await?,
    };
    let answer = match state.broker.advance_programmatic(run).await? {
        Step::ToolCalls {
            session_id,
            token,
            calls,
        } => {
            let tool_calls: Vec<Value> = calls
                .into_iter()
                .map(|c| json!({ "id": c.call_id, "name": c.name, "input": c.input }))
                .collect();
            json!({
                "status": "tool_call_required",
                "session_id": session_id,
                "continuation_token": token,
                "tool_calls": tool_calls,
            })
        }
        Step::Ended(output) => final_json(&output),
    };
    Ok(Json(answer))
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
    Ok(state
        .broker
        .start_programmatic(&choice, input, specs, request_id(headers))
        .await?)
}

/// The request id a client names its request by (LibreChat's header, or the generic one).
fn request_id(headers: &HeaderMap) -> Option<String> {
    ["x-librechat-code-request-id", "x-codeapi-request-id"]
        .iter()
        .find_map(|h| headers.get(*h)?.to_str().ok())
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
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
    let session_id = state.broker.cancel_programmatic(
        caller.tenant.as_deref(),
        user.as_deref(),
        &body.request_id,
    )?;
    Ok(Json(json!({
        "message": "cancelled",
        "request_id": body.request_id,
        "session_id": session_id,
    })))
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandbox_runner::{Limit, RuntimeStatus};

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
