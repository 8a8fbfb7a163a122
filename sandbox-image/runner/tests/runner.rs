//! End-to-end tests of the runner binary on the host: a runner per test, speaking frames
//! over its stdin/stdout, with a temporary workspace.
//!
//! On a host the runner is not PID 1, so its sweep kills only its own descendants; these
//! tests never signal anything themselves except their own runner.

use sandbox_runner::{
    CoordinatorMessage, DisplayData, ExecRequest, ExecResponse, HelloRequest, JobId, Language,
    Limit, Multiplexed, OutputChunk, RuntimeStatus, StdinChunk, Stream, ToolCall, ToolResult,
    ToolSpec, WorkerMessage,
};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// How long any single answer may take on a loaded 2-core machine.
const PATIENCE: Duration = Duration::from_secs(30);

struct Runner {
    child: Child,
    stdin: Option<ChildStdin>,
    frames: Receiver<String>,
    dir: PathBuf,
}

fn kernel_script() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../kernels/kernel.py");
    p.exists().then_some(p)
}

impl Runner {
    fn start() -> Self {
        Self::start_with(&[])
    }

    /// A runner with extra environment variables.
    fn start_with(envs: &[(&str, &str)]) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "runner-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("work")).unwrap();
        std::fs::create_dir_all(dir.join("tmp")).unwrap();
        let kernel = kernel_script().unwrap_or_else(|| dir.join("no-kernel.py"));
        let mut child = Command::new(env!("CARGO_BIN_EXE_sandbox-runner"))
            .env("CODEBROKER_WORKDIR", dir.join("work"))
            .env("CODEBROKER_TMP", dir.join("tmp"))
            .env("CODEBROKER_KERNEL", kernel)
            .env("CODEBROKER_MPL_CACHE", dir.join("tmp/mpl"))
            // For programs that run the tool client themselves (not on PATH on a host).
            .env("RUNNER_EXE", env!("CARGO_BIN_EXE_sandbox-runner"))
            .envs(envs.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the runner");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Runner {
            stdin: child.stdin.take(),
            child,
            frames: rx,
            dir,
        }
    }

    fn workdir(&self) -> PathBuf {
        self.dir.join("work")
    }

    fn send_line(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().unwrap();
        stdin.write_all(line.as_bytes()).unwrap();
        stdin.write_all(b"\n").unwrap();
        stdin.flush().unwrap();
    }

    fn send(&mut self, job: JobId, msg: CoordinatorMessage) {
        let line = serde_json::to_string(&Multiplexed(job, msg)).unwrap();
        self.send_line(&line);
    }

    fn recv(&self) -> (JobId, WorkerMessage) {
        let line = match self.frames.recv_timeout(PATIENCE) {
            Ok(l) => l,
            Err(RecvTimeoutError::Timeout) => panic!("no frame within {PATIENCE:?}"),
            Err(RecvTimeoutError::Disconnected) => panic!("the runner closed its stdout"),
        };
        let Multiplexed(job, msg) = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("unparseable frame {line:?}: {e}"));
        (job, msg)
    }

    /// Reads frames until the end of `job`, collecting its streamed chunks.
    fn finish(&self, job: JobId) -> (Vec<OutputChunk>, ExecResponse) {
        let mut chunks = Vec::new();
        loop {
            let (j, msg) = self.recv();
            assert_eq!(j, job, "frame for another job: {msg:?}");
            match msg {
                WorkerMessage::Output(c) => chunks.push(c),
                WorkerMessage::ExecDone(r) => return (chunks, r),
                other => panic!("unexpected {other:?}"),
            }
        }
    }

    fn exec(&mut self, job: JobId, req: ExecRequest) -> ExecResponse {
        self.send(job, CoordinatorMessage::Exec(req));
        let (chunks, resp) = self.finish(job);
        assert!(chunks.is_empty());
        resp
    }

    /// Closes the channel and returns the runner's exit code.
    fn close(&mut self) -> Option<i32> {
        self.stdin.take();
        let until = Instant::now() + PATIENCE;
        while Instant::now() < until {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("the runner did not exit after EOF");
    }
}

impl Drop for Runner {
    fn drop(&mut self) {
        if self.stdin.is_some() && !std::thread::panicking() {
            let _ = self.close();
        } else {
            self.stdin.take();
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn req(lang: Language, code: &str) -> ExecRequest {
    ExecRequest {
        lang,
        code: code.into(),
        args: vec![],
        timeout_ms: 20_000,
        max_output_bytes: 64 * 1024,
        stream: false,
        tools: vec![],
        max_display_events: sandbox_runner::DEFAULT_MAX_DISPLAY_EVENTS,
        max_display_bytes: sandbox_runner::DEFAULT_MAX_DISPLAY_BYTES,
        rich: false,
        stdin: false,
    }
}

/// Whether a pid is a live process (a zombie or a vanished pid is not).
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat[stat.rfind(')').unwrap() + 1..].trim_start();
            !state.starts_with('Z') && !state.starts_with('X')
        }
        Err(_) => false,
    }
}

fn pids(text: &str) -> Vec<i32> {
    text.lines().filter_map(|l| l.trim().parse().ok()).collect()
}

#[test]
fn hello_answers_with_version() {
    let mut r = Runner::start();
    r.send(1, CoordinatorMessage::Hello(HelloRequest::default()));
    match r.recv() {
        (1, WorkerMessage::Hello(h)) => {
            assert_eq!(h.runner_version, env!("CARGO_PKG_VERSION"));
            assert!(!h.kernel_running);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(r.close(), Some(0));
}

impl Runner {
    /// Waits up to `within` for the runner to exit on its own; its exit code.
    fn exits_within(&mut self, within: Duration) -> Option<Option<i32>> {
        let until = Instant::now() + within;
        while Instant::now() < until {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status.code());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

#[test]
fn an_unattended_runner_exits_when_no_broker_writes_and_kills_what_runs() {
    let mut r = Runner::start_with(&[(sandbox_runner::UNATTENDED_EXIT_ENV, "1500")]);
    let t0 = Instant::now();
    r.send(1, CoordinatorMessage::Hello(HelloRequest::default()));
    assert!(matches!(r.recv(), (1, WorkerMessage::Hello(_))));
    // An exec still running when the broker goes quiet does not keep the runner.
    let mut long = req(Language::Bash, "echo $$; sleep 120");
    long.stream = true;
    r.send(2, CoordinatorMessage::Exec(long));
    let pid = match r.recv() {
        (2, WorkerMessage::Output(c)) => pids(&c.data)[0],
        other => panic!("{other:?}"),
    };
    assert!(alive(pid));
    let code = r
        .exits_within(Duration::from_secs(20))
        .expect("the runner did not exit within 20 s without a broker");
    assert_eq!(code, Some(0));
    assert!(
        t0.elapsed() >= Duration::from_millis(1400),
        "exited after {:?}, before its limit",
        t0.elapsed()
    );
    let until = Instant::now() + Duration::from_secs(10);
    while alive(pid) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!alive(pid), "the exec's program outlived the runner");
}

#[test]
fn heartbeats_keep_an_unattended_runner() {
    let mut r = Runner::start_with(&[(sandbox_runner::UNATTENDED_EXIT_ENV, "1500")]);
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(5) {
        r.send(0, CoordinatorMessage::Heartbeat);
        std::thread::sleep(Duration::from_millis(200));
        assert!(r.child.try_wait().unwrap().is_none(), "exited while beaten");
    }
    // Nothing answers a heartbeat; the next request is answered as usual.
    r.send(3, CoordinatorMessage::Hello(HelloRequest::default()));
    assert!(matches!(r.recv(), (3, WorkerMessage::Hello(_))));
    assert!(r.exits_within(Duration::from_secs(20)).is_some());
}

#[test]
fn without_the_limit_a_silent_runner_stays() {
    let mut r = Runner::start();
    assert_eq!(r.exits_within(Duration::from_secs(3)), None);
    r.send(1, CoordinatorMessage::Hello(HelloRequest::default()));
    assert!(matches!(r.recv(), (1, WorkerMessage::Hello(_))));
}

#[test]
fn bash_runs_in_the_workspace() {
    let mut r = Runner::start();
    let mut rq = req(
        Language::Bash,
        "echo out; echo err >&2; pwd; echo \"$HOME\" \"$LANG\"; echo \"$@\"; read x || echo no-stdin; exit 3",
    );
    rq.args = vec!["a".into(), "b c".into()];
    let resp = r.exec(1, rq);
    let work = r.workdir();
    let work = work.display();
    assert_eq!(
        resp.stdout,
        format!("out\n{work}\n{work} C.UTF-8\na b c\nno-stdin\n")
    );
    assert_eq!(resp.stderr, "err\n");
    assert_eq!(resp.exit_code, Some(3));
    assert_eq!(resp.signal, None);
    assert!(resp.limits.is_empty());
    assert_eq!(resp.runtime_status, RuntimeStatus::New);
    assert!(!resp.cancelled);
    // The per-exec directory is gone.
    let left: Vec<_> = std::fs::read_dir(r.dir.join("tmp")).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn programs_are_the_oom_killers_first_choice() {
    // The runner is not dumpable, so only the write after the child made itself dumpable
    // again can set this (as root either would; in the image only that one can).
    let mut r = Runner::start();
    let resp = r.exec(1, req(Language::Bash, "cat /proc/self/oom_score_adj"));
    assert_eq!(resp.stdout, "500\n", "{resp:?}");
}

#[test]
fn killed_by_a_signal() {
    let mut r = Runner::start();
    let resp = r.exec(1, req(Language::Bash, "kill -SEGV $$"));
    assert_eq!(resp.exit_code, None);
    assert_eq!(resp.signal, Some(libc_sigsegv()));
}

fn libc_sigsegv() -> i32 {
    11
}

#[test]
fn c_compile_error_is_reported_and_nothing_runs() {
    let mut r = Runner::start();
    let resp = r.exec(1, req(Language::C, "int main( {"));
    assert_ne!(resp.exit_code, Some(0));
    assert!(resp.exit_code.is_some());
    assert!(resp.stderr.contains("error"), "{}", resp.stderr);
    assert_eq!(resp.stdout, "");

    let resp = r.exec(
        2,
        req(
            Language::C,
            "#include <stdio.h>\n#include <math.h>\nint main(int c, char **v) { printf(\"%d %.0f\\n\", c, sqrt(16.0)); return 0; }",
        ),
    );
    assert_eq!(resp.exit_code, Some(0), "{}", resp.stderr);
    assert_eq!(resp.stdout, "1 4\n");
}

#[test]
fn a_rerun_program_skips_the_compiler() {
    // A gcc on PATH that notes each call, so a cache hit is seen as a compiler not run.
    let bin = std::env::temp_dir().join(format!("runner-test-cc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&bin);
    std::fs::create_dir_all(&bin).unwrap();
    let calls = bin.join("calls");
    let gcc = bin.join("gcc");
    std::fs::write(
        &gcc,
        format!(
            "#!/bin/sh\necho \"$@\" >> {}\nexec /usr/bin/gcc \"$@\"\n",
            calls.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&gcc, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut r = Runner::start_with(&[("PATH", &path)]);
    let gcc_calls = || {
        std::fs::read_to_string(&calls)
            .unwrap_or_default()
            .lines()
            .count()
    };
    let code = "#include <stdio.h>\nint main(int c, char **v) { printf(\"%d %s\\n\", c, c > 1 ? v[1] : \"-\"); return 0; }";

    let first = r.exec(1, req(Language::C, code));
    assert_eq!(first.stdout, "1 -\n", "{}", first.stderr);
    assert_eq!(first.compile_cached, Some(false));
    assert_eq!(gcc_calls(), 1);

    // The same program again, with arguments (they do not change the binary): a hit.
    let mut again = req(Language::C, code);
    again.args = vec!["x".into()];
    let second = r.exec(2, again);
    assert_eq!(second.stdout, "2 x\n", "{}", second.stderr);
    assert_eq!(second.compile_cached, Some(true));
    assert_eq!(gcc_calls(), 1, "the compiler ran for a cached program");
    let third = r.exec(3, req(Language::C, code));
    assert_eq!((third.stdout.as_str(), third.exit_code), ("1 -\n", Some(0)));
    assert_eq!(third.compile_cached, Some(true));

    // Another program misses; a failed compile is never cached.
    let other = r.exec(4, req(Language::C, &code.replace("%d %s", "%d:%s")));
    assert_eq!(
        (other.stdout.as_str(), other.compile_cached),
        ("1:-\n", Some(false))
    );
    assert_eq!(gcc_calls(), 2);
    for job in [5, 6] {
        let broken = r.exec(job, req(Language::C, "int main( {"));
        assert_ne!(broken.exit_code, Some(0));
        assert_eq!(broken.compile_cached, Some(false));
    }
    assert_eq!(gcc_calls(), 4);
    // Nothing of the cache shows in the workspace.
    assert_eq!(std::fs::read_dir(r.workdir()).unwrap().count(), 0);
    // Interpreted languages do not involve it.
    assert_eq!(r.exec(7, req(Language::Bash, "true")).compile_cached, None);
    drop(r);
    let _ = std::fs::remove_dir_all(&bin);
}

#[test]
fn java_is_named_after_its_public_class() {
    if Command::new("javac").arg("-version").output().is_err() {
        println!("note: javac not installed, skipping");
        return;
    }
    let mut r = Runner::start();
    let mut rq = req(
        Language::Java,
        "public class Greeter { public static void main(String[] a) { System.out.println(\"hi \" + a[0]); } }",
    );
    rq.args = vec!["there".into()];
    // javac alone takes seconds on a loaded 2-core host.
    rq.timeout_ms = 120_000;
    let resp = r.exec(1, rq);
    assert_eq!(resp.stdout, "hi there\n", "{}", resp.stderr);
}

#[test]
fn a_missing_program_is_reported() {
    let mut r = Runner::start();
    // `d` needs gdc, which the host may lack; a missing compiler must not hang or crash.
    let resp = r.exec(1, req(Language::D, "void main() {}"));
    if resp.exit_code == Some(127) {
        assert!(resp.stderr.contains("gdc"), "{}", resp.stderr);
    }
    assert_eq!(r.exec(2, req(Language::Bash, "echo ok")).stdout, "ok\n");
}

#[test]
fn timeout_kills_a_busy_loop() {
    let mut r = Runner::start();
    let mut rq = req(Language::Bash, "echo start; while true; do :; done");
    rq.timeout_ms = 500;
    let t = Instant::now();
    let resp = r.exec(1, rq);
    assert!(t.elapsed() < Duration::from_secs(5));
    assert_eq!(resp.limits, vec![Limit::Time]);
    assert_eq!(resp.signal, Some(9));
    assert_eq!(resp.stdout, "start\n");
    assert!(
        resp.stderr.ends_with("Error: Time limit exceeded (0.5 s)"),
        "{:?}",
        resp.stderr
    );
    assert!(!resp.cancelled);
    assert!(resp.duration_ms >= 500);
}

#[test]
fn leftovers_are_killed() {
    let mut r = Runner::start();
    let code = r#"
        nohup sleep 1000 & echo $!
        setsid sleep 1000 & echo $!
        ( sleep 1000 & echo $! )
        ( setsid sh -c 'sleep 1000 & echo $!' & )
        sleep 1000 & kill -STOP $!; echo $!
        sleep 1000 > /dev/null 2>&1 & disown; echo $!
        sleep 0.2
    "#;
    let t = Instant::now();
    let resp = r.exec(1, req(Language::Bash, code));
    // Leftovers hold the stdout pipe; the exec must not wait for them.
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    let pids = pids(&resp.stdout);
    assert_eq!(pids.len(), 6, "{resp:?}");
    for pid in pids {
        assert!(!alive(pid), "pid {pid} survived");
    }
}

#[test]
fn many_background_processes_are_killed_on_timeout() {
    let mut r = Runner::start();
    let mut rq = req(
        Language::Bash,
        "for i in $(seq 150); do (sleep 1000 &); echo $!; done; sleep 1000 & echo $!; while true; do sleep 1000 & done",
    );
    rq.timeout_ms = 1000;
    let resp = r.exec(1, rq);
    assert_eq!(resp.limits, vec![Limit::Time]);
    for pid in pids(&resp.stdout) {
        assert!(!alive(pid), "pid {pid} survived");
    }
    // Nothing of ours is left at all.
    let me = r.child.id() as i32;
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            let ppid: i32 = stat[stat.rfind(')').unwrap() + 2..]
                .split(' ')
                .nth(1)
                .and_then(|p| p.parse().ok())
                .unwrap_or(0);
            assert!(
                ppid != me || !alive(pid),
                "child {pid} of the runner survived"
            );
        }
    }
}

#[test]
fn stdin_reaches_a_program_that_asked_for_it_until_it_is_closed() {
    let mut r = Runner::start();
    // Without `stdin`, a program reads /dev/null.
    let resp = r.exec(1, req(Language::Bash, "cat; echo end"));
    assert_eq!(resp.stdout, "end\n");
    let chunk = |data: &[u8], close| StdinChunk {
        data: data.to_vec(),
        close,
    };
    // Stdin that comes before its exec (the broker's frames of one job may be written in
    // either order) is kept for it.
    r.send(2, CoordinatorMessage::Stdin(chunk(b"one\n", false)));
    let mut with_stdin = req(
        Language::Bash,
        "read first; echo \"got $first\"; wc -c; echo end",
    );
    with_stdin.stdin = true;
    r.send(2, CoordinatorMessage::Exec(with_stdin));
    std::thread::sleep(Duration::from_millis(100));
    // Stdin for a job that is not running is dropped.
    r.send(9, CoordinatorMessage::Stdin(chunk(b"lost\n", false)));
    // More than a pipe holds at once (64 KiB), written as the program reads.
    let big = vec![b'x'; 200 * 1024];
    r.send(2, CoordinatorMessage::Stdin(chunk(&big, false)));
    r.send(2, CoordinatorMessage::Stdin(chunk(b"\n", true)));
    let (_, resp) = r.finish(2);
    assert_eq!(resp.exit_code, Some(0), "{resp:?}");
    assert_eq!(resp.stdout, format!("got one\n{}\nend\n", 200 * 1024 + 1));
    // A program that stops reading does not hold the runner: its stdin is dropped.
    let mut early = req(Language::Bash, "head -c 3; echo; echo done");
    early.stdin = true;
    r.send(3, CoordinatorMessage::Exec(early));
    r.send(
        3,
        CoordinatorMessage::Stdin(chunk(&vec![b'y'; 300 * 1024], false)),
    );
    let (_, resp) = r.finish(3);
    assert_eq!(resp.stdout, "yyy\ndone\n");
    // What came for another job while no exec ran is not handed to the next one.
    r.send(9, CoordinatorMessage::Stdin(chunk(b"stale\n", false)));
    let mut next = req(Language::Bash, "cat; echo next");
    next.stdin = true;
    r.send(4, CoordinatorMessage::Exec(next));
    r.send(4, CoordinatorMessage::Stdin(chunk(b"", true)));
    assert_eq!(r.finish(4).1.stdout, "next\n");
}

#[test]
fn closed_stdout_and_stderr_are_fine() {
    let mut r = Runner::start();
    let resp = r.exec(
        1,
        req(
            Language::Bash,
            "echo before; exec 1>&- 2>&-; sleep 0.1; exit 4",
        ),
    );
    assert_eq!(resp.stdout, "before\n");
    assert_eq!(resp.exit_code, Some(4));
}

#[test]
fn output_is_capped() {
    let mut r = Runner::start();
    let mut rq = req(
        Language::Bash,
        "head -c 5000000 /dev/zero | tr '\\0' a; echo; head -c 100 /dev/zero | tr '\\0' e >&2",
    );
    rq.max_output_bytes = 1000;
    let resp = r.exec(1, rq);
    assert_eq!(resp.exit_code, Some(0));
    assert_eq!(resp.stdout, "a".repeat(1000));
    assert_eq!(resp.limits, vec![Limit::Stdout]);
    assert_eq!(
        resp.stderr,
        format!(
            "{}\nError: stdout length exceeded (limit 1000 bytes)",
            "e".repeat(100)
        )
    );

    // An endless writer is stopped by the time limit, not by a blocked pipe.
    let mut rq = req(Language::Bash, "yes");
    rq.max_output_bytes = 10;
    // Long enough for `yes` to be scheduled on a loaded host; it fills the cap at once.
    rq.timeout_ms = 2_000;
    let resp = r.exec(2, rq);
    assert_eq!(resp.limits, vec![Limit::Time, Limit::Stdout]);
    assert_eq!(resp.stdout, "y\ny\ny\ny\ny\n");
}

#[test]
fn invalid_utf8_is_replaced() {
    let mut r = Runner::start();
    let resp = r.exec(1, req(Language::Bash, "printf 'a\\377b'"));
    assert_eq!(resp.stdout, "a\u{FFFD}b");
}

#[test]
fn streaming_sends_chunks() {
    let mut r = Runner::start();
    let mut rq = req(
        Language::Bash,
        "echo one; sleep 0.3; echo two >&2; sleep 0.3; echo three",
    );
    rq.stream = true;
    rq.timeout_ms = 10_000;
    r.send(1, CoordinatorMessage::Exec(rq));
    let (chunks, resp) = r.finish(1);
    assert_eq!(resp.stdout, "");
    assert_eq!(resp.stderr, "");
    assert_eq!(resp.exit_code, Some(0));
    let text = |s: Stream| {
        chunks
            .iter()
            .filter(|c| c.stream == s)
            .map(|c| c.data.as_str())
            .collect::<String>()
    };
    assert_eq!(text(Stream::Stdout), "one\nthree\n");
    assert_eq!(text(Stream::Stderr), "two\n");
    assert!(chunks.len() >= 3, "{chunks:?}");

    // Limit notes arrive as a last stderr chunk.
    let mut rq = req(Language::Bash, "echo -n x; sleep 5");
    rq.stream = true;
    rq.timeout_ms = 200;
    r.send(2, CoordinatorMessage::Exec(rq));
    let (chunks, resp) = r.finish(2);
    assert_eq!(resp.limits, vec![Limit::Time]);
    let last = chunks.last().unwrap();
    assert_eq!(last.stream, Stream::Stderr);
    assert_eq!(last.data, "Error: Time limit exceeded (0.2 s)");
}

#[test]
fn cancel_and_busy() {
    let mut r = Runner::start();
    r.send(
        5,
        CoordinatorMessage::Exec(req(Language::Bash, "sleep 100")),
    );
    std::thread::sleep(Duration::from_millis(200));
    // A second exec is refused while the first runs.
    r.send(6, CoordinatorMessage::Exec(req(Language::Bash, "echo no")));
    match r.recv() {
        (6, WorkerMessage::Error(e)) => assert!(e.message.contains("busy"), "{e:?}"),
        other => panic!("{other:?}"),
    }
    // A cancel for another job is ignored; hello still works mid-exec.
    r.send(99, CoordinatorMessage::Cancel);
    r.send(7, CoordinatorMessage::Hello(HelloRequest::default()));
    assert!(matches!(r.recv(), (7, WorkerMessage::Hello(_))));
    let t = Instant::now();
    r.send(5, CoordinatorMessage::Cancel);
    let (_, resp) = r.finish(5);
    assert!(t.elapsed() < Duration::from_secs(2));
    assert!(resp.cancelled);
    assert!(resp.limits.is_empty(), "{resp:?}");
    assert_eq!(resp.signal, Some(9));
    // And the runner takes the next exec.
    assert_eq!(r.exec(8, req(Language::Bash, "echo yes")).stdout, "yes\n");
}

#[test]
fn bad_frames_get_errors() {
    let mut r = Runner::start();
    r.send_line("not json");
    assert!(matches!(r.recv(), (0, WorkerMessage::Error(_))));
    r.send_line(r#"[12,{"type":"bogus"}]"#);
    assert!(matches!(r.recv(), (12, WorkerMessage::Error(_))));
    r.send_line(
        r#"[13,{"type":"exec","lang":"cobol","code":"","timeout_ms":1,"max_output_bytes":1}]"#,
    );
    assert!(matches!(r.recv(), (13, WorkerMessage::Error(_))));
    // Longer than MAX_FRAME_BYTES: refused without being buffered, job id recovered.
    let huge = format!(
        "[14,\"{}\"]",
        "x".repeat(sandbox_runner::MAX_FRAME_BYTES + 10)
    );
    r.send_line(&huge);
    match r.recv() {
        (14, WorkerMessage::Error(e)) => assert!(e.message.contains("longer"), "{e:?}"),
        other => panic!("{other:?}"),
    }
    r.send_line("");
    r.send(15, CoordinatorMessage::Hello(HelloRequest::default()));
    assert!(matches!(r.recv(), (15, WorkerMessage::Hello(_))));
}

// ----- Python, through the real kernel -----

fn python_runner() -> Option<Runner> {
    if kernel_script().is_none() {
        println!("note: sandbox-image/kernels/kernel.py is missing; skipping the py tests");
        return None;
    }
    Some(Runner::start())
}

#[test]
fn py_keeps_state_and_survives_timeouts() {
    let Some(mut r) = python_runner() else { return };
    r.send(
        1,
        CoordinatorMessage::Hello(HelloRequest {
            start_kernel: true,
            ..HelloRequest::default()
        }),
    );
    assert!(matches!(r.recv(), (1, WorkerMessage::Hello(_))));

    let resp = r.exec(2, req(Language::Py, "x = 41\nprint('hi')"));
    assert_eq!(resp.stdout, "hi\n", "{resp:?}");
    assert_eq!(resp.runtime_status, RuntimeStatus::New);
    let resp = r.exec(3, req(Language::Py, "x + 1"));
    assert_eq!(resp.stdout, "42\n");
    assert_eq!(resp.runtime_status, RuntimeStatus::Reused);

    // A timeout interrupts the code; the kernel and its state survive.
    let mut rq = req(Language::Py, "while True: pass");
    rq.timeout_ms = 500;
    let resp = r.exec(4, rq);
    assert_eq!(resp.limits, vec![Limit::Time]);
    assert!(resp.stderr.contains("KeyboardInterrupt"), "{}", resp.stderr);
    assert!(resp.stderr.ends_with("Error: Time limit exceeded (0.5 s)"));
    let resp = r.exec(5, req(Language::Py, "x"));
    assert_eq!(resp.stdout, "41\n");
    assert_eq!(resp.runtime_status, RuntimeStatus::Reused);

    // Another language in between does not disturb the kernel.
    assert_eq!(r.exec(6, req(Language::Bash, "echo b")).stdout, "b\n");
    let resp = r.exec(7, req(Language::Py, "import sys; print(sys.argv); x"));
    assert_eq!(resp.stdout, "['main.py']\n41\n");
    assert_eq!(resp.runtime_status, RuntimeStatus::Reused);

    // Exit codes.
    let resp = r.exec(8, req(Language::Py, "raise SystemExit(3)"));
    assert_eq!(resp.exit_code, Some(3));
    let resp = r.exec(9, req(Language::Py, "1/0"));
    assert_eq!(resp.exit_code, Some(1));
    assert!(resp.stderr.contains("ZeroDivisionError"));
}

/// Asks `hello` until the runner says the kernel's preload is over; whether it ever did
/// within [`PATIENCE`].
fn wait_preloaded(r: &mut Runner, mut job: u64) -> bool {
    let until = Instant::now() + PATIENCE;
    while Instant::now() < until {
        r.send(job, CoordinatorMessage::Hello(HelloRequest::default()));
        match r.recv() {
            (j, WorkerMessage::Hello(h)) if j == job => {
                if !h.preloading {
                    return true;
                }
            }
            other => panic!("{other:?}"),
        }
        job += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// A hello that starts the kernel with a preload list: the runner says `preloading` until
/// the kernel has imported the modules in the background (one that fails is skipped), and
/// neither the kernel nor other programs see the variable that carried the list.
#[test]
fn a_warm_up_hello_preloads_modules_in_the_kernel() {
    let Some(mut r) = python_runner() else { return };
    r.send(
        1,
        CoordinatorMessage::Hello(HelloRequest {
            start_kernel: true,
            preload: vec!["wave".into(), "no_such_module_here".into()],
        }),
    );
    match r.recv() {
        (1, WorkerMessage::Hello(h)) => assert!(h.preloading, "{h:?}"),
        other => panic!("{other:?}"),
    }
    assert!(wait_preloaded(&mut r, 100), "the preload never ended");
    let probe = "import os, sys, threading\n\
        print('wave' in sys.modules, 'CODEBROKER_PRELOAD' in os.environ, \
        [t.name for t in threading.enumerate()])";
    let resp = r.exec(2, req(Language::Py, probe));
    assert_eq!(resp.stdout, "True False ['MainThread']\n", "{resp:?}");
    assert_eq!(
        resp.stderr, "",
        "a failed preload is not the session's output"
    );
    let resp = r.exec(
        3,
        req(Language::Bash, "echo \"[${CODEBROKER_PRELOAD-unset}]\""),
    );
    assert_eq!(resp.stdout, "[unset]\n");
    // A plain hello later says the same, and starts nothing.
    assert!(wait_preloaded(&mut r, 200));
}

/// The session's first exec stops the preload, in whatever language: here a bash exec
/// while the kernel is inside a slow first module; the module after it is never imported,
/// and the runner stops saying `preloading` once the import under way is done.
#[test]
fn the_first_exec_stops_the_preload_whatever_its_language() {
    let lib = std::env::temp_dir().join(format!("runner-preload-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&lib);
    std::fs::create_dir_all(&lib).unwrap();
    let mark = lib.join("importing");
    std::fs::write(
        lib.join("slow_first.py"),
        format!(
            "import time\nopen({:?}, 'w').close()\ntime.sleep(0.5)\n",
            mark.to_string_lossy()
        ),
    )
    .unwrap();
    std::fs::write(lib.join("marker_second.py"), "").unwrap();
    if kernel_script().is_none() {
        return;
    }
    let mut r = Runner::start_with(&[("PYTHONPATH", lib.to_str().unwrap())]);
    r.send(
        1,
        CoordinatorMessage::Hello(HelloRequest {
            start_kernel: true,
            preload: vec!["slow_first".into(), "marker_second".into()],
        }),
    );
    assert!(matches!(r.recv(), (1, WorkerMessage::Hello(_))));
    let until = Instant::now() + PATIENCE;
    while !mark.exists() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(mark.exists(), "the preload never began");
    assert_eq!(r.exec(2, req(Language::Bash, "echo b")).stdout, "b\n");
    assert!(wait_preloaded(&mut r, 100), "the preload never ended");
    let resp = r.exec(
        3,
        req(
            Language::Py,
            "import sys\nprint('slow_first' in sys.modules, 'marker_second' in sys.modules)",
        ),
    );
    assert_eq!(resp.stdout, "True False\n", "{resp:?}");
    let _ = std::fs::remove_dir_all(&lib);
}

#[test]
fn py_kernel_death_means_a_fresh_kernel() {
    let Some(mut r) = python_runner() else { return };
    let resp = r.exec(1, req(Language::Py, "import os\nx = 1\nprint(os.getpid())"));
    let kernel = pids(&resp.stdout)[0];
    let resp = r.exec(
        2,
        req(
            Language::Py,
            "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
        ),
    );
    assert_eq!(resp.signal, Some(9));
    assert!(
        resp.stderr.contains("killed by signal 9"),
        "{}",
        resp.stderr
    );
    // A SIGKILL is never taken for the OOM killer's: only the cgroup's OOM kill counter
    // says that, and without one (gVisor) no claim is made.
    assert!(resp.limits.is_empty(), "{:?}", resp.limits);
    assert!(!alive(kernel));
    let resp = r.exec(3, req(Language::Py, "print('x' in globals())"));
    assert_eq!(resp.stdout, "False\n");
    assert_eq!(resp.runtime_status, RuntimeStatus::New);

    let resp = r.exec(4, req(Language::Py, "import os; os._exit(7)"));
    assert_eq!(resp.exit_code, Some(7));
    assert!(resp.limits.is_empty());
    let resp = r.exec(5, req(Language::Py, "print(1)"));
    assert_eq!(resp.runtime_status, RuntimeStatus::New);
}

#[test]
fn py_unresponsive_kernel_is_killed_after_a_grace() {
    let Some(mut r) = python_runner() else { return };
    // A kernel still starting has nothing to lose: a timeout kills it outright.
    let mut rq = req(Language::Py, "pass");
    rq.timeout_ms = 5;
    let resp = r.exec(1, rq);
    assert_eq!(resp.limits, vec![Limit::Time], "{resp:?}");
    assert_eq!(resp.signal, Some(9));

    assert_eq!(r.exec(3, req(Language::Py, "print(1)")).stdout, "1\n");
    let code = "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: pass";
    let mut rq = req(Language::Py, code);
    rq.timeout_ms = 300;
    let t = Instant::now();
    let resp = r.exec(4, rq);
    assert!(t.elapsed() < Duration::from_secs(5));
    assert_eq!(resp.limits, vec![Limit::Time], "{resp:?}");
    assert_eq!(resp.signal, Some(9));
    let resp = r.exec(5, req(Language::Py, "print(2)"));
    assert_eq!(resp.stdout, "2\n");
    assert_eq!(resp.runtime_status, RuntimeStatus::New);
}

#[test]
fn py_cancel_streaming_and_leftovers() {
    let Some(mut r) = python_runner() else { return };
    let mut rq = req(
        Language::Py,
        "import subprocess, time\np = subprocess.Popen(['sleep', '1000'])\nprint(p.pid, flush=True)\ntime.sleep(100)",
    );
    rq.stream = true;
    r.send(1, CoordinatorMessage::Exec(rq));
    let (_, first) = r.recv();
    let WorkerMessage::Output(chunk) = first else {
        panic!("{first:?}")
    };
    let child = pids(&chunk.data)[0];
    assert!(alive(child));
    r.send(1, CoordinatorMessage::Cancel);
    let (_, resp) = r.finish(1);
    assert!(resp.cancelled);
    assert!(resp.limits.is_empty(), "{resp:?}");
    assert_eq!(resp.exit_code, Some(1));
    assert!(!alive(child), "the kernel's child survived");
    let resp = r.exec(2, req(Language::Py, "print(p.poll() is not None)"));
    assert_eq!(resp.stdout, "True\n");
    assert_eq!(resp.runtime_status, RuntimeStatus::Reused);
}

#[test]
fn py_output_between_execs_is_dropped() {
    let Some(mut r) = python_runner() else { return };
    let code = "import threading, time, sys\ndef f():\n    time.sleep(0.3)\n    print('late', flush=True)\nthreading.Thread(target=f, daemon=True).start()";
    assert_eq!(r.exec(1, req(Language::Py, code)).stdout, "");
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(r.exec(2, req(Language::Py, "print('now')")).stdout, "now\n");
}

#[test]
fn eof_stops_the_runner_and_its_kernel() {
    let Some(mut r) = python_runner() else { return };
    let resp = r.exec(1, req(Language::Py, "import os; print(os.getpid())"));
    let kernel = pids(&resp.stdout)[0];
    assert!(alive(kernel));
    assert_eq!(r.close(), Some(0));
    assert!(!alive(kernel));
}

#[test]
fn py_warm_round_trip() {
    let Some(mut r) = python_runner() else { return };
    r.exec(1, req(Language::Py, "n = 0"));
    let t = Instant::now();
    let rounds = 50;
    for i in 0..rounds {
        let resp = r.exec(2 + i, req(Language::Py, "n += 1"));
        assert_eq!(resp.exit_code, Some(0));
    }
    let per = t.elapsed() / rounds as u32;
    println!("warm py exec round trip on the host: {per:?}");
    assert_eq!(r.exec(100, req(Language::Py, "n")).stdout, "50\n");
}

#[test]
fn eof_lets_the_running_exec_finish() {
    let mut r = Runner::start();
    r.send(
        1,
        CoordinatorMessage::Exec(req(Language::Bash, "sleep 0.3; echo done")),
    );
    r.stdin.take();
    let (_, resp) = r.finish(1);
    assert_eq!(resp.stdout, "done\n");
    assert_eq!(r.close(), Some(0));
}

#[test]
fn py_kernel_killed_by_another_exec_is_not_blamed_on_the_next() {
    let Some(mut r) = python_runner() else { return };
    let resp = r.exec(1, req(Language::Py, "import os; print(os.getpid())"));
    let kernel = pids(&resp.stdout)[0];
    let resp = r.exec(
        2,
        req(Language::Bash, &format!("kill -9 {kernel}; echo ok")),
    );
    assert_eq!(resp.stdout, "ok\n");
    let resp = r.exec(3, req(Language::Py, "print(3)"));
    assert_eq!(resp.stdout, "3\n", "{resp:?}");
    assert!(resp.limits.is_empty());
    assert_eq!(resp.runtime_status, RuntimeStatus::New);
}

#[test]
fn py_stopped_kernel_is_woken_up() {
    let Some(mut r) = python_runner() else { return };
    let resp = r.exec(1, req(Language::Py, "import os; x = 5; print(os.getpid())"));
    let kernel = pids(&resp.stdout)[0];
    r.exec(2, req(Language::Bash, &format!("kill -STOP {kernel}")));
    let resp = r.exec(3, req(Language::Py, "x"));
    assert_eq!(resp.stdout, "5\n", "{resp:?}");
    assert_eq!(resp.runtime_status, RuntimeStatus::Reused);
}

#[test]
fn planted_exec_dirs_are_skipped() {
    let mut r = Runner::start();
    let tmp = r.dir.join("tmp");
    let victim = r.dir.join("victim");
    std::fs::create_dir(&victim).unwrap();
    std::fs::write(victim.join("keep"), "x").unwrap();
    // The first exec of job 1 would use exec-1-1: plant a symlink there.
    std::os::unix::fs::symlink(&victim, tmp.join("exec-1-1")).unwrap();
    let resp = r.exec(1, req(Language::Bash, "echo $0"));
    assert!(resp.stdout.contains("/exec-1-2/"), "{resp:?}");
    assert!(victim.join("keep").exists());
    assert!(std::fs::symlink_metadata(tmp.join("exec-1-1")).is_ok());
    assert!(!tmp.join("exec-1-2").exists());
}

// ----- tools: a fake broker answers the code's tool calls -----

/// Everything a job sent, up to its end.
#[derive(Debug, Default)]
struct Transcript {
    chunks: Vec<OutputChunk>,
    displays: Vec<DisplayData>,
    calls: Vec<ToolCall>,
    /// When each stdout chunk arrived, from the start of `drive`.
    stdout_at: Vec<Duration>,
    /// How many chunks had come when each tool call came.
    chunks_at_call: Vec<usize>,
}

impl Transcript {
    fn text(&self, which: Stream) -> String {
        self.chunks
            .iter()
            .filter(|c| c.stream == which)
            .map(|c| c.data.as_str())
            .collect()
    }
}

impl Runner {
    /// Sends an exec and plays the broker until it ends: each tool call is answered with
    /// what `answer` returns (nothing: left unanswered).
    fn drive(
        &mut self,
        job: JobId,
        req: ExecRequest,
        mut answer: impl FnMut(&ToolCall) -> Option<ToolResult>,
    ) -> (Transcript, ExecResponse) {
        let t = Instant::now();
        self.send(job, CoordinatorMessage::Exec(req));
        let mut tr = Transcript::default();
        loop {
            let (j, msg) = self.recv();
            assert_eq!(j, job, "frame for another job: {msg:?}");
            match msg {
                WorkerMessage::Output(c) => {
                    if c.stream == Stream::Stdout {
                        tr.stdout_at.push(t.elapsed());
                    }
                    tr.chunks.push(c);
                }
                WorkerMessage::Display(d) => tr.displays.push(d),
                WorkerMessage::ToolCall(call) => {
                    tr.chunks_at_call.push(tr.chunks.len());
                    if let Some(result) = answer(&call) {
                        self.send(job, CoordinatorMessage::ToolResult(result));
                    }
                    tr.calls.push(call);
                }
                WorkerMessage::ExecDone(r) => return (tr, r),
                other => panic!("unexpected {other:?}"),
            }
        }
    }
}

/// The tool the tests give: `add(a, b)`.
fn add_tool() -> ToolSpec {
    ToolSpec {
        name: "add".into(),
        description: "Adds two numbers.".into(),
        parameters: serde_json::json!({
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"],
        }),
    }
}

/// The fake broker's `add`: the sum, or an error without both numbers.
fn add(call: &ToolCall) -> Option<ToolResult> {
    assert_eq!(call.name, "add");
    let (a, b) = (call.input.get("a"), call.input.get("b"));
    Some(
        match (a.and_then(|v| v.as_f64()), b.and_then(|v| v.as_f64())) {
            (Some(a), Some(b)) => ToolResult {
                call_id: call.call_id.clone(),
                result: if (a + b).fract() == 0.0 {
                    serde_json::json!((a + b) as i64)
                } else {
                    serde_json::json!(a + b)
                },
                is_error: false,
                error_message: None,
            },
            _ => ToolResult {
                call_id: call.call_id.clone(),
                result: serde_json::Value::Null,
                is_error: true,
                error_message: Some("need a and b".into()),
            },
        },
    )
}

fn tool_req(lang: Language, code: &str) -> ExecRequest {
    let mut r = req(lang, code);
    r.tools = vec![add_tool()];
    r.stream = true;
    r
}

fn call_ids(tr: &Transcript) -> Vec<&str> {
    tr.calls.iter().map(|c| c.call_id.as_str()).collect()
}

#[test]
fn py_tools_sequential_and_cleared_after_the_exec() {
    let Some(mut r) = python_runner() else { return };
    let code = "x = await add(a=1, b=2)\ny = await add(a=x, b=0.5)\nprint(x, y)\n\
                import os, subprocess\n\
                print(subprocess.run([os.environ['RUNNER_EXE'], 'tool-call', 'add', '{\"a\": 2, \"b\": 2}'], capture_output=True, text=True).stdout, end='')\n\
                print(os.path.exists(os.environ['CODEBROKER_TOOL_SOCKET']))";
    let (tr, resp) = r.drive(1, tool_req(Language::Py, code), add);
    assert_eq!(resp.exit_code, Some(0), "{tr:?} {resp:?}");
    assert_eq!(tr.text(Stream::Stdout), "3 3.5\n4\nTrue\n", "{tr:?}");
    assert_eq!(call_ids(&tr), ["call_001", "call_002", "call_003"]);
    assert_eq!(tr.calls[1].input, serde_json::json!({"a": 3, "b": 0.5}));

    // The next exec has no tools: the functions, ToolError and the variable are gone, and
    // so is the socket's directory; a name the code rebound stays.
    let (tr, _) = r.drive(2, tool_req(Language::Py, "add = 'mine'"), add);
    assert!(tr.calls.is_empty());
    let resp = r.exec(
        3,
        req(
            Language::Py,
            "import os\nprint(add, 'ToolError' in globals(), os.environ.get('CODEBROKER_TOOL_SOCKET'))",
        ),
    );
    assert_eq!(resp.stdout, "mine False None\n", "{resp:?}");
    let resp = r.exec(4, req(Language::Py, "del add\nadd"));
    assert!(resp.stderr.contains("NameError"), "{resp:?}");
    let left: Vec<_> = std::fs::read_dir(r.dir.join("tmp"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .filter(|n| n.to_string_lossy().starts_with("tools-"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn py_tools_gather_sends_both_calls_before_any_answer() {
    let Some(mut r) = python_runner() else { return };
    let code = "import asyncio\nprint(await asyncio.gather(add(a=1, b=2), add(a=3, b=4)))";
    r.send(1, CoordinatorMessage::Exec(tool_req(Language::Py, code)));
    let mut calls = Vec::new();
    while calls.len() < 2 {
        match r.recv() {
            (1, WorkerMessage::ToolCall(c)) => calls.push(c),
            other => panic!("{other:?}"),
        }
    }
    let mut ids: Vec<_> = calls.iter().map(|c| c.call_id.as_str()).collect();
    ids.sort();
    assert_eq!(ids, ["call_001", "call_002"]);
    // Both name the step they were made in, so the broker batches them.
    let hint = calls[0].batch.clone().expect("a batch hint");
    assert_eq!(hint.size, 2);
    assert_eq!(calls[1].batch.as_ref(), Some(&hint));
    // Answered in the reverse order of arrival.
    for c in calls.iter().rev() {
        r.send(1, CoordinatorMessage::ToolResult(add(c).unwrap()));
    }
    let (chunks, resp) = r.finish(1);
    assert_eq!(resp.exit_code, Some(0), "{chunks:?}");
    let out: String = chunks.iter().map(|c| c.data.as_str()).collect();
    assert_eq!(out, "[3, 7]\n");
}

#[test]
fn py_tools_wide_fan_out() {
    let Some(mut r) = python_runner() else { return };
    // More calls at once than the runner serves connections: the rest wait their turn.
    let code = "import asyncio\nr = await asyncio.gather(*(add(a=i, b=1) for i in range(300)))\nprint(sum(r))";
    let (tr, resp) = r.drive(1, tool_req(Language::Py, code), add);
    assert_eq!(resp.exit_code, Some(0), "{tr:?}");
    assert_eq!(tr.text(Stream::Stdout), "45150\n");
    let mut ids: Vec<_> = call_ids(&tr);
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 300);
    assert_eq!(ids[299], "call_300");
}

#[test]
fn py_tool_errors_and_unknown_tools() {
    let Some(mut r) = python_runner() else { return };
    let code = r#"
try:
    await add(a=1)
except TypeError as e:
    print("TypeError:", e)
try:
    await add(a=1, b=None)
except ToolError as e:
    print("caught:", e, e.tool, isinstance(e, RuntimeError))
import json, os, socket
def raw(line):
    s = socket.socket(socket.AF_UNIX)
    s.connect(os.environ["CODEBROKER_TOOL_SOCKET"])
    s.sendall(line)
    if not line.endswith(b"\n"):
        s.shutdown(socket.SHUT_WR)  # the end of a request without a newline
    answer = json.loads(s.makefile("rb").read())
    s.close()
    return answer
print(raw(b'{"name": "z", "input": {}}\n'))
print(raw(b'not json\n')["error_message"].startswith("Invalid tool call request"))
print(raw(b'{"name": "add", "input": [1]}\n')["error_message"])
print(raw(b'{"name": "add", "input": {"a": 1, "b": 1}}')["result"])
await add(b=1, a=None)
"#;
    let (tr, resp) = r.drive(1, tool_req(Language::Py, code), add);
    assert_eq!(
        tr.text(Stream::Stdout),
        "TypeError: add() missing 1 required keyword-only argument: 'b'\n\
         caught: need a and b add True\n\
         {'result': None, 'is_error': True, 'error_message': \"Unknown tool: 'z'\"}\n\
         True\n\
         Tool input must be a JSON object (tool 'add')\n\
         2\n",
        "{tr:?}"
    );
    // The broker saw only the calls of `add` with an object input.
    assert_eq!(call_ids(&tr), ["call_001", "call_002", "call_003"]);
    assert_eq!(tr.calls[0].input, serde_json::json!({"a": 1, "b": null}));
    // An uncaught ToolError: a traceback of the cell's frames only.
    assert_eq!(resp.exit_code, Some(1));
    let err = tr.text(Stream::Stderr);
    assert!(err.ends_with("ToolError: need a and b\n"), "{err}");
    assert!(err.contains("await add(b=1, a=None)"), "{err}");
    assert!(
        !err.contains("kernel.py") && !err.contains("codebroker-tool"),
        "{err}"
    );
}

#[test]
fn py_twenty_sequential_round_trips() {
    let Some(mut r) = python_runner() else { return };
    let code = "import time\ns = 0\nt = time.perf_counter()\nfor i in range(20):\n    s = await add(a=s, b=1)\n\
                print(s, round((time.perf_counter() - t) / 20 * 1e6))";
    let (tr, resp) = r.drive(1, tool_req(Language::Py, code), add);
    assert_eq!(resp.exit_code, Some(0), "{tr:?}");
    let out = tr.text(Stream::Stdout);
    let mut fields = out.split_whitespace();
    assert_eq!(fields.next(), Some("20"), "{out}");
    let micros: u64 = fields.next().and_then(|f| f.parse().ok()).unwrap();
    println!("py tool call round trip seen by the code (fake broker on the host): {micros} µs");
    assert_eq!(tr.calls.len(), 20);
    assert_eq!(tr.calls[19].call_id, "call_020");
}

#[test]
fn py_cancel_while_waiting_for_a_result() {
    let Some(mut r) = python_runner() else { return };
    r.exec(1, req(Language::Py, "kept = 1"));
    let code = "print('asking', flush=True)\nawait add(a=1, b=2)\nprint('never')";
    r.send(2, CoordinatorMessage::Exec(tool_req(Language::Py, code)));
    let call = loop {
        match r.recv() {
            (2, WorkerMessage::ToolCall(c)) => break c,
            (2, WorkerMessage::Output(_)) => {}
            other => panic!("{other:?}"),
        }
    };
    let t = Instant::now();
    r.send(2, CoordinatorMessage::Cancel);
    let (chunks, resp) = r.finish(2);
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    assert!(resp.cancelled, "{resp:?}");
    let out: String = chunks.iter().map(|c| c.data.as_str()).collect();
    assert!(!out.contains("never"), "{out}");
    // A late result is dropped; the kernel kept its state.
    r.send(2, CoordinatorMessage::ToolResult(add(&call).unwrap()));
    let resp = r.exec(3, req(Language::Py, "print(kept)"));
    assert_eq!(resp.stdout, "1\n", "{resp:?}");
    assert_eq!(resp.runtime_status, RuntimeStatus::Reused);
}

#[test]
fn py_timeout_while_waiting_for_a_result() {
    let Some(mut r) = python_runner() else { return };
    r.exec(1, req(Language::Py, "kept = 2"));
    // The call waits in a thread too, which the interrupt does not reach: the runner's
    // error answer must end it.
    // The thread records what it saw rather than printing it: its print may come after
    // the exec ended, and output between execs is dropped by design. It binds `ToolError`
    // when defined: the name is removed before the next cell, which may already run when
    // the error reaches the thread.
    let code = "import asyncio, threading\n\
                seen = []\n\
                def side(ToolError=ToolError):\n    try:\n        asyncio.run(add(a=1, b=1))\n    except ToolError as e:\n        seen.append(str(e))\n\
                t = threading.Thread(target=side)\nt.start()\n\
                await add(a=1, b=2)";
    let mut rq = tool_req(Language::Py, code);
    // Long enough that both calls are made first even on a loaded host.
    rq.timeout_ms = 3000;
    let t = Instant::now();
    let (tr, resp) = r.drive(2, rq, |_| None);
    assert!(t.elapsed() < Duration::from_secs(6), "{:?}", t.elapsed());
    assert_eq!(resp.limits, vec![Limit::Time], "{resp:?}");
    assert_eq!(tr.calls.len(), 2);
    let resp = r.exec(
        3,
        req(Language::Py, "t.join(5)\nprint(t.is_alive(), kept, seen)"),
    );
    assert_eq!(
        resp.stdout, "False 2 ['Time limit exceeded']\n",
        "{resp:?} {tr:?}"
    );
    assert_eq!(resp.runtime_status, RuntimeStatus::Reused);
}

#[test]
fn bash_tools() {
    let mut r = Runner::start();
    let code = r#"add '{"a":1,"b":2}'
echo '{"a":1,"b":5}' | add
add '{"a":1}' || echo "failed $?"
bash -c 'add "{\"a\":2,\"b\":2}"'
"$RUNNER_EXE" tool-call z '{}' || echo "unknown $?"
add 'nope' || echo "bad input $?"
"#;
    let (tr, resp) = r.drive(1, tool_req(Language::Bash, code), add);
    assert_eq!(resp.exit_code, Some(0), "{tr:?}");
    assert_eq!(
        tr.text(Stream::Stdout),
        "3\n6\nfailed 1\n4\nunknown 1\nbad input 2\n"
    );
    let err = tr.text(Stream::Stderr);
    assert!(
        err.starts_with("need a and b\nUnknown tool: 'z'\nadd: the input is not valid JSON"),
        "{err}"
    );
    assert_eq!(tr.calls.len(), 4);
    // Nothing is left in the temp dir.
    let left: Vec<_> = std::fs::read_dir(r.dir.join("tmp")).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");

    // Without tools there is no function and no socket.
    let resp = r.exec(
        2,
        req(
            Language::Bash,
            "type add 2>/dev/null || echo none; \"$RUNNER_EXE\" tool-call add '{}'; echo $?",
        ),
    );
    assert_eq!(resp.stdout, "none\n2\n", "{resp:?}");
    assert!(resp.stderr.contains("no tool socket"), "{resp:?}");
}

#[test]
fn bash_cancel_while_waiting_for_a_result() {
    let mut r = Runner::start();
    r.send(
        1,
        CoordinatorMessage::Exec(tool_req(
            Language::Bash,
            "add '{\"a\":1,\"b\":2}'; echo never",
        )),
    );
    match r.recv() {
        (1, WorkerMessage::ToolCall(_)) => {}
        other => panic!("{other:?}"),
    }
    let t = Instant::now();
    r.send(1, CoordinatorMessage::Cancel);
    let (chunks, resp) = r.finish(1);
    assert!(t.elapsed() < Duration::from_secs(2));
    assert!(resp.cancelled);
    assert!(
        chunks.iter().all(|c| !c.data.contains("never")),
        "{chunks:?}"
    );
}

fn have(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
}

#[test]
fn js_tools() {
    if !have("node") {
        println!("note: node not installed, skipping");
        return;
    }
    let mut r = Runner::start();
    let code = r#"console.log(await add({a: 1, b: 2}));
console.log(await codemode.add({a: 2, b: 3}));
console.log(await Promise.all([add({a: 1, b: 1}), add({a: 2, b: 2})]));
try { await add({a: 1}); } catch (e) { console.log(e instanceof ToolError, e.name, e.message); }
console.log(typeof module.exports, this === module.exports);
await add({a: 1});
"#;
    let (tr, resp) = r.drive(1, tool_req(Language::Js, code), add);
    assert_eq!(
        tr.text(Stream::Stdout),
        "3\n5\n[ 2, 4 ]\ntrue ToolError need a and b\nobject true\n",
        "{tr:?}"
    );
    assert_eq!(tr.calls.len(), 6);
    // Only the two calls of `Promise.all` share a step.
    let hints: Vec<_> = tr.calls.iter().map(|c| c.batch.clone()).collect();
    assert!(hints[0].is_none() && hints[1].is_none(), "{hints:?}");
    assert_eq!(hints[2].as_ref().map(|h| h.size), Some(2), "{hints:?}");
    assert_eq!(hints[2], hints[3]);
    assert!(hints[4..].iter().all(Option::is_none), "{hints:?}");
    // An error that escapes: reported like node does, exit code 1.
    assert_eq!(resp.exit_code, Some(1));
    let err = tr.text(Stream::Stderr);
    assert!(err.starts_with("ToolError: need a and b\n    at "), "{err}");

    // A tool named like a global keeps the global and gets a suffix; codemode has it as is.
    let mut rq = tool_req(
        Language::Js,
        "console.log(typeof setTimeout === 'function' && setTimeout !== codemode.setTimeout, await setTimeout_tool({a: 1, b: 1}))",
    );
    rq.tools[0].name = "setTimeout".into();
    let (tr, _) = r.drive(2, rq, |c| {
        add(&ToolCall {
            name: "add".into(),
            ..c.clone()
        })
    });
    assert_eq!(tr.text(Stream::Stdout), "true 2\n", "{tr:?}");
    assert_eq!(tr.calls[0].name, "setTimeout");
}

#[test]
fn ts_tools() {
    if !have("node") || !have("esbuild") {
        println!("note: node or esbuild not installed, skipping");
        return;
    }
    let mut r = Runner::start();
    let code = "import * as path from 'path';\nconst n: number = await add({a: 1, b: 2});\nconsole.log(n, path.basename('/a/b'), typeof require('fs').readFileSync);";
    let (tr, resp) = r.drive(1, tool_req(Language::Ts, code), add);
    assert_eq!(resp.exit_code, Some(0), "{tr:?}");
    assert_eq!(tr.text(Stream::Stdout), "3 b function\n");
}

fn have_matplotlib() -> bool {
    Command::new("python3")
        .args(["-c", "import matplotlib"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn py_plt_show_sends_display_frames_when_streaming() {
    let Some(mut r) = python_runner() else { return };
    if !have_matplotlib() {
        println!("note: matplotlib not installed, skipping");
        return;
    }
    let code = "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.figure()\nplt.plot([2, 1])\nplt.show()\nprint('shown')";
    let mut rq = req(Language::Py, code);
    rq.stream = true;
    rq.timeout_ms = 60_000;
    let (tr, resp) = r.drive(1, rq, |_| None);
    assert_eq!(resp.exit_code, Some(0), "{tr:?}");
    let names: Vec<_> = tr.displays.iter().map(|d| d.name.as_deref()).collect();
    assert_eq!(names, [Some("plot-1.png"), Some("plot-2.png")], "{tr:?}");
    assert!(tr
        .displays
        .iter()
        .all(|d| d.mime == "image/png" && d.data.is_none()));
    assert!(r.workdir().join("plot-2.png").exists());

    // Without streaming, no display frames (the files are there all the same).
    let resp = r.exec(2, req(Language::Py, "plt.plot([1]); plt.show()"));
    assert_eq!(resp.exit_code, Some(0), "{resp:?}");
    assert!(r.workdir().join("plot-3.png").exists());
}

#[test]
fn py_display_events_beyond_the_budget_are_dropped_and_said_once() {
    let Some(mut r) = python_runner() else { return };
    // The kernel's own event channel, called in a loop as hostile code can.
    let code = "import gc\n\
                k = next(o for o in gc.get_objects() if type(o).__name__ == 'Kernel')\n\
                for i in range(500):\n\
                \x20   k.channel.send({'event': 'display', 'id': k.request_id, 'mime': 'text/plain', 'data': 'x' * 1000})\n\
                print('sent')";
    let mut rq = req(Language::Py, code);
    rq.stream = true;
    rq.max_display_events = 100;
    rq.max_display_bytes = 1 << 20;
    let (tr, resp) = r.drive(1, rq, |_| None);
    assert_eq!(resp.exit_code, Some(0), "{resp:?}");
    assert_eq!(tr.displays.len(), 100);
    let stderr = tr.text(Stream::Stderr);
    assert_eq!(
        stderr.matches("Display events beyond 100").count(),
        1,
        "{stderr}"
    );

    // By bytes: 10 events of about 1000 bytes fit in 10 000.
    let mut rq = req(Language::Py, code);
    rq.stream = true;
    rq.max_display_bytes = 10_000;
    let (tr, _) = r.drive(2, rq, |_| None);
    assert!(
        (9..=10).contains(&tr.displays.len()),
        "{}",
        tr.displays.len()
    );

    // The next exec has a budget of its own, and no note.
    let mut rq = req(Language::Py, "k.channel.send({'event': 'display', 'id': k.request_id, 'mime': 'text/plain', 'data': 'y'})");
    rq.stream = true;
    let (tr, resp) = r.drive(3, rq, |_| None);
    assert_eq!(resp.exit_code, Some(0), "{resp:?}");
    assert_eq!(tr.displays.len(), 1);
    assert!(!tr.text(Stream::Stderr).contains("Display events"));
}

#[test]
fn streamed_output_is_sent_at_once() {
    let Some(mut r) = python_runner() else { return };
    r.exec(1, req(Language::Py, "import time"));
    let mut cases = vec![
        (Language::Py, "print('a')\ntime.sleep(1)\nprint('b')"),
        (Language::Bash, "echo a; sleep 1; echo b"),
    ];
    if have("node") {
        cases.push((
            Language::Js,
            "console.log('a'); setTimeout(() => console.log('b'), 1000);",
        ));
    }
    for (i, (lang, code)) in cases.into_iter().enumerate() {
        let mut rq = req(lang, code);
        rq.stream = true;
        let (tr, resp) = r.drive(10 + i as u64, rq, |_| None);
        assert_eq!(resp.exit_code, Some(0), "{lang}: {tr:?}");
        assert_eq!(tr.text(Stream::Stdout), "a\nb\n", "{lang}");
        let first = tr.stdout_at[0];
        println!(
            "{lang}: first chunk after {first:?}, exec took {} ms",
            resp.duration_ms
        );
        assert!(resp.duration_ms >= 1000);
        assert!(tr.stdout_at.len() >= 2, "{lang}: {tr:?}");
        // `a` left a second before `b`, however long the interpreter took to start on a
        // loaded host: it was sent at once, not held until the exec ended.
        let last = tr.stdout_at[tr.stdout_at.len() - 1];
        assert!(
            last.saturating_sub(first) >= Duration::from_millis(700),
            "{lang}: {first:?} then {last:?}"
        );
    }
}

#[test]
fn streamed_output_is_gathered_into_few_chunks() {
    let Some(mut r) = python_runner() else { return };
    let expected: String = (1..=10_000).map(|i| format!("{i}\n")).collect();
    let mut cases = vec![
        (Language::Py, "for i in range(1, 10001):\n    print(i)"),
        (Language::Bash, "for i in $(seq 10000); do echo $i; done"),
    ];
    if have("node") {
        cases.push((
            Language::Js,
            "for (let i = 1; i <= 10000; i++) console.log(i);",
        ));
    }
    for (i, (lang, code)) in cases.into_iter().enumerate() {
        let mut rq = req(lang, code);
        rq.stream = true;
        rq.max_output_bytes = 1 << 20;
        let (tr, resp) = r.drive(1 + i as u64, rq, |_| None);
        assert_eq!(resp.exit_code, Some(0), "{lang}: {resp:?}");
        assert_eq!(tr.text(Stream::Stdout), expected, "{lang}");
        println!(
            "{lang}: 10,000 lines in {} chunks, {} ms",
            tr.chunks.len(),
            resp.duration_ms
        );
        // A chunk per read of up to 64 KiB, and a read per 5 ms at most while the writes
        // are small: a handful, where a frame per line would be 10,000.
        assert!(
            tr.chunks.len() < 1000 + resp.duration_ms as usize / 5,
            "{lang}: {} chunks",
            tr.chunks.len()
        );
    }
}

#[test]
fn output_before_a_tool_call_is_sent_before_it() {
    let Some(mut r) = python_runner() else { return };
    let cases = [
        (
            Language::Py,
            "import sys\nfor i in range(3):\n    print('before', i)\nsys.stderr.write('err before\\n')\n\
             r = await add(a=1, b=2)\nprint('after', r)",
        ),
        (
            Language::Bash,
            "for i in 0 1 2; do echo before $i; done; echo 'err before' >&2\n\
             r=$(add '{\"a\":1,\"b\":2}')\necho after $r",
        ),
    ];
    for (i, (lang, code)) in cases.into_iter().enumerate() {
        let (tr, resp) = r.drive(1 + i as u64, tool_req(lang, code), add);
        assert_eq!(resp.exit_code, Some(0), "{lang}: {tr:?}");
        assert_eq!(tr.chunks_at_call.len(), 1, "{lang}: {tr:?}");
        let before = &tr.chunks[..tr.chunks_at_call[0]];
        let text = |which: Stream| -> String {
            (before.iter().filter(|c| c.stream == which))
                .map(|c| c.data.as_str())
                .collect()
        };
        assert_eq!(
            text(Stream::Stdout),
            "before 0\nbefore 1\nbefore 2\n",
            "{lang}: {tr:?}"
        );
        assert_eq!(text(Stream::Stderr), "err before\n", "{lang}: {tr:?}");
        assert!(
            tr.text(Stream::Stdout).ends_with("after 3\n"),
            "{lang}: {tr:?}"
        );
    }
}

#[test]
fn tool_round_trip_inside_the_runner() {
    if kernel_script().is_none() {
        return;
    }
    // The runner reports the calls' mean times on its stderr.
    let mut r = Runner::start_with(&[("CODEBROKER_TOOL_TRACE", "1")]);
    let code = "for i in range(50):\n    await add(a=i, b=1)";
    let (tr, resp) = r.drive(1, tool_req(Language::Py, code), add);
    assert_eq!(resp.exit_code, Some(0), "{tr:?}");
    assert_eq!(tr.calls.len(), 50);
    let t = Instant::now();
    let code = "for i in $(seq 20); do add '{\"a\":1,\"b\":1}' >/dev/null; done";
    let (tr, _) = r.drive(2, tool_req(Language::Bash, code), add);
    assert_eq!(tr.calls.len(), 20);
    println!("bash tool call, whole command: {:?}", t.elapsed() / 20);
}

#[test]
fn workspace_growth_past_the_quota_stops_the_exec() {
    let mut r = Runner::start_with(&[
        ("CODEBROKER_WORKSPACE_QUOTA", "8388608"),
        ("CODEBROKER_WORKSPACE_MAX_FILES", "100"),
    ]);
    let resp = r.exec(
        1,
        req(
            Language::Bash,
            "head -c 1048576 /dev/urandom > keep; echo ok",
        ),
    );
    assert_eq!(resp.stdout, "ok\n");
    assert!(resp.limits.is_empty(), "{:?}", resp.limits);
    // Many small writes, slower than the watcher: stopped with the disk limit.
    let resp = r.exec(
        2,
        req(
            Language::Bash,
            "i=0; while true; do head -c 262144 /dev/zero > f$i; i=$((i+1)); done",
        ),
    );
    assert_eq!(resp.limits, vec![Limit::Disk], "{}", resp.stderr);
    assert!(
        resp.stderr.contains("Disk quota exceeded"),
        "{}",
        resp.stderr
    );
    // Over the quota, an exec that does not grow the workspace runs; one that frees space
    // too; nothing was deleted by the runner.
    let resp = r.exec(3, req(Language::Bash, "ls | wc -l; rm -f f*; ls"));
    assert!(resp.limits.is_empty(), "{:?}", resp.limits);
    assert_eq!(resp.stdout.lines().last(), Some("keep"), "{}", resp.stdout);
    // Too many files.
    let resp = r.exec(
        4,
        req(Language::Bash, "for i in $(seq 1000); do : > n$i; done"),
    );
    assert_eq!(resp.limits, vec![Limit::Disk], "{}", resp.stderr);
}

// ----- Installs across runners -----

#[test]
fn installs_packed_in_one_runner_are_unpacked_in_another() {
    let mut a = Runner::start();
    // Nothing installed: nothing packed.
    let nothing = match a.ask(
        1,
        CoordinatorMessage::PackInstalls(sandbox_runner::PackInstallsRequest {
            max_bytes: 1 << 20,
        }),
    ) {
        WorkerMessage::InstallsPacked(p) => p,
        other => panic!("{other:?}"),
    };
    assert_eq!((nothing.bytes, nothing.error), (0, None));
    let made = a.exec(
        2,
        req(
            Language::Bash,
            "mkdir -p .local/lib/site/pkg node_modules/.bin node_modules/tool \
             && echo 'VALUE = 7' > .local/lib/site/pkg/__init__.py \
             && printf '#!/bin/sh\necho tool ran\n' > node_modules/tool/cli \
             && chmod 755 node_modules/tool/cli && ln -s ../tool/cli node_modules/.bin/tool \
             && echo mine > data.txt",
        ),
    );
    assert_eq!(made.exit_code, Some(0), "{made:?}");
    let packed = match a.ask(
        3,
        CoordinatorMessage::PackInstalls(sandbox_runner::PackInstallsRequest {
            max_bytes: 1 << 20,
        }),
    ) {
        WorkerMessage::InstallsPacked(p) => p,
        other => panic!("{other:?}"),
    };
    assert_eq!(packed.error, None, "{packed:?}");
    let bytes = a.read_state_file(4, sandbox_runner::StateFile::Installs, 4096);
    assert_eq!(bytes.len() as u64, packed.bytes);

    let mut b = Runner::start();
    b.write_state_file(1, sandbox_runner::StateFile::Installs, &bytes, 3000);
    let unpacked = match b.ask(
        2,
        CoordinatorMessage::UnpackInstalls(sandbox_runner::UnpackInstallsRequest {
            max_bytes: bytes.len() as u64,
        }),
    ) {
        WorkerMessage::InstallsUnpacked(u) => u,
        other => panic!("{other:?}"),
    };
    assert_eq!((unpacked.error, unpacked.entries), (None, packed.entries));
    let resp = b.exec(
        3,
        req(
            Language::Bash,
            "cat .local/lib/site/pkg/__init__.py; node_modules/.bin/tool; ls data.txt",
        ),
    );
    assert_eq!(resp.stdout, "VALUE = 7\ntool ran\n", "{resp:?}");
    assert!(
        resp.stderr.contains("No such file"),
        "only installs: {resp:?}"
    );
}

// ----- Python state across runners -----

impl Runner {
    /// Sends a request and returns the message that answers it.
    fn ask(&mut self, job: JobId, msg: CoordinatorMessage) -> WorkerMessage {
        self.send(job, msg);
        let (j, answer) = self.recv();
        assert_eq!(j, job, "{answer:?}");
        answer
    }

    /// The state file's bytes, read in chunks of `len`.
    fn read_state(&mut self, job: JobId, len: u32) -> Vec<u8> {
        self.read_state_file(job, sandbox_runner::StateFile::Python, len)
    }

    /// The bytes of `file` of the state directory, read in chunks of `len`.
    fn read_state_file(
        &mut self,
        job: JobId,
        file: sandbox_runner::StateFile,
        len: u32,
    ) -> Vec<u8> {
        let mut bytes = Vec::new();
        loop {
            let req = sandbox_runner::ReadStateRequest {
                file,
                offset: bytes.len() as u64,
                len,
            };
            match self.ask(job, CoordinatorMessage::ReadState(req)) {
                WorkerMessage::FileChunk(chunk) => {
                    assert!(chunk.data.len() <= len as usize);
                    bytes.extend_from_slice(&chunk.data);
                    if chunk.eof {
                        return bytes;
                    }
                }
                other => panic!("{other:?}"),
            }
        }
    }

    /// Writes `bytes` as the state file in chunks of `len`.
    fn write_state(&mut self, job: JobId, bytes: &[u8], len: usize) {
        self.write_state_file(job, sandbox_runner::StateFile::Python, bytes, len);
    }

    /// Writes `bytes` as `file` of the state directory in chunks of `len`.
    fn write_state_file(
        &mut self,
        job: JobId,
        file: sandbox_runner::StateFile,
        bytes: &[u8],
        len: usize,
    ) {
        for (i, piece) in bytes.chunks(len).enumerate() {
            let req = sandbox_runner::WriteStateRequest {
                file,
                offset: (i * len) as u64,
                data: piece.to_vec(),
                create: i == 0,
            };
            let answer = self.ask(job, CoordinatorMessage::WriteState(req));
            assert!(
                matches!(answer, WorkerMessage::FileWritten(_)),
                "{answer:?}"
            );
        }
    }

    fn save_state(&mut self, job: JobId, max_bytes: u64) -> sandbox_runner::StateSaved {
        let req = sandbox_runner::SaveStateRequest {
            max_bytes,
            timeout_ms: 20_000,
        };
        match self.ask(job, CoordinatorMessage::SaveState(req)) {
            WorkerMessage::StateSaved(saved) => saved,
            other => panic!("{other:?}"),
        }
    }

    fn restore_state(&mut self, job: JobId, max_bytes: u64) -> sandbox_runner::StateRestored {
        let req = sandbox_runner::RestoreStateRequest {
            max_bytes,
            timeout_ms: 20_000,
        };
        match self.ask(job, CoordinatorMessage::RestoreState(req)) {
            WorkerMessage::StateRestored(restored) => restored,
            other => panic!("{other:?}"),
        }
    }
}

fn cloudpickle_on_host() -> bool {
    let found = Command::new("python3")
        .args(["-c", "import cloudpickle"])
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        println!("note: no cloudpickle for python3 on this host; skipping the state tests");
    }
    found
}

#[test]
fn py_state_moves_to_another_runner_and_says_what_it_left_out() {
    let Some(mut a) = python_runner() else { return };
    if !cloudpickle_on_host() {
        return;
    }
    // A kernel that ran no code has nothing to save.
    let nothing = a.save_state(1, 1 << 20);
    assert_eq!(
        (nothing.bytes, nothing.error.as_deref()),
        (0, None),
        "{nothing:?}"
    );
    let code = "import os\nclass Box:\n    def __init__(self, v): self.v = v\n\
                box = Box(41)\nlog = open(os.devnull, 'w')\nbig = bytes(300_000)";
    assert_eq!(a.exec(2, req(Language::Py, code)).exit_code, Some(0));
    let saved = a.save_state(3, 100_000);
    assert_eq!((saved.saved, saved.modules), (2, 1), "{saved:?}"); // Box, box; os
    let why: Vec<(&str, &str)> = saved
        .skipped
        .iter()
        .map(|n| (n.name.as_str(), n.why.as_str()))
        .collect();
    assert_eq!(
        why,
        [
            ("log", "an open file"),
            ("big", "too large: the saved state may hold 100000 bytes")
        ]
    );
    let bytes = a.read_state(4, 1000);
    assert_eq!(bytes.len() as u64, saved.bytes);

    let Some(mut b) = python_runner() else { return };
    b.write_state(1, &bytes, 700);
    let restored = b.restore_state(2, 100_000);
    assert_eq!(
        (restored.restored, restored.error.as_deref()),
        (3, None),
        "{restored:?}"
    );
    let resp = b.exec(
        3,
        req(Language::Py, "print(box.v + 1, type(box) is Box, os.sep)"),
    );
    assert_eq!(resp.stdout, "42 True /\n", "{resp:?}");
    assert_eq!(resp.runtime_status, RuntimeStatus::Reused);
    // The file went with the restore; a kernel that ran code takes no state.
    assert!(matches!(
        b.ask(
            4,
            CoordinatorMessage::ReadState(sandbox_runner::ReadStateRequest {
                file: sandbox_runner::StateFile::Python,
                offset: 0,
                len: 10
            })
        ),
        WorkerMessage::Error(_)
    ));
    b.write_state(5, &bytes, 1 << 20);
    let refused = b.restore_state(6, 100_000);
    assert_eq!(
        refused.error.as_deref(),
        Some("the kernel has run code already")
    );
}

#[test]
fn py_bad_saved_state_is_refused_and_the_next_exec_starts_fresh() {
    let Some(mut r) = python_runner() else { return };
    // No file at all, damaged bytes, and a file over the bound: each refused, the kernel
    // unharmed, the exec after them a fresh start.
    let none = r.restore_state(1, 1000);
    assert!(none.error.unwrap().starts_with("no saved state"));
    r.write_state(2, &[b'y'; 100], 30);
    let damaged = r.restore_state(3, 1000);
    assert_eq!(
        damaged.error.as_deref(),
        Some("not a saved state"),
        "{damaged:?}"
    );
    r.write_state(4, &[b'x'; 2000], 1000);
    let over = r.restore_state(5, 1000);
    assert_eq!(
        over.error.as_deref(),
        Some("the saved state has 2000 bytes, more than the 1000 allowed")
    );
    let resp = r.exec(
        6,
        req(
            Language::Py,
            "print('fresh', len([k for k in globals() if not k.startswith('__')]))",
        ),
    );
    assert_eq!(resp.stdout, "fresh 0\n", "{resp:?}");
    assert_eq!(resp.runtime_status, RuntimeStatus::New);
}
