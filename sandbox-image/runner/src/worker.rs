//! The worker thread: runs one exec at a time, and keeps the Python kernel.
//!
//! Everything is one `ppoll` loop per phase over the exec's pipes and a wake-up pipe. The
//! wake-up pipe is written by the reader thread (a new task, a cancel) and by the reaper
//! (a tracked child ended), so the worker notices each of those at once, without polling
//! on a timer. When an exec's program ends (or is stopped), everything it left behind is
//! killed (`sweep`), then its pipes are drained and the answer is sent.
//!
//! An exec with tools also has a tool socket (`tools`), whose descriptors join the same
//! poll loop; tool results from the broker come through [`Control`] like cancels do.

use crate::capture::Capture;
use crate::compile_cache::{self, CompileCache};
use crate::frame::Channel;
use crate::quota::{self, Quota, Usage};
use crate::reaper::{Exit, Tracker};
use crate::spawn::Spec;
use crate::sys::{self, Read, Waker};
use crate::tools::ToolBridge;
use crate::{client, lang, scratch, stubs, sweep, Config};
use sandbox_runner::{
    Admit, DisplayBudget, DisplayData, ExecRequest, ExecResponse, JobId, Language, Limit,
    OutputChunk, RuntimeStatus, Stream, ToolResult, WorkerMessage,
};
use std::collections::VecDeque;
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long the kernel gets to answer `done` after SIGINT before it is killed.
const INTERRUPT_GRACE: Duration = Duration::from_secs(1);
/// How long a SIGKILLed process may take to be reported dead before we stop waiting.
const KILL_GIVE_UP: Duration = Duration::from_secs(5);
/// How long the sweep may try to kill processes stuck in the kernel (D state).
const SWEEP_LIMIT: Duration = Duration::from_secs(5);
/// How long pipes may stay open after the sweep (nothing should hold them by then).
const DRAIN_LIMIT: Duration = Duration::from_secs(2);
/// How long a kernel that closed a pipe gets to exit by itself before it is killed.
const BROKEN_GRACE: Duration = Duration::from_millis(100);
/// Longest line the kernel may write on its event pipe.
const MAX_EVENT_LINE: usize = 1 << 20;
/// The shared-memory tmpfs, a scratch mount like the temp dir.
const SHM: &str = "/dev/shm";
/// Read size per pipe per wake-up; also the largest streamed chunk.
const READ_CHUNK: usize = 64 * 1024;

/// Work for the worker thread.
pub enum Task {
    /// Start the Python kernel if it is not running (a `hello` asked to warm up).
    StartKernel,
    /// Run an exec and answer it.
    Exec(JobId, ExecRequest),
}

/// State shared between the reader thread and the worker.
pub struct Control {
    /// The queue and the running job.
    state: Mutex<State>,
    /// Wakes the worker after a change.
    waker: Waker,
    /// Signals the end of an exec to a reader thread waiting to shut down.
    finished: Condvar,
    /// Wakes the quota watcher when an exec starts to be watched.
    watch_started: Condvar,
    /// Whether a kernel process is alive, for `hello` answers.
    pub kernel_running: AtomicBool,
}

/// See [`Control`].
struct State {
    /// Tasks not started yet.
    queue: VecDeque<Task>,
    /// The exec queued or running, so a second one is refused and a cancel finds it.
    current: Option<JobId>,
    /// A cancel arrived for `current`.
    cancel: bool,
    /// Tool results for `current` not yet handed to its tool calls.
    tool_results: Vec<ToolResult>,
    /// The exec the quota watcher should measure for, and the workspace usage it started
    /// with.
    watch: Option<(JobId, Usage)>,
    /// The watcher found the workspace grown past its quota during `current`.
    disk_over: bool,
    /// Between execs, with a kernel alive (its threads may still write): the workspace
    /// usage the last exec ended with, for the watcher to measure against.
    idle_watch: Option<Usage>,
    /// The watcher found the workspace grown past its quota between execs: the kernel,
    /// the only thing that can still run then, is to be killed.
    kernel_over: bool,
}

/// What the quota watcher measures for.
pub enum Watch {
    /// A running exec, with the usage it started with.
    Exec(JobId, Usage),
    /// The idle kernel, with the usage the last exec ended with.
    Idle(Usage),
}

impl Control {
    /// Nothing queued or running.
    pub fn new(waker: Waker) -> Self {
        Control {
            state: Mutex::new(State {
                queue: VecDeque::new(),
                current: None,
                cancel: false,
                tool_results: Vec::new(),
                watch: None,
                disk_over: false,
                idle_watch: None,
                kernel_over: false,
            }),
            waker,
            finished: Condvar::new(),
            watch_started: Condvar::new(),
            kernel_running: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues a task that is not an exec.
    pub fn push(&self, task: Task) {
        self.lock().queue.push_back(task);
        self.waker.wake();
    }

    /// Queues an exec, or returns the job that is still running.
    pub fn start_exec(&self, job: JobId, req: ExecRequest) -> Result<(), JobId> {
        let mut st = self.lock();
        if let Some(running) = st.current {
            return Err(running);
        }
        st.current = Some(job);
        st.cancel = false;
        st.disk_over = false;
        st.tool_results.clear();
        st.queue.push_back(Task::Exec(job, req));
        drop(st);
        self.waker.wake();
        Ok(())
    }

    /// The exec queued or running, if any.
    pub fn current_job(&self) -> Option<JobId> {
        self.lock().current
    }

    /// Asks the exec of `job` to stop; ignored when that job is not running (it may just
    /// have finished).
    pub fn cancel(&self, job: JobId) {
        let mut st = self.lock();
        if st.current == Some(job) {
            st.cancel = true;
            drop(st);
            self.waker.wake();
        }
    }

    /// Hands a tool result to the exec of `job`; dropped when that job is not running (it
    /// may have timed out while the broker was working on the call).
    pub fn tool_result(&self, job: JobId, result: ToolResult) {
        let mut st = self.lock();
        if st.current == Some(job) {
            st.tool_results.push(result);
            drop(st);
            self.waker.wake();
        }
    }

    fn take_tool_results(&self) -> Vec<ToolResult> {
        std::mem::take(&mut self.lock().tool_results)
    }

    fn next(&self) -> Option<Task> {
        self.lock().queue.pop_front()
    }

    fn cancelled(&self) -> bool {
        self.lock().cancel
    }

    fn disk_over(&self) -> bool {
        self.lock().disk_over
    }

    /// Asks the quota watcher to measure the workspace while `job` runs.
    fn watch(&self, job: JobId, base: Usage) {
        let mut st = self.lock();
        st.watch = Some((job, base));
        st.idle_watch = None;
        drop(st);
        self.watch_started.notify_all();
    }

    /// Asks the quota watcher to measure the workspace while the kernel idles.
    fn watch_idle(&self, base: Usage) {
        self.lock().idle_watch = Some(base);
        self.watch_started.notify_all();
    }

    /// Whether the idle kernel is still being watched.
    fn idle_watching(&self) -> bool {
        self.lock().idle_watch.is_some()
    }

    /// The watcher found the workspace grown between execs.
    fn idle_over_quota(&self) {
        let mut st = self.lock();
        if st.idle_watch.take().is_some() {
            st.kernel_over = true;
            drop(st);
            self.waker.wake();
        }
    }

    fn take_kernel_over(&self) -> bool {
        std::mem::take(&mut self.lock().kernel_over)
    }

    /// Stops the quota watcher's measurements (the exec's program ended).
    fn unwatch(&self) {
        self.lock().watch = None;
    }

    /// Blocks until an exec other than `last`, or the idle kernel, is to be watched.
    fn next_watch(&self, last: Option<JobId>) -> Watch {
        let st = self.lock();
        let st = self
            .watch_started
            .wait_while(st, |st| {
                st.watch.is_none_or(|(job, _)| Some(job) == last) && st.idle_watch.is_none()
            })
            .unwrap_or_else(|e| e.into_inner());
        match (st.watch, st.idle_watch) {
            (Some((job, base)), _) if Some(job) != last => Watch::Exec(job, base),
            (_, Some(base)) => Watch::Idle(base),
            _ => Watch::Idle(Usage::default()),
        }
    }

    /// Whether `job` is still being watched.
    fn watching(&self, job: JobId) -> bool {
        self.lock().watch.is_some_and(|(j, _)| j == job)
    }

    /// The quota watcher found `job` over the quota: it is stopped like a cancelled one.
    fn over_quota(&self, job: JobId) {
        let mut st = self.lock();
        if st.current == Some(job) && st.watch.is_some_and(|(j, _)| j == job) {
            st.disk_over = true;
            drop(st);
            self.waker.wake();
        }
    }

    /// Marks the exec done, before its answer is sent, so the broker may send the next
    /// one as soon as it reads the answer.
    fn finish(&self) {
        let mut st = self.lock();
        st.current = None;
        st.cancel = false;
        st.disk_over = false;
        st.watch = None;
        st.tool_results.clear();
        self.finished.notify_all();
    }

    /// Blocks until no exec is queued or running (each is bounded by its time limit).
    pub fn wait_idle(&self) {
        let st = self.lock();
        let _st = self
            .finished
            .wait_while(st, |st| st.current.is_some())
            .unwrap_or_else(|e| e.into_inner());
    }
}

/// Why an exec was stopped before it ended by itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// The wall-time limit expired.
    Time,
    /// The broker sent a cancel.
    Cancel,
    /// The workspace grew past its quota.
    Disk,
}

/// The bookkeeping of one exec, apart from its output.
struct Ctl {
    /// The job, for streamed chunks.
    job: JobId,
    /// When the wall-time limit expires; `None` if it is too far to represent.
    deadline: Option<Instant>,
    /// Set once the exec is being stopped.
    stop: Option<Stop>,
    /// We SIGKILLed the exec's main process ourselves (so its death is not explained as
    /// the kernel's own).
    killed: bool,
    /// The runner's own notes for stderr (a program that could not start).
    notes: Vec<String>,
    /// The temp dir was too full to hold the program (user code can fill it).
    disk_full: bool,
    /// Whether the request asked for streaming (display events are sent only then).
    stream: bool,
    /// The display events the exec may still send: a loop of `display` calls must not
    /// flood the channel.
    displays: DisplayBudget,
    /// The tool socket, when the exec has tools (and it could be set up).
    tools: Option<ToolBridge>,
    /// Whether the compile cache served the program (`None`: nothing to compile).
    compile_cached: Option<bool>,
}

/// The persistent Python kernel (see the README's kernel protocol).
struct Kernel {
    /// Its pid (also its process group).
    pid: libc::pid_t,
    /// Its stdout; `None` once closed.
    stdout: Option<OwnedFd>,
    /// Its stderr; `None` once closed.
    stderr: Option<OwnedFd>,
    /// Fd 4 on its side: `ready` and `done` events; `None` once closed.
    events: Option<OwnedFd>,
    /// Fd 3 on its side: requests; `None` once it stopped reading.
    requests: Option<OwnedFd>,
    /// A partial event line.
    events_buf: Vec<u8>,
    /// Whether it said `ready`: before that it has no state worth an interrupt, and
    /// SIGINT could kill it half-started, so a stop kills it at once.
    ready: bool,
    /// Whether it was given code before (`Reused` rather than `New`).
    ran_code: bool,
    /// Its raw wait status once it died.
    exit: Option<libc::c_int>,
    /// When it closed one of its pipes; such a kernel is replaced.
    broken_at: Option<Instant>,
    /// The id of the last request.
    last_id: u64,
    /// Display events of the running request not yet sent.
    displays: Vec<DisplayData>,
}

impl Kernel {
    fn mark_broken(&mut self) {
        self.broken_at.get_or_insert_with(Instant::now);
    }

    /// Reads what is available on the event pipe; returns the exit code of a `done` for
    /// request `want`, if one came.
    fn read_events(&mut self, buf: &mut [u8], want: Option<u64>) -> Option<i32> {
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
    fn discard_pending(&mut self, buf: &mut [u8]) {
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
struct KernelEvent {
    /// `ready`, `display` or `done`.
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
}

/// The worker thread's state.
pub struct Worker {
    /// Settings.
    cfg: Arc<Config>,
    /// Where answers and streamed output go.
    chan: Arc<Channel>,
    /// Starts children and reports their exits.
    tracker: Arc<Tracker>,
    /// Tasks and cancels from the reader thread.
    control: Arc<Control>,
    /// Read end of the wake-up pipe.
    wake_r: OwnedFd,
    /// Stdin of every child.
    devnull: OwnedFd,
    /// The Python kernel, when one was started.
    kernel: Option<Kernel>,
    /// The read buffer, reused.
    buf: Vec<u8>,
    /// Makes per-exec directory names unique.
    seq: u64,
    /// Programs compiled earlier in this sandbox, so a rerun skips the compiler.
    compile_cache: CompileCache,
}

impl Worker {
    /// A worker with no kernel yet.
    pub fn new(
        cfg: Arc<Config>,
        chan: Arc<Channel>,
        tracker: Arc<Tracker>,
        control: Arc<Control>,
        wake_r: OwnedFd,
    ) -> io::Result<Self> {
        let devnull = std::fs::File::open("/dev/null")?.into();
        Ok(Worker {
            chan,
            tracker,
            control,
            wake_r,
            devnull,
            kernel: None,
            buf: vec![0; READ_CHUNK],
            seq: 0,
            compile_cache: CompileCache::new(&cfg.tmp),
            cfg,
        })
    }

    /// The worker thread's body.
    pub fn run(mut self) {
        loop {
            match self.control.next() {
                Some(Task::StartKernel) => {
                    self.drop_dead_kernel();
                    if self.kernel.is_none() {
                        if let Err(e) = self.start_kernel() {
                            eprintln!("sandbox-runner: cannot start the kernel: {e}");
                        }
                    }
                }
                Some(Task::Exec(job, req)) => {
                    let msg = self.exec(job, &req);
                    self.control.finish();
                    self.chan.send(job, &msg);
                }
                None => self.idle(),
            }
        }
    }

    /// Waits for the next wake-up, discarding what the idle kernel writes and noticing
    /// its death.
    fn idle(&mut self) {
        let mut fds = vec![sys::pollin(&self.wake_r)];
        if let Some(k) = &self.kernel {
            for fd in [&k.stdout, &k.stderr, &k.events].into_iter().flatten() {
                fds.push(sys::pollin(fd));
            }
        }
        if let Err(e) = sys::poll(&mut fds, None) {
            eprintln!("sandbox-runner: poll: {e}");
            std::thread::sleep(Duration::from_millis(10));
        }
        sys::drain(&self.wake_r);
        if self.control.take_kernel_over() {
            // Its threads grew the workspace past the quota after the exec ended.
            if let Some(k) = self.kernel.take() {
                eprintln!("sandbox-runner: the idle kernel outgrew the workspace quota");
                self.discard_kernel(k);
            }
        }
        if let Some(k) = self.kernel.as_mut() {
            if fds[1..].iter().any(sys::ready) {
                k.discard_pending(&mut self.buf);
            }
            if k.exit.is_none() {
                k.exit = self.tracker.take_exit(k.pid);
            }
        }
        self.drop_dead_kernel();
    }

    /// Forgets a kernel that died or broke its pipes (killing it if needed), so the next
    /// `py` exec starts a fresh one.
    fn drop_dead_kernel(&mut self) {
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

    fn discard_kernel(&self, k: Kernel) {
        self.tracker.signal(k.pid, k.pid, libc::SIGKILL);
        self.tracker.forget(k.pid);
        self.control.kernel_running.store(false, Ordering::Relaxed);
    }

    /// Starts `python3 kernel.py` with its four pipes.
    fn start_kernel(&mut self) -> io::Result<()> {
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
            displays: Vec::new(),
        });
        self.control.kernel_running.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Runs one exec and builds its answer.
    fn exec(&mut self, job: JobId, req: &ExecRequest) -> WorkerMessage {
        let start = Instant::now();
        let started_at = scratch::now();
        let oom_before = oom_kills();
        let mut ctl = Ctl {
            job,
            deadline: start.checked_add(Duration::from_millis(req.timeout_ms)),
            stop: None,
            killed: false,
            notes: Vec::new(),
            disk_full: false,
            stream: req.stream,
            displays: DisplayBudget::of(req),
            tools: None,
            compile_cached: None,
        };
        if !req.tools.is_empty() {
            match self.open_tools(job, req) {
                Ok(bridge) => ctl.tools = Some(bridge),
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) => {
                    ctl.disk_full = true;
                }
                Err(e) => ctl
                    .notes
                    .push(format!("Error: cannot set up the tool socket: {e}")),
            }
        }
        let mut sink = Capture::new(req.max_output_bytes, req.stream);
        let cfg = self.cfg.clone(); // kept while self is borrowed mutably
        let quota = cfg.quota.as_ref();
        let quota_base = quota.map(Quota::measure);
        if let Some(base) = quota_base {
            self.control.watch(job, base);
        }
        let (exit, runtime_status) = if self.check_stop(&mut ctl) {
            (None, RuntimeStatus::New) // cancelled (or no time at all) before it started
        } else if req.lang == Language::Py {
            let (exit, status) = self.exec_py(&mut ctl, &mut sink, req);
            (Some(exit), status)
        } else {
            (
                self.exec_program(&mut ctl, &mut sink, req),
                RuntimeStatus::New,
            )
        };

        // The tool socket goes away with the program: nothing can call tools any more.
        ctl.tools = None;
        self.control.unwatch();
        // Growth since the watcher's last look (or a file that hit RLIMIT_FSIZE, set to
        // the quota) counts too; the sweep has stopped every writer by now.
        let quota_end = quota.map(Quota::measure);
        let workspace_full = ctl.stop == Some(Stop::Disk)
            || exit == Some(Exit::Signal(libc::SIGXFSZ))
            || matches!((quota, quota_base, quota_end), (Some(q), Some(base), Some(end)) if q.exceeded(base, end));
        if let (Some(end), Some(_)) = (quota_end, &self.kernel) {
            // The kernel's threads may go on writing between execs.
            self.control.watch_idle(end);
        }
        // A scratch mount this exec filled: what it wrote there goes, or no later exec
        // could even write its program (only in a container: on a host these are shared).
        let mut scratch_full = Vec::new();
        if self.cfg.pid1 {
            for dir in [self.cfg.tmp.as_path(), Path::new(SHM)] {
                if scratch::nearly_full(dir) {
                    let removed = scratch::remove_changed_since(dir, started_at);
                    scratch_full.push(format!(
                        "{} full: {removed} entries this exec made there were removed",
                        dir.display()
                    ));
                }
            }
        }
        let mut limits = Vec::new();
        if ctl.stop == Some(Stop::Time) {
            limits.push(Limit::Time);
        }
        if ctl.disk_full || workspace_full || !scratch_full.is_empty() {
            limits.push(Limit::Disk);
        }
        // Only the cgroup's OOM kill counter says it: a SIGKILL we did not send may be the
        // code's own `kill -9`. Without a counter (gVisor shows no cgroup files) no claim is
        // made; there the host ends the whole sandbox and the broker asks the engine.
        let out_of_memory = matches!((oom_before, oom_kills()), (Some(a), Some(b)) if b > a);
        if out_of_memory {
            limits.push(Limit::Memory);
        }
        limits.extend(sink.limits());

        let mut notes = std::mem::take(&mut ctl.notes);
        for limit in &limits {
            notes.push(match limit {
                Limit::Time => format!("Error: {limit} ({} s)", seconds(req.timeout_ms)),
                Limit::Stdout | Limit::Stderr => {
                    format!("Error: {limit} (limit {} bytes)", sink.cap())
                }
                Limit::Disk => {
                    let mut places = Vec::new();
                    if workspace_full {
                        places.push(quota.map_or_else(
                            || self.cfg.workdir.display().to_string(),
                            Quota::describe,
                        ));
                    }
                    if ctl.disk_full && scratch_full.is_empty() {
                        places.push(self.cfg.tmp.display().to_string());
                    }
                    places.extend(scratch_full.iter().cloned());
                    format!("Error: {limit} ({})", places.join("; "))
                }
                _ => format!("Error: {limit}"),
            });
        }
        let mut note = String::new();
        if !notes.is_empty() {
            if sink.stderr_needs_newline() {
                note.push('\n');
            }
            note.push_str(&notes.join("\n"));
        }
        if req.stream {
            for which in [Stream::Stdout, Stream::Stderr] {
                let mut text = sink.flush(which);
                if which == Stream::Stderr {
                    text.push_str(&note);
                }
                self.send_chunk(job, which, text);
            }
        }
        let (stdout, mut stderr) = sink.into_text();
        if !req.stream {
            stderr.push_str(&note);
        }
        WorkerMessage::ExecDone(ExecResponse {
            exit_code: match exit {
                Some(Exit::Code(c)) => Some(c),
                _ => None,
            },
            signal: match exit {
                Some(Exit::Signal(s)) => Some(s),
                _ => None,
            },
            stdout,
            stderr,
            limits,
            runtime_status,
            duration_ms: start.elapsed().as_millis().try_into().unwrap_or(u64::MAX),
            cancelled: ctl.stop == Some(Stop::Cancel),
            compile_cached: ctl.compile_cached,
        })
    }

    fn send_chunk(&self, job: JobId, stream: Stream, data: String) {
        if !data.is_empty() {
            let msg = WorkerMessage::Output(OutputChunk { stream, data });
            self.chan.send(job, &msg);
        }
    }

    /// Starts stopping the exec if it was cancelled or ran out of time; returns true
    /// exactly when it decides to stop now.
    fn check_stop(&self, ctl: &mut Ctl) -> bool {
        if ctl.stop.is_some() {
            return false;
        }
        if self.control.cancelled() {
            ctl.stop = Some(Stop::Cancel);
        } else if self.control.disk_over() {
            ctl.stop = Some(Stop::Disk);
        } else if ctl.deadline.is_some_and(|d| Instant::now() >= d) {
            ctl.stop = Some(Stop::Time);
        }
        if let (Some(stop), Some(tools)) = (ctl.stop, ctl.tools.as_mut()) {
            // Calls waiting for a result must not keep the code waiting (a thread the
            // interrupt does not reach, a client that ignores signals).
            tools.stop(match stop {
                Stop::Time => Limit::Time.message(),
                Stop::Disk => Limit::Disk.message(),
                Stop::Cancel => "Cancelled",
            });
        }
        ctl.stop.is_some()
    }

    /// Sets up the tool socket of an exec in a fresh private directory.
    fn open_tools(&mut self, job: JobId, req: &ExecRequest) -> io::Result<ToolBridge> {
        let dir = self.make_dir("tools", job)?;
        ToolBridge::open(dir, &req.tools, self.cfg.tool_trace)
    }

    /// Serves the tool socket after a poll: new calls go to the broker, results that came
    /// in go to their calls.
    fn service_tools(&self, ctl: &mut Ctl, pfds: &[libc::pollfd]) {
        if let Some(tools) = ctl.tools.as_mut() {
            tools.service(pfds, &self.chan, ctl.job);
            for result in self.control.take_tool_results() {
                tools.deliver(result);
            }
        }
    }

    /// Reads what is available on one pipe into `sink`, streaming it if asked; returns
    /// whether data came.
    fn pump(
        &mut self,
        fd: &mut Option<OwnedFd>,
        which: Stream,
        sink: &mut Capture,
        job: JobId,
    ) -> bool {
        let Some(f) = fd.as_ref() else { return false };
        match sys::read(f, &mut self.buf) {
            Ok(Read::Data(n)) => {
                if let Some(text) = sink.push(which, &self.buf[..n]) {
                    self.send_chunk(job, which, text);
                }
                true
            }
            Ok(Read::WouldBlock) => false,
            Ok(Read::Eof) | Err(_) => {
                *fd = None;
                false
            }
        }
    }

    /// [`Worker::pump`] for the kernel's stdout or stderr; a closed pipe breaks the kernel
    /// (later execs would lose their output), so it gets replaced.
    fn pump_kernel(
        &mut self,
        k: &mut Kernel,
        which: Stream,
        sink: &mut Capture,
        job: JobId,
    ) -> bool {
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

    /// Kills everything left over, sparing the kernel (which it also wakes up, in case
    /// user code stopped it).
    fn sweep(&self, spare: Option<libc::pid_t>) {
        let survivors = self.tracker.paused(spare, |spare| {
            let survivors = sweep::kill_leftovers(spare, self.cfg.pid1, SWEEP_LIMIT);
            if let Some(pid) = spare {
                sys::kill(pid, libc::SIGCONT);
            }
            survivors
        });
        if survivors > 0 {
            eprintln!("sandbox-runner: {survivors} processes would not die");
        }
    }

    /// Reads both pipes to end of file; the sweep has killed every writer, so this ends
    /// quickly (the limit guards against the unexpected).
    fn drain(&mut self, fds: &mut [Option<OwnedFd>; 2], sink: &mut Capture, job: JobId) {
        let until = Instant::now() + DRAIN_LIMIT;
        while fds.iter().any(Option::is_some) {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                eprintln!("sandbox-runner: output pipes still open after the sweep");
                return;
            }
            let mut pfds: Vec<libc::pollfd> = fds.iter().flatten().map(sys::pollin).collect();
            if sys::poll(&mut pfds, Some(left)).is_err() {
                return;
            }
            for (i, which) in [Stream::Stdout, Stream::Stderr].into_iter().enumerate() {
                let mut slot = fds[i].take();
                self.pump(&mut slot, which, sink, job);
                fds[i] = slot;
            }
        }
    }

    // ----- programs other than Python -----

    /// Writes the source to a fresh directory, compiles it if the language needs that, and
    /// runs it; `None` when it could not even be written (the reason is in the notes).
    fn exec_program(
        &mut self,
        ctl: &mut Ctl,
        sink: &mut Capture,
        req: &ExecRequest,
    ) -> Option<Exit> {
        let dir = match self.make_dir("exec", ctl.job) {
            Ok(dir) => dir,
            Err(e) => {
                self.cannot_write(ctl, &e);
                return None;
            }
        };
        let result = self.compile_and_run(ctl, sink, req, &dir);
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            eprintln!("sandbox-runner: cannot remove {}: {e}", dir.display());
        }
        match result {
            Ok(exit) => Some(exit),
            Err(e) => {
                self.cannot_write(ctl, &e);
                None
            }
        }
    }

    /// Explains a program that could not be written to the temp dir.
    fn cannot_write(&self, ctl: &mut Ctl, e: &io::Error) {
        if matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) {
            ctl.disk_full = true;
        } else {
            let tmp = self.cfg.tmp.display();
            ctl.notes
                .push(format!("Error: cannot write the program to {tmp}: {e}"));
        }
    }

    fn compile_and_run(
        &mut self,
        ctl: &mut Ctl,
        sink: &mut Capture,
        req: &ExecRequest,
        dir: &Path,
    ) -> io::Result<Exit> {
        let mut plan = lang::plan(req.lang, &req.code, dir)
            .ok_or_else(|| io::Error::other("no plan for this language"))?;
        let mut env = None;
        let mut wrapped = None;
        if let Some(tools) = &ctl.tools {
            let (run_env, prelude) = self.tool_env(tools, req, dir)?;
            env = Some(run_env);
            if let Some(prelude) = prelude {
                lang::preload(&mut plan, req.lang, dir, &prelude);
                if req.lang == Language::Js {
                    wrapped = Some(stubs::wrap_js(&req.code));
                }
            }
        }
        // Only writing can fail with `Err`; a failing compiler or program is an `Exit`.
        std::fs::write(
            dir.join(&plan.source),
            wrapped.as_deref().unwrap_or(&req.code),
        )?;
        let cfg = self.cfg.clone(); // the base environment, kept while self is borrowed mutably
        let cache_key = (plan.compile.as_ref())
            .filter(|_| compile_cache::caches(req.lang))
            .map(|compile| compile_cache::key(req.lang, &plan.source, compile, &req.code));
        if let Some(key) = &cache_key {
            ctl.compile_cached = Some(self.compile_cache.restore(key, dir));
        }
        if let Some(compile) = plan
            .compile
            .as_ref()
            .filter(|_| ctl.compile_cached != Some(true))
        {
            // The compiler's own output is shown only when compiling fails.
            let mut cc = Capture::new(req.max_output_bytes, false);
            let exit = self.run_child(ctl, &mut cc, compile, dir, &cfg.env);
            if exit != Exit::Code(0) || ctl.stop.is_some() {
                for which in [Stream::Stdout, Stream::Stderr] {
                    if let Some(text) = sink.push(which, cc.bytes(which)) {
                        self.send_chunk(ctl.job, which, text);
                    }
                }
                for limit in cc.limits() {
                    sink.mark_over(match limit {
                        Limit::Stdout => Stream::Stdout,
                        _ => Stream::Stderr,
                    });
                }
                return Ok(exit);
            }
            // Stored before the program runs, which could change what is in `dir`.
            if let Some(key) = &cache_key {
                self.compile_cache.store(key, dir, &plan.source);
            }
        }
        let mut argv = plan.run.clone();
        argv.extend(req.args.iter().cloned());
        let workdir = self.cfg.workdir.clone();
        let env = env.as_deref().unwrap_or(&cfg.env);
        Ok(self.run_child(ctl, sink, &argv, &workdir, env))
    }

    /// The environment of a program that may call tools, and the prelude file written for
    /// its language (bash gets it through `BASH_ENV`; for JavaScript and TypeScript it is
    /// the file to preload). `dir` is the per-exec directory.
    fn tool_env(
        &self,
        tools: &ToolBridge,
        req: &ExecRequest,
        dir: &Path,
    ) -> io::Result<(Vec<CString>, Option<PathBuf>)> {
        let socket = tools.socket().to_string_lossy().into_owned();
        let mut vars = vec![(client::SOCKET_ENV, socket.clone())];
        let prelude = match req.lang {
            Language::Bash => {
                let file = tools.dir().join("prelude.sh");
                let text = stubs::bash_prelude(&req.tools, &self.cfg.path, &self.cfg.runner_exe);
                std::fs::write(&file, text)?;
                vars.push(("BASH_ENV", file.to_string_lossy().into_owned()));
                None
            }
            Language::Js | Language::Ts => {
                let file = tools.dir().join("prelude.js");
                let esm_main = lang::esm_main(req.lang, dir);
                let text = stubs::js_prelude(&req.tools, &socket, esm_main.as_deref());
                std::fs::write(&file, text)?;
                Some(file)
            }
            _ => None,
        };
        let mut env: Vec<CString> = self
            .cfg
            .env
            .iter()
            .filter(|kv| !vars.iter().any(|(k, _)| env_key_is(kv, k)))
            .cloned()
            .collect();
        for (k, v) in vars {
            env.push(crate::spawn::cstring(format!("{k}={v}").as_bytes())?);
        }
        Ok((env, prelude))
    }

    /// A new private directory under the temp dir, never one that already exists (user
    /// code shares /tmp and may have planted names).
    fn make_dir(&mut self, prefix: &str, job: JobId) -> io::Result<PathBuf> {
        loop {
            self.seq += 1;
            let dir = self.cfg.tmp.join(format!("{prefix}-{job}-{}", self.seq));
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => return Ok(dir),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists && self.seq % 1000 != 0 => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Runs one program to its end (or until stopped), then sweeps and drains its output.
    fn run_child(
        &mut self,
        ctl: &mut Ctl,
        sink: &mut Capture,
        argv: &[String],
        cwd: &Path,
        env: &[CString],
    ) -> Exit {
        let mut fds: [Option<OwnedFd>; 2] = [None, None];
        let pid = match self.spawn_piped(argv, cwd, env, &mut fds) {
            Ok(pid) => pid,
            Err(e) => {
                let name = argv.first().map_or("", String::as_str);
                ctl.notes.push(format!("Error: cannot run {name}: {e}"));
                return Exit::Code(127);
            }
        };
        let mut killed_at: Option<Instant> = None;
        let exit = loop {
            if let Some(status) = self.tracker.take_exit(pid) {
                break Exit::from_raw(status);
            }
            if killed_at.is_none() && self.check_stop(ctl) {
                self.tracker.signal(pid, -pid, libc::SIGKILL);
                ctl.killed = true;
                killed_at = Some(Instant::now());
            }
            let timeout = match killed_at {
                Some(t) if t.elapsed() >= KILL_GIVE_UP => {
                    self.tracker.forget(pid);
                    break Exit::Signal(libc::SIGKILL);
                }
                Some(t) => Some(KILL_GIVE_UP.saturating_sub(t.elapsed())),
                None => ctl
                    .deadline
                    .map(|d| d.saturating_duration_since(Instant::now())),
            };
            let mut pfds = vec![sys::pollin(&self.wake_r)];
            pfds.extend(fds.iter().flatten().map(sys::pollin));
            let outputs = pfds.len();
            if let Some(tools) = &ctl.tools {
                tools.pollfds(&mut pfds);
            }
            if let Err(e) = sys::poll(&mut pfds, timeout) {
                eprintln!("sandbox-runner: poll: {e}");
                std::thread::sleep(Duration::from_millis(1));
            }
            sys::drain(&self.wake_r);
            if pfds[1..outputs].iter().any(sys::ready) {
                for (i, which) in [Stream::Stdout, Stream::Stderr].into_iter().enumerate() {
                    let mut slot = fds[i].take();
                    self.pump(&mut slot, which, sink, ctl.job);
                    fds[i] = slot;
                }
            }
            self.service_tools(ctl, &pfds[outputs..]);
        };
        let spare = self
            .kernel
            .as_ref()
            .filter(|k| k.exit.is_none())
            .map(|k| k.pid);
        self.sweep(spare);
        self.drain(&mut fds, sink, ctl.job);
        exit
    }

    /// Starts a program with stdin from /dev/null and stdout/stderr on fresh pipes.
    fn spawn_piped(
        &mut self,
        argv: &[String],
        cwd: &Path,
        env: &[CString],
        fds: &mut [Option<OwnedFd>; 2],
    ) -> io::Result<libc::pid_t> {
        let (out_r, out_w) = sys::pipe()?;
        let (err_r, err_w) = sys::pipe()?;
        sys::set_nonblocking(&out_r)?;
        sys::set_nonblocking(&err_r)?;
        let spec = Spec::new(
            argv,
            &self.cfg.path,
            env,
            cwd,
            vec![
                (self.devnull.as_raw_fd(), 0),
                (out_w.as_raw_fd(), 1),
                (err_w.as_raw_fd(), 2),
            ],
        )?;
        let pid = self.tracker.spawn(&spec)?;
        *fds = [Some(out_r), Some(err_r)];
        Ok(pid)
    }

    // ----- Python -----

    /// Runs the code in the persistent kernel, starting it first if needed.
    fn exec_py(
        &mut self,
        ctl: &mut Ctl,
        sink: &mut Capture,
        req: &ExecRequest,
    ) -> (Exit, RuntimeStatus) {
        self.drop_dead_kernel();
        if self.kernel.is_none() {
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
            let timeout = wake_at.map(|t| t.saturating_duration_since(now));

            let mut pfds = vec![sys::pollin(&self.wake_r)];
            let mut roles = vec![Role::Wake];
            for (fd, role) in [
                (&k.stdout, Role::Out),
                (&k.stderr, Role::Err),
                (&k.events, Role::Events),
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
            for (p, role) in pfds.iter().zip(roles) {
                if !sys::ready(p) {
                    continue;
                }
                match role {
                    Role::Wake => sys::drain(&self.wake_r),
                    Role::Out => {
                        self.pump_kernel(&mut k, Stream::Stdout, sink, ctl.job);
                    }
                    Role::Err => {
                        self.pump_kernel(&mut k, Stream::Stderr, sink, ctl.job);
                    }
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
                    if !self.pump_kernel(&mut k, which, sink, ctl.job) {
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
    /// The kernel's stdout.
    Out,
    /// The kernel's stderr.
    Err,
    /// The kernel's event pipe.
    Events,
    /// The kernel's request pipe, while a request is being written.
    Requests,
}

/// How many times the kernel was OOM-killed in this container's memory cgroup so far.
fn oom_kills() -> Option<u64> {
    const SOURCES: [&str; 2] = [
        "/sys/fs/cgroup/memory/memory.oom_control", // cgroup v1
        "/sys/fs/cgroup/memory.events",             // cgroup v2
    ];
    SOURCES.iter().find_map(|path| {
        let text = std::fs::read_to_string(path).ok()?;
        text.lines().find_map(|line| {
            line.strip_prefix("oom_kill ")
                .and_then(|v| v.trim().parse().ok())
        })
    })
}

/// Whether a `KEY=VALUE` entry sets `key`.
fn env_key_is(entry: &CString, key: &str) -> bool {
    entry
        .as_bytes()
        .strip_prefix(key.as_bytes())
        .is_some_and(|rest| rest.starts_with(b"="))
}

/// Milliseconds as seconds for a note: `30`, `0.5`, `1.25`.
fn seconds(ms: u64) -> String {
    if ms % 1000 == 0 {
        (ms / 1000).to_string()
    } else {
        let s = format!("{}.{:03}", ms / 1000, ms % 1000);
        s.trim_end_matches('0').to_string()
    }
}

/// The quota watcher thread's body: measures the workspace while each exec runs, and
/// stops the exec once it grew past the quota (see `quota`).
/// Measures the workspace while the kernel idles, less often than during an exec, until
/// the next exec starts; kills the kernel (through the worker) if it grew past the quota.
fn watch_idle(quota: &Quota, control: &Control, base: Usage) {
    let mut pause = quota::MIN_INTERVAL;
    loop {
        std::thread::sleep(pause);
        if !control.idle_watching() {
            return;
        }
        let (now, took) = quota::timed_measure(quota);
        if quota.exceeded(base, now) {
            control.idle_over_quota();
            return;
        }
        // Idle kernels are the common case: at most a twentieth of a CPU on watching, but
        // as often as during an exec while the workspace grows (threads still writing).
        pause = if now.bytes > base.bytes || now.files > base.files {
            quota::interval(took)
        } else {
            (took * 20).max(quota::IDLE_INTERVAL)
        };
    }
}

pub fn watch_quota(quota: Quota, control: Arc<Control>) {
    let mut last = None;
    loop {
        let (job, base) = match control.next_watch(last) {
            Watch::Exec(job, base) => (job, base),
            Watch::Idle(base) => {
                watch_idle(&quota, &control, base);
                continue;
            }
        };
        last = Some(job);
        let mut pause = quota::MIN_INTERVAL;
        loop {
            std::thread::sleep(pause);
            if !control.watching(job) {
                break;
            }
            let (now, took) = quota::timed_measure(&quota);
            if quota.exceeded(base, now) {
                control.over_quota(job);
                break;
            }
            pause = quota::interval(took);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_read_naturally() {
        assert_eq!(seconds(30_000), "30");
        assert_eq!(seconds(500), "0.5");
        assert_eq!(seconds(1250), "1.25");
        assert_eq!(seconds(1), "0.001");
    }
}
