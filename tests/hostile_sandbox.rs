//! Hostile code inside a sandbox: every attack is contained, the attacked session (or a
//! fresh one, where the attack must end it) answers `echo ok` within 2 s afterwards (5 s
//! under gVisor, `CODEBROKER_RUNTIME=runsc`), and a session started before the attack
//! never notices it.

mod common;

use common::{session, stderr, stdout, TestBroker};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// Generous bound for an exec that hits a limit: its time limit plus the sweep, the drain
/// and a busy shared machine.
const SLACK: Duration = Duration::from_secs(20);

/// A broker with a bystander session already running, for one attack.
struct Arena {
    broker: TestBroker,
    /// A session started before the attack; it must not notice it.
    bystander: String,
}

impl Arena {
    async fn start(tag: &str) -> Arena {
        Self::start_with(tag, |_| {}).await
    }

    async fn start_with(tag: &str, adjust: impl FnOnce(&mut codebroker::config::Config)) -> Arena {
        let broker = TestBroker::start_with(tag, adjust).await;
        let first = broker.run("bash", "echo ok", None).await;
        assert_eq!(stdout(&first).trim(), "ok", "{first}");
        let bystander = session(&first);
        Arena { broker, bystander }
    }

    /// A new session ready for the attack: its sandbox is started by a first `echo`.
    async fn victim(&self) -> String {
        let first = self.broker.run("bash", "echo ok", None).await;
        assert_eq!(stdout(&first).trim(), "ok", "{first}");
        session(&first)
    }

    /// Runs the attack with `timeout_ms`; it must answer 200 within that limit plus slack.
    async fn attack(&self, session: &str, lang: &str, code: &str, timeout_ms: u64) -> Value {
        let started = Instant::now();
        let (status, resp) = self
            .broker
            .exec(json!({
                "lang": lang, "code": code, "session_id": session, "timeout": timeout_ms,
            }))
            .await;
        let took = started.elapsed();
        eprintln!("attack answered in {took:?} (limit {timeout_ms} ms)");
        assert_eq!(status, 200, "{resp}");
        assert!(
            took < Duration::from_millis(timeout_ms) + SLACK,
            "the attack took {took:?}: {resp}"
        );
        resp
    }

    /// The attacked session and the bystander each run `echo ok` within 2 s.
    async fn still_fine(&self, session: &str) {
        echo_ok(&self.broker, session).await;
        echo_ok(&self.broker, &self.bystander).await;
    }
}

/// How soon `echo ok` must answer after an attack: 2 s; 5 s under gVisor, where every
/// syscall goes through its kernel and a sandbox the attack ended (a memory bomb ends the
/// whole sandbox there) takes longer to start anew.
fn echo_bound() -> Duration {
    match std::env::var("CODEBROKER_RUNTIME") {
        Ok(r) if r.trim() == "runsc" => Duration::from_secs(5),
        _ => Duration::from_secs(2),
    }
}

/// How many times the overshoot bounds of the workspace quota stretch: 1; 2 under gVisor,
/// where the runner's walks of the workspace go through its kernel and take longer, so
/// writers get further between two of them (seen: 160 MB at a 64 MiB quota, four threads).
fn quota_slack() -> u64 {
    match std::env::var("CODEBROKER_RUNTIME") {
        Ok(r) if r.trim() == "runsc" => 2,
        _ => 1,
    }
}

/// `echo ok` in `session` answers `ok` within [`echo_bound`].
async fn echo_ok(broker: &TestBroker, session: &str) {
    let started = Instant::now();
    let resp = broker.run("bash", "echo ok", Some(session)).await;
    let took = started.elapsed();
    assert_eq!(stdout(&resp).trim(), "ok", "{resp}");
    assert_eq!(resp["session_id"], session, "{resp}");
    assert!(took < echo_bound(), "echo ok took {took:?}");
}

fn limits(resp: &Value) -> Vec<String> {
    resp["limits"]
        .as_array()
        .map(|l| {
            l.iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// The broker's memory grew by less than this during an output flood.
const RSS_GROWTH_BOUND: u64 = 100 * 1024 * 1024;

/// Counts the processes of the sandbox other than the runner (PID 1), the idle Python
/// kernel, this script and the pipeline it runs.
const COUNT_PROCESSES: &str = "ps -eo pid=,ppid=,args= | awk -v me=$$ '$1 != 1 && $1 != me && $2 != me && !/kernel.py/' | wc -l";

// ----- processes -----

#[tokio::test]
async fn a_bash_fork_bomb_is_contained() {
    let arena = Arena::start("forkbomb").await;
    let s = arena.victim().await;
    // The bomb goes on in the background while the script sleeps, until the sweep.
    let resp = arena
        .attack(&s, "bash", ":(){ :|:& };:\nsleep 2", 4000)
        .await;
    assert!(
        stderr(&resp).contains("Resource temporarily unavailable"),
        "the bomb did not reach the pids limit: {}",
        short(&resp)
    );
    arena.still_fine(&s).await;
    let left = arena.broker.run("bash", COUNT_PROCESSES, Some(&s)).await;
    assert_eq!(stdout(&left).trim(), "0", "{left}");
}

#[tokio::test]
async fn a_python_fork_loop_is_contained() {
    let arena = Arena::start("pyfork").await;
    let s = arena.victim().await;
    let code = "import os, time\nwhile True:\n    try:\n        if os.fork() == 0:\n            time.sleep(100)\n    except OSError:\n        time.sleep(0.01)";
    let resp = arena.attack(&s, "py", code, 3000).await;
    assert!(
        limits(&resp).contains(&"Time limit exceeded".to_string()),
        "{resp}"
    );
    arena.still_fine(&s).await;
    let left = arena.broker.run("bash", COUNT_PROCESSES, Some(&s)).await;
    assert_eq!(stdout(&left).trim(), "0", "{left}");
    let py = arena.broker.run("py", "print(6 * 7)", Some(&s)).await;
    assert_eq!(stdout(&py).trim(), "42", "{py}");
}

#[tokio::test]
async fn a_multiprocessing_pool_under_memory_pressure_reports_out_of_memory() {
    let arena = Arena::start_with("mppool", |c| c.sandbox.memory_mb = 256).await;
    let s = arena.victim().await;
    let code = "import multiprocessing as mp\n\
def grab(i):\n    x = []\n    while True:\n        x.append(bytearray(8 * 1024 * 1024))\n\
with mp.Pool(64) as p:\n    p.map(grab, range(64))";
    let resp = arena.attack(&s, "py", code, 15000).await;
    assert!(
        limits(&resp).contains(&"Out of memory".to_string()),
        "{resp}"
    );
    assert!(stderr(&resp).contains("Out of memory"), "{resp}");
    arena.still_fine(&s).await;
    let py = arena.broker.run("py", "print(6 * 7)", Some(&s)).await;
    assert_eq!(stdout(&py).trim(), "42", "{py}");
}

#[tokio::test]
async fn detached_processes_are_gone_after_the_exec() {
    let arena = Arena::start("detached").await;
    let s = arena.victim().await;
    let code = "nohup sleep 1000 >/dev/null 2>&1 &\n\
setsid sleep 1001 >/dev/null 2>&1 < /dev/null &\n\
( ( sleep 1002 >/dev/null 2>&1 & ) & )\n\
setsid bash -c 'trap \"\" HUP TERM; exec -a sleep-1003 sleep 1003' >/dev/null 2>&1 &\n\
sleep 0.3; ps -eo args | grep -c '^sleep'";
    let resp = arena.attack(&s, "bash", code, 5000).await;
    let started: u32 = stdout(&resp).trim().parse().expect("a count");
    assert!(started >= 4, "the leftovers did not even start: {resp}");
    let check = arena
        .broker
        .run("bash", "ps -eo args | grep -c '^sleep' || true", Some(&s))
        .await;
    assert_eq!(stdout(&check).trim(), "0", "{check}");
    arena.still_fine(&s).await;
}

#[tokio::test]
async fn kill_stop_everything_is_contained() {
    let arena = Arena::start("killstop").await;
    let s = arena.victim().await;
    // The kernel is running (and stopped along with the rest).
    arena.broker.run("py", "x = 1", Some(&s)).await;
    let resp = arena
        .attack(&s, "bash", "kill -STOP -1; echo after", 3000)
        .await;
    // `kill -1` spares the caller: the script goes on, everything else was stopped.
    assert_eq!(stdout(&resp).trim(), "after", "{resp}");
    arena.still_fine(&s).await;
    let py = arena.broker.run("py", "print(x + 1)", Some(&s)).await;
    assert_eq!(stdout(&py).trim(), "2", "the kernel was woken up: {py}");
}

#[tokio::test]
async fn kill_9_everything_is_contained() {
    let arena = Arena::start("kill9").await;
    let s = arena.victim().await;
    arena.broker.run("py", "x = 1", Some(&s)).await;
    let resp = arena
        .attack(&s, "bash", "kill -9 -1; echo after", 3000)
        .await;
    assert_eq!(stdout(&resp).trim(), "after", "{resp}");
    assert!(
        !limits(&resp).contains(&"Out of memory".to_string()),
        "{resp}"
    );
    arena.still_fine(&s).await;
    // The kernel died with everything else: a fresh one answers.
    let py = arena.broker.run("py", "print(6 * 7)", Some(&s)).await;
    assert_eq!(stdout(&py).trim(), "42", "{py}");
    assert_eq!(py["runtime_status"], "new", "{py}");
}

#[tokio::test]
async fn killing_the_python_kernel_is_contained() {
    let arena = Arena::start("killkernel").await;
    let s = arena.victim().await;
    let resp = arena
        .attack(&s, "py", "import os\nos.kill(os.getpid(), 9)", 3000)
        .await;
    assert!(resp["exit_code"].is_null(), "{resp}");
    assert!(stderr(&resp).contains("killed by signal 9"), "{resp}");
    // A kill is not mistaken for the OOM killer's.
    assert!(
        !limits(&resp).contains(&"Out of memory".to_string()),
        "{resp}"
    );
    arena.still_fine(&s).await;
    let py = arena.broker.run("py", "print(6 * 7)", Some(&s)).await;
    assert_eq!(stdout(&py).trim(), "42", "{py}");
    assert_eq!(py["runtime_status"], "new", "{py}");
}

#[tokio::test]
async fn closing_every_fd_of_the_kernel_is_contained() {
    let arena = Arena::start("closefds").await;
    let s = arena.victim().await;
    let resp = arena
        .attack(
            &s,
            "py",
            "import os\nos.closerange(0, 1024)\nprint('gone')",
            3000,
        )
        .await;
    assert!(!stdout(&resp).contains("gone"), "{resp}");
    arena.still_fine(&s).await;
    let py = arena.broker.run("py", "print(6 * 7)", Some(&s)).await;
    assert_eq!(stdout(&py).trim(), "42", "{py}");
}

#[tokio::test]
async fn nproc_reports_no_more_cpus_than_the_limit() {
    let arena = Arena::start_with("nproc", |c| c.sandbox.cpus = 1.0).await;
    let s = arena.victim().await;
    let resp = arena
        .attack(
            &s,
            "bash",
            "nproc; python3 -c 'import os; print(len(os.sched_getaffinity(0)))'",
            5000,
        )
        .await;
    let counts: Vec<u32> = stdout(&resp)
        .lines()
        .map(|l| l.trim().parse().expect("a number"))
        .collect();
    assert_eq!(counts, [1, 1], "{resp}");
    let py = arena
        .broker
        .run(
            "py",
            "import os\nprint(len(os.sched_getaffinity(0)))",
            Some(&s),
        )
        .await;
    assert_eq!(stdout(&py).trim(), "1", "{py}");
    arena.still_fine(&s).await;
}

// ----- memory -----

#[tokio::test]
async fn a_memory_bomb_reports_out_of_memory_and_the_runner_survives() {
    let arena = Arena::start_with("membomb", |c| c.sandbox.memory_mb = 256).await;
    let s = arena.victim().await;
    let container = arena.broker.containers();
    let resp = arena
        .attack(
            &s,
            "bash",
            "python3 -c 'x = []\nwhile True: x.append(bytearray(16 << 20))'",
            10000,
        )
        .await;
    assert!(
        limits(&resp).contains(&"Out of memory".to_string()),
        "{resp}"
    );
    assert!(stderr(&resp).contains("Out of memory"), "{resp}");
    // Under runc the runner (PID 1) survives and the same container keeps serving the
    // session; under runsc the host ends the whole sandbox and the session gets a new one.
    // Either way none is left behind.
    arena.still_fine(&s).await;
    assert_eq!(arena.broker.containers().len(), container.len());
    let again = arena
        .attack(&s, "py", "x = b'x' * (512 << 20)", 10000)
        .await;
    assert!(
        limits(&again).contains(&"Out of memory".to_string()),
        "{again}"
    );
    arena.still_fine(&s).await;
    assert_eq!(arena.broker.containers().len(), container.len());
}

/// Several sandboxes at their memory limit at once, two rounds: each is reported out of
/// memory. Under gVisor the OOM killer then sometimes takes one of gVisor's own processes
/// instead of its kernel, and that sandbox exits with another code than 137 (2 here, for
/// one to four of the eight); the engine's `oom` event still says what happened.
#[tokio::test]
async fn memory_bombs_in_several_sandboxes_at_once_each_report_out_of_memory() {
    let broker = TestBroker::start_with("membombs", |c| c.sandbox.memory_mb = 256).await;
    let bomb = "x = []\nwhile True: x.append(bytearray(8 << 20))";
    for round in 0..2 {
        let answers = futures::future::join_all(
            (0..4).map(|_| broker.exec(json!({"lang": "py", "code": bomb, "timeout": 20000}))),
        )
        .await;
        for (status, resp) in answers {
            assert_eq!(status, 200, "round {round}: {resp}");
            assert!(
                limits(&resp).contains(&"Out of memory".to_string()),
                "round {round}: {resp}"
            );
        }
    }
    let out = broker.run("py", "print(6 * 7)", None).await;
    assert_eq!(stdout(&out).trim(), "42", "{out}");
}

#[tokio::test]
async fn a_sandbox_killed_after_an_out_of_memory_is_not_reported_as_one() {
    let arena = Arena::start_with("oomthenkill", |c| c.sandbox.memory_mb = 256).await;
    let s = arena.victim().await;
    // An OOM kill first: the engine's `OOMKilled` stays set for the container's life
    // (under runc the runner survives it; under runsc the sandbox is replaced).
    let bomb = arena
        .attack(&s, "py", "x = b'x' * (512 << 20)", 10000)
        .await;
    assert!(
        limits(&bomb).contains(&"Out of memory".to_string()),
        "{bomb}"
    );
    echo_ok(&arena.broker, &s).await;
    let victim = common::docker::container_of(&arena.broker.instance, &s);
    // Then the container is killed from outside during an exec: not a memory limit.
    let killer = tokio::task::spawn_blocking(move || {
        std::thread::sleep(Duration::from_secs(2));
        common::docker::kill_container(&victim)
    });
    let resp = arena.attack(&s, "bash", "sleep 30", 40000).await;
    assert!(killer.await.expect("killer").status.success());
    assert!(
        !limits(&resp).contains(&"Out of memory".to_string()),
        "{resp}"
    );
    assert!(stderr(&resp).contains("stopped unexpectedly"), "{resp}");
    arena.still_fine(&s).await;
}

// ----- output -----

/// Runs a flood and checks the answer is capped, reported and timely, and that the
/// broker's memory stayed bounded.
async fn flood(tag: &str, lang: &str, code: &str, expect: &str) -> Value {
    let arena = Arena::start(tag).await;
    let s = arena.victim().await;
    let before = common::rss_bytes();
    let resp = arena.attack(&s, lang, code, 20000).await;
    let after = common::rss_bytes();
    eprintln!("broker RSS {before} -> {after} bytes");
    assert!(
        after.saturating_sub(before) < RSS_GROWTH_BOUND,
        "broker memory grew from {before} to {after} bytes"
    );
    assert!(
        limits(&resp).contains(&expect.to_string()),
        "{}",
        short(&resp)
    );
    assert!(stderr(&resp).contains(expect), "{}", short(&resp));
    // The cap counts the program's bytes; an invalid byte becomes U+FFFD (3 bytes).
    assert!(
        stdout(&resp).len() <= 3 * 64 * 1024 + 1024,
        "stdout {}",
        stdout(&resp).len()
    );
    assert!(
        stderr(&resp).len() <= 3 * 64 * 1024 + 1024,
        "stderr {}",
        stderr(&resp).len()
    );
    arena.still_fine(&s).await;
    resp
}

/// A response with its output cut, for assertion messages.
fn short(resp: &Value) -> String {
    let mut r = resp.clone();
    for k in ["stdout", "stderr"] {
        if let Some(s) = r[k].as_str() {
            r[k] = json!(s.chars().take(200).collect::<String>());
        }
    }
    r.to_string()
}

#[tokio::test]
async fn a_200_mb_stdout_flood_is_capped() {
    flood(
        "flood200",
        "bash",
        "head -c 200000000 /dev/zero | tr '\\0' 'x' | fold -w 100",
        "stdout length exceeded",
    )
    .await;
}

#[tokio::test]
async fn a_50_mb_line_without_newline_is_capped() {
    let resp = flood(
        "line50",
        "bash",
        "head -c 50000000 /dev/zero | tr '\\0' 'y'",
        "stdout length exceeded",
    )
    .await;
    assert!(stdout(&resp).starts_with("yyyy"), "{}", short(&resp));
}

#[tokio::test]
async fn binary_junk_on_stderr_is_capped_and_valid_text() {
    let resp = flood(
        "junk",
        "bash",
        "printf '\\xff\\xfe\\xc3\\x28 invalid \\xed\\xa0\\x80\\n' >&2; head -c 20000000 /dev/urandom >&2",
        "stderr length exceeded",
    )
    .await;
    // serde_json parsed it, so it is valid UTF-8; invalid sequences became U+FFFD.
    assert!(stderr(&resp).contains('\u{FFFD}'), "{}", short(&resp));
    assert!(stderr(&resp).contains("invalid"), "{}", short(&resp));
}

// ----- disk -----

/// Workspace quota and file cap small enough to hit fast.
const QUOTA: u64 = 64 * 1024 * 1024;
const MAX_FILES: u64 = 2000;

async fn quota_arena(tag: &str) -> Arena {
    Arena::start_with(tag, |c| {
        c.sandbox.workspace_quota = QUOTA;
        c.sandbox.workspace_max_files = MAX_FILES;
    })
    .await
}

/// Writes `keep.bin` (1 MiB of random bytes) and returns its SHA-256.
async fn keep_file(arena: &Arena, s: &str) -> String {
    let resp = arena
        .broker
        .run(
            "bash",
            "head -c 1048576 /dev/urandom > keep.bin && sha256sum keep.bin | cut -d' ' -f1",
            Some(s),
        )
        .await;
    let sum = stdout(&resp).trim().to_string();
    assert_eq!(sum.len(), 64, "{resp}");
    sum
}

async fn keep_file_intact(arena: &Arena, s: &str, sum: &str) {
    let resp = arena
        .broker
        .run("bash", "sha256sum keep.bin | cut -d' ' -f1", Some(s))
        .await;
    assert_eq!(stdout(&resp).trim(), sum, "{resp}");
}

/// Four threads writing 8 MiB files in 1 MiB writes, forever.
const THREADED_WRITER: &str = r#"import threading
def w(t):
    i = 0
    while True:
        with open(f'w{t}-{i}', 'wb') as f:
            for _ in range(8):
                f.write(b'z' * (1 << 20))
        i += 1
ts = [threading.Thread(target=w, args=(t,), daemon=True) for t in range(4)]
[t.start() for t in ts]
[t.join() for t in ts]"#;

/// Allocated bytes under the workspace, as `du` counts them.
async fn workspace_bytes(arena: &Arena, s: &str) -> u64 {
    let du = arena
        .broker
        .run("bash", "du -sb --apparent-size . | cut -f1", Some(s))
        .await;
    let used = stdout(&du).trim().parse().expect("a size");
    eprintln!("workspace: {used} bytes, quota {QUOTA}");
    used
}

#[tokio::test]
async fn a_workspace_writer_is_stopped_at_the_quota() {
    let arena = quota_arena("quota").await;
    let s = arena.victim().await;
    let sum = keep_file(&arena, &s).await;
    // Many files, each under the per-file limit, written slowly enough to be seen.
    let code =
        "i=0; while true; do head -c 4194304 /dev/zero > fill-$i.bin || exit 9; i=$((i+1)); done";
    let resp = arena.attack(&s, "bash", code, 20000).await;
    assert!(
        limits(&resp).contains(&"Disk quota exceeded".to_string()),
        "{resp}"
    );
    assert!(stderr(&resp).contains("Disk quota exceeded"), "{resp}");
    keep_file_intact(&arena, &s, &sum).await;
    arena.still_fine(&s).await;
    // Overshoot bounded: under twice the quota.
    let du = arena
        .broker
        .run("bash", "du -sb --apparent-size . | cut -f1", Some(&s))
        .await;
    let used: u64 = stdout(&du).trim().parse().expect("a size");
    eprintln!("workspace after the writer: {used} bytes, quota {QUOTA}");
    assert!(
        used < 2 * QUOTA * quota_slack(),
        "{used} bytes in the workspace"
    );

    // One big file stops at the file size limit, which is the quota.
    let py = arena
        .attack(
            &s,
            "py",
            "import os\nos.remove('fill-0.bin')\nwith open('one.bin', 'wb') as f:\n    while True:\n        f.write(b'z' * (1 << 20))",
            20000,
        )
        .await;
    assert!(
        limits(&py).contains(&"Disk quota exceeded".to_string()),
        "{py}"
    );
    keep_file_intact(&arena, &s, &sum).await;
    arena.still_fine(&s).await;
    // Threads of the kernel (an interrupt would stop only its main thread).
    arena
        .broker
        .run("bash", "rm -f fill-* one.bin", Some(&s))
        .await;
    let threads = arena.attack(&s, "py", THREADED_WRITER, 20000).await;
    assert!(
        limits(&threads).contains(&"Disk quota exceeded".to_string()),
        "{}",
        short(&threads)
    );
    // Four threads write between two walks: tens of MiB on a quiet host, up to about
    // 80 MiB over the quota seen while the rest of this suite loads both cores.
    let used = workspace_bytes(&arena, &s).await;
    assert!(
        used < 3 * QUOTA * quota_slack(),
        "{used} bytes in the workspace"
    );
    keep_file_intact(&arena, &s, &sum).await;
    arena.still_fine(&s).await;

    // Threads left writing after the exec ended: the idle kernel is stopped.
    arena.broker.run("bash", "rm -f w*", Some(&s)).await;
    // The threads wait a second before writing, so the exec that starts them has ended
    // (under gVisor a new kernel's print can otherwise come after the quota is hit).
    let code = THREADED_WRITER
        .replace("    i = 0\n", "    import time; time.sleep(1)\n    i = 0\n")
        .replace("[t.join() for t in ts]", "print('started')");
    assert!(code.contains("time.sleep(1)"), "{code}");
    let bg = arena.broker.run("py", &code, Some(&s)).await;
    assert_eq!(stdout(&bg).trim(), "started", "{}", short(&bg));
    tokio::time::sleep(Duration::from_secs(3)).await;
    // Unlike an exec's, these writes start when nothing watches closely yet; the overshoot
    // is what four threads write in one idle interval plus one walk (a few tens of MiB
    // here; more on a loaded host), so the bound is looser, and still a bound.
    let used = workspace_bytes(&arena, &s).await;
    assert!(used < 4 * QUOTA * quota_slack(), "{used} bytes");
    let py = arena.broker.run("py", "print(6 * 7)", Some(&s)).await;
    assert_eq!(py["runtime_status"], "new", "the kernel was replaced: {py}");
    keep_file_intact(&arena, &s, &sum).await;
    arena.still_fine(&s).await;
}

#[tokio::test]
async fn a_workspace_file_count_cap_stops_file_floods() {
    let arena = quota_arena("inodes-data").await;
    let s = arena.victim().await;
    let sum = keep_file(&arena, &s).await;
    let code =
        "mkdir -p many && cd many && i=0; while [ $i -lt 1000000 ]; do : > f$i; i=$((i+1)); done";
    let resp = arena.attack(&s, "bash", code, 20000).await;
    assert!(
        limits(&resp).contains(&"Disk quota exceeded".to_string()),
        "{resp}"
    );
    keep_file_intact(&arena, &s, &sum).await;
    arena.still_fine(&s).await;
    let count = arena.broker.run("bash", "ls many | wc -l", Some(&s)).await;
    let n: u64 = stdout(&count).trim().parse().expect("a count");
    eprintln!("files made before the cap stopped the flood: {n}, cap {MAX_FILES}");
    assert!(n < 1_000_000, "{count}");
}

/// Fills a tmpfs: `No space left on device` reported, next exec fine, space freed.
async fn fill_tmpfs(tag: &str, dir: &str) {
    let arena = Arena::start_with(tag, |c| {
        c.sandbox.tmp_mb = 32;
        c.sandbox.shm_mb = 16;
    })
    .await;
    let s = arena.victim().await;
    let code = format!("cat /dev/zero > {dir}/fill; df -k {dir} | tail -1");
    let resp = arena.attack(&s, "bash", &code, 10000).await;
    assert!(stderr(&resp).contains("No space left on device"), "{resp}");
    assert!(
        limits(&resp).contains(&"Disk quota exceeded".to_string()),
        "{resp}"
    );
    assert!(stderr(&resp).contains(&format!("{dir} full")), "{resp}");
    arena.still_fine(&s).await;
    // What the exec wrote there is gone, so even a compiler finds room again.
    let c = arena
        .broker
        .run(
            "c",
            "#include <stdio.h>\nint main(void) { puts(\"ok\"); return 0; }",
            Some(&s),
        )
        .await;
    assert_eq!(stdout(&c).trim(), "ok", "{c}");
}

#[tokio::test]
async fn filling_tmp_stops_at_its_size() {
    fill_tmpfs("filltmp", "/tmp").await;
}

#[tokio::test]
async fn filling_dev_shm_stops_at_its_size() {
    fill_tmpfs("fillshm", "/dev/shm").await;
}

#[tokio::test]
async fn a_million_files_in_tmp_is_contained() {
    let arena = Arena::start_with("inodes-tmp", |c| c.sandbox.tmp_mb = 32).await;
    let s = arena.victim().await;
    let code = "mkdir -p /tmp/many && cd /tmp/many && python3 -c '\nimport os\nfor i in range(1000000):\n    open(str(i), \"w\").close()'";
    let resp = arena.attack(&s, "bash", code, 20000).await;
    let text = stderr(&resp);
    assert!(
        text.contains("No space left on device")
            || limits(&resp).contains(&"Time limit exceeded".to_string()),
        "{}",
        short(&resp)
    );
    arena.still_fine(&s).await;
    arena.broker.run("bash", "rm -rf /tmp/many", Some(&s)).await;
    echo_ok(&arena.broker, &s).await;
}

#[tokio::test]
async fn a_huge_sparse_file_is_neither_read_nor_hashed() {
    let arena = Arena::start("sparse").await;
    let s = arena.victim().await;
    let resp = arena
        .attack(
            &s,
            "bash",
            "truncate -s 100T /mnt/data/big; ls -s /mnt/data/big",
            5000,
        )
        .await;
    // The file size limit (the quota, 1 GiB by default) stops it at once.
    assert!(stderr(&resp).contains("File size limit exceeded"), "{resp}");
    let files = resp["files"].as_array().cloned().unwrap_or_default();
    assert!(
        files.iter().all(|f| f["name"] != "big" || f["size"] == 0),
        "a sparse giant was harvested: {resp}"
    );
    arena.still_fine(&s).await;
    // With no file size limit and no quota, the file is made (10 TiB: ext4 allows no
    // more than 16), and the broker neither reads nor hashes it.
    let arena = Arena::start_with("sparse-nofsize", |c| {
        c.sandbox.fsize_mb = 1 << 30;
        c.sandbox.workspace_quota = 0;
    })
    .await;
    let s = arena.victim().await;
    let started = Instant::now();
    let resp = arena
        .attack(
            &s,
            "bash",
            "truncate -s 10T /mnt/data/big && echo made",
            5000,
        )
        .await;
    assert_eq!(stdout(&resp).trim(), "made", "{resp}");
    assert!(started.elapsed() < Duration::from_secs(10), "{resp}");
    let files = resp["files"].as_array().cloned().unwrap_or_default();
    assert!(files.iter().all(|f| f["name"] != "big"), "{resp}");
    assert!(
        stderr(&resp).contains("big"),
        "the skip is explained: {resp}"
    );
    arena.still_fine(&s).await;
}

#[tokio::test]
async fn new_sessions_are_refused_when_the_data_volume_is_low() {
    // A session made before the disk ran low, on a broker that is then restarted with a
    // threshold no volume can meet (as if the volume had filled up meanwhile).
    let first = TestBroker::start("lowdisk").await;
    let existing = session(&first.run("bash", "echo ok", None).await);
    let (instance, data) = (first.instance.clone(), first.data.clone());
    let _tmp = first.stop().await;
    let mut config = codebroker::config::Config::for_tests(data, &instance);
    config.pool.pool_size = 0;
    config.caps.min_free_disk = u64::MAX / 2;
    let broker = TestBroker::serve(config).await;

    let (status, resp) = broker
        .exec(json!({ "lang": "bash", "code": "echo hi" }))
        .await;
    assert_eq!(status, 503, "{resp}");
    assert_eq!(resp["error"], "unavailable", "{resp}");
    let message = resp["message"].as_str().unwrap_or_default();
    assert!(message.contains("data volume is low"), "{resp}");
    let upload = broker
        .client
        .post(broker.url("/upload"))
        .multipart(reqwest::multipart::Form::new().part(
            "file",
            reqwest::multipart::Part::bytes(b"x".to_vec()).file_name("x.txt"),
        ))
        .send()
        .await
        .expect("upload");
    assert_eq!(
        upload.status(),
        503,
        "uploads into a new session are refused too"
    );
    // The session that existed keeps running.
    echo_ok(&broker, &existing).await;
}
