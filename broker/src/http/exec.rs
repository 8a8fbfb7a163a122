//! `POST /exec`: run code in a session and answer with its output and files.

use super::{ApiJson, AppState};
use crate::auth::Caller;
use crate::broker::{ExecInput, ExecOutput, InputFile, SessionChoice};
use crate::error::{AppError, AppResult};
use crate::ids::is_valid_id;
use axum::body::Body;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use sandbox_runner::{Language, RuntimeStatus};
use serde::Deserialize;
use serde_json::{json, Value};
use std::time::Duration;

/// How long a call may take before the answer switches to a stream that starts with
/// whitespace, so idle-socket timeouts of clients (LibreChat's is a few seconds) do not
/// fire during a long exec.
const KEEPALIVE_AFTER: Duration = Duration::from_secs(2);
/// How often the whitespace comes.
const KEEPALIVE_EVERY: Duration = Duration::from_secs(3);

pub fn router() -> Router<AppState> {
    Router::new().route("/exec", post(exec))
}

/// The body of `POST /exec` (both contract generations). Unknown fields are ignored.
#[derive(Debug, Deserialize)]
pub struct ExecBody {
    /// Language name or alias.
    pub lang: String,
    /// Source code.
    pub code: String,
    /// Arguments: a list, or one string split at white space.
    #[serde(default)]
    pub args: Option<Args>,
    pub session_id: Option<String>,
    pub entity_id: Option<String>,
    pub user_id: Option<String>,
    pub runtime_session_hint: Option<String>,
    /// Wall-time limit in milliseconds.
    pub timeout: Option<f64>,
    /// Input files.
    #[serde(default)]
    pub files: Option<Vec<FileRef>>,
}

/// `args` as clients send it.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Args {
    List(Vec<String>),
    Line(String),
}

/// An input file reference, classic `{id, session_id, name}` or new
/// `{id, resource_id, storage_session_id, name, kind, version}`.
#[derive(Debug, Deserialize)]
pub struct FileRef {
    pub id: String,
    pub session_id: Option<String>,
    pub storage_session_id: Option<String>,
    #[serde(default)]
    pub name: String,
}

impl ExecBody {
    /// Checks the body and splits it into the session choice and the exec.
    pub fn into_parts(self, caller: &Caller) -> AppResult<(SessionChoice, ExecInput)> {
        let lang: Language = self
            .lang
            .parse()
            .map_err(|_| AppError::UnsupportedLanguage(self.lang.clone()))?;
        let args = match self.args {
            None => Vec::new(),
            Some(Args::List(list)) => list,
            Some(Args::Line(line)) => line.split_whitespace().map(str::to_string).collect(),
        };
        let mut files = Vec::new();
        for f in self.files.unwrap_or_default() {
            if !is_valid_id(&f.id) {
                return Err(AppError::BadRequest(format!("invalid file id: {:?}", f.id)));
            }
            let session_id = f
                .storage_session_id
                .or(f.session_id)
                .filter(|s| !s.is_empty())
                .unwrap_or_default();
            if !session_id.is_empty() && !is_valid_id(&session_id) {
                return Err(AppError::BadRequest(format!(
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
        };
        let input = ExecInput {
            lang,
            code: self.code,
            args,
            timeout_ms,
            files,
        };
        Ok((choice, input))
    }
}

/// The `/exec` response of API.md.
pub fn output_json(output: &ExecOutput) -> Value {
    let files: Vec<Value> = output
        .files
        .iter()
        .map(|f| {
            let mut file = json!({
                "id": f.id,
                "name": f.name,
                "path": format!("/mnt/data/{}", f.name),
                "storage_session_id": output.session_id,
                "session_id": output.session_id,
                "size": f.size,
            });
            if let Some(previous) = &f.modified_from {
                file["modified_from"] = json!(previous);
            }
            file
        })
        .collect();
    json!({
        "session_id": output.session_id,
        "stdout": output.stdout,
        "stderr": output.stderr,
        "files": files,
        "runtime_session_id": output.session_id,
        "runtime_status": match output.runtime_status {
            RuntimeStatus::New => "new",
            RuntimeStatus::Reused => "reused",
        },
        "exit_code": output.exit_code,
        "duration_ms": output.duration_ms,
        "limits": output.limits.iter().map(|l| l.message()).collect::<Vec<_>>(),
    })
}

async fn exec(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(body): ApiJson<ExecBody>,
) -> AppResult<Response> {
    let (choice, input) = body.into_parts(&caller)?;
    state.broker.limits.check_exec(choice.user.as_deref())?;
    let broker = state.broker.clone();
    let session = broker.choose_session(&choice, &input.files).await?;
    // The exec runs in a task of its own: a client that goes away does not leave the
    // session half-way through a call.
    let mut task = tokio::spawn(async move { broker.exec(session, input, None).await });

    match tokio::time::timeout(KEEPALIVE_AFTER, &mut task).await {
        Ok(joined) => {
            let output =
                joined.map_err(|e| AppError::internal(format!("exec task failed: {e}")))??;
            Ok(axum::Json(output_json(&output)).into_response())
        }
        Err(_) => Ok(keepalive_response(task)),
    }
}

/// A 200 whose body is whitespace every few seconds, then the JSON (JSON parsers skip
/// leading whitespace). An error after this point can only be told in the body.
fn keepalive_response(task: tokio::task::JoinHandle<AppResult<ExecOutput>>) -> Response {
    let stream = futures::stream::unfold(Some(task), |task| async move {
        let mut task = task?;
        tokio::select! {
            joined = &mut task => {
                let body = match joined {
                    Ok(Ok(output)) => output_json(&output),
                    Ok(Err(err)) => err.body(),
                    Err(e) => AppError::internal(format!("exec task failed: {e}")).body(),
                };
                Some((Ok::<_, std::io::Error>(body.to_string().into_bytes()), None))
            }
            _ = tokio::time::sleep(KEEPALIVE_EVERY) => Some((Ok(b" ".to_vec()), Some(task))),
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
