//! The code interpreter (port 49999): `/execute` streams one execution as E2B's
//! newline-delimited JSON (its count, output with timestamps, results, an error, the
//! end), and `/contexts` lists the languages' contexts. A context is a language here:
//! every Python execution of a sandbox shares one kernel (docs/E2B.md).

use super::data::DataRequest;
use super::paths::{e2b_path, workspace_relative, HOME};
use super::process::{env_exports, exec_cap_ms, is_env_name, run_code, ScriptRun};
use crate::clock::now_ms;
use crate::core::rich::{python_exception, tail, BUNDLE_MIME, ERROR_MIME};
use crate::core::{Display, ExecEvent, ExecHooks, OutputStream, Verdict};
use axum::body::{Body, Bytes};
use axum::http::{header, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use sandbox_runner::{Language, Limit};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::str::FromStr as _;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Seconds of silence after which `/execute` sends `{"type": "keepalive"}` (E2B's 5).
const KEEPALIVE: Duration = Duration::from_secs(5);

/// Most bytes of a displayed file inlined into a result.
const MAX_RESULT_BYTES: u64 = 8 * 1024 * 1024;

/// The interpreter's routes.
pub(super) async fn route(
    request: DataRequest,
    body: Body,
    method: &Method,
    path: &str,
) -> Response {
    match (method, path) {
        (&Method::POST, "/execute") => execute(request, body).await,
        (&Method::GET, "/contexts") => list_contexts(),
        (&Method::POST, "/contexts") => create_context(body).await,
        (&Method::DELETE, p) if p.starts_with("/contexts/") => {
            match context_language(&p["/contexts/".len()..]) {
                Some(_) => Json(Value::Null).into_response(),
                None => context_not_found(&p["/contexts/".len()..]),
            }
        }
        (&Method::POST, p) if p.starts_with("/contexts/") && p.ends_with("/restart") => {
            let id = &p["/contexts/".len()..p.len() - "/restart".len()];
            match context_language(id) {
                Some(Language::Py) => {
                    request
                        .state
                        .broker
                        .restart_sandbox(&request.sandbox.session)
                        .await;
                    Json(Value::Null).into_response()
                }
                Some(_) => Json(Value::Null).into_response(),
                None => context_not_found(id),
            }
        }
        _ => (
            StatusCode::NOT_FOUND,
            format!("no such route: {method} {path}"),
        )
            .into_response(),
    }
}

/// The language a context id names (ids are E2B's language names).
fn context_language(id: &str) -> Option<Language> {
    Language::from_str(id.trim()).ok()
}

/// E2B's 404 for an unknown context: the SDKs raise it as their not-found error.
fn context_not_found(id: &str) -> Response {
    (StatusCode::NOT_FOUND, format!("Context {id} not found")).into_response()
}

/// A context's JSON.
fn context_json(id: &str) -> Value {
    json!({"id": id, "language": id, "cwd": HOME})
}

fn list_contexts() -> Response {
    Json(json!([context_json("python")])).into_response()
}

/// `POST /contexts` body.
#[derive(Deserialize, Default)]
struct NewContext {
    language: Option<String>,
    cwd: Option<String>,
}

async fn create_context(body: Body) -> Response {
    let bytes = axum::body::to_bytes(body, 64 * 1024)
        .await
        .unwrap_or_default();
    let asked: NewContext = if bytes.iter().all(u8::is_ascii_whitespace) {
        NewContext::default()
    } else {
        match serde_json::from_slice(&bytes) {
            Ok(a) => a,
            Err(e) => {
                return (StatusCode::BAD_REQUEST, format!("invalid request: {e}")).into_response()
            }
        }
    };
    let language = asked
        .language
        .unwrap_or_else(|| "python".to_string())
        .to_lowercase();
    if context_language(&language).is_none() {
        return (
            StatusCode::BAD_REQUEST,
            format!("unsupported language: {language}"),
        )
            .into_response();
    }
    if let Some(cwd) = asked.cwd.filter(|c| !c.is_empty()) {
        if workspace_relative(&cwd)
            .map(|r| !r.is_empty())
            .unwrap_or(true)
        {
            return (
                StatusCode::BAD_REQUEST,
                format!("codebroker's contexts run in {HOME}, not in {cwd}"),
            )
                .into_response();
        }
    }
    Json(context_json(&language)).into_response()
}

/// `POST /execute` body.
#[derive(Deserialize)]
struct ExecuteRequest {
    code: String,
    context_id: Option<String>,
    language: Option<String>,
    env_vars: Option<BTreeMap<String, String>>,
}

/// An RFC 3339 timestamp of now, as E2B's output lines carry.
fn timestamp() -> String {
    crate::http::files::iso8601(now_ms())
}

/// One NDJSON line.
fn line(value: &Value) -> Bytes {
    let mut text = value.to_string();
    text.push('\n');
    Bytes::from(text)
}

async fn execute(request: DataRequest, body: Body) -> Response {
    let bytes = match axum::body::to_bytes(body, super::process::MAX_REQUEST_BYTES).await {
        Ok(b) => b,
        Err(e) => {
            return (
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("request too large: {e}"),
            )
                .into_response()
        }
    };
    let asked: ExecuteRequest = match serde_json::from_slice(&bytes) {
        Ok(a) => a,
        Err(e) => {
            return (StatusCode::BAD_REQUEST, format!("invalid request: {e}")).into_response()
        }
    };
    if asked.context_id.is_some() && asked.language.is_some() {
        return (
            StatusCode::BAD_REQUEST,
            "You can only specify either context_id or language, not both",
        )
            .into_response();
    }
    let lang = match (&asked.context_id, &asked.language) {
        (Some(id), _) => match context_language(id) {
            Some(l) => l,
            None => return context_not_found(id),
        },
        (None, Some(name)) => match Language::from_str(name.trim()) {
            Ok(l) => l,
            Err(_) => {
                return (
                    StatusCode::BAD_REQUEST,
                    format!("unsupported language: {name}"),
                )
                    .into_response()
            }
        },
        (None, None) => Language::Py,
    };
    let mut env = request.sandbox.env_vars.clone();
    let call_env = asked.env_vars.unwrap_or_default();
    env.extend(call_env.clone());
    if let Some(bad) = env.keys().find(|k| !is_env_name(k)) {
        return (
            StatusCode::BAD_REQUEST,
            format!("invalid environment variable name {bad:?}"),
        )
            .into_response();
    }
    let count = request.sandbox.executions.fetch_add(1, Ordering::SeqCst) + 1;
    let (lines, rx) = mpsc::channel::<Bytes>(64);
    let _ = lines.try_send(line(
        &json!({"type": "number_of_executions", "execution_count": count}),
    ));
    tokio::spawn(async move {
        run_execution(request, lang, asked.code, env, call_env, lines).await;
    });
    let mut rx = rx;
    let body = Body::from_stream(futures::stream::poll_fn(move |cx| {
        rx.poll_recv(cx)
            .map(|l| l.map(Ok::<_, std::convert::Infallible>))
    }));
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        body,
    )
        .into_response()
}

/// Python code that sets `env` in the kernel's environment.
fn python_set_env(env: &BTreeMap<String, String>) -> String {
    let pairs = serde_json::to_string(env).unwrap_or_else(|_| "{}".to_string());
    format!("import os as _e2b_os\n_e2b_os.environ.update({pairs})\ndel _e2b_os\n")
}

/// Python code that removes `names` from the kernel's environment.
fn python_unset_env(names: &[&String]) -> String {
    let names = serde_json::to_string(names).unwrap_or_else(|_| "[]".to_string());
    format!("import os as _e2b_os\nfor _e2b_k in {names}: _e2b_os.environ.pop(_e2b_k, None)\ndel _e2b_os, _e2b_k\n")
}

/// Runs one execution and writes its lines; stops the exec when the client goes away.
async fn run_execution(
    request: DataRequest,
    lang: Language,
    code: String,
    env: BTreeMap<String, String>,
    call_env: BTreeMap<String, String>,
    lines: mpsc::Sender<Bytes>,
) {
    let cap = exec_cap_ms(&request);
    let code = match lang {
        Language::Bash if !env.is_empty() => format!("{}{code}", env_exports(env.iter())),
        _ => code,
    };
    // Python keeps one kernel: the variables are set before the code, and the
    // execution's own are taken away after it (the sandbox's stay).
    if lang == Language::Py && !env.is_empty() {
        let _ = run_code(
            &request,
            Language::Py,
            python_set_env(&env),
            None,
            ExecHooks::default(),
        )
        .await;
    }
    let cancel = CancellationToken::new();
    let (events, mut received) = mpsc::channel::<ExecEvent>(64);
    let mut error_sent = false;
    let hooks = ExecHooks {
        events: Some(events),
        tools: None,
        cancel: Some(cancel.clone()),
        stdin: None,
    };
    let run = run_code(&request, lang, code, Some(cap), hooks);
    tokio::pin!(run);
    let outcome = loop {
        let next = tokio::select! {
            outcome = &mut run => break outcome,
            event = received.recv() => match event {
                Some(event) => {
                    error_sent |= is_error(&event);
                    event_line(&request, event).await
                }
                None => None,
            },
            () = tokio::time::sleep(KEEPALIVE) => Some(line(&json!({"type": "keepalive"}))),
        };
        if let Some(next) = next {
            if lines.send(next).await.is_err() {
                // The client is gone: E2B interrupts the kernel.
                cancel.cancel();
            }
        }
    };
    while let Ok(event) = received.try_recv() {
        error_sent |= is_error(&event);
        if let Some(next) = event_line(&request, event).await {
            let _ = lines.send(next).await;
        }
    }
    if lang == Language::Py {
        let only_call: Vec<&String> = call_env
            .keys()
            .filter(|k| !request.sandbox.env_vars.contains_key(*k))
            .collect();
        if !only_call.is_empty() {
            let _ = run_code(
                &request,
                Language::Py,
                python_unset_env(&only_call),
                None,
                ExecHooks::default(),
            )
            .await;
        }
    }
    let error = match outcome {
        // The kernel sent the exception itself.
        Ok(run) if error_sent && matches!(run.verdict, Verdict::Failed(_)) => None,
        Ok(run) => error_of(lang, &run, cap),
        Err(err) => Some(json!({
            "type": "error",
            "name": "SandboxError",
            "value": err.message,
            "traceback": "",
        })),
    };
    if let Some(error) = error {
        let _ = lines.send(line(&error)).await;
    }
    let _ = lines.send(line(&json!({"type": "end_of_execution"}))).await;
}

/// Whether `event` is the kernel's uncaught exception.
fn is_error(event: &ExecEvent) -> bool {
    matches!(event, ExecEvent::Display(d) if d.mime == ERROR_MIME)
}

/// The line for one event of the exec.
async fn event_line(request: &DataRequest, event: ExecEvent) -> Option<Bytes> {
    match event {
        ExecEvent::Output { stream, text } => {
            let kind = match stream {
                OutputStream::Stdout => "stdout",
                OutputStream::Stderr => "stderr",
            };
            Some(line(
                &json!({"type": kind, "text": text, "timestamp": timestamp()}),
            ))
        }
        ExecEvent::Display(display) => {
            let result = display_result(request, &display).await?;
            Some(line(&result))
        }
    }
}

/// A bundle `{"main": bool, "data": {mime: value}}` as E2B's `result`.
fn bundle_result(payload: &str) -> Option<Value> {
    let payload: Value = serde_json::from_str(payload).ok()?;
    let mut result = json!({
        "type": "result",
        "is_main_result": payload["main"].as_bool().unwrap_or(false),
    });
    for (mime, value) in payload["data"].as_object()? {
        let field = result_field(mime);
        match field {
            // E2B strips one pair of quotes from text/plain (a repr of a str).
            "text" => {
                let text = value.as_str().unwrap_or_default();
                let stripped = ["'", "\""].iter().find_map(|q| {
                    text.strip_prefix(q)
                        .and_then(|t| t.strip_suffix(q))
                        .filter(|_| text.len() >= 2)
                });
                result["text"] = json!(stripped.unwrap_or(text));
            }
            "extra" => result["extra"][mime] = value.clone(),
            "json" => {
                result["json"] = match value {
                    Value::String(s) => serde_json::from_str(s).unwrap_or(value.clone()),
                    other => other.clone(),
                }
            }
            _ => result[field] = value.clone(),
        }
    }
    Some(result)
}

/// The kernel's error event as E2B's `error` line.
fn error_line(payload: &str) -> Option<Value> {
    let error: Value = serde_json::from_str(payload).ok()?;
    Some(json!({
        "type": "error",
        "name": error["name"].as_str().unwrap_or("Error"),
        "value": error["value"].as_str().unwrap_or(""),
        "traceback": error["traceback"].as_str().unwrap_or(""),
    }))
}

/// A display as E2B's `result` (not the main one: a figure, a shown value).
async fn display_result(request: &DataRequest, display: &Display) -> Option<Value> {
    match (display.mime.as_str(), &display.data) {
        (BUNDLE_MIME, Some(payload)) => return bundle_result(payload),
        (ERROR_MIME, Some(payload)) => return error_line(payload),
        _ => {}
    }
    let value = Value::String(
        request
            .state
            .broker
            .display_value(&request.sandbox.session, display, MAX_RESULT_BYTES)
            .await?,
    );
    let mut result = json!({"type": "result", "is_main_result": false});
    let field = result_field(&display.mime);
    if field == "json" {
        let parsed = value
            .as_str()
            .and_then(|s| serde_json::from_str(s).ok())
            .unwrap_or(value);
        result["json"] = parsed;
    } else if field == "extra" {
        result["extra"] = json!({ display.mime.clone(): value });
    } else {
        result[field] = value;
    }
    if let Some(name) = &display.name {
        // Where the figure is in the workspace, for clients that want the file.
        result["extra"]["codebroker/path"] = json!(e2b_path(name));
    }
    Some(result)
}

/// The field of E2B's `Result` a MIME type goes to.
fn result_field(mime: &str) -> &'static str {
    match mime {
        "text/plain" => "text",
        "text/html" => "html",
        "text/markdown" => "markdown",
        "image/svg+xml" => "svg",
        "image/png" => "png",
        "image/jpeg" => "jpeg",
        "application/pdf" => "pdf",
        "text/latex" => "latex",
        "application/json" => "json",
        "application/javascript" => "javascript",
        _ => "extra",
    }
}

/// The `error` line of an execution that failed, if it did.
fn error_of(lang: Language, run: &ScriptRun, cap_ms: u64) -> Option<Value> {
    let error = |name: &str, value: String, traceback: String| json!({"type": "error", "name": name, "value": value, "traceback": traceback});
    match &run.verdict {
        Verdict::Ok => None,
        Verdict::Limit(limits) if limits.contains(&Limit::Time) => Some(error(
            "TimeoutError",
            format!(
                "Execution exceeded codebroker's time limit of {} s",
                cap_ms / 1000
            ),
            String::new(),
        )),
        Verdict::Limit(limits) => {
            let words: Vec<&str> = limits.iter().map(|l| l.message()).collect();
            Some(error("LimitError", words.join("; "), String::new()))
        }
        Verdict::Stopped => Some(error(
            "UnexpectedEndOfExecution",
            "the execution was stopped".to_string(),
            String::new(),
        )),
        Verdict::Failed(code) if lang == Language::Py => {
            let (name, value) = python_exception(&run.stderr)
                .unwrap_or_else(|| ("ExitError".to_string(), format!("exit code {code}")));
            Some(error(&name, value, run.stderr.clone()))
        }
        Verdict::Failed(code) => Some(error(
            "ExitError",
            format!("exit code {code}"),
            tail(&run.stderr, 4096),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mime_types_go_to_e2b_s_fields() {
        assert_eq!(result_field("image/png"), "png");
        assert_eq!(result_field("text/html"), "html");
        assert_eq!(result_field("application/x-foo"), "extra");
    }

    #[test]
    fn lines_end_in_a_newline_and_are_never_blank() {
        let l = line(&json!({"type": "end_of_execution"}));
        assert_eq!(&l[..], b"{\"type\":\"end_of_execution\"}\n");
    }
}
