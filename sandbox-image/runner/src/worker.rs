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
//!
//! Here: the worker's loop and the steps every exec shares. Its parts: `control` (what
//! the reader thread and the quota watcher share with it), `kernel` (Python, in the
//! persistent kernel), `program` (every other language), `report` (the answer).

mod control;
mod gather;
mod kernel;
mod program;
mod report;
mod state;

pub(crate) use control::{Control, Task, Watch};
pub(crate) use state::state_dir;
// Started beside the worker, on the same `Control`.
pub(crate) use crate::quota::watch_quota;

use crate::capture::Capture;
use crate::compile_cache::CompileCache;
use crate::frame::Channel;
use crate::quota::Quota;
use crate::reaper::Tracker;
use crate::sys::{self, Read};
use crate::tools::ToolBridge;
use crate::{scratch, sweep, Config};
use kernel::Kernel;
use report::Ran;
use sandbox_runner::{
    DisplayBudget, ExecRequest, JobId, Language, Limit, OutputChunk, RuntimeStatus, Stream,
    WorkerMessage,
};
use std::io;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a SIGKILLed process may take to be reported dead before we stop waiting.
const KILL_GIVE_UP: Duration = Duration::from_secs(5);
/// How long the sweep may try to kill processes stuck in the kernel (D state).
const SWEEP_LIMIT: Duration = Duration::from_secs(5);
/// How long pipes may stay open after the sweep (nothing should hold them by then).
const DRAIN_LIMIT: Duration = Duration::from_secs(2);
/// The shared-memory tmpfs, a scratch mount like the temp dir.
const SHM: &str = "/dev/shm";
/// Read size per pipe per wake-up; also the largest streamed chunk.
const READ_CHUNK: usize = 64 * 1024;

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
struct ExecState {
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
                Some(Task::StartKernel(preload)) => {
                    self.drop_dead_kernel();
                    if self.kernel.is_none() {
                        if let Err(e) = self.start_kernel() {
                            eprintln!("sandbox-runner: cannot start the kernel: {e}");
                        }
                    }
                    self.request_preload(&preload);
                    self.sync_preloading();
                }
                Some(Task::Exec(job, req)) => {
                    let msg = self.exec(job, &req);
                    self.control.finish();
                    self.chan.send(job, &msg);
                }
                Some(Task::SaveState(job, req)) => {
                    let msg = WorkerMessage::StateSaved(self.save_state(&req));
                    self.chan.send(job, &msg);
                }
                Some(Task::RestoreState(job, req)) => {
                    let msg = WorkerMessage::StateRestored(self.restore_state(&req));
                    self.chan.send(job, &msg);
                }
                Some(Task::PackInstalls(job, req)) => {
                    let msg = WorkerMessage::InstallsPacked(self.pack_installs(&req));
                    self.chan.send(job, &msg);
                }
                Some(Task::UnpackInstalls(job, req)) => {
                    let msg = WorkerMessage::InstallsUnpacked(self.unpack_installs(&req));
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

    /// Runs one exec and builds its answer.
    fn exec(&mut self, job: JobId, req: &ExecRequest) -> WorkerMessage {
        let start = Instant::now();
        let started_at = scratch::now();
        let oom_before = report::oom_kills();
        let mut ctl = ExecState {
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
        let quota_base = self.cfg.quota.as_ref().map(Quota::measure);
        if let Some(base) = quota_base {
            self.control.watch(job, base);
        }
        let (exit, runtime_status) = if self.check_stop(&mut ctl) {
            (None, RuntimeStatus::New) // cancelled (or no time at all) before it started
        } else if req.lang == Language::Py {
            let (exit, status) = self.exec_py(&mut ctl, &mut sink, req);
            (Some(exit), status)
        } else {
            self.stop_preload();
            (
                self.exec_program(&mut ctl, &mut sink, req),
                RuntimeStatus::New,
            )
        };

        // The tool socket goes away with the program: nothing can call tools any more.
        ctl.tools = None;
        self.control.unwatch();
        let ran = Ran {
            start,
            started_at,
            oom_before,
            quota_base,
            exit,
            runtime_status,
        };
        self.report(req, ctl, sink, ran)
    }

    fn send_chunk(&self, job: JobId, stream: Stream, data: String) {
        if !data.is_empty() {
            let msg = WorkerMessage::Output(OutputChunk { stream, data });
            self.chan.send(job, &msg);
        }
    }

    /// Starts stopping the exec if it was cancelled or ran out of time; returns true
    /// exactly when it decides to stop now.
    fn check_stop(&self, ctl: &mut ExecState) -> bool {
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
    fn service_tools(&self, ctl: &mut ExecState, pfds: &[libc::pollfd]) {
        if let Some(tools) = ctl.tools.as_mut() {
            tools.service(pfds, &self.chan, ctl.job);
            for result in self.control.take_tool_results() {
                tools.deliver(result);
            }
        }
    }

    /// Reads what is available on one pipe into `sink`, streaming it if asked; returns
    /// how many bytes came (at most [`READ_CHUNK`]).
    fn pump(
        &mut self,
        fd: &mut Option<OwnedFd>,
        which: Stream,
        sink: &mut Capture,
        job: JobId,
    ) -> usize {
        let Some(f) = fd.as_ref() else { return 0 };
        match sys::read(f, &mut self.buf) {
            Ok(Read::Data(n)) => {
                if let Some(text) = sink.push(which, &self.buf[..n]) {
                    self.send_chunk(job, which, text);
                }
                n
            }
            Ok(Read::WouldBlock) => 0,
            Ok(Read::Eof) | Err(_) => {
                *fd = None;
                0
            }
        }
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
}
