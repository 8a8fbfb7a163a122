//! `POST /exec`: run code in a session and answer with its output and files.

use super::stream::{display_json, ndjson_response, sse_response, StreamEvent, STREAM_QUEUE};
use super::{ApiJson, AppState};
use crate::core::{
    ExecEvent, ExecHooks, ExecInput, ExecRun, InputFile, OutputStream, SessionChoice,
};
use crate::http::auth::Caller;
use crate::http::error::{AppError, AppResult};
use crate::ids::is_valid_id;
use crate::render::output_json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use sandbox_runner::Language;
use serde::Deserialize;
use serde_json::Value;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// How long a call may take before the answer switches to a stream that starts with
/// whitespace, so idle-socket timeouts of clients (LibreChat's is a few seconds) do not
/// fire during a long exec.
const KEEPALIVE_AFTER: Duration = Duration::from_secs(2);
/// How often the whitespace comes.
const KEEPALIVE_EVERY: Duration = Duration::from_secs(3);

pub(crate) fn router() -> Router<AppState> {
    Router::new()
        .route("/exec", post(exec))
        .route("/exec/stream", post(exec_stream))
}

/// The body of `POST /exec` (both contract generations). Unknown fields are ignored.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub(crate) struct ExecBody {
    /// Language name or alias.
    pub(crate) lang: String,
    /// Source code.
    pub(crate) code: String,
    /// Arguments: a list, or one string split at white space.
    #[serde(default)]
    pub(crate) args: Option<Args>,
    pub(crate) session_id: Option<String>,
    pub(crate) entity_id: Option<String>,
    pub(crate) user_id: Option<String>,
    pub(crate) runtime_session_hint: Option<String>,
    /// Wall-time limit in milliseconds.
    pub(crate) timeout: Option<f64>,
    /// Input files.
    #[serde(default)]
    pub(crate) files: Option<Vec<FileRef>>,
}

/// `args` as clients send it.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
pub(crate) enum Args {
    List(Vec<String>),
    Line(String),
}

/// An input file reference, classic `{id, session_id, name}` or new
/// `{id, resource_id, storage_session_id, name, kind, version}`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub(crate) struct FileRef {
    pub(crate) id: String,
    pub(crate) session_id: Option<String>,
    pub(crate) storage_session_id: Option<String>,
    #[serde(default)]
    pub(crate) name: String,
}

impl ExecBody {
    /// Checks the body and splits it into the session choice and the exec.
    pub(crate) fn into_parts(self, caller: &Caller) -> AppResult<(SessionChoice, ExecInput)> {
        let lang: Language = self
            .lang
            .parse()
            .map_err(|_| AppError::unsupported_language(self.lang.clone()))?;
        let args = match self.args {
            None => Vec::new(),
            Some(Args::List(list)) => list,
            Some(Args::Line(line)) => line.split_whitespace().map(str::to_string).collect(),
        };
        let refs = self.files.unwrap_or_default();
        crate::core::limits::check_input_refs(refs.len())?;
        let mut files = Vec::new();
        for f in refs {
            if !is_valid_id(&f.id) {
                return Err(AppError::bad_request(format!(
                    "invalid file id: {:?}",
                    f.id
                )));
            }
            let session_id = f
                .storage_session_id
                .or(f.session_id)
                .filter(|s| !s.is_empty())
                .unwrap_or_default();
            if !session_id.is_empty() && !is_valid_id(&session_id) {
                return Err(AppError::bad_request(format!(
                    "invalid session id in file ref: {session_id:?}"
                )));
            }
            files.push(InputFile {
                id: f.id,
                session_id,
                name: f.name,
            });
        }
        let timeout_ms = match self.timeout {
            Some(t) if !t.is_finite() || t < 0.0 => {
                return Err(AppError::Unprocessable(
                    "timeout must be a positive number of ms".into(),
                ))
            }
            Some(t) => Some(t as u64),
            None => None,
        };
        let choice = SessionChoice {
            user: caller.user_or(self.user_id.as_deref()),
            session_id: self.session_id,
            runtime_session_hint: self.runtime_session_hint,
            entity_id: self.entity_id,
            tenant: caller.tenant.clone(),
        };
        let input = ExecInput {
            lang,
            code: self.code,
            args,
            timeout_ms,
            files,
            tenant: caller.tenant.clone(),
            rich: false,
        };
        Ok((choice, input))
    }
}

/// Runs code in a session and answers with its output and files. After 2 s the answer
/// becomes a 200 whose body starts with whitespace (keep-alive) and ends with the JSON.
#[utoipa::path(
    post,
    path = "/exec",
    tag = "exec",
    security(("api_key" = []), ("bearer" = [])),
    request_body = ExecBody,
    responses(
        (status = 200, description = "The exec's output", body = crate::http::openapi::ExecResponseDoc),
        crate::http::openapi::BadExec,
        crate::http::openapi::Unauthorized,
        (status = 403, description = "An input file belongs to another user", body = crate::http::openapi::ErrorBody),
        crate::http::openapi::WrongShape,
        crate::http::openapi::RateLimited,
        (status = 503, description = "No sandbox can be started right now", body = crate::http::openapi::ErrorBody),
    )
)]
async fn exec(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(body): ApiJson<ExecBody>,
) -> AppResult<Response> {
    let (choice, input) = body.into_parts(&caller)?;
    // The exec runs in a task of its own, so a client that goes away does not leave the
    // session half-way through a call; it is told to stop instead (the run, dropped with
    // this handler or with the response body, cancels it), so its code does not run on
    // for nobody.
    let cancel = CancellationToken::new();
    let hooks = ExecHooks {
        cancel: Some(cancel.clone()),
        ..Default::default()
    };
    let mut run = state
        .broker
        .start_exec(&choice, input, hooks)
        .await?
        .cancel_on_drop(Some(&cancel));

    match tokio::time::timeout(KEEPALIVE_AFTER, &mut run).await {
        Ok(output) => Ok(axum::Json(output_json(&output?)).into_response()),
        Err(_) => Ok(keepalive_response(run)),
    }
}

/// A 200 whose body is whitespace every few seconds, then the JSON (JSON parsers skip
/// leading whitespace). An error after this point can only be told in the body. The body
/// holds the run: a client that disconnects stops the exec.
fn keepalive_response(run: ExecRun) -> Response {
    let stream = futures::stream::unfold(Some(run), |state| async move {
        let mut run = state?;
        tokio::select! {
            output = &mut run => {
                let body = match output {
                    Ok(output) => output_json(&output),
                    Err(err) => AppError::from(err).body(),
                };
                Some((Ok::<_, std::io::Error>(body.to_string().into_bytes()), None))
            }
            _ = tokio::time::sleep(KEEPALIVE_EVERY) => {
                Some((Ok(b" ".to_vec()), Some(run)))
            }
        }
    });
    let stream =
        futures::StreamExt::chain(futures::stream::once(async { Ok(b" ".to_vec()) }), stream);
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        Body::from_stream(stream),
    )
        .into_response()
}

/// `POST /exec/stream`: the `/exec` request answered as `text/event-stream` (or NDJSON
/// with `Accept: application/x-ndjson`): `stdout`/`stderr` chunks as the code writes
/// them, `display` for figures, and a final `result` with the `/exec` response; after
/// each `CODEBROKER_STREAM_KEEPALIVE_SECS` of silence an SSE comment (NDJSON: a
/// `heartbeat` event), so proxies do not cut a quiet run. A client that disconnects
/// stops the exec; the session stays usable.
#[utoipa::path(
    post,
    path = "/exec/stream",
    tag = "exec",
    security(("api_key" = []), ("bearer" = [])),
    request_body = ExecBody,
    responses(
        (status = 200, description = "`stdout`, `stderr`, `display` events, then `result` (the /exec response) or `error` (the error envelope); NDJSON lines `{event, data}` with `Accept: application/x-ndjson`; a `: keep-alive` comment (NDJSON: `{\"event\":\"heartbeat\",\"data\":null}`) after each CODEBROKER_STREAM_KEEPALIVE_SECS (15) of silence", content_type = "text/event-stream"),
        crate::http::openapi::BadExec,
        crate::http::openapi::Unauthorized,
        crate::http::openapi::WrongShape,
        crate::http::openapi::RateLimited,
    )
)]
async fn exec_stream(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    ApiJson(body): ApiJson<ExecBody>,
) -> AppResult<Response> {
    let ndjson = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/x-ndjson"));
    let (choice, input) = body.into_parts(&caller)?;
    let inline_left = state.broker.config().exec_limits.max_display_bytes;
    let keepalive = Duration::from_secs(state.broker.config().stream_keepalive_secs);
    let (tx, rx) = mpsc::channel(STREAM_QUEUE);
    let cancel = CancellationToken::new();
    let hooks = ExecHooks {
        events: Some(tx),
        tools: None,
        cancel: Some(cancel.clone()),
        stdin: None,
    };
    let run = state
        .broker
        .start_exec(&choice, input, hooks)
        .await?
        .cancel_on_drop(Some(&cancel));
    let files_of = run.session.clone();

    struct State {
        rx: mpsc::Receiver<ExecEvent>,
        /// The exec; dropped with the body, so a client that goes away cancels it.
        run: Option<ExecRun>,
        /// The exec's session, whose files displays may inline.
        files_of: std::sync::Arc<crate::session::Session>,
        /// Through which those files are read.
        broker: std::sync::Arc<crate::core::Broker>,
        /// Bytes of files the displays of this exec may still inline.
        inline_left: u64,
    }
    let state = State {
        rx,
        run: Some(run),
        files_of,
        broker: state.broker.clone(),
        inline_left,
    };
    let events = futures::stream::unfold(state, move |mut st| async move {
        if let Some(msg) = st.rx.recv().await {
            let event = match msg {
                ExecEvent::Output { stream, text } => StreamEvent {
                    name: match stream {
                        OutputStream::Stdout => "stdout",
                        OutputStream::Stderr => "stderr",
                    },
                    data: Value::String(text),
                },
                ExecEvent::Display(display) => {
                    let (data, left) =
                        display_json(&st.broker, &st.files_of, display, st.inline_left).await;
                    st.inline_left = left;
                    StreamEvent {
                        name: "display",
                        data,
                    }
                }
            };
            return Some((event, st));
        }
        let run = st.run.take()?;
        let (name, data) = match run.await {
            Ok(output) => ("result", output_json(&output)),
            Err(err) => ("error", AppError::from(err).body()),
        };
        Some((StreamEvent { name, data }, st))
    });
    Ok(if ndjson {
        ndjson_response(events, keepalive)
    } else {
        sse_response(events, keepalive)
    })
}
