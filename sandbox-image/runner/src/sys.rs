//! Thin wrappers over the few system calls std does not offer: pipes with exact flags,
//! non-blocking reads and writes, and `ppoll`.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// A pipe whose both ends are close-on-exec, so no child inherits them by accident.
pub fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } == -1 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 succeeded, so both are fresh descriptors nobody else owns.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Makes reads and writes on `fd` return `EAGAIN` instead of blocking the event loop.
pub fn set_nonblocking(fd: &OwnedFd) -> io::Result<()> {
    let raw = fd.as_raw_fd();
    // SAFETY: plain fcntl calls on a descriptor we own.
    unsafe {
        let flags = libc::fcntl(raw, libc::F_GETFL);
        if flags == -1 || libc::fcntl(raw, libc::F_SETFL, flags | libc::O_NONBLOCK) == -1 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// What one non-blocking read found.
#[derive(Debug, PartialEq, Eq)]
pub enum Read {
    /// This many bytes were read.
    Data(usize),
    /// Nothing available right now.
    WouldBlock,
    /// Every writer has closed its end.
    Eof,
}

/// One read on a non-blocking descriptor, retried on `EINTR`.
pub fn read(fd: &OwnedFd, buf: &mut [u8]) -> io::Result<Read> {
    loop {
        // SAFETY: `buf` is valid for `buf.len()` bytes.
        let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n > 0 {
            return Ok(Read::Data(n as usize));
        }
        if n == 0 {
            return Ok(Read::Eof);
        }
        let err = io::Error::last_os_error();
        match err.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => return Ok(Read::WouldBlock),
            _ => return Err(err),
        }
    }
}

/// One write on a non-blocking descriptor; `Ok(0)` when the pipe is full.
pub fn write(fd: &OwnedFd, buf: &[u8]) -> io::Result<usize> {
    loop {
        // SAFETY: `buf` is valid for `buf.len()` bytes.
        let n = unsafe { libc::write(fd.as_raw_fd(), buf.as_ptr().cast(), buf.len()) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let err = io::Error::last_os_error();
        match err.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => return Ok(0),
            _ => return Err(err),
        }
    }
}

/// Writes all of `buf` to a blocking descriptor (the channel to the broker).
pub fn write_all_raw(fd: RawFd, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        // SAFETY: `buf` is valid for `buf.len()` bytes.
        let n = unsafe { libc::write(fd, buf.as_ptr().cast(), buf.len()) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        buf = &buf[n as usize..];
    }
    Ok(())
}

/// Waits until one of `fds` is ready or `timeout` passes (`None`: no timeout). A signal
/// interrupting the wait counts as a spurious wake-up; callers re-check their state anyway.
pub fn poll(fds: &mut [libc::pollfd], timeout: Option<Duration>) -> io::Result<()> {
    let ts = timeout.map(|t| libc::timespec {
        tv_sec: t.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: t.subsec_nanos() as libc::c_long,
    });
    let ts_ptr = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: `fds` is a valid slice of pollfd; a null sigmask keeps the current mask.
    let r = unsafe {
        libc::ppoll(
            fds.as_mut_ptr(),
            fds.len() as libc::nfds_t,
            ts_ptr,
            std::ptr::null(),
        )
    };
    if r == -1 {
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
    Ok(())
}

/// A pollfd asking for readability (and, implicitly, hang-up and errors).
pub fn pollin(fd: &OwnedFd) -> libc::pollfd {
    libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    }
}

/// A pollfd asking for room to write (and, implicitly, hang-up and errors).
pub fn pollout(fd: &OwnedFd) -> libc::pollfd {
    libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLOUT,
        revents: 0,
    }
}

/// Whether a polled descriptor has something to act on: data, end of file or an error.
pub fn ready(p: &libc::pollfd) -> bool {
    p.revents != 0
}

/// Sends `sig` to a process (`pid > 0`) or a process group (`pid < 0`), ignoring the
/// "no such process" that a race with its exit produces.
pub fn kill(pid: libc::pid_t, sig: libc::c_int) {
    // SAFETY: kill has no memory-safety preconditions.
    unsafe {
        libc::kill(pid, sig);
    }
}

/// A way to wake the worker's event loop from another thread: one byte on a pipe the
/// worker polls. A full pipe already means "wake up", so a failed write is fine.
#[derive(Clone)]
pub struct Waker {
    /// The write end; shared by the reader thread, the reaper and the worker itself.
    fd: std::sync::Arc<OwnedFd>,
}

impl Waker {
    /// Wraps the write end of a non-blocking pipe.
    pub fn new(fd: OwnedFd) -> Self {
        Waker {
            fd: std::sync::Arc::new(fd),
        }
    }

    /// Makes the worker's next (or current) poll return.
    pub fn wake(&self) {
        let _ = write(&self.fd, &[1]);
    }
}

/// Empties the worker's wake-up pipe, so the next poll blocks until a new wake-up.
pub fn drain(fd: &OwnedFd) {
    let mut buf = [0u8; 64];
    while let Ok(Read::Data(_)) = read(fd, &mut buf) {}
}

/// CPUs the container's CFS quota allows, rounded up: `cpu.cfs_quota_us / cpu.cfs_period_us`
/// (cgroup v1) or `cpu.max` (v2); `None` without a quota.
fn cpu_quota() -> Option<usize> {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let (quota, period) = if let Some(max) = read("/sys/fs/cgroup/cpu.max") {
        let mut f = max.split_ascii_whitespace();
        (
            f.next()?.parse::<i64>().ok()?,
            f.next()?.parse::<i64>().ok()?,
        )
    } else {
        let q = read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")?;
        let p = read("/sys/fs/cgroup/cpu/cpu.cfs_period_us")?;
        (q.trim().parse().ok()?, p.trim().parse().ok()?)
    };
    if quota <= 0 || period <= 0 {
        return None;
    }
    usize::try_from((quota + period - 1) / period).ok()
}

/// Narrows this process's CPU affinity to as many CPUs as the CPU quota allows, so that
/// `nproc`, `os.sched_getaffinity` and the thread pools sized from them see the limit
/// rather than the host's CPU count. The quota itself is what limits CPU time; this only
/// makes the count honest. Which CPUs: a random window of the allowed ones, so sandboxes
/// spread over the host.
pub fn fit_affinity_to_cpu_quota() {
    let Some(want) = cpu_quota() else { return };
    // SAFETY: cpu_set_t is plain data; sched_getaffinity fills it in.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: valid pointer and size.
    if unsafe { libc::sched_getaffinity(0, size, &mut set) } != 0 {
        return;
    }
    let allowed: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
        // SAFETY: the index is below CPU_SETSIZE.
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect();
    if want == 0 || want >= allowed.len() {
        return;
    }
    let mut seed = [0u8; 8];
    // SAFETY: valid buffer; a failure leaves zeros, which only picks the first window.
    unsafe { libc::getrandom(seed.as_mut_ptr().cast(), seed.len(), 0) };
    let start = (u64::from_ne_bytes(seed) % allowed.len() as u64) as usize;
    // SAFETY: as above.
    let mut narrow: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for i in 0..want {
        // SAFETY: every allowed index is below CPU_SETSIZE.
        unsafe { libc::CPU_SET(allowed[(start + i) % allowed.len()], &mut narrow) };
    }
    // SAFETY: valid pointer and size.
    if unsafe { libc::sched_setaffinity(0, size, &narrow) } != 0 {
        eprintln!(
            "sandbox-runner: cannot narrow the CPU affinity: {}",
            io::Error::last_os_error()
        );
    }
}
