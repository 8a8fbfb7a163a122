//! The persistent Python kernel: starting it, dropping a dead one, and running one exec
//! in it over its request and event pipes (see the README's kernel protocol).

use super::gather::{earlier, Gather};
use super::{ExecState, Stop, Worker, KILL_GIVE_UP, READ_CHUNK};
use crate::capture::Capture;
use crate::reaper::Exit;
use crate::spawn::Spec;
use crate::sweep;
use crate::sys::{self, Read};
use sandbox_runner::{
    Admit, DisplayData, ExecRequest, JobId, RuntimeStatus, Stream, WorkerMessage,
};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long the kernel gets to answer `done` after SIGINT before it is killed.
const INTERRUPT_GRACE: Duration = Duration::from_secs(1);
/// How long a kernel that closed a pipe gets to exit by itself before it is killed.
const BROKEN_GRACE: Duration = Duration::from_millis(100);
/// Longest line the kernel may write on its event pipe.
const MAX_EVENT_LINE: usize = 1 << 20;
/// Writes to a pipe up to this size are atomic (POSIX guarantees 512; Linux gives 4096).
const PIPE_BUF: usize = 4096;
/// Longest kernel log message passed on to the runner's stderr.
const MAX_LOG_MESSAGE: usize = 1000;
/// Tells a preloading kernel that the session's first exec (in another language) began:
/// from then on its own code decides what is imported (see `kernel.py`, "Preload").
const STOP_PRELOAD: &[u8] = b"{\"type\":\"stop_preload\"}\n";

/// The persistent Python kernel (see the README's kernel protocol).
pub(super) struct Kernel {
    /// Its pid (also its process group).
    pub(super) pid: libc::pid_t,
    /// Its stdout; `None` once closed.
    pub(super) stdout: Option<OwnedFd>,
    /// Its stderr; `None` once closed.
    pub(super) stderr: Option<OwnedFd>,
    /// Fd 4 on its side: `ready` and `done` events; `None` once closed.
    pub(super) events: Option<OwnedFd>,
    /// Fd 3 on its side: requests; `None` once it stopped reading.
    pub(super) requests: Option<OwnedFd>,
    /// A partial event line.
    events_buf: Vec<u8>,
    /// Whether it said `ready`: before that it has no state worth an interrupt, and
    /// SIGINT could kill it half-started, so a stop kills it at once.
    ready: bool,
    /// Whether it was given code before, or restored a saved state (`Reused` rather than
    /// `New`).
    pub(super) ran_code: bool,
    /// Its raw wait status once it died.
    pub(super) exit: Option<libc::c_int>,
    /// When it closed one of its pipes; such a kernel is replaced.
    pub(super) broken_at: Option<Instant>,
    /// The id of the last request.
    pub(super) last_id: u64,
    /// The answer to the state request under way (`state_saved`, `state_restored`).
    pub(super) state_reply: Option<KernelEvent>,
    /// Display events of the running request not yet sent.
    displays: Vec<DisplayData>,
    /// Whether it was asked to preload (once at most, before any code).
    preload_requested: bool,
    /// Whether that preload has not ended yet.
    preload_pending: bool,
    /// What `hello` answers read of `preload_pending` (shared with [`Control`]).
    preloading: Arc<AtomicBool>,
}

impl Kernel {
    pub(super) fn mark_broken(&mut self) {
        self.broken_at.get_or_insert_with(Instant::now);
    }

    /// Reads what is available on the event pipe; returns the exit code of a `done` for
    /// request `want`, if one came.
    pub(super) fn read_events(&mut self, buf: &mut [u8], want: Option<u64>) -> Option<i32> {
        let Some(fd) = &self.events else { return None };
        // No newline is left before what this read adds: scan only the new bytes, so a
        // long line costs its length, not its length squared over the reads.
        let mut from = self.events_buf.len();
        match sys::read(fd, buf) {
            Ok(Read::Data(n)) => self.events_buf.extend_from_slice(&buf[..n]),
            Ok(Read::WouldBlock) => return None,
            Ok(Read::Eof) | Err(_) => {
                self.events = None;
                self.mark_broken();
                return None;
            }
        }
        let mut done = None;
        while let Some(i) = self.events_buf[from..].iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.events_buf.drain(..=from + i).collect();
            from = 0;
            if let Ok(ev) = serde_json::from_slice::<KernelEvent>(&line) {
                if ev.event == "ready" {
                    self.ready = true;
                } else if ev.event == "preloaded" {
                    self.preload_pending = false;
                    self.preloading.store(false, Ordering::Relaxed);
                } else if ev.event == "log" {
                    // The kernel's own notes (a preload that failed): for the broker's log,
                    // never for an exec's output.
                    let message = ev.message.as_deref().unwrap_or("");
                    let cut = message
                        .char_indices()
                        .nth(MAX_LOG_MESSAGE)
                        .map_or(message.len(), |(i, _)| i);
                    eprintln!("sandbox-runner: kernel: {}", &message[..cut]);
                } else if ev.event.starts_with("state_") && want.is_some() && ev.id == want {
                    self.state_reply = Some(ev);
                } else if ev.event == "done" && want.is_some() && ev.id == want {
                    done = Some(ev.exit_code.unwrap_or(1));
                } else if ev.event == "display" && want.is_some() && ev.id == want {
                    if let Some(mime) = ev.mime {
                        self.displays.push(DisplayData {
                            mime,
                            name: ev.name,
                            data: ev.data,
                        });
                    }
                }
            }
        }
        if self.events_buf.len() > MAX_EVENT_LINE {
            self.events_buf.clear();
            self.mark_broken();
        }
        done
    }

    /// Throws away output that arrived while no exec was running.
    pub(super) fn discard_pending(&mut self, buf: &mut [u8]) {
        for slot in [&mut self.stdout, &mut self.stderr] {
            // Bounded: a background thread printing non-stop must not keep us here.
            for _ in 0..1024 {
                let Some(fd) = slot.as_ref() else { break };
                match sys::read(fd, buf) {
                    Ok(Read::Data(_)) => {}
                    Ok(Read::WouldBlock) => break,
                    Ok(Read::Eof) | Err(_) => {
                        *slot = None;
                        self.broken_at.get_or_insert_with(Instant::now);
                    }
                }
            }
        }
        while self.read_events(buf, None).is_some() {}
        self.displays.clear();
    }
}

/// One line of the kernel's event pipe.
#[derive(serde::Deserialize)]
pub(super) struct KernelEvent {
    /// `ready`, `display`, `done`, `log`, `preloaded`, `state_saved` or `state_restored`.
    event: String,
    /// The request a `done` answers or a `display` belongs to.
    #[serde(default)]
    id: Option<u64>,
    /// The exit code a `done` reports.
    #[serde(default)]
    exit_code: Option<i32>,
    /// A `display`'s MIME type.
    #[serde(default)]
    mime: Option<String>,
    /// A `display`'s file in the workspace.
    #[serde(default)]
    name: Option<String>,
    /// A `display`'s value, when small text.
    #[serde(default)]
    data: Option<String>,
    /// A `log`'s text.
    #[serde(default)]
    message: Option<String>,
    /// A `state_saved`'s file size.
    #[serde(default)]
    pub(super) bytes: Option<u64>,
    /// A `state_saved`'s count of values pickled.
    #[serde(default)]
    pub(super) saved: Option<u32>,
    /// A `state_saved`'s count of modules recorded.
    #[serde(default)]
    pub(super) modules: Option<u32>,
    /// A `state_saved`'s names left out, `[name, why]` each.
    #[serde(default)]
    pub(super) skipped: Option<Vec<Vec<String>>>,
    /// A `state_restored`'s count of globals restored.
    #[serde(default)]
    pub(super) restored: Option<u32>,
    /// A `state_restored`'s names that failed, `[name, why]` each.
    #[serde(default)]
    pub(super) failed: Option<Vec<Vec<String>>>,
    /// Why a state request did nothing.
    #[serde(default)]
    pub(super) error: Option<String>,
}

impl Worker {
    /// Forgets a kernel that died or broke its pipes (killing it if needed), so the next
    /// `py` exec starts a fresh one.
    pub(super) fn drop_dead_kernel(&mut self) {
        if let Some(k) = self.kernel.as_mut() {
            // Its death may not have been reported yet (a `kill -9 -1` in the exec that
            // just ended): ask /proc too, or the next exec would be blamed for it.
            if k.exit.is_none() {
                k.exit = self.tracker.take_exit(k.pid);
            }
            if k.exit.is_none() && !sweep::alive(k.pid) {
                k.mark_broken();
            }
            if k.exit.is_some() || k.broken_at.is_some() {
                if let Some(k) = self.kernel.take() {
                    self.discard_kernel(k);
                }
            }
        }
    }

    pub(super) fn discard_kernel(&self, k: Kernel) {
        self.tracker.signal(k.pid, k.pid, libc::SIGKILL);
        self.tracker.forget(k.pid);
        self.control.kernel_running.store(false, Ordering::Relaxed);
        k.preloading.store(false, Ordering::Relaxed);
    }

    /// Makes `hello` answers say whether the kernel still preloads.
    pub(super) fn sync_preloading(&self) {
        let pending = self.kernel.as_ref().is_some_and(|k| k.preload_pending);
        self.control.preloading.store(pending, Ordering::Relaxed);
    }

    /// Tells a kernel still preloading that an exec in another language began, so it
    /// imports nothing more; a Python exec's request tells it by itself.
    pub(super) fn stop_preload(&mut self) {
        let Some(k) = self.kernel.as_mut() else {
            return;
        };
        if !k.preload_pending {
            return;
        }
        if let Some(fd) = &k.requests {
            // Far below PIPE_BUF, into a pipe the idle kernel keeps empty: written whole
            // or, should the pipe be full, not at all (the preload then runs to its end).
            let _ = sys::write(fd, STOP_PRELOAD);
        }
    }

    /// Asks a kernel that has run no code yet to import `modules` in the background (see
    /// `kernel.py`, "Preload"); once per kernel.
    pub(super) fn request_preload(&mut self, modules: &[String]) {
        let Some(k) = self.kernel.as_mut() else {
            return;
        };
        if k.ran_code || k.preload_requested || modules.is_empty() {
            return;
        }
        let mut line = serde_json::json!({"type": "preload", "modules": modules})
            .to_string()
            .into_bytes();
        line.push(b'\n');
        // Within PIPE_BUF (the broker's bounds on the list keep it there), into the idle
        // kernel's empty request pipe: written whole, or not at all.
        if line.len() > PIPE_BUF {
            eprintln!("sandbox-runner: the preload list is too long; nothing is preloaded");
            return;
        }
        if let Some(fd) = &k.requests {
            if matches!(sys::write(fd, &line), Ok(n) if n == line.len()) {
                k.preload_requested = true;
                k.preload_pending = true;
            }
        }
    }

    /// Starts `python3 kernel.py` with its four pipes.
    pub(super) fn start_kernel(&mut self) -> io::Result<()> {
        let (out_r, out_w) = sys::pipe()?;
        let (err_r, err_w) = sys::pipe()?;
        let (req_r, req_w) = sys::pipe()?;
        let (ev_r, ev_w) = sys::pipe()?;
        for fd in [&out_r, &err_r, &ev_r, &req_w] {
            sys::set_nonblocking(fd)?;
        }
        let argv = [
            self.cfg.python.clone(),
            self.cfg.kernel_script.to_string_lossy().into_owned(),
        ];
        let spec = Spec::new(
            &argv,
            &self.cfg.path,
            &self.cfg.env,
            &self.cfg.workdir,
            vec![
                (self.devnull.as_raw_fd(), 0),
                (out_w.as_raw_fd(), 1),
                (err_w.as_raw_fd(), 2),
                (req_r.as_raw_fd(), 3),
                (ev_w.as_raw_fd(), 4),
            ],
        )?;
        let pid = self.tracker.spawn(&spec)?;
        self.kernel = Some(Kernel {
            pid,
            stdout: Some(out_r),
            stderr: Some(err_r),
            events: Some(ev_r),
            requests: Some(req_w),
            events_buf: Vec::new(),
            ready: false,
            ran_code: false,
            exit: None,
            broken_at: None,
            last_id: 0,
            state_reply: None,
            displays: Vec::new(),
            preload_requested: false,
            preload_pending: false,
            preloading: self.control.preloading.clone(),
        });
        self.control.kernel_running.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// [`Worker::pump`] for the kernel's stdout or stderr; a closed pipe breaks the kernel
    /// (later execs would lose their output), so it gets replaced. Returns the bytes read.
    fn pump_kernel(
        &mut self,
        k: &mut Kernel,
        which: Stream,
        sink: &mut Capture,
        job: JobId,
    ) -> usize {
        let slot = match which {
            Stream::Stdout => &mut k.stdout,
            Stream::Stderr => &mut k.stderr,
        };
        let was_open = slot.is_some();
        let data = self.pump(slot, which, sink, job);
        if was_open && slot.is_none() {
            k.mark_broken();
        }
        data
    }

    /// Runs the code in the persistent kernel, starting it first if needed.
    pub(super) fn exec_py(
        &mut self,
        ctl: &mut ExecState,
        sink: &mut Capture,
        req: &ExecRequest,
    ) -> (Exit, RuntimeStatus) {
        self.drop_dead_kernel();
        if self.kernel.is_none() {
            // Started for this exec: nothing is imported ahead of its code.
            if let Err(e) = self.start_kernel() {
                ctl.notes
                    .push(format!("Error: cannot start the Python kernel: {e}"));
                return (Exit::Code(127), RuntimeStatus::New);
            }
        }
        let Some(mut k) = self.kernel.take() else {
            return (Exit::Code(127), RuntimeStatus::New);
        };
        let status = if k.ran_code {
            RuntimeStatus::Reused
        } else {
            RuntimeStatus::New
        };
        k.discard_pending(&mut self.buf);
        k.ran_code = true;
        k.last_id += 1;
        let id = k.last_id;
        let mut request = serde_json::json!({"id": id, "code": req.code, "args": req.args});
        if req.rich {
            request["rich"] = serde_json::json!(true);
        }
        if !req.tools.is_empty() {
            // Without a socket (it could not be set up) the functions still exist, and
            // raise ToolError when called.
            request["tools"] = serde_json::json!(req.tools);
            request["tool_socket"] = serde_json::json!(ctl
                .tools
                .as_ref()
                .map(|t| t.socket().to_string_lossy().into_owned()));
        }
        let mut pending = request.to_string().into_bytes();
        pending.push(b'\n');
        let mut written = 0;

        let mut done: Option<i32> = None;
        let mut interrupted_at: Option<Instant> = None;
        let mut killed_at: Option<Instant> = None;
        let mut gather = Gather::default();
        loop {
            if k.exit.is_none() {
                k.exit = self.tracker.take_exit(k.pid);
            }
            if done.is_some() || k.exit.is_some() {
                break;
            }
            let now = Instant::now();
            let mut kill_now = killed_at.is_none()
                && (interrupted_at.is_some_and(|t| now >= t + INTERRUPT_GRACE)
                    || k.broken_at.is_some_and(|t| now >= t + BROKEN_GRACE));
            if killed_at.is_none() && interrupted_at.is_none() && self.check_stop(ctl) {
                // Over the quota the kernel goes at once: an interrupt reaches only its
                // main thread, and other threads would go on writing.
                if k.ready && ctl.stop != Some(Stop::Disk) {
                    self.tracker.signal(k.pid, k.pid, libc::SIGINT);
                    interrupted_at = Some(now);
                    // Its children are done for anyway, and a fork bomb among them would
                    // starve the kernel's answer (and us) of CPU.
                    self.tracker.paused(Some(k.pid), |spare| {
                        sweep::kill_leftovers(spare, self.cfg.pid1, INTERRUPT_GRACE)
                    });
                } else {
                    kill_now = true;
                }
            }
            if kill_now {
                // Its whole process group: the kernel and whatever it started.
                self.tracker.signal(k.pid, -k.pid, libc::SIGKILL);
                ctl.killed = true;
                killed_at = Some(now);
            }
            if killed_at.is_some_and(|t| now >= t + KILL_GIVE_UP) {
                break;
            }
            // Sleep until the next thing that could need doing.
            let wake_at = [
                killed_at.map(|t| t + KILL_GIVE_UP),
                interrupted_at
                    .filter(|_| killed_at.is_none())
                    .map(|t| t + INTERRUPT_GRACE),
                k.broken_at
                    .filter(|_| killed_at.is_none())
                    .map(|t| t + BROKEN_GRACE),
                ctl.deadline.filter(|_| ctl.stop.is_none()),
            ]
            .into_iter()
            .flatten()
            .min();
            let timeout = earlier(
                wake_at.map(|t| t.saturating_duration_since(now)),
                gather
                    .next_resume()
                    .map(|t| t.saturating_duration_since(now)),
            );

            let mut pfds = vec![sys::pollin(&self.wake_r)];
            let mut roles = vec![Role::Wake];
            for (fd, role) in [
                (
                    k.stdout.as_ref().filter(|_| gather.polled(0, now)),
                    Role::Output,
                ),
                (
                    k.stderr.as_ref().filter(|_| gather.polled(1, now)),
                    Role::Output,
                ),
                (k.events.as_ref(), Role::Events),
            ] {
                if let Some(fd) = fd {
                    pfds.push(sys::pollin(fd));
                    roles.push(role);
                }
            }
            if written < pending.len() {
                if let Some(fd) = &k.requests {
                    pfds.push(libc::pollfd {
                        fd: fd.as_raw_fd(),
                        events: libc::POLLOUT,
                        revents: 0,
                    });
                    roles.push(Role::Requests);
                }
            }
            let kernel_fds = pfds.len();
            if let Some(tools) = &ctl.tools {
                tools.pollfds(&mut pfds);
            }
            if let Err(e) = sys::poll(&mut pfds, timeout) {
                eprintln!("sandbox-runner: poll: {e}");
                std::thread::sleep(Duration::from_millis(1));
            }
            // Output first, whatever woke us: the kernel flushes it before a display event
            // or a tool call, so it comes before them.
            let now = Instant::now();
            let woken = (pfds.iter().enumerate().skip(1)) // not the wake-up pipe
                .any(|(i, p)| sys::ready(p) && !matches!(roles.get(i), Some(Role::Requests)));
            if woken || gather.due(now) {
                for (i, which) in [Stream::Stdout, Stream::Stderr].into_iter().enumerate() {
                    let n = self.pump_kernel(&mut k, which, sink, ctl.job);
                    gather.read(i, n, READ_CHUNK, now);
                }
            }
            for (p, role) in pfds.iter().zip(roles) {
                if !sys::ready(p) {
                    continue;
                }
                match role {
                    Role::Wake => sys::drain(&self.wake_r),
                    Role::Output => {} // read above
                    Role::Events => {
                        if let Some(code) = k.read_events(&mut self.buf, Some(id)) {
                            done = Some(code);
                        }
                        for display in std::mem::take(&mut k.displays) {
                            if !ctl.stream {
                                continue;
                            }
                            match ctl.displays.admit(&display) {
                                Admit::Keep => {
                                    self.chan.send(ctl.job, &WorkerMessage::Display(display));
                                }
                                Admit::DropFirst(note) => ctl.notes.push(note),
                                Admit::Drop => {}
                            }
                        }
                    }
                    Role::Requests => {
                        let result = match &k.requests {
                            Some(fd) => sys::write(fd, &pending[written..]),
                            None => Ok(0),
                        };
                        match result {
                            Ok(n) => written += n,
                            Err(_) => {
                                k.requests = None;
                                k.mark_broken();
                            }
                        }
                    }
                }
            }
            self.service_tools(ctl, &pfds[kernel_fds..]);
        }

        let alive = k.exit.is_none() && killed_at.is_none() && k.broken_at.is_none();
        self.sweep(alive.then_some(k.pid));
        let exit = match (done, k.exit) {
            (Some(code), _) => Exit::Code(code),
            (None, Some(status)) => Exit::from_raw(status),
            (None, None) => Exit::Signal(libc::SIGKILL),
        };
        if let (None, false, Exit::Signal(sig)) = (done, ctl.killed, exit) {
            ctl.notes.push(format!(
                "Error: the Python kernel was killed by signal {sig}; its variables are \
                 lost and the next exec starts a new one"
            ));
        }
        if alive {
            // The kernel flushed before `done`, so its output is in the pipes already.
            for which in [Stream::Stdout, Stream::Stderr] {
                // Bounded: a background thread printing non-stop must not keep us here.
                for _ in 0..1024 {
                    if self.pump_kernel(&mut k, which, sink, ctl.job) == 0 {
                        break;
                    }
                }
            }
        } else {
            let mut fds = [k.stdout.take(), k.stderr.take()];
            self.drain(&mut fds, sink, ctl.job);
        }
        if alive && k.broken_at.is_none() {
            self.kernel = Some(k);
        } else {
            self.discard_kernel(k);
        }
        (exit, status)
    }
}

/// What a polled descriptor of a Python exec is.
#[derive(Clone, Copy)]
enum Role {
    /// The worker's wake-up pipe.
    Wake,
    /// The kernel's stdout or stderr (read together, see `gather`).
    Output,
    /// The kernel's event pipe.
    Events,
    /// The kernel's request pipe, while a request is being written.
    Requests,
}
