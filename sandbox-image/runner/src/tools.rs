//! The sandbox half of programmatic tool calling: a Unix socket per exec that has tools.
//!
//! Each connection carries one call. The client writes one JSON line
//! `{"name": "...", "input": {...}}`; the runner gives the call an id (`call_001`,
//! `call_002`, ... in order of arrival), sends a [`ToolCall`] frame to the broker at once,
//! and when the broker's [`ToolResult`] comes back writes one JSON line
//! `{"result": ..., "is_error": false, "error_message": null}` and closes the connection.
//! A call of a tool the exec was not given is refused without asking the broker.
//!
//! Everything runs in the worker's poll loop (no threads: the runner starts all its threads
//! once): the worker adds the bridge's descriptors to its `ppoll` set ([`ToolBridge::pollfds`])
//! and hands back what became ready ([`ToolBridge::service`]); results the reader thread
//! received are routed with [`ToolBridge::deliver`]. When the exec is stopped, calls still
//! waiting get an error answer ([`ToolBridge::stop`]); when it ends, the bridge is dropped,
//! which closes every connection and removes the socket's directory.

use crate::frame::Channel;
use sandbox_runner::{BatchHint, JobId, ToolCall, ToolResult, ToolSpec, WorkerMessage};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The socket's file name in the bridge's directory.
pub const SOCKET_NAME: &str = "tools.sock";
/// Most connections open at once; more wait in the listen backlog.
const MAX_CONNECTIONS: usize = 256;
/// Longest request line a client may send.
const MAX_REQUEST: usize = 4 << 20;
/// How many connections one wake-up accepts, so a flood cannot starve the rest of the loop.
const ACCEPT_BATCH: usize = 16;

/// What the client sends.
#[derive(Deserialize)]
struct Request {
    /// The tool to call.
    name: String,
    /// Its input; missing or `null` means `{}`.
    #[serde(default)]
    input: serde_json::Value,
    /// The step it was made in with other calls, if any (passed on to the broker).
    #[serde(default)]
    batch: Option<BatchHint>,
}

/// What the client gets back.
#[derive(Serialize)]
struct Answer<'a> {
    /// The tool's result (`null` on error).
    result: &'a serde_json::Value,
    /// Whether the call failed.
    is_error: bool,
    /// Why it failed.
    error_message: Option<&'a str>,
}

/// Where one connection stands.
#[derive(Debug, PartialEq, Eq)]
enum Phase {
    /// Reading the request line.
    Reading,
    /// The call went to the broker; waiting for its result.
    Waiting,
    /// Writing the answer.
    Writing,
}

/// When things happened to one call, for tracing (`CODEBROKER_TOOL_TRACE`).
#[derive(Default, Clone, Copy)]
struct Times {
    /// The request line was complete.
    request: Option<Instant>,
    /// The `tool_call` frame was written to the broker.
    sent: Option<Instant>,
    /// The broker's result reached the worker.
    result: Option<Instant>,
}

/// One client connection.
struct Conn {
    /// The socket.
    stream: UnixStream,
    /// Where it stands.
    phase: Phase,
    /// The request line read so far.
    input: Vec<u8>,
    /// The call's id once sent to the broker.
    call_id: Option<String>,
    /// The tool's name once known (for default error messages).
    tool: String,
    /// The answer line being written.
    output: Vec<u8>,
    /// How much of `output` was written.
    written: usize,
    /// Tracing timestamps.
    times: Times,
}

/// A tool socket for one exec.
pub struct ToolBridge {
    /// The private directory holding the socket (and the preludes); removed on drop.
    dir: PathBuf,
    /// The socket's path, given to the code.
    socket: PathBuf,
    /// The listening socket; `None` once the exec is stopping.
    listener: Option<UnixListener>,
    /// Names of the tools the exec was given.
    names: HashSet<String>,
    /// Open connections.
    conns: Vec<Conn>,
    /// Calls sent to the broker so far (the next id is this plus one).
    calls: u64,
    /// Once set, calls that still wait get this error.
    stopped: Option<String>,
    /// Report the calls' mean timings on stderr when the exec ends.
    trace: bool,
    /// Per answered call: time in the runner from the request line to the frame sent, from
    /// the result to the answer written, and the broker's turnaround in between.
    stats: Vec<[Duration; 3]>,
}

impl ToolBridge {
    /// Listens on `dir/tools.sock`; `dir` must be a fresh private directory, which the
    /// bridge owns from now on.
    pub fn open(dir: PathBuf, tools: &[ToolSpec], trace: bool) -> io::Result<Self> {
        let socket = dir.join(SOCKET_NAME);
        let listener = match UnixListener::bind(&socket).and_then(|l| {
            l.set_nonblocking(true)?;
            Ok(l)
        }) {
            Ok(l) => l,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        Ok(ToolBridge {
            dir,
            socket,
            listener: Some(listener),
            names: tools.iter().map(|t| t.name.clone()).collect(),
            conns: Vec::new(),
            calls: 0,
            stopped: None,
            trace,
            stats: Vec::new(),
        })
    }

    /// The private directory (for prelude files).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The socket's path.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Appends the descriptors to poll.
    pub fn pollfds(&self, out: &mut Vec<libc::pollfd>) {
        if let Some(l) = &self.listener {
            if self.conns.len() < MAX_CONNECTIONS {
                out.push(pollfd(l.as_raw_fd(), libc::POLLIN));
            }
        }
        for c in &self.conns {
            let events = match c.phase {
                Phase::Reading => libc::POLLIN,
                Phase::Writing => libc::POLLOUT,
                // Nothing to do until the result comes; extra bytes from the client must
                // not make poll spin.
                Phase::Waiting => 0,
            };
            out.push(pollfd(c.stream.as_raw_fd(), events));
        }
    }

    /// Acts on the descriptors [`ToolBridge::pollfds`] added, given back after `poll`
    /// (found by number, so other descriptors in `pfds` do not matter).
    pub fn service(&mut self, pfds: &[libc::pollfd], chan: &Channel, job: JobId) {
        let revents =
            |fd: std::os::fd::RawFd| pfds.iter().find(|p| p.fd == fd).map_or(0, |p| p.revents);
        for i in (0..self.conns.len()).rev() {
            let ev = revents(self.conns[i].stream.as_raw_fd());
            if ev != 0 {
                self.step(i, ev, chan, job);
            }
        }
        let accept = self
            .listener
            .as_ref()
            .is_some_and(|l| revents(l.as_raw_fd()) != 0);
        if accept {
            self.accept(chan, job);
        }
        self.conns.retain(|c| !c.is_done());
    }

    /// Takes new connections and reads what they already sent.
    fn accept(&mut self, chan: &Channel, job: JobId) {
        for _ in 0..ACCEPT_BATCH {
            if self.conns.len() >= MAX_CONNECTIONS {
                return;
            }
            let Some(listener) = &self.listener else {
                return;
            };
            match listener.accept() {
                Ok((stream, _)) => {
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    self.conns.push(Conn {
                        stream,
                        phase: Phase::Reading,
                        input: Vec::new(),
                        call_id: None,
                        tool: String::new(),
                        output: Vec::new(),
                        written: 0,
                        times: Times::default(),
                    });
                    // The request is usually there already: save a trip through poll.
                    let i = self.conns.len() - 1;
                    self.step(i, libc::POLLIN, chan, job);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return, // WouldBlock, or out of descriptors: try again later
            }
        }
    }

    /// Moves connection `i` on as far as it can go without blocking; `revents` is what
    /// poll reported for it.
    fn step(&mut self, i: usize, revents: libc::c_short, chan: &Channel, job: JobId) {
        match self.conns[i].phase {
            Phase::Reading => {
                if let Some(line) = self.conns[i].read_request() {
                    self.request(i, &line, chan, job);
                }
            }
            Phase::Writing => self.conns[i].write_answer(),
            // The client went away (killed, say): its result will have nowhere to go.
            Phase::Waiting if revents & (libc::POLLHUP | libc::POLLERR) != 0 => {
                self.conns[i].close()
            }
            Phase::Waiting => {}
        }
        if self.conns[i].phase == Phase::Writing && self.conns[i].is_done() {
            self.finished(i);
        }
    }

    /// Handles a complete request line of connection `i`.
    fn request(&mut self, i: usize, line: &[u8], chan: &Channel, job: JobId) {
        let req = match serde_json::from_slice::<Request>(line) {
            Ok(r) => r,
            Err(e) => {
                let msg = format!("Invalid tool call request: {e}");
                return self.conns[i].answer_error(&msg);
            }
        };
        self.conns[i].tool = req.name.clone();
        let input = match req.input {
            serde_json::Value::Null => serde_json::Value::Object(Default::default()),
            v @ serde_json::Value::Object(_) => v,
            _ => {
                let msg = format!("Tool input must be a JSON object (tool '{}')", req.name);
                return self.conns[i].answer_error(&msg);
            }
        };
        if !self.names.contains(&req.name) {
            let msg = format!("Unknown tool: '{}'", req.name);
            return self.conns[i].answer_error(&msg);
        }
        if let Some(why) = &self.stopped {
            let why = why.clone();
            return self.conns[i].answer_error(&why);
        }
        self.calls += 1;
        let call_id = format!("call_{:03}", self.calls);
        let call = ToolCall {
            call_id: call_id.clone(),
            name: req.name,
            input,
            batch: req.batch.filter(|b| b.size > 1),
        };
        chan.send(job, &WorkerMessage::ToolCall(call));
        let c = &mut self.conns[i];
        c.times.sent = Some(Instant::now());
        c.call_id = Some(call_id);
        c.phase = Phase::Waiting;
    }

    /// Routes a result from the broker to the call waiting for it; results for calls that
    /// are not waiting (answered already, or never made) are dropped.
    pub fn deliver(&mut self, result: ToolResult) {
        let Some(i) = self.conns.iter().position(|c| {
            c.phase == Phase::Waiting && c.call_id.as_deref() == Some(result.call_id.as_str())
        }) else {
            return;
        };
        let c = &mut self.conns[i];
        c.times.result = Some(Instant::now());
        if result.is_error {
            let default = format!("Tool '{}' failed", c.tool);
            let msg = result.error_message.as_deref().unwrap_or(&default);
            c.answer(&serde_json::Value::Null, Some(msg));
        } else {
            c.answer(&result.result, None);
        }
        if c.is_done() {
            self.finished(i);
        }
    }

    /// The exec is stopping: no new calls; calls waiting for a result get `why` as error.
    pub fn stop(&mut self, why: &str) {
        self.listener = None;
        self.stopped = Some(why.to_string());
        for c in &mut self.conns {
            match c.phase {
                Phase::Waiting => c.answer_error(why),
                Phase::Reading => c.phase = Phase::Writing, // nothing to say: just close
                Phase::Writing => {}
            }
        }
        self.conns.retain(|c| !c.is_done());
    }

    /// Records the timings of a call whose answer was written (once: they are taken).
    fn finished(&mut self, i: usize) {
        let c = &mut self.conns[i];
        let times = std::mem::take(&mut c.times);
        let (Some(req), Some(sent), Some(res)) = (times.request, times.sent, times.result) else {
            return;
        };
        if self.trace {
            self.stats.push([
                sent.saturating_duration_since(req),
                res.elapsed(),
                res.saturating_duration_since(sent),
            ]);
        }
    }
}

impl Drop for ToolBridge {
    fn drop(&mut self) {
        if !self.stats.is_empty() {
            let n = self.stats.len() as u32;
            let mean =
                |k: usize| (self.stats.iter().map(|s| s[k]).sum::<Duration>() / n).as_micros();
            eprintln!(
                "sandbox-runner: {n} tool calls, mean {} µs in the runner (request→frame sent {} µs, \
                 result→answer written {} µs), {} µs at the broker",
                mean(0) + mean(1),
                mean(0),
                mean(1),
                mean(2)
            );
        }
        self.conns.clear();
        self.listener = None;
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            eprintln!("sandbox-runner: cannot remove {}: {e}", self.dir.display());
        }
    }
}

impl Conn {
    /// Reads what is available; returns the request line once complete (a client may
    /// also end it by closing its side).
    fn read_request(&mut self) -> Option<Vec<u8>> {
        let mut buf = [0u8; 16 * 1024];
        loop {
            match self.stream.read(&mut buf) {
                Ok(0) => {
                    if self.input.is_empty() {
                        self.close();
                        return None;
                    }
                    return Some(self.take_line(self.input.len()));
                }
                Ok(n) => {
                    let start = self.input.len();
                    self.input.extend_from_slice(&buf[..n]);
                    if let Some(j) = self.input[start..].iter().position(|&b| b == b'\n') {
                        return Some(self.take_line(start + j));
                    }
                    if self.input.len() > MAX_REQUEST {
                        self.input = Vec::new();
                        let msg = format!("Tool call request longer than {MAX_REQUEST} bytes");
                        self.answer_error(&msg);
                        return None;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return None,
                Err(_) => {
                    self.close();
                    return None;
                }
            }
        }
    }

    /// The request line (the first `len` bytes read); the phase moves on.
    fn take_line(&mut self, len: usize) -> Vec<u8> {
        self.times.request = Some(Instant::now());
        let mut line = std::mem::take(&mut self.input);
        line.truncate(len);
        self.phase = Phase::Waiting;
        line
    }

    /// Queues an error answer and starts writing it.
    fn answer_error(&mut self, msg: &str) {
        self.answer(&serde_json::Value::Null, Some(msg));
    }

    /// Queues the answer line and writes as much as it can at once.
    fn answer(&mut self, result: &serde_json::Value, error: Option<&str>) {
        let answer = Answer {
            result,
            is_error: error.is_some(),
            error_message: error,
        };
        let mut line = serde_json::to_vec(&answer).unwrap_or_else(|_| {
            br#"{"result":null,"is_error":true,"error_message":"unencodable result"}"#.to_vec()
        });
        line.push(b'\n');
        self.output = line;
        self.written = 0;
        self.phase = Phase::Writing;
        self.write_answer();
    }

    /// Writes what the socket takes of the answer.
    fn write_answer(&mut self) {
        while self.written < self.output.len() {
            match self.stream.write(&self.output[self.written..]) {
                Ok(0) => return self.close(),
                Ok(n) => self.written += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(_) => return self.close(), // the client went away
            }
        }
    }

    /// Gives up on the connection (it is dropped at the next clean-up).
    fn close(&mut self) {
        self.phase = Phase::Writing;
        self.output = Vec::new();
        self.written = 0;
    }

    /// Whether there is nothing left to do: the answer was written (or there is none).
    fn is_done(&self) -> bool {
        self.phase == Phase::Writing && self.written >= self.output.len()
    }
}

/// A pollfd for `fd` asking for `events`.
fn pollfd(fd: std::os::fd::RawFd, events: libc::c_short) -> libc::pollfd {
    libc::pollfd {
        fd,
        events,
        revents: 0,
    }
}
