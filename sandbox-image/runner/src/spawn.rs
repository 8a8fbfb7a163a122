//! Starting a child with fork and execve, by hand.
//!
//! std's `Command` waits for a child itself when `exec` fails, which races with the reaper
//! thread (PID 1 must `waitpid(-1)` to collect orphans). Forking ourselves also lets us set
//! up exactly the descriptors a child gets (0-2, and 3-4 for the kernel) and its process
//! group, with nothing but async-signal-safe calls between fork and exec.

use crate::sys;
use std::ffi::{CString, OsStr};
use std::io::{self, Read as _};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// The nice value of every child (see `child`).
const CHILD_NICE: libc::c_int = 10;

/// The OOM score adjustment of every child (raising it needs no privilege).
const CHILD_OOM_SCORE_ADJ: &[u8] = b"500";

/// Most descriptors a child gets mapped; the kernel needs five.
const MAX_FDS: usize = 8;

/// Everything a child needs, prepared before fork so the child allocates nothing.
pub struct Spec<'a> {
    /// The file to execute, already resolved against PATH (no search after fork).
    pub program: CString,
    /// The argument vector, `argv[0]` included.
    pub argv: Vec<CString>,
    /// The environment, as `KEY=VALUE` strings.
    pub envp: &'a [CString],
    /// The working directory of the child.
    pub cwd: CString,
    /// Descriptors to install in the child: `(descriptor here, number in the child)`.
    pub fds: Vec<(RawFd, RawFd)>,
}

impl<'a> Spec<'a> {
    /// Builds a spec for `argv` (whose first element is resolved against `path`).
    pub fn new(
        argv: &[String],
        path: &OsStr,
        envp: &'a [CString],
        cwd: &Path,
        fds: Vec<(RawFd, RawFd)>,
    ) -> io::Result<Self> {
        let first = argv
            .first()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "empty command"))?;
        let program = resolve(first, path).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("{first}: command not found"),
            )
        })?;
        Ok(Spec {
            program: cstring(program.as_os_str().as_bytes())?,
            argv: argv
                .iter()
                .map(|a| cstring(a.as_bytes()))
                .collect::<io::Result<_>>()?,
            envp,
            cwd: cstring(cwd.as_os_str().as_bytes())?,
            fds,
        })
    }
}

/// A C string, or an error for interior NUL bytes (possible in user-supplied arguments).
pub fn cstring(b: &[u8]) -> io::Result<CString> {
    CString::new(b).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL byte in argument"))
}

/// Finds `prog` in `path` the way execvp would, or takes it as is when it has a slash.
pub fn resolve(prog: &str, path: &OsStr) -> Option<PathBuf> {
    if prog.contains('/') {
        return Some(PathBuf::from(prog));
    }
    path.as_bytes()
        .split(|&b| b == b':')
        .map(|dir| {
            if dir.is_empty() {
                Path::new(".").join(prog)
            } else {
                Path::new(OsStr::from_bytes(dir)).join(prog)
            }
        })
        .find(|p| {
            std::fs::metadata(p)
                .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
                .unwrap_or(false)
        })
}

/// A forked child whose exec has not been confirmed yet.
pub struct Forked {
    /// The child's pid.
    pub pid: libc::pid_t,
    /// Read end of the close-on-exec pipe the child reports a failed setup on; end of
    /// file means exec succeeded.
    err_r: OwnedFd,
}

/// Which setup step failed in the child, for the error message.
const STAGES: [&str; 4] = ["setpgid", "dup2", "chdir", "execve"];

/// Forks a child that sets itself up per `spec` and execs. The caller holds the reaper's
/// lock, so the child cannot be reaped before it is tracked.
pub fn fork(spec: &Spec) -> io::Result<Forked> {
    if spec.fds.len() > MAX_FDS {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "too many fds"));
    }
    let (err_r, err_w) = sys::pipe()?;
    let mut argv: Vec<*const libc::c_char> = spec.argv.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    let mut envp: Vec<*const libc::c_char> = spec.envp.iter().map(|a| a.as_ptr()).collect();
    envp.push(std::ptr::null());
    // SAFETY: the child only makes async-signal-safe calls on memory prepared above, then
    // execs or exits.
    let pid = unsafe { libc::fork() };
    if pid == -1 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        // SAFETY: we are the freshly forked child.
        unsafe { child(spec, &argv, &envp, err_w.as_raw_fd()) }
    }
    drop(err_w);
    Ok(Forked { pid, err_r })
}

/// Waits until the child has exec'd (or failed to); call without the reaper's lock.
pub fn wait_exec(forked: Forked) -> io::Result<()> {
    let mut file = std::fs::File::from(forked.err_r);
    let mut report = [0u8; 8];
    let mut got = 0;
    while got < report.len() {
        match file.read(&mut report[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    if got < report.len() {
        return Ok(());
    }
    let stage = u32::from_ne_bytes([report[0], report[1], report[2], report[3]]) as usize;
    let errno = i32::from_ne_bytes([report[4], report[5], report[6], report[7]]);
    let err = io::Error::from_raw_os_error(errno);
    let what = STAGES.get(stage).copied().unwrap_or("setup");
    Err(io::Error::new(err.kind(), format!("{what}: {err}")))
}

/// The child side of `fork`: only async-signal-safe calls from here on.
unsafe fn child(
    spec: &Spec,
    argv: &[*const libc::c_char],
    envp: &[*const libc::c_char],
    err_w: RawFd,
) -> ! {
    // Rust ignores SIGPIPE and ignored signals survive exec; programs expect the default.
    let mut set: libc::sigset_t = std::mem::zeroed();
    libc::sigemptyset(&mut set);
    libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
    libc::signal(libc::SIGPIPE, libc::SIG_DFL);

    // A lower priority than the runner's: under a fork bomb or a CPU hog the runner must
    // still get the CPU to answer, time out and sweep. It only matters when the two
    // compete; alone, a niced process runs at full speed.
    libc::setpriority(libc::PRIO_PROCESS, 0, CHILD_NICE);
    // Its own process group, so a timeout can kill the whole group at once.
    if libc::setpgid(0, 0) == -1 {
        fail(err_w, 0);
    }
    // Move every source, and the error pipe, above the target range first, so installing
    // one cannot clobber another (the parent's pipe ends may well be fds 3 or 4).
    let mut tmp = [-1 as RawFd; MAX_FDS];
    for (i, &(src, _)) in spec.fds.iter().enumerate() {
        tmp[i] = libc::fcntl(src, libc::F_DUPFD_CLOEXEC, 10);
        if tmp[i] == -1 {
            fail(err_w, 1);
        }
    }
    let err_high = libc::fcntl(err_w, libc::F_DUPFD_CLOEXEC, 10);
    if err_high == -1 {
        fail(err_w, 1);
    }
    for (i, &(_, dst)) in spec.fds.iter().enumerate() {
        // dup2 clears close-on-exec on the target, so exactly these survive exec.
        if libc::dup2(tmp[i], dst) == -1 {
            fail(err_high, 1);
        }
    }
    // Nothing else of the runner's stays open: once dumpable (below), a process of the
    // same uid may open /proc/<child>/fd/N until exec closes the close-on-exec ones, and
    // those are the kernel's pipes and the runner's wake pipe. The error pipe moves to
    // the first number after the installed ones; everything above it is closed.
    let err_w = spec
        .fds
        .iter()
        .map(|&(_, dst)| dst)
        .fold(2, RawFd::max)
        .saturating_add(1);
    if err_high != err_w && libc::dup3(err_high, err_w, libc::O_CLOEXEC) == -1 {
        fail(err_high, 1);
    }
    close_from(err_w.saturating_add(1));
    if libc::chdir(spec.cwd.as_ptr()) == -1 {
        fail(err_w, 2);
    }
    // A better OOM victim than the runner: if PID 1 is OOM-killed, the container dies.
    // /proc/self is writable only once we are dumpable again, which exec would make us
    // anyway; only the child's own descriptors and the error pipe are left to expose.
    libc::prctl(libc::PR_SET_DUMPABLE, 1, 0, 0, 0);
    let adj = libc::open(
        c"/proc/self/oom_score_adj".as_ptr(),
        libc::O_WRONLY | libc::O_CLOEXEC,
    );
    if adj >= 0 {
        libc::write(
            adj,
            CHILD_OOM_SCORE_ADJ.as_ptr().cast(),
            CHILD_OOM_SCORE_ADJ.len(),
        );
        libc::close(adj);
    }
    libc::execve(spec.program.as_ptr(), argv.as_ptr(), envp.as_ptr());
    fail(err_w, 3)
}

/// Closes every descriptor from `first` up, in the child (async-signal-safe).
unsafe fn close_from(first: RawFd) {
    let first = libc::c_uint::try_from(first).unwrap_or(libc::c_uint::MAX);
    if libc::syscall(libc::SYS_close_range, first, libc::c_uint::MAX, 0) == 0 {
        return;
    }
    // Kernels before 5.9 (and runtimes without close_range): one by one, up to the limit
    // on open files.
    let mut limit: libc::rlimit = std::mem::zeroed();
    let max = if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 {
        limit.rlim_cur.min(1 << 20) as libc::c_uint
    } else {
        1024
    };
    for fd in first..max {
        libc::close(fd as RawFd);
    }
}

/// Reports a failed setup step to the parent and exits the child.
unsafe fn fail(err_w: RawFd, stage: u32) -> ! {
    let errno = *libc::__errno_location();
    let mut report = [0u8; 8];
    report[..4].copy_from_slice(&stage.to_ne_bytes());
    report[4..].copy_from_slice(&errno.to_ne_bytes());
    libc::write(err_w, report.as_ptr().cast(), report.len());
    libc::_exit(127)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A child gets the descriptors it is given and nothing else of the runner's, not
    /// even what the runner opened without close-on-exec.
    #[test]
    fn a_child_holds_only_its_own_descriptors() {
        let (out_r, out_w) = sys::pipe().expect("pipe");
        // Inheritable: before, it would have reached the child.
        let stray = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY) };
        assert!(stray > 2);
        let envp = [];
        let argv = ["/bin/sh".to_string(), "-c".into(), "ls /proc/$$/fd".into()];
        let devnull =
            unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
        let spec = Spec::new(
            &argv,
            OsStr::new("/bin"),
            &envp,
            Path::new("/"),
            vec![(devnull, 0), (out_w.as_raw_fd(), 1), (out_w.as_raw_fd(), 2)],
        )
        .expect("spec");
        let forked = fork(&spec).expect("fork");
        let pid = forked.pid;
        wait_exec(forked).expect("exec");
        drop(out_w);
        let mut listing = String::new();
        std::fs::File::from(out_r)
            .read_to_string(&mut listing)
            .expect("read");
        let mut status = 0;
        unsafe { libc::waitpid(pid, &mut status, 0) };
        unsafe {
            libc::close(stray);
            libc::close(devnull);
        }
        let fds: Vec<&str> = listing.split_whitespace().collect();
        assert_eq!(fds, ["0", "1", "2"], "{listing}");
    }

    #[test]
    fn resolves_against_path() {
        let p = resolve("sh", OsStr::new("/nonexistent:/bin:/usr/bin")).unwrap();
        assert!(p.ends_with("sh"), "{p:?}");
        assert_eq!(resolve("no-such-program-xyz", OsStr::new("/bin")), None);
        assert_eq!(resolve("./x", OsStr::new("")), Some(PathBuf::from("./x")));
    }
}
