//! End-to-end tests of the runner binary on the host: a runner per test, speaking frames
//! over its stdin/stdout, with a temporary workspace.
//!
//! On a host the runner is not PID 1, so its sweep kills only its own descendants; these
//! tests never signal anything themselves except their own runner.

use sandbox_runner::{
    CoordinatorMessage, ExecRequest, ExecResponse, HelloRequest, JobId, Language, Limit,
    Multiplexed, OutputChunk, RuntimeStatus, Stream, WorkerMessage,
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
    rq.timeout_ms = 300;
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
        CoordinatorMessage::Hello(HelloRequest { start_kernel: true }),
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
    // A SIGKILL we did not send counts as the OOM killer's.
    assert_eq!(resp.limits, vec![Limit::Memory]);
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
