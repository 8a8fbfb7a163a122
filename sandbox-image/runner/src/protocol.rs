//! Frames exchanged over the attached stdio of a sandbox.
//!
//! One frame is one line of JSON: `[job_id, message]`. The broker picks job ids; the runner
//! echoes the id of the request a message answers. Job id 0 is reserved for messages the
//! runner sends on its own (a notice at start-up, a complaint about a frame it could not
//! parse).

use crate::files::{
    FileChunk, FileList, FileRemoved, FileWritten, ListFilesRequest, ReadFileRequest,
    RemoveFileRequest, WriteFileRequest,
};
use crate::installs::{
    InstallsPacked, InstallsUnpacked, PackInstallsRequest, UnpackInstallsRequest,
};
use crate::state::{
    ReadStateRequest, RestoreStateRequest, SaveStateRequest, StateRestored, StateSaved,
    WriteStateRequest,
};
use crate::tunnel::{EgressListenRequest, TunnelFrame};
use crate::Language;
use serde::{Deserialize, Serialize};
use std::fmt;

/// The id of one request and of every message that concerns it.
pub type JobId = u64;

/// The job id of messages that answer no request.
pub const UNSOLICITED: JobId = 0;

/// The container environment variable that tells the runner how many milliseconds it may
/// go without hearing from a broker before it exits (unset or 0: never). Brokers that keep
/// containers for their next start send [`CoordinatorMessage::Heartbeat`] well within it,
/// so a container whose broker never comes back ends itself instead of running forever.
pub const UNATTENDED_EXIT_ENV: &str = "CODEBROKER_UNATTENDED_EXIT_MS";

/// The port of the runner's egress forwarder, on 127.0.0.1 inside the container: where
/// `HTTP_PROXY` and `HTTPS_PROXY` point (see [`EGRESS_PROXY_URL`]). The container has no
/// network; with egress on, the broker bind-mounts a directory ([`EGRESS_SOCKET_DIR`]) holding
/// its proxy's Unix socket and names the socket in [`EGRESS_SOCKET_ENV`]; the runner relays
/// every connection on this port to it. With egress off, the runner answers each request with
/// a 403 that says so.
pub const EGRESS_PROXY_PORT: u16 = 3128;

/// What the broker sets `HTTP_PROXY`, `HTTPS_PROXY`, `http_proxy` and `https_proxy` to in
/// every container, egress on or off.
pub const EGRESS_PROXY_URL: &str = "http://127.0.0.1:3128";

/// What the broker sets `NO_PROXY` and `no_proxy` to: the container's own loopback.
pub const EGRESS_NO_PROXY: &str = "localhost,127.0.0.1,::1";

/// The container environment variable naming the broker's proxy socket, set only when
/// egress is on (to [`EGRESS_SOCKET_PATH`]).
pub const EGRESS_SOCKET_ENV: &str = "CODEBROKER_EGRESS_SOCKET";

/// The directory the broker bind-mounts into the container, holding the proxy socket.
pub const EGRESS_SOCKET_DIR: &str = "/run/codebroker/egress";

/// The proxy socket's path inside the container.
pub const EGRESS_SOCKET_PATH: &str = "/run/codebroker/egress/proxy.sock";

/// Longest frame either side accepts, in bytes. Output is capped well below this by the
/// runner; a longer line means the peer is broken or hostile.
pub const MAX_FRAME_BYTES: usize = 32 * 1024 * 1024;

/// Every frame on the channel: the job it belongs to, and the message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Multiplexed<T>(pub JobId, pub T);

/// A message from the broker (the coordinator) to the runner (the worker).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum CoordinatorMessage {
    /// Are you there? Also starts the Python kernel ahead of the first exec when asked.
    Hello(HelloRequest),
    /// Run code.
    Exec(ExecRequest),
    /// Stop the exec of this job id as soon as possible; it still answers with `ExecDone`.
    Cancel,
    /// The answer to a [`WorkerMessage::ToolCall`] of this job's exec.
    ToolResult(ToolResult),
    /// Bytes for the stdin of this job's program, or its end (an exec with `stdin`).
    Stdin(StdinChunk),
    /// A broker is attached (sent under job 0, periodically); nothing answers it. See
    /// [`UNATTENDED_EXIT_ENV`].
    Heartbeat,
    /// List the workspace's files (see [`crate::files`]).
    ListFiles(ListFilesRequest),
    /// Send a piece of one workspace file.
    ReadFile(ReadFileRequest),
    /// Write a piece of one workspace file.
    WriteFile(WriteFileRequest),
    /// Remove one workspace file if it is still the version the broker placed.
    RemoveFile(RemoveFileRequest),
    /// Have the kernel save its globals to the state file (see [`crate::state`]).
    SaveState(SaveStateRequest),
    /// Send a piece of the state file.
    ReadState(ReadStateRequest),
    /// Write a piece of the state file.
    WriteState(WriteStateRequest),
    /// Have the kernel load the state file before it runs code.
    RestoreState(RestoreStateRequest),
    /// Pack the session's installs into the state directory's archive (see
    /// [`crate::installs`]).
    PackInstalls(PackInstallsRequest),
    /// Unpack the archive written before into the workspace.
    UnpackInstalls(UnpackInstallsRequest),
    /// Carry the sandbox's egress connections over the channel, under this job (see
    /// [`crate::tunnel`]); never answered but by the tunnel's frames.
    EgressListen(EgressListenRequest),
    /// A step of a tunnelled egress connection, under the listening job.
    Egress(TunnelFrame),
}

/// A message from the runner to the broker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum WorkerMessage {
    /// Answer to [`HelloRequest`].
    Hello(HelloResponse),
    /// A chunk of output of a running exec (only when the request asked for streaming).
    Output(OutputChunk),
    /// Code of this job's exec called a tool; the exec waits for a
    /// [`CoordinatorMessage::ToolResult`] with the same `call_id`.
    ToolCall(ToolCall),
    /// The exec showed a rich value, such as a figure saved by `plt.show()` (only when
    /// the request asked for streaming).
    Display(DisplayData),
    /// The exec of this job id finished; the last message of its job.
    ExecDone(ExecResponse),
    /// The request of this job id could not be carried out (or, under job 0, a frame
    /// could not be parsed). The last message of its job.
    Error(WorkerError),
    /// Answer to [`ListFilesRequest`].
    FileList(FileList),
    /// Answer to [`ReadFileRequest`].
    FileChunk(FileChunk),
    /// Answer to [`WriteFileRequest`].
    FileWritten(FileWritten),
    /// Answer to [`RemoveFileRequest`].
    FileRemoved(FileRemoved),
    /// Answer to [`SaveStateRequest`].
    StateSaved(StateSaved),
    /// Answer to [`RestoreStateRequest`].
    StateRestored(StateRestored),
    /// Answer to [`PackInstallsRequest`].
    InstallsPacked(InstallsPacked),
    /// Answer to [`UnpackInstallsRequest`].
    InstallsUnpacked(InstallsUnpacked),
    /// A step of a tunnelled egress connection, under the job of the broker's
    /// [`CoordinatorMessage::EgressListen`].
    Egress(TunnelFrame),
}

/// Ties a request to the message that answers it. The broker narrows the message that
/// ends a job to `Response` through its `TryFrom`, which gives back any other message.
pub trait Request: Into<CoordinatorMessage> {
    /// The message that ends this request's job.
    type Response: TryFrom<WorkerMessage, Error = WorkerMessage>;
}

/// `TryFrom<WorkerMessage>` for the payload of one variant: the payload, or the message
/// given back unchanged.
macro_rules! narrow {
    ($variant:ident => $payload:ty) => {
        impl TryFrom<WorkerMessage> for $payload {
            type Error = WorkerMessage;

            fn try_from(msg: WorkerMessage) -> Result<Self, WorkerMessage> {
                match msg {
                    WorkerMessage::$variant(payload) => Ok(payload),
                    other => Err(other),
                }
            }
        }
    };
}

narrow!(Hello => HelloResponse);
narrow!(ExecDone => ExecResponse);
narrow!(FileList => crate::files::FileList);
narrow!(FileChunk => crate::files::FileChunk);
narrow!(FileWritten => crate::files::FileWritten);
narrow!(FileRemoved => crate::files::FileRemoved);
narrow!(StateSaved => crate::state::StateSaved);
narrow!(StateRestored => crate::state::StateRestored);
narrow!(InstallsPacked => crate::installs::InstallsPacked);
narrow!(InstallsUnpacked => crate::installs::InstallsUnpacked);

/// Ties a request type to its [`CoordinatorMessage`] variant and its answer.
macro_rules! request {
    ($request:ty => $variant:ident, $response:ty) => {
        impl Request for $request {
            type Response = $response;
        }

        impl From<$request> for CoordinatorMessage {
            fn from(r: $request) -> Self {
                CoordinatorMessage::$variant(r)
            }
        }
    };
}

request!(crate::files::ListFilesRequest => ListFiles, crate::files::FileList);
request!(crate::files::ReadFileRequest => ReadFile, crate::files::FileChunk);
request!(crate::files::WriteFileRequest => WriteFile, crate::files::FileWritten);
request!(crate::files::RemoveFileRequest => RemoveFile, crate::files::FileRemoved);
request!(crate::state::SaveStateRequest => SaveState, crate::state::StateSaved);
request!(crate::state::ReadStateRequest => ReadState, crate::files::FileChunk);
request!(crate::state::WriteStateRequest => WriteState, crate::files::FileWritten);
request!(crate::state::RestoreStateRequest => RestoreState, crate::state::StateRestored);
request!(crate::installs::PackInstallsRequest => PackInstalls, crate::installs::InstallsPacked);
request!(crate::installs::UnpackInstallsRequest => UnpackInstalls, crate::installs::InstallsUnpacked);

/// Checks the runner is alive, and optionally warms it up.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HelloRequest {
    /// Start the Python kernel now, so the first `py` exec finds it running.
    #[serde(default)]
    pub start_kernel: bool,
    /// Modules the kernel (started now, or already running) imports in the background
    /// while it waits for its first exec (a pooled sandbox's data stack); empty: none.
    /// Ignored by a kernel that has run code or was asked before; the first exec stops
    /// it. A kernel started later (by an exec, or after a crash) imports nothing ahead.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub preload: Vec<String>,
}

impl Request for HelloRequest {
    type Response = HelloResponse;
}

impl From<HelloRequest> for CoordinatorMessage {
    fn from(r: HelloRequest) -> Self {
        CoordinatorMessage::Hello(r)
    }
}

/// What the runner says about itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HelloResponse {
    /// The runner's crate version, so a broker can tell an outdated image.
    pub runner_version: String,
    /// Whether a Python kernel process is running right now.
    pub kernel_running: bool,
    /// The exec queued or running, if any: after a broker restart, one the old broker
    /// started, which the new one cancels before it sends its own.
    #[serde(default)]
    pub running_job: Option<JobId>,
    /// Whether the kernel is still importing what a warm-up `hello` asked it to preload
    /// (it stops at the first exec). A pooled sandbox waits at a low CPU weight until
    /// then, so the broker asks.
    #[serde(default)]
    pub preloading: bool,
}

/// Run one piece of code.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecRequest {
    /// The language to run it as.
    pub lang: Language,
    /// The source code.
    pub code: String,
    /// Command-line arguments (`sys.argv[1:]` in Python).
    #[serde(default)]
    pub args: Vec<String>,
    /// Wall-time limit for the whole exec, compile included.
    pub timeout_ms: u64,
    /// Cap on each of stdout and stderr; the rest is dropped and the limit reported.
    pub max_output_bytes: u64,
    /// Send output as [`OutputChunk`] messages while the code runs, instead of in the
    /// final [`ExecResponse`].
    #[serde(default)]
    pub stream: bool,
    /// Tools the code may call (`await name(**kwargs)` in Python, `await name({...})` in
    /// JavaScript/TypeScript, a `name` command in bash). Empty: no tool functions.
    #[serde(default)]
    pub tools: Vec<ToolSpec>,
    /// How many display events the exec may send; the rest are dropped and said so once.
    #[serde(default = "default_max_display_events")]
    pub max_display_events: u32,
    /// How many bytes of display events (MIME type, name and value) the exec may send.
    #[serde(default = "default_max_display_bytes")]
    pub max_display_bytes: u64,
    /// Python: show values as MIME bundles (a trailing expression, `display()`, open
    /// figures) and send an uncaught exception as an event, for front ends that show them
    /// as notebooks do; without it values are printed (sandbox-image/README.md).
    #[serde(default)]
    pub rich: bool,
    /// Give the program a pipe on its stdin that [`CoordinatorMessage::Stdin`] writes to
    /// (E2B's commands); without it stdin is `/dev/null`. The Python kernel takes none.
    #[serde(default)]
    pub stdin: bool,
}

/// A piece of a running program's stdin.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StdinChunk {
    /// The bytes.
    #[serde(with = "crate::files::base64", default)]
    pub data: Vec<u8>,
    /// Close the program's stdin once the bytes so far are written.
    #[serde(default)]
    pub close: bool,
}

/// Display events per exec when the request names no budget (an older broker).
pub const DEFAULT_MAX_DISPLAY_EVENTS: u32 = 256;
/// Display bytes per exec when the request names no budget (an older broker).
pub const DEFAULT_MAX_DISPLAY_BYTES: u64 = 8 * 1024 * 1024;

fn default_max_display_events() -> u32 {
    DEFAULT_MAX_DISPLAY_EVENTS
}

fn default_max_display_bytes() -> u64 {
    DEFAULT_MAX_DISPLAY_BYTES
}

/// A tool made callable from sandboxed code.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    /// The tool's name as the client knows it (the function name may differ, e.g. a
    /// Python keyword gets a `_tool` suffix).
    pub name: String,
    /// What the tool does: the generated function's docstring.
    #[serde(default)]
    pub description: String,
    /// JSON Schema of the tool's input object: the generated function's parameters.
    #[serde(default)]
    pub parameters: serde_json::Value,
}

/// One call of a tool by sandboxed code.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// Unique within the exec; the result names it.
    pub call_id: String,
    /// The tool's name (as in [`ToolSpec::name`]).
    pub name: String,
    /// The input object the code passed.
    #[serde(default)]
    pub input: serde_json::Value,
    /// Set when the code made this call together with others in one step (JavaScript's
    /// `Promise.all`, Python's `asyncio.gather`): the broker answers them as one batch
    /// however far apart they arrive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch: Option<BatchHint>,
}

/// The calls a piece of code made in the same step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchHint {
    /// Names the step, unique within the exec.
    pub id: String,
    /// How many calls it made.
    pub size: u32,
}

/// The outcome of a [`ToolCall`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolResult {
    /// The call this answers.
    pub call_id: String,
    /// The tool's result (any JSON).
    #[serde(default)]
    pub result: serde_json::Value,
    /// The tool failed: the code sees an exception (or a non-zero exit in bash).
    #[serde(default)]
    pub is_error: bool,
    /// Why it failed.
    #[serde(default)]
    pub error_message: Option<String>,
}

/// A rich value shown by the code.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DisplayData {
    /// MIME type, e.g. `image/png`.
    pub mime: String,
    /// A file under `/mnt/data` holding the value (e.g. `plot-1.png`), when it is one.
    #[serde(default)]
    pub name: Option<String>,
    /// The value itself when it is small text (e.g. `text/html`).
    #[serde(default)]
    pub data: Option<String>,
}

/// The display events one exec may still send. Both ends keep one: the runner so the code
/// cannot flood the channel, the broker so it never holds more whatever the sandbox sends.
#[derive(Debug, Clone)]
pub struct DisplayBudget {
    /// Events still allowed.
    events_left: u32,
    /// Bytes still allowed.
    bytes_left: u64,
    /// The event limit, for the note.
    max_events: u32,
    /// The byte limit, for the note.
    max_bytes: u64,
    /// Whether an event was dropped already (the note is said once).
    dropped: bool,
}

/// What to do with one display event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admit {
    /// Within the budget: send it on.
    Keep,
    /// The first event over the budget: drop it and tell the code's reader this note.
    DropFirst(String),
    /// Over the budget, already said: drop it.
    Drop,
}

impl DisplayBudget {
    /// A budget of `max_events` events and `max_bytes` bytes.
    pub fn new(max_events: u32, max_bytes: u64) -> Self {
        DisplayBudget {
            events_left: max_events,
            bytes_left: max_bytes,
            max_events,
            max_bytes,
            dropped: false,
        }
    }

    /// The budget an exec request names.
    pub fn of(req: &ExecRequest) -> Self {
        Self::new(req.max_display_events, req.max_display_bytes)
    }

    /// Counts `display` against the budget. Once one event is dropped every later one is
    /// too, so what the reader sees is a prefix of what the code showed.
    pub fn admit(&mut self, display: &DisplayData) -> Admit {
        let size = (display.mime.len()
            + display.name.as_ref().map_or(0, String::len)
            + display.data.as_ref().map_or(0, String::len)) as u64;
        if !self.dropped && self.events_left > 0 && size <= self.bytes_left {
            self.events_left -= 1;
            self.bytes_left -= size;
            return Admit::Keep;
        }
        if std::mem::replace(&mut self.dropped, true) {
            Admit::Drop
        } else {
            Admit::DropFirst(self.note())
        }
    }

    /// Takes `bytes` more from the byte budget (a file the broker inlines); false, taking
    /// nothing, when they do not fit.
    pub fn take_bytes(&mut self, bytes: u64) -> bool {
        if bytes > self.bytes_left {
            return false;
        }
        self.bytes_left -= bytes;
        true
    }

    /// The one line that says display events were dropped.
    pub fn note(&self) -> String {
        format!(
            "Display events beyond {} or {} bytes per exec were dropped.",
            self.max_events, self.max_bytes
        )
    }
}

impl Request for ExecRequest {
    type Response = ExecResponse;
}

impl From<ExecRequest> for CoordinatorMessage {
    fn from(r: ExecRequest) -> Self {
        CoordinatorMessage::Exec(r)
    }
}

/// Which of the two output streams a chunk came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stream {
    Stdout,
    Stderr,
}

/// Output written by a running exec.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutputChunk {
    /// Where the code wrote it.
    pub stream: Stream,
    /// The bytes, decoded as UTF-8 with invalid sequences replaced.
    pub data: String,
}

/// Whether the Python kernel that ran the code had run code before.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RuntimeStatus {
    /// A fresh process: no state from earlier execs.
    New,
    /// The kernel kept its globals from earlier execs.
    Reused,
}

/// A limit an exec ran into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Limit {
    Time,
    Memory,
    Stdout,
    Stderr,
    Disk,
}

impl Limit {
    /// LibreChat's words for the limit, which clients match on.
    pub fn message(self) -> &'static str {
        match self {
            Limit::Time => "Time limit exceeded",
            Limit::Memory => "Out of memory",
            Limit::Stdout => "stdout length exceeded",
            Limit::Stderr => "stderr length exceeded",
            Limit::Disk => "Disk quota exceeded",
        }
    }
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.message())
    }
}

/// How an exec ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecResponse {
    /// The exit code of the program (or of the compiler, when compiling failed); `None`
    /// when it was killed by a signal.
    pub exit_code: Option<i32>,
    /// The signal that killed it, if one did.
    #[serde(default)]
    pub signal: Option<i32>,
    /// Everything written to stdout, up to the cap (empty when streamed).
    #[serde(default)]
    pub stdout: String,
    /// Everything written to stderr, up to the cap (empty when streamed). The runner's
    /// own notes (a limit hit, a missing compiler) are appended here too.
    #[serde(default)]
    pub stderr: String,
    /// The limits the exec ran into, each once.
    #[serde(default)]
    pub limits: Vec<Limit>,
    /// For `py`, whether the kernel had state from earlier execs; `New` for every other
    /// language.
    pub runtime_status: RuntimeStatus,
    /// Wall time of the exec inside the sandbox.
    pub duration_ms: u64,
    /// The exec was stopped by a [`CoordinatorMessage::Cancel`].
    #[serde(default)]
    pub cancelled: bool,
    /// For compiled languages: `true` when the sandbox's compile cache had the program
    /// and the compiler did not run, `false` when it compiled; `None` otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compile_cached: Option<bool>,
}

/// A request the runner could not carry out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerError {
    /// What went wrong, for logs; never shown to end users as is.
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_egress_names_agree_with_each_other() {
        assert_eq!(
            EGRESS_PROXY_URL,
            format!("http://127.0.0.1:{EGRESS_PROXY_PORT}")
        );
        let path = std::path::Path::new(EGRESS_SOCKET_PATH);
        assert_eq!(path.parent(), Some(std::path::Path::new(EGRESS_SOCKET_DIR)));
        assert!(EGRESS_NO_PROXY.split(',').any(|h| h == "127.0.0.1"));
    }

    #[test]
    fn frames_are_compact_json_pairs() {
        let req = Multiplexed(
            7,
            CoordinatorMessage::Exec(ExecRequest {
                lang: Language::Py,
                code: "print(1)".into(),
                args: vec![],
                timeout_ms: 1000,
                max_output_bytes: 64,
                stream: false,
                tools: vec![],
                max_display_events: DEFAULT_MAX_DISPLAY_EVENTS,
                max_display_bytes: DEFAULT_MAX_DISPLAY_BYTES,
                rich: false,
                stdin: false,
            }),
        );
        let line = serde_json::to_string(&req).unwrap();
        assert!(line.starts_with("[7,{\"type\":\"exec\""), "{line}");
        let back: Multiplexed<CoordinatorMessage> = serde_json::from_str(&line).unwrap();
        assert_eq!(back, req);

        let cancel = serde_json::to_string(&Multiplexed(3, CoordinatorMessage::Cancel)).unwrap();
        assert_eq!(cancel, r#"[3,{"type":"cancel"}]"#);
        let beat = serde_json::to_string(&Multiplexed(0, CoordinatorMessage::Heartbeat)).unwrap();
        assert_eq!(beat, r#"[0,{"type":"heartbeat"}]"#);
    }

    #[test]
    fn display_budget_keeps_a_prefix_and_says_so_once() {
        let shown = |n: usize| DisplayData {
            mime: "text/plain".into(),
            name: None,
            data: Some("x".repeat(n)),
        };
        let mut by_count = DisplayBudget::new(2, 1 << 20);
        assert_eq!(by_count.admit(&shown(1)), Admit::Keep);
        assert_eq!(by_count.admit(&shown(1)), Admit::Keep);
        assert!(matches!(by_count.admit(&shown(1)), Admit::DropFirst(n) if n.contains("beyond 2")));
        assert_eq!(by_count.admit(&shown(1)), Admit::Drop);

        let mut by_bytes = DisplayBudget::new(100, 100);
        assert_eq!(by_bytes.admit(&shown(50)), Admit::Keep);
        assert!(matches!(by_bytes.admit(&shown(60)), Admit::DropFirst(_)));
        // Smaller events after a drop are dropped too: the reader sees a prefix.
        assert_eq!(by_bytes.admit(&shown(1)), Admit::Drop);
        assert!(!by_bytes.take_bytes(100));
        assert!(by_bytes.take_bytes(10));
    }

    #[test]
    fn exec_requests_without_a_display_budget_get_the_default() {
        let req: ExecRequest =
            serde_json::from_str(r#"{"lang":"py","code":"","timeout_ms":1,"max_output_bytes":1}"#)
                .unwrap();
        assert_eq!(req.max_display_events, DEFAULT_MAX_DISPLAY_EVENTS);
        assert_eq!(req.max_display_bytes, DEFAULT_MAX_DISPLAY_BYTES);
    }

    #[test]
    fn limits_use_librechat_words() {
        assert_eq!(Limit::Time.to_string(), "Time limit exceeded");
        assert_eq!(Limit::Memory.to_string(), "Out of memory");
        assert_eq!(Limit::Stdout.to_string(), "stdout length exceeded");
        assert_eq!(Limit::Stderr.to_string(), "stderr length exceeded");
    }
}
