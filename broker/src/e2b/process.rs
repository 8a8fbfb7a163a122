//! envd's process service over Connect RPC with the JSON codec: `Start` (a server stream
//! of start, output and end events), `List`, `SendSignal`; the rest answer
//! `unimplemented`. A command is a Bash exec in the sandbox's session, so it takes the
//! session's turn like every exec (docs/E2B.md, "Commands").

use super::data::DataRequest;
use super::paths::{sandbox_path, workspace_relative};
use super::E2bSandbox;
use crate::core::{ExecEvent, ExecHooks, ExecInput, OutputStream, SessionChoice, Verdict};
use crate::sync::LockExt as _;
use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use sandbox_runner::{Language, Limit, StdinChunk};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Most bytes of a Connect request read (a command line, a path).
pub(super) const MAX_REQUEST_BYTES: usize = 1024 * 1024;

/// The first pid handed out in a sandbox.
const FIRST_PID: u32 = 1000;

/// The commands of one sandbox, by pid.
#[derive(Default)]
pub(crate) struct Commands {
    /// The last pid handed out (0: none yet).
    last_pid: u32,
    /// Commands still running.
    running: HashMap<u32, Command>,
}

/// A running command.
struct Command {
    /// Its `ProcessConfig` as `List` shows it.
    config: Value,
    /// Its tag, if the caller gave one.
    tag: Option<String>,
    /// Stops it.
    cancel: CancellationToken,
    /// Its stdin, when it was started with one.
    stdin: Option<mpsc::Sender<StdinChunk>>,
}

impl Commands {
    /// Stops every running command (the sandbox is killed or paused).
    pub(crate) fn stop_all(&mut self) {
        for command in self.running.values() {
            command.cancel.cancel();
        }
    }

    fn next_pid(&mut self) -> u32 {
        self.last_pid = self.last_pid.max(FIRST_PID - 1) + 1;
        self.last_pid
    }
}

pub(super) use crate::core::is_env_name;

/// `export NAME='value'` lines for Bash; the names were checked with [`is_env_name`].
pub(super) fn env_exports<'a>(env: impl Iterator<Item = (&'a String, &'a String)>) -> String {
    env.map(|(name, value)| format!("export {name}={}\n", shell_quote(value)))
        .collect()
}

/// The most an exec may run (CODEBROKER_MAX_EXEC_TIMEOUT_MS), in ms.
pub(super) fn exec_cap_ms(request: &DataRequest) -> u64 {
    request
        .state
        .broker
        .config()
        .exec_limits
        .max_exec_timeout_ms
}

/// `text` as one shell word.
pub(super) fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// A Connect error: its code string and message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RpcError {
    pub(super) code: &'static str,
    pub(super) message: String,
}

impl RpcError {
    pub(super) fn new(code: &'static str, message: impl Into<String>) -> RpcError {
        RpcError {
            code,
            message: message.into(),
        }
    }

    /// The HTTP status of a unary answer with this code (Connect's table).
    fn status(&self) -> StatusCode {
        match self.code {
            "invalid_argument" | "failed_precondition" | "out_of_range" => StatusCode::BAD_REQUEST,
            "unauthenticated" => StatusCode::UNAUTHORIZED,
            "permission_denied" => StatusCode::FORBIDDEN,
            "not_found" => StatusCode::NOT_FOUND,
            "already_exists" | "aborted" => StatusCode::CONFLICT,
            "resource_exhausted" => StatusCode::TOO_MANY_REQUESTS,
            "unimplemented" => StatusCode::NOT_IMPLEMENTED,
            "unavailable" => StatusCode::SERVICE_UNAVAILABLE,
            "deadline_exceeded" => StatusCode::GATEWAY_TIMEOUT,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// A unary error answer.
    pub(super) fn unary(&self) -> Response {
        (
            self.status(),
            [(header::CONTENT_TYPE, "application/json")],
            json!({"code": self.code, "message": self.message}).to_string(),
        )
            .into_response()
    }

    /// The JSON of an end-stream frame carrying this error.
    fn end_stream(&self) -> Value {
        json!({"error": {"code": self.code, "message": self.message}})
    }
}

impl From<crate::core::Error> for RpcError {
    fn from(err: crate::core::Error) -> RpcError {
        use crate::core::Error;
        let code = match &err {
            Error::BadRequest(_) | Error::UnsupportedLanguage(_) => "invalid_argument",
            Error::Forbidden(_) => "permission_denied",
            Error::NotFound(_) => "not_found",
            Error::Conflict(_) => "already_exists",
            Error::TooLarge(_) | Error::RateLimited { .. } => "resource_exhausted",
            Error::Unavailable(_) => "unavailable",
            Error::Internal(_) => "internal",
        };
        RpcError::new(code, err.client_message())
    }
}

/// One Connect envelope: a flag byte, a 4-byte big-endian length, the JSON.
pub(super) fn frame(flags: u8, json: &Value) -> Bytes {
    let payload = json.to_string().into_bytes();
    let mut out = Vec::with_capacity(5 + payload.len());
    out.push(flags);
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(&payload);
    Bytes::from(out)
}

/// The end-stream flag.
const END_STREAM: u8 = 0x02;

/// Reads a Connect request's message: the bare JSON of a unary call, or the one envelope
/// of a streaming one.
pub(super) async fn read_message<T: for<'de> Deserialize<'de>>(
    headers: &HeaderMap,
    body: Body,
) -> Result<T, RpcError> {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("application/json");
    if content_type.contains("proto") {
        return Err(RpcError::new(
            "unimplemented",
            "codebroker speaks Connect with the JSON codec only",
        ));
    }
    let bytes = axum::body::to_bytes(body, MAX_REQUEST_BYTES)
        .await
        .map_err(|e| RpcError::new("resource_exhausted", format!("request too large: {e}")))?;
    let json: &[u8] = if content_type.starts_with("application/connect+") {
        let [flags, a, b, c, d, rest @ ..] = &bytes[..] else {
            return Err(RpcError::new(
                "invalid_argument",
                "missing the request envelope",
            ));
        };
        if flags & 0x01 != 0 {
            return Err(RpcError::new(
                "internal",
                "compressed messages are not accepted",
            ));
        }
        let len = u32::from_be_bytes([*a, *b, *c, *d]) as usize;
        rest.get(..len)
            .ok_or_else(|| RpcError::new("invalid_argument", "truncated request envelope"))?
    } else {
        &bytes
    };
    let json = if json.iter().all(u8::is_ascii_whitespace) {
        b"{}".as_slice()
    } else {
        json
    };
    serde_json::from_slice(json)
        .map_err(|e| RpcError::new("invalid_argument", format!("invalid request: {e}")))
}

/// A unary success answer.
pub(super) fn unary_ok(message: Value) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        message.to_string(),
    )
        .into_response()
}

/// A server stream's answer: 200, `application/connect+json` exactly (the Python client
/// compares it literally), and the frames `frames` yields.
fn stream_response(mut frames: mpsc::Receiver<Bytes>) -> Response {
    let body = Body::from_stream(futures::stream::poll_fn(move |cx| {
        frames
            .poll_recv(cx)
            .map(|f| f.map(Ok::<_, std::convert::Infallible>))
    }));
    let mut response = (StatusCode::OK, body).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/connect+json"),
    );
    response
}

/// A stream that fails at once: 200 and an end-stream frame with the error (Connect
/// clients read no body from a non-200 stream).
fn stream_error(error: &RpcError) -> Response {
    let (tx, rx) = mpsc::channel(1);
    let _ = tx.try_send(frame(END_STREAM, &error.end_stream()));
    stream_response(rx)
}

/// `process.Process/<method>`.
pub(super) async fn rpc(request: DataRequest, body: Body, method: &str) -> Response {
    match method {
        "Start" => start(request, body).await,
        "List" => list(&request.sandbox),
        "SendSignal" => send_signal(request, body).await,
        "SendInput" => send_input(request, body, false).await,
        "CloseStdin" => send_input(request, body, true).await,
        "Connect" | "StreamInput" => stream_error(&RpcError::new(
            "unimplemented",
            format!("process.Process/{method} is not supported by codebroker"),
        )),
        other => RpcError::new(
            "unimplemented",
            format!("process.Process/{other} is not supported by codebroker"),
        )
        .unary(),
    }
}

/// `StartRequest`.
#[derive(Deserialize)]
struct StartRequest {
    process: ProcessConfig,
    pty: Option<Value>,
    tag: Option<String>,
    /// Keep the command's stdin open for `SendInput` (E2B's `stdin: true`).
    stdin: Option<bool>,
}

/// `ProcessConfig`.
#[derive(Deserialize)]
struct ProcessConfig {
    cmd: String,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    envs: BTreeMap<String, String>,
    cwd: Option<String>,
}

/// The Bash script that runs `config` with the sandbox's and the command's environment,
/// in its working directory.
fn command_script(sandbox: &E2bSandbox, config: &ProcessConfig) -> Result<String, RpcError> {
    if let Some(bad) = config.envs.keys().find(|k| !is_env_name(k)) {
        return Err(RpcError::new(
            "invalid_argument",
            format!("invalid environment variable name {bad:?}"),
        ));
    }
    let mut script = env_exports(sandbox.env_vars.iter().chain(&config.envs));
    if let Some(cwd) = config.cwd.as_deref().filter(|c| !c.is_empty()) {
        let relative =
            workspace_relative(cwd).map_err(|e| RpcError::new("permission_denied", e))?;
        script.push_str(&format!(
            "cd -- {} || exit 1\n",
            shell_quote(&sandbox_path(&relative))
        ));
    }
    // E2B runs `/bin/bash -l -c <command>`: the command is that script. Anything else
    // runs as given.
    let is_shell = matches!(config.cmd.as_str(), "/bin/bash" | "bash" | "/bin/sh" | "sh");
    match config.args.iter().position(|a| a == "-c") {
        Some(at) if is_shell && at + 1 < config.args.len() => {
            script.push_str(&config.args[at + 1]);
        }
        _ => {
            let words: Vec<String> = std::iter::once(&config.cmd)
                .chain(&config.args)
                .map(|w| shell_quote(w))
                .collect();
            script.push_str("exec ");
            script.push_str(&words.join(" "));
        }
    }
    script.push('\n');
    Ok(script)
}

/// `Connect-Timeout-Ms`: the command's lifetime (0 or absent: the exec cap).
fn connect_timeout(headers: &HeaderMap) -> Option<u64> {
    headers
        .get("connect-timeout-ms")
        .and_then(|v| v.to_str().ok())
        .filter(|v| v.len() <= 10)
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|ms| *ms > 0)
}

/// Seconds of silence after which a stream sends a keep-alive (`Keepalive-Ping-Interval`,
/// else envd's 90).
fn keepalive(headers: &HeaderMap) -> Duration {
    let secs = headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|s| (1..=3600).contains(s))
        .unwrap_or(90);
    Duration::from_secs(secs)
}

/// How an exec of a script ended, for the caller.
pub(super) struct ScriptRun {
    /// Everything it wrote to stdout.
    pub(super) stdout: String,
    /// To stderr.
    pub(super) stderr: String,
    /// Its verdict.
    pub(super) verdict: Verdict,
}

/// Runs `script` with Bash in `sandbox`'s session, forwarding its output to `events`
/// when given, and stopping at `cancel`.
pub(super) async fn run_script(
    request: &DataRequest,
    script: String,
    timeout_ms: Option<u64>,
    events: Option<mpsc::Sender<ExecEvent>>,
    cancel: Option<CancellationToken>,
) -> Result<ScriptRun, RpcError> {
    let hooks = ExecHooks {
        events,
        tools: None,
        cancel,
        stdin: None,
    };
    run_code(request, Language::Bash, script, timeout_ms, hooks).await
}

/// Runs `code` in `lang` in the sandbox's session (see [`run_script`]).
pub(super) async fn run_code(
    request: &DataRequest,
    lang: Language,
    code: String,
    timeout_ms: Option<u64>,
    hooks: ExecHooks,
) -> Result<ScriptRun, RpcError> {
    let sandbox = &request.sandbox;
    let choice = SessionChoice {
        session_id: Some(sandbox.session.id().to_string()),
        tenant: sandbox.tenant.clone(),
        ..SessionChoice::default()
    };
    let input = ExecInput {
        lang,
        code,
        args: Vec::new(),
        timeout_ms,
        files: Vec::new(),
        tenant: sandbox.tenant.clone(),
        // Python values as MIME bundles, exceptions as events: E2B's results.
        rich: lang == Language::Py,
    };
    let run = request
        .state
        .broker
        .start_exec(&choice, input, hooks)
        .await?;
    let output = run.await?;
    Ok(ScriptRun {
        verdict: output.verdict(),
        stdout: output.stdout,
        stderr: output.stderr,
    })
}

/// `process.Process/Start`: the command as a Bash exec, streamed.
async fn start(request: DataRequest, body: Body) -> Response {
    let timeout_ms = connect_timeout(&request.headers);
    let every = keepalive(&request.headers);
    let start: StartRequest = match read_message(&request.headers, body).await {
        Ok(s) => s,
        Err(e) => return stream_error(&e),
    };
    if start.pty.as_ref().is_some_and(|p| !p.is_null()) {
        return stream_error(&RpcError::new(
            "unimplemented",
            "codebroker runs commands without a terminal (no pty)",
        ));
    }
    let script = match command_script(&request.sandbox, &start.process) {
        Ok(s) => s,
        Err(e) => return stream_error(&e),
    };
    let cap = exec_cap_ms(&request);
    let limited = timeout_ms.is_some_and(|ms| ms <= cap);
    let cancel = CancellationToken::new();
    let (stdin_tx, stdin_rx) = match start.stdin {
        Some(true) => {
            let (tx, rx) = mpsc::channel::<StdinChunk>(64);
            (Some(tx), Some(rx))
        }
        _ => (None, None),
    };
    let pid = {
        let mut commands = request.sandbox.commands.locked();
        let pid = commands.next_pid();
        commands.running.insert(
            pid,
            Command {
                config: json!({
                    "cmd": start.process.cmd,
                    "args": start.process.args,
                    "envs": start.process.envs,
                    "cwd": start.process.cwd.clone().unwrap_or_else(|| super::paths::HOME.to_string()),
                }),
                tag: start.tag.clone(),
                cancel: cancel.clone(),
                stdin: stdin_tx,
            },
        );
        pid
    };
    let (frames, rx) = mpsc::channel::<Bytes>(64);
    tokio::spawn(async move {
        let (events, mut received) = mpsc::channel::<ExecEvent>(64);
        let sandbox = request.sandbox.clone();
        let _ = frames
            .send(frame(0, &json!({"event": {"start": {"pid": pid}}})))
            .await;
        let hooks = ExecHooks {
            events: Some(events),
            tools: None,
            cancel: Some(cancel),
            stdin: stdin_rx,
        };
        let run = run_code(&request, Language::Bash, script, timeout_ms, hooks);
        tokio::pin!(run);
        let outcome = loop {
            tokio::select! {
                outcome = &mut run => break outcome,
                event = received.recv() => {
                    if let Some(ExecEvent::Output { stream, text }) = event {
                        let key = match stream {
                            OutputStream::Stdout => "stdout",
                            OutputStream::Stderr => "stderr",
                        };
                        let data = base64::engine::general_purpose::STANDARD.encode(text.as_bytes());
                        // A client gone does not stop the command (as envd).
                        let _ = frames.send(frame(0, &json!({"event": {"data": {key: data}}}))).await;
                    }
                }
                () = tokio::time::sleep(every) => {
                    let _ = frames.send(frame(0, &json!({"event": {"keepalive": {}}}))).await;
                }
            }
        };
        // Output still queued when the exec ended.
        while let Ok(ExecEvent::Output { stream, text }) = received.try_recv() {
            let key = match stream {
                OutputStream::Stdout => "stdout",
                OutputStream::Stderr => "stderr",
            };
            let data = base64::engine::general_purpose::STANDARD.encode(text.as_bytes());
            let _ = frames
                .send(frame(0, &json!({"event": {"data": {key: data}}})))
                .await;
        }
        sandbox.commands.locked().running.remove(&pid);
        let last = match outcome {
            Ok(run) => match end_event(&run.verdict, limited, cap) {
                Ok(end) => {
                    let _ = frames.send(frame(0, &json!({"event": {"end": end}}))).await;
                    json!({})
                }
                Err(error) => error.end_stream(),
            },
            Err(error) => error.end_stream(),
        };
        let _ = frames.send(frame(END_STREAM, &last)).await;
    });
    stream_response(rx)
}

/// The `end` event of a command that ended with `verdict`; a time limit is the stream's
/// `deadline_exceeded` instead, as envd ends a command at its deadline. `limited`: the
/// caller's own timeout was the limit, else codebroker's cap (`cap_ms`).
fn end_event(verdict: &Verdict, limited: bool, cap_ms: u64) -> Result<Value, RpcError> {
    let exit = |code: i32| {
        let status = format!("exit status {code}");
        let error = (code != 0).then(|| status.clone());
        json!({"exitCode": code, "exited": true, "status": status, "error": error})
    };
    let killed = |why: &str| json!({"exitCode": -1, "exited": false, "status": "signal: killed", "error": why});
    match verdict {
        Verdict::Ok => Ok(exit(0)),
        Verdict::Failed(code) => Ok(exit(*code)),
        Verdict::Stopped => Ok(killed("signal: killed")),
        Verdict::Limit(limits) if limits.contains(&Limit::Time) => Err(RpcError::new(
            "deadline_exceeded",
            if limited {
                "the command exceeded its timeout".to_string()
            } else {
                format!(
                    "the command exceeded codebroker's time limit of {} s \
                         (CODEBROKER_MAX_EXEC_TIMEOUT_MS)",
                    cap_ms / 1000
                )
            },
        )),
        Verdict::Limit(limits) => {
            let words: Vec<&str> = limits.iter().map(|l| l.message()).collect();
            let code = if limits.contains(&Limit::Memory) {
                137
            } else {
                1
            };
            Ok(json!({
                "exitCode": code,
                "exited": false,
                "status": "signal: killed",
                "error": words.join("; "),
            }))
        }
    }
}

/// `process.Process/List`.
fn list(sandbox: &Arc<E2bSandbox>) -> Response {
    let commands = sandbox.commands.locked();
    let mut processes: Vec<(u32, Value)> = commands
        .running
        .iter()
        .map(|(pid, c)| {
            let mut info = json!({"pid": pid, "config": c.config});
            if let Some(tag) = &c.tag {
                info["tag"] = json!(tag);
            }
            (*pid, info)
        })
        .collect();
    processes.sort_by_key(|(pid, _)| *pid);
    let processes: Vec<Value> = processes.into_iter().map(|(_, p)| p).collect();
    unary_ok(json!({"processes": processes}))
}

/// `SendSignalRequest`.
#[derive(Deserialize)]
struct SendSignalRequest {
    process: Selector,
}

/// `ProcessSelector`: a pid or a tag.
#[derive(Deserialize)]
struct Selector {
    pid: Option<u32>,
    tag: Option<String>,
}

/// `process.Process/SendSignal`: any signal stops the command (SIGTERM and SIGKILL are
/// the ones the SDKs send).
async fn send_signal(request: DataRequest, body: Body) -> Response {
    let signal: SendSignalRequest = match read_message(&request.headers, body).await {
        Ok(s) => s,
        Err(e) => return e.unary(),
    };
    let commands = request.sandbox.commands.locked();
    let found = commands.running.iter().find(|(pid, c)| {
        Some(**pid) == signal.process.pid
            || (signal.process.tag.is_some() && c.tag == signal.process.tag)
    });
    match found {
        Some((_, command)) => {
            command.cancel.cancel();
            unary_ok(json!({}))
        }
        None => RpcError::new("not_found", "process not found").unary(),
    }
}

/// `SendInputRequest` and `CloseStdinRequest`.
#[derive(Deserialize)]
struct InputRequest {
    process: Selector,
    input: Option<ProcessInput>,
}

/// `ProcessInput`: bytes for stdin (a PTY's are not served).
#[derive(Deserialize)]
struct ProcessInput {
    stdin: Option<String>,
    pty: Option<String>,
}

/// `process.Process/SendInput` (`close`: `CloseStdin`): bytes for, or the end of, the
/// stdin of a command started with `stdin: true`.
async fn send_input(request: DataRequest, body: Body, close: bool) -> Response {
    let asked: InputRequest = match read_message(&request.headers, body).await {
        Ok(a) => a,
        Err(e) => return e.unary(),
    };
    let data = match asked.input {
        _ if close => Vec::new(),
        Some(ProcessInput {
            stdin: Some(text), ..
        }) => match decode_base64(&text) {
            Some(bytes) => bytes,
            None => return RpcError::new("invalid_argument", "stdin is not base64").unary(),
        },
        Some(ProcessInput { pty: Some(_), .. }) => {
            return RpcError::new(
                "unimplemented",
                "codebroker runs commands without a terminal (no pty)",
            )
            .unary()
        }
        _ => Vec::new(),
    };
    let sender = {
        let commands = request.sandbox.commands.locked();
        let found = commands.running.iter().find(|(pid, c)| {
            Some(**pid) == asked.process.pid
                || (asked.process.tag.is_some() && c.tag == asked.process.tag)
        });
        match found {
            None => return RpcError::new("not_found", "process not found").unary(),
            Some((_, command)) => command.stdin.clone(),
        }
    };
    let Some(sender) = sender else {
        return RpcError::new(
            "failed_precondition",
            "the command was started without stdin (start it with stdin: true)",
        )
        .unary();
    };
    // A command that ended meanwhile drops what was sent, as envd does.
    let _ = sender.send(StdinChunk { data, close }).await;
    unary_ok(json!({}))
}

/// Standard or URL-safe base64, padded or not (proto3 JSON's `bytes`).
fn decode_base64(text: &str) -> Option<Vec<u8>> {
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
    [STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD]
        .iter()
        .find_map(|engine| engine.decode(text.trim()).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_is_a_flag_a_big_endian_length_and_the_json() {
        let bytes = frame(0, &json!({"a": 1}));
        assert_eq!(&bytes[..], b"\x00\x00\x00\x00\x07{\"a\":1}");
        let end = frame(END_STREAM, &json!({}));
        assert_eq!(&end[..], b"\x02\x00\x00\x00\x02{}");
    }

    #[test]
    fn values_are_quoted() {
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }

    #[test]
    fn ends_say_what_envd_says() {
        let end = end_event(&Verdict::Failed(3), false, 30_000).expect("end");
        assert_eq!(end["exitCode"], 3);
        assert_eq!(end["error"], "exit status 3");
        let ok = end_event(&Verdict::Ok, false, 30_000).expect("end");
        assert_eq!(ok["error"], Value::Null);
        let late = end_event(&Verdict::Limit(vec![Limit::Time]), false, 30_000).unwrap_err();
        assert_eq!(late.code, "deadline_exceeded");
        assert!(late.message.contains("30 s"));
    }
}
