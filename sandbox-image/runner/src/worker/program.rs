//! Programs other than Python: the source written to a fresh private directory, compiled
//! when the language needs it (through the compile cache), and run to its end or its stop.

use super::gather::{earlier, Gather};
use super::{ExecState, Worker, KILL_GIVE_UP, READ_CHUNK};
use crate::capture::Capture;
use crate::compile_cache;
use crate::reaper::Exit;
use crate::spawn::Spec;
use crate::sys;
use crate::tools::ToolBridge;
use crate::{client, plan, stubs};
use sandbox_runner::{ExecRequest, JobId, Language, Limit, StdinChunk, Stream};
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

impl Worker {
    /// Writes the source to a fresh directory, compiles it if the language needs that, and
    /// runs it; `None` when it could not even be written (the reason is in the notes).
    pub(super) fn exec_program(
        &mut self,
        ctl: &mut ExecState,
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
    fn cannot_write(&self, ctl: &mut ExecState, e: &io::Error) {
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
        ctl: &mut ExecState,
        sink: &mut Capture,
        req: &ExecRequest,
        dir: &Path,
    ) -> io::Result<Exit> {
        let mut plan = plan::plan(req.lang, &req.code, dir)
            .ok_or_else(|| io::Error::other("no plan for this language"))?;
        let mut env = None;
        let mut wrapped = None;
        if let Some(tools) = &ctl.tools {
            let (run_env, prelude) = self.tool_env(tools, req, dir)?;
            env = Some(run_env);
            if let Some(prelude) = prelude {
                plan::preload(&mut plan, req.lang, dir, &prelude);
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
            let exit = self.run_child(ctl, &mut cc, compile, dir, &cfg.env, false);
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
        Ok(self.run_child(ctl, sink, &argv, &workdir, env, req.stdin))
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
                let esm_main = plan::esm_main(req.lang, dir);
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
    pub(super) fn make_dir(&mut self, prefix: &str, job: JobId) -> io::Result<PathBuf> {
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
    /// With `stdin`, the program reads what [`StdinChunk`]s bring, until one closes it.
    fn run_child(
        &mut self,
        ctl: &mut ExecState,
        sink: &mut Capture,
        argv: &[String],
        cwd: &Path,
        env: &[CString],
        stdin: bool,
    ) -> Exit {
        let mut fds: [Option<OwnedFd>; 2] = [None, None];
        let mut input = StdinPipe::default();
        let pid = match self.spawn_piped(argv, cwd, env, &mut fds, stdin.then_some(&mut input)) {
            Ok(pid) => pid,
            Err(e) => {
                let name = argv.first().map_or("", String::as_str);
                ctl.notes.push(format!("Error: cannot run {name}: {e}"));
                return Exit::Code(127);
            }
        };
        let mut killed_at: Option<Instant> = None;
        let mut gather = Gather::default();
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
            let now = Instant::now();
            let timeout = earlier(
                timeout,
                gather
                    .next_resume()
                    .map(|t| t.saturating_duration_since(now)),
            );
            let mut pfds = vec![sys::pollin(&self.wake_r)];
            for (i, fd) in fds.iter().enumerate() {
                if let Some(fd) = fd.as_ref().filter(|_| gather.polled(i, now)) {
                    pfds.push(sys::pollin(fd));
                }
            }
            let outputs = pfds.len();
            if let Some(tools) = &ctl.tools {
                tools.pollfds(&mut pfds);
            }
            if stdin {
                input.take(self.control.take_stdin());
                input.flush();
            }
            let stdin_at = pfds.len();
            if let Some(fd) = input.waiting() {
                pfds.push(sys::pollout(fd));
            }
            if let Err(e) = sys::poll(&mut pfds, timeout) {
                eprintln!("sandbox-runner: poll: {e}");
                std::thread::sleep(Duration::from_millis(1));
            }
            sys::drain(&self.wake_r);
            if pfds.get(stdin_at).is_some_and(sys::ready) {
                input.flush();
            }
            // Output first, whatever woke us: it was written before a tool call that came.
            let now = Instant::now();
            if pfds[1..].iter().any(sys::ready) || gather.due(now) {
                for (i, which) in [Stream::Stdout, Stream::Stderr].into_iter().enumerate() {
                    let mut slot = fds[i].take();
                    let n = self.pump(&mut slot, which, sink, ctl.job);
                    gather.read(i, n, READ_CHUNK, now);
                    fds[i] = slot;
                }
            }
            self.service_tools(ctl, &pfds[outputs..stdin_at]);
        };
        drop(input);
        let spare = self
            .kernel
            .as_ref()
            .filter(|k| k.exit.is_none())
            .map(|k| k.pid);
        self.sweep(spare);
        self.drain(&mut fds, sink, ctl.job);
        exit
    }

    /// Starts a program with stdout/stderr on fresh pipes, and stdin from /dev/null, or
    /// from a pipe whose write end goes to `input`.
    fn spawn_piped(
        &mut self,
        argv: &[String],
        cwd: &Path,
        env: &[CString],
        fds: &mut [Option<OwnedFd>; 2],
        input: Option<&mut StdinPipe>,
    ) -> io::Result<libc::pid_t> {
        let (out_r, out_w) = sys::pipe()?;
        let (err_r, err_w) = sys::pipe()?;
        sys::set_nonblocking(&out_r)?;
        sys::set_nonblocking(&err_r)?;
        // Held until the child has it: the child's end of the stdin pipe.
        let mut stdin_r = None;
        if let Some(input) = input {
            let (r, w) = sys::pipe()?;
            sys::set_nonblocking(&w)?;
            input.fd = Some(w);
            stdin_r = Some(r);
        }
        let stdin_fd = stdin_r
            .as_ref()
            .map_or(self.devnull.as_raw_fd(), |r| r.as_raw_fd());
        let spec = Spec::new(
            argv,
            &self.cfg.path,
            env,
            cwd,
            vec![
                (stdin_fd, 0),
                (out_w.as_raw_fd(), 1),
                (err_w.as_raw_fd(), 2),
            ],
        )?;
        let pid = self.tracker.spawn(&spec)?;
        *fds = [Some(out_r), Some(err_r)];
        Ok(pid)
    }
}

/// The write end of a program's stdin, and what waits to be written to it.
#[derive(Default)]
struct StdinPipe {
    /// The pipe; `None` once closed (asked for, or the program stopped reading).
    fd: Option<OwnedFd>,
    /// Bytes not yet written.
    pending: Vec<u8>,
    /// Close once `pending` is written.
    close: bool,
}

impl StdinPipe {
    /// Queues what the broker sent.
    fn take(&mut self, chunks: Vec<StdinChunk>) {
        for chunk in chunks {
            if self.fd.is_some() {
                self.pending.extend_from_slice(&chunk.data);
            }
            self.close |= chunk.close;
        }
    }

    /// Writes what the pipe takes without blocking; closes it when asked and done, or
    /// when the program stopped reading.
    fn flush(&mut self) {
        let Some(fd) = self.fd.as_ref() else {
            self.pending.clear();
            return;
        };
        while !self.pending.is_empty() {
            match sys::write(fd, &self.pending) {
                Ok(0) => return,
                Ok(n) => {
                    self.pending.drain(..n);
                }
                Err(_) => {
                    // EPIPE: nobody reads any more.
                    self.fd = None;
                    self.pending.clear();
                    return;
                }
            }
        }
        if self.close {
            self.fd = None;
        }
    }

    /// The pipe, when bytes wait for room in it.
    fn waiting(&self) -> Option<&OwnedFd> {
        self.fd.as_ref().filter(|_| !self.pending.is_empty())
    }
}

/// Whether a `KEY=VALUE` entry sets `key`.
fn env_key_is(entry: &CString, key: &str) -> bool {
    entry
        .as_bytes()
        .strip_prefix(key.as_bytes())
        .is_some_and(|rest| rest.starts_with(b"="))
}
