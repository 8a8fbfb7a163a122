//! What the reader thread, the worker and the quota watcher share: the task queue, the
//! running job with its cancel and tool results, and what the quota watcher measures for.

use crate::quota::Usage;
use crate::sys::Waker;
use sandbox_runner::sync::{unpoisoned, LockExt as _};
use sandbox_runner::{
    ExecRequest, JobId, PackInstallsRequest, RestoreStateRequest, SaveStateRequest, StdinChunk,
    ToolResult, UnpackInstallsRequest,
};
use std::collections::VecDeque;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// Work for the worker thread.
pub enum Task {
    /// Start the Python kernel if it is not running (a `hello` asked to warm up), and ask
    /// it to import these modules in the background while it waits (if it has run no code).
    StartKernel(Vec<String>),
    /// Run an exec and answer it.
    Exec(JobId, ExecRequest),
    /// Have the kernel save its globals to the state file, and answer.
    SaveState(JobId, SaveStateRequest),
    /// Have the kernel (started if need be) load the state file, and answer.
    RestoreState(JobId, RestoreStateRequest),
    /// Pack the session's installs into the state directory, and answer.
    PackInstalls(JobId, PackInstallsRequest),
    /// Unpack the installs archive into the workspace, and answer.
    UnpackInstalls(JobId, UnpackInstallsRequest),
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
    /// Whether the kernel is still importing the modules a warm-up `hello` asked it to
    /// preload, for `hello` answers: the broker gives a pooled sandbox its CPU weight back
    /// when this ends. Shared with the kernel, whose `preloaded` event clears it.
    pub preloading: Arc<AtomicBool>,
}

/// Most bytes of stdin held for an exec that has not started yet.
const EARLY_STDIN_BYTES: usize = 1 << 20;

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
    /// Stdin for `current`'s program not yet written.
    stdin: Vec<StdinChunk>,
    /// Stdin that came for a job before its exec did (the broker's frames of one job may
    /// be written in either order), handed over when that exec starts; at most
    /// [`EARLY_STDIN_BYTES`].
    early_stdin: Vec<(JobId, StdinChunk)>,
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
                stdin: Vec::new(),
                early_stdin: Vec::new(),
                watch: None,
                disk_over: false,
                idle_watch: None,
                kernel_over: false,
            }),
            waker,
            finished: Condvar::new(),
            watch_started: Condvar::new(),
            kernel_running: AtomicBool::new(false),
            preloading: Arc::new(AtomicBool::new(false)),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.locked()
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
        let early = std::mem::take(&mut st.early_stdin);
        st.stdin = early
            .into_iter()
            .filter(|(j, _)| *j == job)
            .map(|(_, chunk)| chunk)
            .collect();
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

    /// Hands stdin to the program of `job`; kept for a while when that job has not
    /// started yet (see `early_stdin`), dropped when another one runs.
    pub fn stdin(&self, job: JobId, chunk: StdinChunk) {
        let mut st = self.lock();
        if st.current == Some(job) {
            st.stdin.push(chunk);
            drop(st);
            self.waker.wake();
        } else if st.current.is_none() {
            let held: usize = st.early_stdin.iter().map(|(_, c)| c.data.len()).sum();
            if held + chunk.data.len() <= EARLY_STDIN_BYTES {
                st.early_stdin.push((job, chunk));
            }
        }
    }

    pub(crate) fn take_stdin(&self) -> Vec<StdinChunk> {
        std::mem::take(&mut self.lock().stdin)
    }

    pub(crate) fn take_tool_results(&self) -> Vec<ToolResult> {
        std::mem::take(&mut self.lock().tool_results)
    }

    pub(crate) fn next(&self) -> Option<Task> {
        self.lock().queue.pop_front()
    }

    pub(crate) fn cancelled(&self) -> bool {
        self.lock().cancel
    }

    pub(crate) fn disk_over(&self) -> bool {
        self.lock().disk_over
    }

    /// Asks the quota watcher to measure the workspace while `job` runs.
    pub(crate) fn watch(&self, job: JobId, base: Usage) {
        let mut st = self.lock();
        st.watch = Some((job, base));
        st.idle_watch = None;
        drop(st);
        self.watch_started.notify_all();
    }

    /// Asks the quota watcher to measure the workspace while the kernel idles.
    pub(crate) fn watch_idle(&self, base: Usage) {
        self.lock().idle_watch = Some(base);
        self.watch_started.notify_all();
    }

    /// Whether the idle kernel is still being watched.
    pub(crate) fn idle_watching(&self) -> bool {
        self.lock().idle_watch.is_some()
    }

    /// The watcher found the workspace grown between execs.
    pub(crate) fn idle_over_quota(&self) {
        let mut st = self.lock();
        if st.idle_watch.take().is_some() {
            st.kernel_over = true;
            drop(st);
            self.waker.wake();
        }
    }

    pub(crate) fn take_kernel_over(&self) -> bool {
        std::mem::take(&mut self.lock().kernel_over)
    }

    /// Stops the quota watcher's measurements (the exec's program ended).
    pub(crate) fn unwatch(&self) {
        self.lock().watch = None;
    }

    /// Blocks until an exec other than `last`, or the idle kernel, is to be watched.
    pub(crate) fn next_watch(&self, last: Option<JobId>) -> Watch {
        let st = self.lock();
        let st = unpoisoned(self.watch_started.wait_while(st, |st| {
            st.watch.is_none_or(|(job, _)| Some(job) == last) && st.idle_watch.is_none()
        }));
        match (st.watch, st.idle_watch) {
            (Some((job, base)), _) if Some(job) != last => Watch::Exec(job, base),
            (_, Some(base)) => Watch::Idle(base),
            _ => Watch::Idle(Usage::default()),
        }
    }

    /// Whether `job` is still being watched.
    pub(crate) fn watching(&self, job: JobId) -> bool {
        self.lock().watch.is_some_and(|(j, _)| j == job)
    }

    /// The quota watcher found `job` over the quota: it is stopped like a cancelled one.
    pub(crate) fn over_quota(&self, job: JobId) {
        let mut st = self.lock();
        if st.current == Some(job) && st.watch.is_some_and(|(j, _)| j == job) {
            st.disk_over = true;
            drop(st);
            self.waker.wake();
        }
    }

    /// Marks the exec done, before its answer is sent, so the broker may send the next
    /// one as soon as it reads the answer.
    pub(crate) fn finish(&self) {
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
        let _st = unpoisoned(self.finished.wait_while(st, |st| st.current.is_some()));
    }
}
