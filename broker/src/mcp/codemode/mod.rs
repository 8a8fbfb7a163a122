//! Code mode (docs/API.md, "MCP at /mcp"; docs/ARCHITECTURE.md, trust boundaries): code run by the MCP tool `execute` calls functions
//! the broker serves itself over the exec's tool bridge, with no client round trip:
//!
//! - `codemode.http.fetch({url, method?, headers?, body?})`: the broker makes the request,
//!   for hosts on `CODEBROKER_CODEMODE_HTTP_ALLOW` only (redirects included; a name must
//!   resolve to a public address unless that address is listed), so the container keeps
//!   no network;
//! - `codemode.env.get({key})`: variables of the broker's environment on
//!   `CODEBROKER_CODEMODE_ENV_ALLOW`;
//! - `codemode.<server>.<tool>(args)`: tools of the upstream MCP servers of
//!   `CODEBROKER_CODEMODE_MCP_SERVERS`, connected once with rmcp's client.
//!
//! The bridge's tools are flat names (`http.fetch`, `srv.add`); the code this module wraps
//! around the caller's builds the nested `codemode.<ns>.<name>` objects from them (first dot
//! only) in JavaScript/TypeScript and Python, and reports the code's value and error through
//! one more, internal tool ([`RESULT_TOOL`]).

mod allow;
mod decl;
mod fetch;
mod search;
mod upstream;
mod wrap;

use self::allow::HostRule;
use self::decl::{declaration, python_stubs, typescript_declarations};
use self::fetch::builtin_specs;
use self::search::rank;
use self::upstream::{parse_server, UpstreamSlot};
use self::wrap::{wrap_js, wrap_py, wrap_ts};
use crate::config::CodeModeConfig;
use crate::core::Admitted;
use crate::core::{Broker, Error, ExecHooks, ExecInput, ToolBridge};
use crate::core::{ExecEvent, OutputStream};
use crate::sync::LockExt as _;
use sandbox_runner::{Language, ToolCall, ToolResult, ToolSpec};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;

/// The internal tool the wrapper reports the code's value and error with.
pub(crate) const RESULT_TOOL: &str = "__codemode_result";
/// Events of a running `execute` queued for the collector, which drains them at once.
const EVENT_QUEUE: usize = 16;
/// Calls of one `execute` the broker answers at once; the code's other calls wait their
/// turn, in the order made. Each holds up to a body or a result, so this (with the result
/// queue of the same size) bounds what one `execute` makes the broker hold.
const MAX_CALLS_IN_FLIGHT: usize = 8;
/// Calls of one `execute` that may wait for their turn (the runner lets 256 be made at
/// once); one more is refused at once.
const MAX_CALLS_WAITING: usize = 256;
/// Bytes of input (as JSON) the waiting calls of one `execute` may hold: a call that would
/// pass them is refused at once, unless none waits.
const MAX_WAITING_INPUT_BYTES: u64 = 16 << 20;

/// The bytes of function results one `execute` may still receive
/// (`CODEBROKER_CODEMODE_MAX_RESULT_BYTES`), shared by its calls. As with displays, the
/// code is told when it runs out.
pub(crate) struct ResultBudget {
    /// Bytes left.
    left: AtomicU64,
    /// The whole budget, for the error.
    max: u64,
}

impl ResultBudget {
    fn new(max: u64) -> Self {
        ResultBudget {
            left: AtomicU64::new(max),
            max,
        }
    }

    /// Bytes left.
    fn left(&self) -> u64 {
        self.left.load(Ordering::SeqCst)
    }

    /// Takes `bytes`; false, taking nothing, when they do not fit.
    fn take(&self, bytes: u64) -> bool {
        self.left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| {
                left.checked_sub(bytes)
            })
            .is_ok()
    }

    /// What a call past the budget gets.
    fn exceeded(&self) -> String {
        format!(
            "The function results of this execute passed their budget of {} bytes; \
             no more are passed",
            self.max
        )
    }
}

/// The size of `value` as JSON, counted without writing it anywhere.
fn json_size(value: &Value) -> u64 {
    /// Counts what is written to it.
    struct Counter(u64);
    impl std::io::Write for Counter {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0 += bytes.len() as u64;
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut counter = Counter(0);
    // Writing to a counter cannot fail, nor can serializing a Value.
    let _ = serde_json::to_writer(&mut counter, value);
    counter.0
}

/// What one `execute` produced.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Outcome {
    /// The value the code returned (JS/TS `return`, a lone expression, Python's last
    /// expression), as JSON; `null` when none.
    pub(crate) result: Value,
    /// Lines the code printed (console.log/warn/error, print), stdout and stderr in order.
    pub(crate) logs: Vec<String>,
    /// Why the code failed (an exception, a limit), when it did.
    pub(crate) error: Option<String>,
}

impl Outcome {
    /// `{result, logs, error}`.
    pub(crate) fn to_json(&self) -> Value {
        json!({ "result": self.result, "logs": self.logs, "error": self.error })
    }
}

/// Code mode's settings and connections, shared by every MCP session.
pub struct CodeMode {
    /// Whether `execute` and `search` are offered.
    pub(crate) enabled: bool,
    /// Hosts `http.fetch` may reach.
    http_allow: Arc<Vec<HostRule>>,
    /// Variables `env.get` may read.
    env_allow: Vec<String>,
    /// Variables a `stdio:` upstream server gets besides [`UPSTREAM_BASE_ENV`].
    upstream_env: Vec<String>,
    /// Upstream servers as configured (valid entries), with their connections.
    upstreams: Vec<UpstreamSlot>,
    /// The HTTP client of `http.fetch` (its redirect policy checks the allowlist); `None`
    /// when it could not be made (then no HTTP at all, rather than a client without it).
    http: Option<reqwest::Client>,
    /// Largest body `http.fetch` passes.
    max_body: u64,
    /// Bytes of function results one `execute` may receive in all.
    max_result_bytes: u64,
    /// The uid `stdio:` upstream servers run as.
    upstream_uid: u32,
    /// Time limit of one call.
    call_timeout: Duration,
    /// Time limit of one `execute`.
    exec_timeout_ms: u64,
}

impl CodeMode {
    /// Code mode from its settings; starts connecting upstream servers in the
    /// background when enabled and inside a runtime.
    pub fn new(settings: &CodeModeConfig) -> Arc<CodeMode> {
        let http_allow: Arc<Vec<HostRule>> = Arc::new(
            settings
                .codemode_http_allow
                .iter()
                .filter_map(|e| HostRule::parse(e))
                .collect(),
        );
        let env_allow = settings
            .codemode_env_allow
            .iter()
            .map(|k| k.trim().to_string())
            .filter(|k| !k.is_empty())
            .collect();
        let mut upstreams = Vec::new();
        for entry in settings.codemode_mcp_servers.iter().map(|e| e.trim()) {
            if entry.is_empty() {
                continue;
            }
            match parse_server(entry) {
                Ok((name, target)) => upstreams.push(UpstreamSlot {
                    name,
                    target,
                    state: Default::default(),
                }),
                Err(e) => tracing::warn!(error = %e, "ignoring a code mode MCP server"),
            }
        }
        let call_timeout = Duration::from_millis(settings.codemode_call_timeout_ms.max(1));
        let http = fetch::http_client(
            http_allow.clone(),
            settings.codemode_http_allow_private,
            call_timeout,
        );
        let mode = Arc::new(CodeMode {
            enabled: settings.codemode,
            http_allow,
            env_allow,
            upstream_env: settings
                .codemode_mcp_env
                .iter()
                .map(|k| k.trim().to_string())
                .filter(|k| !k.is_empty())
                .collect(),
            upstreams,
            http,
            max_body: settings.codemode_http_max_bytes,
            max_result_bytes: settings.codemode_max_result_bytes,
            upstream_uid: settings.codemode_mcp_uid,
            call_timeout,
            exec_timeout_ms: settings.codemode_timeout_ms,
        });
        if mode.enabled && !mode.upstreams.is_empty() {
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                let eager = mode.clone();
                handle.spawn(async move {
                    eager.connected().await;
                });
            }
        }
        mode
    }

    /// Every function the code may call, sorted by name.
    pub async fn specs(&self) -> Vec<ToolSpec> {
        let mut specs = builtin_specs();
        for upstream in self.connected().await {
            for tool in &upstream.tools {
                specs.push(ToolSpec {
                    name: format!("{}.{}", upstream.name, tool.name),
                    description: tool.description.as_deref().unwrap_or_default().to_string(),
                    parameters: Value::Object((*tool.input_schema).clone()),
                });
            }
        }
        specs.sort_by(|a, b| a.name.cmp(&b.name));
        specs
    }

    /// The output schema of an upstream tool, when it declares one.
    async fn output_schemas(&self) -> BTreeMap<String, Value> {
        let mut out = BTreeMap::new();
        out.insert(
            "http.fetch".to_string(),
            json!({"type": "object", "required": ["status", "headers", "body", "encoding"], "properties": {
                "status": {"type": "integer"},
                "headers": {"type": "object", "additionalProperties": {"type": "string"}},
                "body": {"type": "string"},
                "encoding": {"enum": ["utf-8", "base64"]}}}),
        );
        out.insert("env.get".to_string(), json!({"type": ["string", "null"]}));
        for upstream in self.connected().await {
            for tool in &upstream.tools {
                if let Some(schema) = &tool.output_schema {
                    out.insert(
                        format!("{}.{}", upstream.name, tool.name),
                        Value::Object((**schema).clone()),
                    );
                }
            }
        }
        out
    }

    /// The description of `execute`: what it does, then the functions as TypeScript
    /// declarations and as Python stubs.
    pub(crate) async fn execute_description(&self) -> String {
        let specs = self.specs().await;
        let outputs = self.output_schemas().await;
        format!(
            "Run code that calls the functions below and get {{result, logs, error}}: result is \
the value the code returns (JavaScript/TypeScript: `return value;`, or a lone expression; \
Python: the last expression), logs the lines it printed (console.log/warn/error, print), error \
the message when it threw. The code runs in a sandbox with no network; only these functions \
reach outside, and each is awaited (`await codemode.http.fetch({{url}})`, in Python `await \
codemode.http.fetch(url=...)`); run independent calls at once with Promise.all / \
asyncio.gather. A denied call throws an error the code can catch. lang: js (default), ts, \
py. It runs in this MCP session's sandbox session, beside the files of execute_code. Use \
`search` to find functions by topic.\n\n```ts\n{}```\n\n```python\n{}```",
            typescript_declarations(&specs, &outputs),
            python_stubs(&specs)
        )
    }

    /// The functions matching `query`, best first.
    pub(crate) async fn search(&self, query: &str) -> Value {
        let specs = self.specs().await;
        let outputs = self.output_schemas().await;
        let hits: Vec<Value> = rank(&specs, query)
            .into_iter()
            .map(|(spec, score)| {
                json!({
                    "name": format!("codemode.{}", spec.name),
                    "description": spec.description,
                    "score": score,
                    "declaration": declaration(spec, outputs.get(&spec.name)),
                })
            })
            .collect();
        json!({ "query": query, "tools": hits })
    }

    /// Answers one call of the code, as the only call of an `execute`.
    pub async fn serve(&self, call: ToolCall) -> ToolResult {
        self.serve_within(call, &ResultBudget::new(self.max_result_bytes))
            .await
    }

    /// Answers one call of the code, its result taken from `budget`.
    pub(crate) async fn serve_within(&self, call: ToolCall, budget: &ResultBudget) -> ToolResult {
        let answer = if budget.left() == 0 {
            Err(budget.exceeded())
        } else {
            match call.name.as_str() {
                "http.fetch" => self.fetch(&call.input, budget).await,
                "env.get" => self.env_get(&call.input),
                name => self.call_upstream(name, &call.input).await,
            }
            .and_then(|value| {
                if budget.take(json_size(&value)) {
                    Ok(value)
                } else {
                    Err(budget.exceeded())
                }
            })
        };
        match answer {
            Ok(result) => ToolResult {
                call_id: call.call_id,
                result,
                is_error: false,
                error_message: None,
            },
            Err(message) => ToolResult {
                call_id: call.call_id,
                result: Value::Null,
                is_error: true,
                error_message: Some(message),
            },
        }
    }

    /// Runs `code` in the admitted session with the code mode functions; waits for the
    /// end.
    pub(crate) async fn run(
        self: &Arc<Self>,
        broker: Arc<Broker>,
        admitted: Admitted,
        lang: Language,
        code: &str,
        cancel: CancellationToken,
    ) -> Result<Outcome, Error> {
        let code = match lang {
            Language::Js => wrap_js(code),
            Language::Ts => wrap_ts(code),
            Language::Py => wrap_py(code),
            _ => return Err(Error::BadRequest("code mode runs js, ts or py".to_string())),
        };
        let mut specs = self.specs().await;
        specs.push(ToolSpec {
            name: RESULT_TOOL.to_string(),
            description: "Internal: reports the code's value.".to_string(),
            parameters: json!({"type": "object", "properties": {"value": {}, "error": {}}}),
        });
        let (calls_tx, mut calls_rx) = mpsc::unbounded_channel::<ToolCall>();
        // Bounded: a call's result waits for room before its call gives up its turn.
        let (results_tx, results_rx) = mpsc::channel::<ToolResult>(MAX_CALLS_IN_FLIGHT);
        let (events_tx, mut events_rx) = mpsc::channel::<ExecEvent>(EVENT_QUEUE);
        // Output is kept as it comes (the runner caps it); displays have no place in the
        // answer and are dropped here, never queued until the end.
        let collector = tokio::spawn(async move {
            let mut chunks = Vec::new();
            while let Some(event) = events_rx.recv().await {
                if let ExecEvent::Output { stream, text } = event {
                    chunks.push((stream, text));
                }
            }
            chunks
        });
        let reported: Arc<Mutex<Option<Value>>> = Arc::default();
        let report = reported.clone();
        let mode = self.clone();
        let budget = Arc::new(ResultBudget::new(self.max_result_bytes));
        // Answers the calls as they come, each in a task of its own (Promise.all), at most
        // MAX_CALLS_IN_FLIGHT at once; the tasks end with this one.
        let server = tokio::spawn(async move {
            let in_flight = Arc::new(Semaphore::new(MAX_CALLS_IN_FLIGHT));
            // Bytes of input of the calls waiting for their turn.
            let waiting = Arc::new(AtomicU64::new(0));
            let mut answering = tokio::task::JoinSet::new();
            while let Some(call) = calls_rx.recv().await {
                while answering.try_join_next().is_some() {}
                if call.name == RESULT_TOOL {
                    // A poisoned lock still holds a whole value: the report is kept.
                    *report.locked() = Some(call.input.clone());
                    let _ = results_tx
                        .send(ToolResult {
                            call_id: call.call_id,
                            result: Value::Null,
                            is_error: false,
                            error_message: None,
                        })
                        .await;
                    continue;
                }
                let size = json_size(&call.input);
                let queued = waiting.load(Ordering::SeqCst);
                if answering.len() >= MAX_CALLS_IN_FLIGHT + MAX_CALLS_WAITING
                    || (queued > 0 && queued + size > MAX_WAITING_INPUT_BYTES)
                {
                    let _ = results_tx
                        .send(ToolResult {
                            call_id: call.call_id,
                            result: Value::Null,
                            is_error: true,
                            error_message: Some(format!(
                                "Too many calls wait for their turn: {MAX_CALLS_IN_FLIGHT} run \
                                 at once, and at most {MAX_CALLS_WAITING} calls with \
                                 {MAX_WAITING_INPUT_BYTES} bytes of input wait"
                            )),
                        })
                        .await;
                    continue;
                }
                waiting.fetch_add(size, Ordering::SeqCst);
                let (mode, results, budget) = (mode.clone(), results_tx.clone(), budget.clone());
                let (in_flight, waiting) = (in_flight.clone(), waiting.clone());
                // The semaphore is fair: calls take their turns in the order made.
                answering.spawn(async move {
                    let turn = in_flight.acquire_owned().await;
                    waiting.fetch_sub(size, Ordering::SeqCst);
                    let Ok(turn) = turn else { return };
                    let result = mode.serve_within(call, &budget).await;
                    let _ = results.send(result).await;
                    drop(turn);
                });
            }
        });
        let input = ExecInput {
            lang,
            code,
            args: Vec::new(),
            timeout_ms: Some(self.exec_timeout_ms),
            files: Vec::new(),
            // No input refs, so no shared files to read.
            tenant: None,
            rich: false,
        };
        let hooks = ExecHooks {
            events: Some(events_tx),
            tools: Some(ToolBridge {
                specs,
                calls: calls_tx,
                results: results_rx,
            }),
            cancel: Some(cancel),
            stdin: None,
        };
        // A task of its own: the session's turn is released even if the caller goes away.
        let output = broker.spawn_exec(admitted, input, hooks).await?;
        server.abort();
        // The exec is over and its sender gone: the collector ends at once.
        let chunks = collector
            .await
            .map_err(|e| Error::internal(format!("output collector failed: {e}")))?;
        let logs = log_lines(&chunks);
        let report = reported.locked().clone();
        let mut result = Value::Null;
        let mut error = None;
        if let Some(report) = report {
            result = report.get("value").cloned().unwrap_or(Value::Null);
            error = report
                .get("error")
                .and_then(Value::as_str)
                .map(str::to_string);
        }
        if error.is_none() {
            error = crate::render::verdict_text(&output);
        }
        Ok(Outcome {
            result,
            logs,
            error,
        })
    }
}

/// The lines the code printed, in the order they were completed; stdout and stderr each
/// keep their own partial line.
fn log_lines(chunks: &[(OutputStream, String)]) -> Vec<String> {
    let mut lines = Vec::new();
    let (mut out, mut err) = (String::new(), String::new());
    for (stream, text) in chunks {
        let partial = match stream {
            OutputStream::Stdout => &mut out,
            OutputStream::Stderr => &mut err,
        };
        partial.push_str(text);
        while let Some(i) = partial.find('\n') {
            let line: String = partial.drain(..=i).collect();
            lines.push(line.trim_end_matches(['\n', '\r']).to_string());
        }
    }
    for rest in [out, err] {
        if !rest.is_empty() {
            lines.push(rest);
        }
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn calls_are_answered_or_refused() {
        let mut config = <crate::config::Config as clap::Parser>::parse_from(["codebroker"]);
        config.code_mode.codemode_env_allow = vec!["CODEMODE_UNIT_UNSET".into()];
        let mode = CodeMode::new(&config.code_mode);
        let call = |name: &str, input: Value| ToolCall {
            call_id: "c1".into(),
            name: name.into(),
            input,
            batch: None,
        };
        let r = mode.serve(call("z", json!({}))).await;
        assert_eq!(r.error_message.as_deref(), Some("Unknown tool: 'z'"));
        let r = mode.serve(call("srv.z", json!({}))).await;
        assert_eq!(r.error_message.as_deref(), Some("Unknown tool: 'srv.z'"));
        let r = mode
            .serve(call("http.fetch", json!({"url": "http://127.0.0.1:1/"})))
            .await;
        assert_eq!(
            r.error_message.as_deref(),
            Some("Host '127.0.0.1:1' is not allowed")
        );
        let r = mode.serve(call("env.get", json!({"key": "PATH"}))).await;
        assert_eq!(
            r.error_message.as_deref(),
            Some("Key 'PATH' is not allowed")
        );
        let r = mode
            .serve(call("env.get", json!({"key": "CODEMODE_UNIT_UNSET"})))
            .await;
        assert!(!r.is_error && r.result.is_null(), "{r:?}");
    }
}
