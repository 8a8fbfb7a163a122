//! One `execute_request`, as a Jupyter kernel answers it: `status` busy, `execute_input`,
//! the cell's output as it comes (`stream`, `display_data`, `execute_result`, `error`),
//! `execute_reply`, `status` idle. The cell is one exec of the kernel's session in rich
//! mode, so values arrive as MIME bundles and exceptions as events.

use super::channels::Outbox;
use super::messages::Message;
use super::{Kernel, Kernels};
use crate::core::rich::{python_exception, tail, BUNDLE_MIME, ERROR_MIME};
use crate::core::{Display, ExecEvent, ExecHooks, ExecInput, OutputStream, SessionChoice, Verdict};
use crate::sync::LockExt as _;
use sandbox_runner::{Language, Limit};
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Most bytes of a displayed file (a saved figure) inlined into a message.
const MAX_DISPLAY_BYTES: u64 = 8 * 1024 * 1024;

/// Most bytes of stderr a failure without a traceback event carries.
const MAX_ERROR_TAIL: usize = 4096;

/// The uncaught exception of a cell, as Jupyter's `error` and `execute_reply` carry it.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct CellError {
    pub(super) ename: String,
    pub(super) evalue: String,
    pub(super) traceback: Vec<String>,
}

impl CellError {
    pub(super) fn new(ename: &str, evalue: impl Into<String>) -> CellError {
        CellError::with_traceback(ename.to_string(), evalue.into(), "")
    }

    /// An error whose traceback is `text`, a line per entry as Jupyter sends it (the
    /// exception's line alone when `text` is empty).
    fn with_traceback(ename: String, evalue: String, text: &str) -> CellError {
        let mut traceback: Vec<String> = text.lines().map(str::to_string).collect();
        if traceback.is_empty() {
            traceback.push(format!("{ename}: {evalue}"));
        }
        CellError {
            ename,
            evalue,
            traceback,
        }
    }

    /// The `error` message's content (also the error fields of a reply).
    pub(super) fn content(&self) -> Value {
        json!({"ename": self.ename, "evalue": self.evalue, "traceback": self.traceback})
    }
}

/// Whether a cell ran to its end, or failed (later cells of the queue are aborted when
/// it asked for `stop_on_error`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CellEnd {
    Ok,
    Failed,
}

/// Runs one `execute_request` and sends every message it gets.
pub(super) async fn run(
    kernels: &Kernels,
    kernel: &Kernel,
    request: &Message,
    out: &Outbox,
) -> CellEnd {
    let _turn = kernel.turn.lock().await;
    let parent = Some(&request.header);
    let send_status = |state: &str| {
        Message::reply(
            parent,
            &kernel.kernel_session,
            "iopub",
            "status",
            json!({"execution_state": state}),
        )
    };
    kernel.busy.store(true, Ordering::SeqCst);
    kernel.touch();
    out.publish(send_status("busy")).await;
    let end = execute(kernels, kernel, request, out).await;
    kernel.busy.store(false, Ordering::SeqCst);
    kernel.touch();
    out.publish(send_status("idle")).await;
    end
}

/// Everything between busy and idle.
async fn execute(kernels: &Kernels, kernel: &Kernel, request: &Message, out: &Outbox) -> CellEnd {
    let content = &request.content;
    let parent = Some(&request.header);
    let msg = |channel: &str, msg_type: &str, content: Value| {
        Message::reply(parent, &kernel.kernel_session, channel, msg_type, content)
    };
    let flag = |name: &str, default: bool| content[name].as_bool().unwrap_or(default);
    let (silent, store_history) = (flag("silent", false), flag("store_history", true));
    let counted = !silent && store_history;
    let count = if counted {
        kernel.execution_count.fetch_add(1, Ordering::SeqCst) + 1
    } else {
        kernel.execution_count.load(Ordering::SeqCst)
    };
    let Some(code) = content["code"].as_str() else {
        let error = CellError::new("ValueError", "execute_request needs a string `code`");
        return fail(out, &msg, &request.channel, count, &error).await;
    };
    if !silent {
        out.publish(msg(
            "iopub",
            "execute_input",
            json!({"code": code, "execution_count": count}),
        ))
        .await;
    }
    let error = if code.trim().is_empty() {
        None
    } else {
        run_code(kernels, kernel, code, silent, count, out, &msg).await
    };
    match error {
        None => {
            out.reply(msg(
                &request.channel,
                "execute_reply",
                json!({"status": "ok", "execution_count": count, "user_expressions": {},
                       "payload": []}),
            ))
            .await;
            CellEnd::Ok
        }
        Some(error) => fail(out, &msg, &request.channel, count, &error).await,
    }
}

/// Sends a failed cell's `error` and its `execute_reply`.
async fn fail(
    out: &Outbox,
    msg: &impl Fn(&str, &str, Value) -> Message,
    channel: &str,
    count: u64,
    error: &CellError,
) -> CellEnd {
    out.publish(msg("iopub", "error", error.content())).await;
    let mut reply = error.content();
    reply["status"] = json!("error");
    reply["execution_count"] = json!(count);
    reply["user_expressions"] = json!({});
    reply["payload"] = json!([]);
    out.reply(msg(channel, "execute_reply", reply)).await;
    CellEnd::Failed
}

/// Runs the code as one exec and publishes its output; the error, if the cell failed.
async fn run_code(
    kernels: &Kernels,
    kernel: &Kernel,
    code: &str,
    silent: bool,
    count: u64,
    out: &Outbox,
    msg: &impl Fn(&str, &str, Value) -> Message,
) -> Option<CellError> {
    // Set before anything runs, so an interrupt during the variables' exec stops the cell.
    let cancel = CancellationToken::new();
    *kernel.running.locked() = Some(cancel.clone());
    set_env(kernels, kernel, &cancel).await;
    let (events, mut received) = mpsc::channel::<ExecEvent>(64);
    let hooks = ExecHooks {
        events: Some(events),
        tools: None,
        cancel: Some(cancel.clone()),
        stdin: None,
    };
    let run = exec(kernels, kernel, code.to_string(), hooks);
    tokio::pin!(run);
    let mut kernel_error: Option<CellError> = None;
    let outcome = loop {
        tokio::select! {
            outcome = &mut run => break outcome,
            Some(event) = received.recv() => {
                show(kernels, kernel, event, silent, count, out, msg, &mut kernel_error).await;
            }
        }
    };
    while let Ok(event) = received.try_recv() {
        show(
            kernels,
            kernel,
            event,
            silent,
            count,
            out,
            msg,
            &mut kernel_error,
        )
        .await;
    }
    *kernel.running.locked() = None;
    let interrupted = cancel.is_cancelled();
    match outcome {
        // A limit is the cause even when the kernel reports how it stopped the code (the
        // KeyboardInterrupt of a time limit).
        Ok(run) if matches!(run.verdict, Verdict::Limit(_)) => {
            failure(&run, interrupted, exec_cap_ms(kernels))
        }
        Ok(_) if kernel_error.is_some() => kernel_error,
        Ok(run) => failure(&run, interrupted, exec_cap_ms(kernels)),
        Err(message) => Some(CellError::new("SandboxError", message)),
    }
}

/// Sets the create's variables in the kernel's Python when its sandbox has not got them
/// yet: before the first cell, and after the sandbox was replaced (released when idle, or
/// restarted), since the saved Python state does not hold `os.environ`.
async fn set_env(kernels: &Kernels, kernel: &Kernel, cancel: &CancellationToken) {
    if kernel.env.is_empty() {
        return;
    }
    let current = || kernel.session.sandbox().map(|s| s.container_id.clone());
    let have = kernel.env_in.locked().clone();
    if have.is_some() && have == current() {
        return;
    }
    let pairs = serde_json::to_string(&kernel.env).unwrap_or_else(|_| "{}".into());
    let set = format!("import os as _k_os\n_k_os.environ.update({pairs})\ndel _k_os\n");
    let hooks = ExecHooks {
        cancel: Some(cancel.clone()),
        ..ExecHooks::default()
    };
    if exec(kernels, kernel, set, hooks).await.is_ok() && !cancel.is_cancelled() {
        *kernel.env_in.locked() = current();
    }
}

/// How one exec ended, as the front end needs it.
struct Ran {
    verdict: Verdict,
    stderr: String,
}

/// The most a cell may run (CODEBROKER_MAX_EXEC_TIMEOUT_MS), in ms: a notebook cell
/// runs as long as it needs, up to the operator's cap.
fn exec_cap_ms(kernels: &Kernels) -> u64 {
    kernels.broker.config().exec_limits.max_exec_timeout_ms
}

/// One Python exec in the kernel's session, rich; the core's error as the client's text.
async fn exec(
    kernels: &Kernels,
    kernel: &Kernel,
    code: String,
    hooks: ExecHooks,
) -> Result<Ran, String> {
    let choice = SessionChoice {
        session_id: Some(kernel.session.id().to_string()),
        tenant: kernel.tenant.clone(),
        ..SessionChoice::default()
    };
    let input = ExecInput {
        lang: Language::Py,
        code,
        args: Vec::new(),
        timeout_ms: Some(exec_cap_ms(kernels)),
        files: Vec::new(),
        tenant: kernel.tenant.clone(),
        rich: true,
    };
    let run = kernels
        .broker
        .start_exec(&choice, input, hooks)
        .await
        .map_err(|e| e.client_message())?;
    let output = run.await.map_err(|e| e.client_message())?;
    Ok(Ran {
        verdict: output.verdict(),
        stderr: output.stderr,
    })
}

/// The error of an exec that failed without the kernel sending its exception: a limit,
/// an interrupt, a sandbox that went away, an exit.
fn failure(run: &Ran, interrupted: bool, cap_ms: u64) -> Option<CellError> {
    match &run.verdict {
        Verdict::Ok => None,
        Verdict::Limit(limits) if limits.contains(&Limit::Time) => Some(CellError::new(
            "TimeoutError",
            format!(
                "the cell exceeded codebroker's time limit of {} s",
                cap_ms / 1000
            ),
        )),
        Verdict::Limit(limits) => {
            let words: Vec<&str> = limits.iter().map(|l| l.message()).collect();
            Some(CellError::new("LimitError", words.join("; ")))
        }
        _ if interrupted => Some(CellError::new("KeyboardInterrupt", "")),
        Verdict::Stopped => Some(CellError::new(
            "DeadKernelError",
            "the sandbox stopped during the cell; its Python state is lost",
        )),
        Verdict::Failed(code) => {
            let (ename, evalue) = python_exception(&run.stderr)
                .unwrap_or_else(|| ("SystemExit".to_string(), code.to_string()));
            let text = tail(&run.stderr, MAX_ERROR_TAIL);
            Some(CellError::with_traceback(ename, evalue, &text))
        }
    }
}

/// Publishes one event of the exec.
#[allow(clippy::too_many_arguments)]
async fn show(
    kernels: &Kernels,
    kernel: &Kernel,
    event: ExecEvent,
    silent: bool,
    count: u64,
    out: &Outbox,
    msg: &impl Fn(&str, &str, Value) -> Message,
    kernel_error: &mut Option<CellError>,
) {
    match event {
        ExecEvent::Output { stream, text } => {
            let name = match stream {
                OutputStream::Stdout => "stdout",
                OutputStream::Stderr => "stderr",
            };
            out.publish(msg("iopub", "stream", json!({"name": name, "text": text})))
                .await;
        }
        ExecEvent::Display(display) if display.mime == ERROR_MIME => {
            // Published with the reply, once the exec's verdict says what ended the cell.
            let error = display
                .data
                .as_deref()
                .and_then(kernel_exception)
                .unwrap_or_else(|| CellError::new("Error", ""));
            *kernel_error = Some(error);
        }
        ExecEvent::Display(display) => {
            let Some((main, data)) = bundle(kernels, kernel, &display).await else {
                return;
            };
            if main && silent {
                return;
            }
            let message = if main {
                msg(
                    "iopub",
                    "execute_result",
                    json!({"execution_count": count, "data": data, "metadata": {}}),
                )
            } else {
                msg(
                    "iopub",
                    "display_data",
                    json!({"data": data, "metadata": {}, "transient": {}}),
                )
            };
            out.publish(message).await;
        }
    }
}

/// The kernel's exception event as Jupyter's error: the traceback one string per line,
/// as Jupyter sends it.
fn kernel_exception(payload: &str) -> Option<CellError> {
    let error: Value = serde_json::from_str(payload).ok()?;
    let ename = error["name"].as_str().unwrap_or("Error").to_string();
    let evalue = error["value"].as_str().unwrap_or("").to_string();
    let text = error["traceback"].as_str().unwrap_or("");
    Some(CellError::with_traceback(ename, evalue, text))
}

/// A display as a MIME bundle, and whether it is the cell's result: the kernel's own
/// bundle, or a file it saved (`plt.show()`), read and inlined (binary types base64).
async fn bundle(kernels: &Kernels, kernel: &Kernel, display: &Display) -> Option<(bool, Value)> {
    if display.mime == BUNDLE_MIME {
        let payload: Value = serde_json::from_str(display.data.as_deref()?).ok()?;
        let data = payload.get("data").filter(|d| d.is_object())?.clone();
        return Some((payload["main"].as_bool().unwrap_or(false), data));
    }
    let value = kernels
        .broker
        .display_value(&kernel.session, display, MAX_DISPLAY_BYTES)
        .await?;
    let mut data = json!({ display.mime.clone(): value });
    if let Some(name) = &display.name {
        // Where the file is in the workspace, for a client that wants it.
        data["text/plain"] = json!(format!("/mnt/data/{name}"));
    }
    Some((false, data))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_s_exception_becomes_jupyter_s_error() {
        let payload = json!({"name": "ZeroDivisionError", "value": "division by zero",
            "traceback": "Traceback (most recent call last):\n  File \"<cell>\", line 1\nZeroDivisionError: division by zero"})
        .to_string();
        let error = kernel_exception(&payload).expect("parses");
        assert_eq!(error.ename, "ZeroDivisionError");
        assert_eq!(error.traceback.len(), 3);
        assert_eq!(error.traceback[2], "ZeroDivisionError: division by zero");
        assert!(kernel_exception("nope").is_none());
    }

    #[test]
    fn failures_without_an_event_are_named() {
        let ran = |verdict, stderr: &str| Ran {
            verdict,
            stderr: stderr.into(),
        };
        assert_eq!(failure(&ran(Verdict::Ok, ""), false, 1000), None);
        let timeout = failure(&ran(Verdict::Limit(vec![Limit::Time]), ""), false, 30_000);
        assert_eq!(timeout.expect("an error").ename, "TimeoutError");
        let stopped = failure(&ran(Verdict::Stopped, ""), true, 1000).expect("an error");
        assert_eq!(stopped.ename, "KeyboardInterrupt");
        let dead = failure(&ran(Verdict::Stopped, ""), false, 1000).expect("an error");
        assert_eq!(dead.ename, "DeadKernelError");
        let exited = failure(&ran(Verdict::Failed(3), ""), false, 1000).expect("an error");
        assert_eq!(
            (exited.ename.as_str(), exited.evalue.as_str()),
            ("SystemExit", "3")
        );
    }
}
