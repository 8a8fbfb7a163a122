//! The one place that waits for children.
//!
//! As PID 1 (or a child subreaper on a host) the runner inherits every orphan, so one
//! thread blocks in `waitid(P_ALL)` for the runner's whole life. It reaps everything; the
//! exit status of a pid someone is tracking (an exec's child, the kernel) is kept for the
//! worker, which is woken through its wake-up pipe. Nothing else in the runner may wait
//! for a child. When there are no children at all, the reaper sleeps in `sigtimedwait`
//! for SIGCHLD, which also announces orphans reparented to us as zombies.
//!
//! Race freedom: a child is forked while the tracker lock is held and tracked before the
//! lock is released, and the reaper only reaps (frees a pid) while holding that lock after
//! peeking with `WNOWAIT`. So a child is always tracked before it can be reaped, and a pid
//! freed by reaping cannot be handed to a new process while someone holding the lock
//! signals it or spares it from a sweep.

use crate::spawn::{self, Spec};
use crate::sys::Waker;
use sandbox_runner::sync::LockExt as _;
use std::collections::{HashMap, HashSet};
use std::io;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// Fork retries on EAGAIN back off from 1 ms and stop at this pause (about 1 s in all).
const FORK_RETRY_END: Duration = Duration::from_millis(600);

/// Children being tracked, and the exit statuses of those that ended.
#[derive(Default)]
struct Inner {
    /// Pids whose exit status someone wants.
    tracked: HashSet<libc::pid_t>,
    /// Raw wait statuses of tracked pids that ended and were not collected yet.
    exited: HashMap<libc::pid_t, libc::c_int>,
}

/// Shared between the reaper thread and everyone who starts children.
pub struct Tracker {
    /// The tracking state; also held across fork (see the module doc).
    inner: Mutex<Inner>,
    /// Wakes the worker when a tracked child ends.
    waker: Waker,
}

impl Tracker {
    /// A tracker that wakes the worker through `waker`.
    pub fn new(waker: Waker) -> Self {
        Tracker {
            inner: Mutex::new(Inner::default()),
            waker,
        }
    }

    /// The state; a panic elsewhere must not make the reaper give up.
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.locked()
    }

    /// Starts a tracked child; returns once it has exec'd.
    pub fn spawn(&self, spec: &Spec) -> io::Result<libc::pid_t> {
        let mut pause = Duration::from_millis(1);
        let forked = loop {
            let mut inner = self.lock();
            match spawn::fork(spec) {
                Ok(forked) => {
                    inner.tracked.insert(forked.pid);
                    break forked;
                }
                // The pids limit is full, most likely of zombies the reaper is still
                // collecting after a sweep: worth a few short retries.
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) && pause < FORK_RETRY_END => {
                    drop(inner);
                    std::thread::sleep(pause);
                    pause *= 2;
                }
                Err(e) => return Err(e),
            }
        };
        let pid = forked.pid;
        match spawn::wait_exec(forked) {
            Ok(()) => Ok(pid),
            Err(e) => {
                // Nobody will collect this one; the reaper just reaps it.
                self.forget(pid);
                Err(e)
            }
        }
    }

    /// The raw wait status of a tracked child, once it has ended (collected only once).
    pub fn take_exit(&self, pid: libc::pid_t) -> Option<libc::c_int> {
        self.lock().exited.remove(&pid)
    }

    /// Stops tracking a child whose status nobody will collect.
    pub fn forget(&self, pid: libc::pid_t) {
        let mut inner = self.lock();
        inner.tracked.remove(&pid);
        inner.exited.remove(&pid);
    }

    /// Sends `sig` to `target` (`pid` itself, or `-pid` for its process group) unless
    /// `pid` was reaped already. The lock makes this exact: the pid cannot be reaped and
    /// handed to another process in between.
    pub fn signal(&self, pid: libc::pid_t, target: libc::pid_t, sig: libc::c_int) {
        let inner = self.lock();
        if inner.tracked.contains(&pid) {
            crate::sys::kill(target, sig);
        }
    }

    /// Runs `f` while nothing is reaped or forked, passing `spare` only if that child was
    /// not reaped yet. A sweep runs this way, so that the pid it spares (the kernel's)
    /// cannot die, be reaped and come back as a process the sweep should have killed.
    pub fn paused<R>(
        &self,
        spare: Option<libc::pid_t>,
        f: impl FnOnce(Option<libc::pid_t>) -> R,
    ) -> R {
        let inner = self.lock();
        let spare = spare.filter(|pid| inner.tracked.contains(pid));
        f(spare)
    }

    /// The reaper thread's body; never returns. SIGCHLD must be blocked in every thread
    /// (see `main`), so it stays pending for this thread to wait for.
    pub fn reap_forever(&self) -> ! {
        loop {
            // SAFETY: siginfo_t is plain data that waitid fills in.
            let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
            // SAFETY: valid pointer to `info`.
            let r =
                unsafe { libc::waitid(libc::P_ALL, 0, &mut info, libc::WEXITED | libc::WNOWAIT) };
            if r == -1 {
                match io::Error::last_os_error().raw_os_error() {
                    // No children at all: sleep until one dies, which may be an orphan
                    // that was reparented to us (a fork bomb's, or one of a process
                    // entered with `docker exec`), announced by SIGCHLD.
                    Some(libc::ECHILD) => wait_for_sigchld(Duration::from_secs(1)),
                    Some(libc::EINTR) => {}
                    _ => std::thread::sleep(Duration::from_millis(10)),
                }
                continue;
            }
            // SAFETY: waitid succeeded, so the union holds child information.
            let pid = unsafe { info.si_pid() };
            if pid <= 0 {
                continue;
            }
            let mut inner = self.lock();
            let mut status: libc::c_int = 0;
            // SAFETY: valid pointer to `status`.
            let reaped = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            if reaped == pid && inner.tracked.remove(&pid) {
                inner.exited.insert(pid, status);
                drop(inner);
                self.waker.wake();
            }
        }
    }
}

/// The signal set holding just SIGCHLD.
fn sigchld_set() -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset initialise the set they are given.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGCHLD);
        set
    }
}

/// Blocks SIGCHLD in the calling thread and the threads it starts later; call first thing
/// in `main`. (Children get an empty mask back before exec.)
pub fn block_sigchld() {
    let set = sigchld_set();
    // SAFETY: a valid signal set; no old mask wanted.
    unsafe {
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// Waits until SIGCHLD is pending (and takes it), or `timeout` passes.
fn wait_for_sigchld(timeout: Duration) {
    let set = sigchld_set();
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: valid set and timeout; the siginfo is not wanted.
    unsafe {
        libc::sigtimedwait(&set, std::ptr::null_mut(), &ts);
    }
}

/// How a child ended, decoded from a raw wait status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// It exited with this code.
    Code(i32),
    /// A signal killed it.
    Signal(i32),
}

impl Exit {
    /// Decodes a raw status from waitpid.
    pub fn from_raw(status: libc::c_int) -> Self {
        if libc::WIFSIGNALED(status) {
            Exit::Signal(libc::WTERMSIG(status))
        } else {
            Exit::Code(libc::WEXITSTATUS(status))
        }
    }
}
