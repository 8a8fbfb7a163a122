//! The runner: PID 1 of every sandbox container.
//!
//! Threads, all started once (a fork bomb may leave no room for new ones later), but for
//! those of egress connections:
//! * the main thread reads frames from stdin, answers `hello` itself and hands execs and
//!   cancels to the worker;
//! * the worker runs one exec at a time, or waits with the idle Python kernel, in a
//!   `ppoll` loop over the pipes of the exec and a wake-up pipe (see `worker`);
//! * the reaper waits for every child and orphan (see `reaper`);
//! * `egress` accepts connections on 127.0.0.1:3128, the in-container HTTP proxy, each
//!   relayed to the broker's proxy socket, or tunnelled over the channel, by two threads
//!   of its own (or answered 403 when egress is off); never fatal (see `egress`,
//!   `egress_channel`).
//!
//! Children run at nice 10 with an OOM score adjustment of 500, so that under a fork bomb
//! or memory pressure the runner keeps the CPU it needs and is not the OOM killer's pick.
//!
//! End of file on stdin: the exec in hand finishes and is answered, everything left is
//! killed, and the runner exits 0.
//!
//! Unattended: started with `CODEBROKER_UNATTENDED_EXIT_MS`, a watchdog thread ends the
//! runner (and so the container) when no frame has come for that long. A broker that
//! stopped and kept its containers for its next start sends heartbeats no more; if it
//! never comes back, the container does not run forever.
//!
//! Signals: none are handled except, as PID 1, SIGTERM and SIGINT sent from outside the
//! container (`docker stop`), which make the runner exit 0 at once (the kernel then kills
//! the rest of the container). The same signals sent from inside the container (user
//! code) are ignored, as are all signals without a handler: the kernel does not deliver
//! them to a namespace's init. SIGCHLD is blocked in every thread and waited for by the
//! reaper.
//!
//! Run as `sandbox-runner tool-call NAME [JSON]`, the binary is instead a tool client for
//! the code of an exec (see `client`), and none of the above happens.

mod capture;
mod client;
mod compile_cache;
mod egress;
mod egress_channel;
mod frame;
mod installs_archive;
mod plan;
mod quota;
mod reaper;
mod scratch;
mod spawn;
mod stubs;
mod sweep;
mod sys;
mod tools;
mod worker;
mod workspace_files;

use frame::{Channel, Line, Parsed};
use reaper::Tracker;
use sandbox_runner::{CoordinatorMessage, HelloResponse, WorkerMessage, UNSOLICITED};
use std::ffi::{CString, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use worker::{Control, Task, Worker};

/// Settings, from the environment so the runner can be tested on a host.
pub struct Config {
    /// The session workspace: working directory and `HOME` of every program.
    pub workdir: PathBuf,
    /// The Python kernel script started for `py`.
    pub kernel_script: PathBuf,
    /// The interpreter that runs the kernel script.
    pub python: String,
    /// Where per-exec directories are made; also `TMPDIR` of programs.
    pub tmp: PathBuf,
    /// The environment of every program, prepared once as `KEY=VALUE` strings.
    pub env: Vec<CString>,
    /// The programs' `PATH`, to resolve command names before forking.
    pub path: OsString,
    /// Whether the runner is PID 1 (in a container) rather than a process on a host: it
    /// decides what the sweep may kill and who reaps orphans.
    pub pid1: bool,
    /// This binary, which bash's tool functions run as a client (`tool-call`).
    pub runner_exe: String,
    /// Report the timing of each tool call on stderr (`CODEBROKER_TOOL_TRACE` set).
    pub tool_trace: bool,
    /// The workspace quota, when the broker set one.
    pub quota: Option<quota::Quota>,
}

/// PATH when the image sets none.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

impl Config {
    fn from_env(pid1: bool) -> Self {
        let var = |name: &str, default: &str| {
            std::env::var_os(name)
                .filter(|v| !v.is_empty())
                .unwrap_or_else(|| default.into())
        };
        let workdir = PathBuf::from(var("CODEBROKER_WORKDIR", "/mnt/data"));
        let tmp = PathBuf::from(var("CODEBROKER_TMP", "/tmp"));
        let path = var("PATH", DEFAULT_PATH);
        // Programs inherit the image's ENV, with the few variables the contract fixes.
        let fixed: [(&str, OsString); 4] = [
            ("PATH", path.clone()),
            ("HOME", workdir.clone().into_os_string()),
            ("LANG", "C.UTF-8".into()),
            ("TMPDIR", tmp.clone().into_os_string()),
        ];
        let mut env: Vec<CString> = std::env::vars_os()
            .filter(|(k, _)| !fixed.iter().any(|(f, _)| k.as_bytes() == f.as_bytes()))
            .chain(fixed.iter().map(|(k, v)| (OsString::from(k), v.clone())))
            .filter_map(|(k, v)| {
                let mut kv = k.into_vec();
                kv.push(b'=');
                kv.extend_from_slice(v.as_bytes());
                CString::new(kv).ok()
            })
            .collect();
        env.sort();
        Config {
            quota: quota::Quota::from_env(&workdir),
            workdir,
            kernel_script: PathBuf::from(var("CODEBROKER_KERNEL", "/opt/codebroker/kernel.py")),
            python: var("CODEBROKER_PYTHON", "python3")
                .to_string_lossy()
                .into_owned(),
            tmp,
            env,
            path,
            pid1,
            runner_exe: std::env::current_exe()
                .ok()
                .and_then(|p| p.into_os_string().into_string().ok())
                .unwrap_or_else(|| "sandbox-runner".into()),
            tool_trace: std::env::var_os("CODEBROKER_TOOL_TRACE").is_some_and(|v| !v.is_empty()),
        }
    }
}

/// Copies the matplotlib font cache made at image build (`CODEBROKER_MPL_CACHE`) into
/// `MPLCONFIGDIR`, which is on the container's fresh `/tmp`: matplotlib in any program,
/// not only in the kernel (which copies it too), then finds it instead of spending about
/// 0.27 s of CPU on building it at its first import. Best effort: without it, matplotlib
/// builds the cache as it always did.
fn seed_font_cache() {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    let Some(dest) = var("MPLCONFIGDIR").map(PathBuf::from) else {
        return;
    };
    let source = var("CODEBROKER_MPL_CACHE").unwrap_or_else(|| "/opt/codebroker/mplconfig".into());
    let Ok(entries) = std::fs::read_dir(&source) else {
        return;
    };
    if std::fs::create_dir_all(&dest).is_err() {
        return;
    }
    for entry in entries.flatten() {
        let to = dest.join(entry.file_name());
        if entry.file_type().is_ok_and(|t| t.is_file()) && !to.exists() {
            let _ = std::fs::copy(entry.path(), to);
        }
    }
}

/// Links `TMP/node_modules` to the workspace's `node_modules`, where `npm install` puts the
/// session's packages: programs run from `TMP/exec-*/`, and node looks for packages in the
/// `node_modules` of each directory up from the program's (then in the image's
/// `/node_modules`), for `require` and `import` alike. A dangling link (nothing installed
/// yet) is passed over. Best effort, as the font cache.
fn link_workspace_packages(tmp: &std::path::Path, workdir: &std::path::Path) {
    let _ = std::os::unix::fs::symlink(workdir.join("node_modules"), tmp.join("node_modules"));
}

fn main() {
    // The client mode first, before anything that only PID 1 (or the agent) may do.
    let mut args = std::env::args_os();
    if args.nth(1).is_some_and(|a| a == "tool-call") {
        std::process::exit(client::main(args));
    }
    // SAFETY: getpid and prctl with these arguments have no memory-safety preconditions.
    let pid1 = unsafe {
        // Non-dumpable: user code (same uid) can neither ptrace the runner nor open its
        // /proc/<pid>/fd, so it cannot reach the channel to forge frames.
        libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
        let pid1 = libc::getpid() == 1;
        if !pid1 {
            // On a host, orphans of our descendants must still come back to us, both to be
            // reaped and to be found by the sweep.
            libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
        }
        pid1
    };
    if pid1 {
        // Before any thread starts, so every thread and child inherits it.
        sys::fit_affinity_to_cpu_quota();
    }
    // Before any thread starts, so all inherit it: the reaper waits for SIGCHLD.
    reaper::block_sigchld();
    if pid1 {
        install_stop_handlers();
    }
    close_inherited_fds_on_exec();

    let cfg = Arc::new(Config::from_env(pid1));
    if pid1 {
        seed_font_cache();
        link_workspace_packages(&cfg.tmp, &cfg.workdir);
    }
    let chan = Arc::new(Channel::stdout());
    let (wake_r, wake_w) = match sys::pipe() {
        Ok(p) => p,
        Err(e) => fatal(&format!("pipe: {e}")),
    };
    for fd in [&wake_r, &wake_w] {
        if let Err(e) = sys::set_nonblocking(fd) {
            fatal(&format!("pipe: {e}"));
        }
    }
    let waker = sys::Waker::new(wake_w);
    let tracker = Arc::new(Tracker::new(waker.clone()));
    let control = Arc::new(Control::new(waker));

    let reaper = tracker.clone();
    if let Err(e) = std::thread::Builder::new()
        .name("reaper".into())
        .spawn(move || essential(|| reaper.reap_forever()))
    {
        fatal(&format!("cannot start the reaper: {e}"));
    }
    let worker = match Worker::new(
        cfg.clone(),
        chan.clone(),
        tracker.clone(),
        control.clone(),
        wake_r,
    ) {
        Ok(w) => w,
        Err(e) => fatal(&format!("cannot set up the worker: {e}")),
    };
    if let Err(e) = std::thread::Builder::new()
        .name("worker".into())
        .spawn(move || essential(|| worker.run()))
    {
        fatal(&format!("cannot start the worker: {e}"));
    }

    if let Some(quota) = cfg.quota.clone() {
        let control = control.clone();
        if let Err(e) = std::thread::Builder::new()
            .name("quota".into())
            .spawn(move || essential(|| worker::watch_quota(quota, control)))
        {
            fatal(&format!("cannot start the quota watcher: {e}"));
        }
    }

    // Best effort: the runner works without it (see `egress`).
    let tunnel = egress::start(pid1, &chan);

    let heard = Arc::new(Heard::new());
    if let Some(limit) = unattended_limit() {
        let (heard, tracker, cfg) = (heard.clone(), tracker.clone(), cfg.clone());
        if let Err(e) = std::thread::Builder::new()
            .name("watchdog".into())
            .spawn(move || essential(|| watch_broker(limit, &heard, &tracker, &cfg)))
        {
            fatal(&format!("cannot start the watchdog: {e}"));
        }
    }

    let stdin = std::io::stdin();
    let mut input = stdin.lock();
    loop {
        let line = frame::read_line(&mut input, sandbox_runner::MAX_FRAME_BYTES);
        // Anything a broker writes, even a bad frame, says a broker is there.
        heard.now();
        match line {
            Ok(Line::Frame(line)) => {
                if !line.trim_ascii().is_empty() {
                    handle(&line, &chan, &control, &cfg, tunnel.as_deref());
                }
            }
            Ok(Line::TooLong(prefix)) => chan.error(
                frame::job_id_prefix(&prefix).unwrap_or(UNSOLICITED),
                format!(
                    "frame longer than {} bytes",
                    sandbox_runner::MAX_FRAME_BYTES
                ),
            ),
            Ok(Line::Eof) => break,
            Err(e) => {
                eprintln!("sandbox-runner: reading stdin: {e}");
                break;
            }
        }
    }
    // The broker closed the channel: finish the exec in hand (its answer may still be
    // read; its time limit bounds the wait), then leave nothing behind (this matters on a
    // host; in a container the kernel kills everything once PID 1 exits anyway).
    control.wait_idle();
    tracker.paused(None, |_| {
        sweep::kill_leftovers(None, cfg.pid1, std::time::Duration::from_secs(5))
    });
    std::process::exit(0);
}

/// Acts on one frame from the broker.
fn handle(
    line: &[u8],
    chan: &Channel,
    control: &Control,
    cfg: &Config,
    tunnel: Option<&egress_channel::Tunnel>,
) {
    let workdir = cfg.workdir.as_path();
    let (job, msg) = match frame::parse(line) {
        Parsed::Msg(job, msg) => (job, msg),
        Parsed::Bad(job, why) => return chan.error(job, why),
    };
    match msg {
        CoordinatorMessage::Hello(hello) => {
            if hello.start_kernel {
                // Said at once, before the worker starts the kernel, so that no answer
                // (this one included) says the preload is over before it began; the
                // worker corrects it if there is nothing to preload after all.
                if !hello.preload.is_empty() {
                    control.preloading.store(true, Ordering::Relaxed);
                }
                control.push(Task::StartKernel(hello.preload));
            }
            let resp = HelloResponse {
                runner_version: env!("CARGO_PKG_VERSION").into(),
                kernel_running: control.kernel_running.load(Ordering::Relaxed),
                preloading: control.preloading.load(Ordering::Relaxed),
                running_job: control.current_job(),
            };
            chan.send(job, &WorkerMessage::Hello(resp));
        }
        CoordinatorMessage::Exec(req) => {
            if let Err(running) = control.start_exec(job, req) {
                chan.error(job, format!("busy: job {running} is still running"));
            }
        }
        CoordinatorMessage::Cancel => control.cancel(job),
        // Results for a job that is not running any more (it timed out, say) are dropped.
        CoordinatorMessage::ToolResult(result) => control.tool_result(job, result),
        // Stdin for a program that ended is dropped too.
        CoordinatorMessage::Stdin(chunk) => control.stdin(job, chunk),
        // Counted when read; nothing to answer.
        CoordinatorMessage::Heartbeat => {}
        // File moves are short and come between execs (the broker holds the session's
        // turn), so they are answered here, in order.
        CoordinatorMessage::ListFiles(req) => answer(
            chan,
            job,
            workspace_files::list(workdir, &req).map(WorkerMessage::FileList),
        ),
        CoordinatorMessage::ReadFile(req) => answer(
            chan,
            job,
            workspace_files::read(workdir, &req).map(WorkerMessage::FileChunk),
        ),
        CoordinatorMessage::WriteFile(req) => answer(
            chan,
            job,
            workspace_files::write(workdir, &req).map(WorkerMessage::FileWritten),
        ),
        CoordinatorMessage::RemoveFile(req) => answer(
            chan,
            job,
            workspace_files::remove(workdir, &req).map(WorkerMessage::FileRemoved),
        ),
        // The kernel is the worker's: saving and loading wait for it, in turn with execs.
        CoordinatorMessage::SaveState(req) => control.push(Task::SaveState(job, req)),
        CoordinatorMessage::RestoreState(req) => control.push(Task::RestoreState(job, req)),
        // Packing and unpacking take seconds for large installs: on the worker, in turn
        // with execs, so this loop goes on reading frames.
        CoordinatorMessage::PackInstalls(req) => control.push(Task::PackInstalls(job, req)),
        CoordinatorMessage::UnpackInstalls(req) => control.push(Task::UnpackInstalls(job, req)),
        // The state file's bytes move like a workspace file's, from the runner's own
        // directory under the temp dir.
        CoordinatorMessage::ReadState(req) => answer(
            chan,
            job,
            worker::state_dir(&cfg.tmp, false).and_then(|dir| {
                let req = sandbox_runner::ReadFileRequest {
                    name: req.file.name().into(),
                    offset: req.offset,
                    len: req.len,
                };
                workspace_files::read(&dir, &req).map(WorkerMessage::FileChunk)
            }),
        ),
        // Egress over the channel: only when the broker set it up (else the runner has no
        // tunnel, and says so once for the listen; stray frames are dropped).
        CoordinatorMessage::EgressListen(_) => match tunnel {
            Some(tunnel) => tunnel.listen(job),
            None => chan.error(job, "egress over the channel is off in this sandbox"),
        },
        CoordinatorMessage::Egress(frame) => {
            if let Some(tunnel) = tunnel {
                tunnel.on_frame(job, frame);
            }
        }
        CoordinatorMessage::WriteState(req) => answer(
            chan,
            job,
            worker::state_dir(&cfg.tmp, true).and_then(|dir| {
                let req = sandbox_runner::WriteFileRequest {
                    name: req.file.name().into(),
                    offset: req.offset,
                    data: req.data,
                    create: req.create,
                    read_only: false,
                };
                workspace_files::write(&dir, &req).map(WorkerMessage::FileWritten)
            }),
        ),
    }
}

/// Sends the answer of a file request, or the error that stopped it.
fn answer(chan: &Channel, job: sandbox_runner::JobId, result: std::io::Result<WorkerMessage>) {
    match result {
        Ok(msg) => chan.send(job, &msg),
        Err(err) => chan.error(job, err.to_string()),
    }
}

/// When a frame last came, as milliseconds since the runner started.
struct Heard {
    /// The runner's start, which the milliseconds count from.
    start: std::time::Instant,
    /// Milliseconds since `start` at the last frame.
    last_ms: std::sync::atomic::AtomicU64,
}

impl Heard {
    fn new() -> Self {
        Heard {
            start: std::time::Instant::now(),
            last_ms: std::sync::atomic::AtomicU64::new(0),
        }
    }

    fn now(&self) {
        self.last_ms
            .store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// How long since the last frame (or the start).
    fn silence(&self) -> std::time::Duration {
        let last = std::time::Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        self.start.elapsed().saturating_sub(last)
    }
}

/// The unattended limit the broker set, if any.
fn unattended_limit() -> Option<std::time::Duration> {
    std::env::var(sandbox_runner::UNATTENDED_EXIT_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|&ms| ms > 0)
        .map(std::time::Duration::from_millis)
}

/// Ends the runner once no broker has written for `limit`: whatever runs is killed (on a
/// host; in a container the kernel does it when PID 1 exits) and the runner exits 0.
fn watch_broker(limit: std::time::Duration, heard: &Heard, tracker: &Tracker, cfg: &Config) {
    let tick = (limit / 4).clamp(
        std::time::Duration::from_millis(50),
        std::time::Duration::from_secs(1),
    );
    loop {
        std::thread::sleep(tick);
        let silence = heard.silence();
        if silence >= limit {
            eprintln!(
                "sandbox-runner: no broker for {} ms, exiting",
                silence.as_millis()
            );
            tracker.paused(None, |_| {
                sweep::kill_leftovers(None, cfg.pid1, std::time::Duration::from_secs(5))
            });
            std::process::exit(0);
        }
    }
}

/// Exits when the container is stopped from outside; see the crate doc.
fn install_stop_handlers() {
    extern "C" fn on_stop(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
        // si_pid is 0 when the sender is outside our pid namespace (docker, the host).
        // SAFETY: the kernel passes a valid siginfo with SA_SIGINFO; _exit is
        // async-signal-safe.
        unsafe {
            if !info.is_null() && (*info).si_pid() == 0 {
                libc::_exit(0);
            }
        }
    }
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: a zeroed sigaction with a valid handler and flags is well-formed.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_stop as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

/// Marks every descriptor we were started with, other than stdio, close-on-exec, so that
/// none leaks into user code (a host test harness may hand us some).
fn close_inherited_fds_on_exec() {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    let fds: Vec<i32> = dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .filter(|&fd| fd > 2)
        .collect();
    for fd in fds {
        // SAFETY: fcntl on a possibly stale number is harmless (EBADF).
        unsafe {
            libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        }
    }
}

/// Runs a thread the runner cannot work without: if it panics (a bug), the whole runner
/// exits, so the broker sees a dead sandbox rather than one that answers nothing.
fn essential(body: impl FnOnce()) {
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body));
    if outcome.is_err() {
        fatal("an essential thread panicked");
    }
    fatal("an essential thread ended");
}

/// Gives up when the runner cannot work at all.
fn fatal(msg: &str) -> ! {
    eprintln!("sandbox-runner: {msg}");
    std::process::exit(1)
}
