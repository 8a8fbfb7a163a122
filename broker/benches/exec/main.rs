//! `make bench`: the broker's latency, throughput and footprint, each beside its goal and
//! its baseline, measured in one run and printed as one table (this machine is shared and
//! noisy, so only same-run numbers compare).
//!
//! Rows: warm `print(1)` through `/exec` (baseline: `docker exec` into the same
//! container); the first exec of a new session with the pool warm and without a pool
//! (baseline: `docker run --rm`); 20 new sessions at once (the first burst, then again
//! with the pool grown, and where a burst of cold starts spends its CPU); 8 sessions x 200 warm execs in
//! parallel; 10,000 lines of output in one `print` and in a `print` loop; a new session
//! whose first exec imports pandas and plots, paced like chat turns, with and without the
//! pool's preload (and both again under gVisor); a 1 MiB upload read by an exec; 100 MiB up and down;
//! 100 MiB written by an exec and brought down, through each file path (host and runner);
//! 200 idle sessions held (broker RSS, memory per container); a C program compiled, then
//! rerun from the compile cache; the first `import pandas`; a tool-call round trip; a
//! LibreChat-like churn of many users (containers alive and memory over time); E2B's
//! create to first `run_code`, and a warm `run_code` beside a warm `/exec`.
//!
//! `BENCH_QUICK=1` runs every row with small counts (a smoke run of a minute or two);
//! `BENCH_N` multiplies the counts of the full run. `BENCH_ROWS=warm,new` runs only the
//! named groups (`warm`, `new`, `chat`, `runsc`, `burst`, `files`, `idle`, `churn`, `e2b`, `jupyter`), e.g. to compare
//! runtimes (`CODEBROKER_RUNTIME=runsc`, read by the broker and the `docker run` baseline).

#[path = "../../../tests/common/mod.rs"]
mod common;
mod cpu;
mod rows;
mod table;

use codebroker::config::Config;
use common::TestBroker;
use serde_json::Value;
use std::process::Command;
use std::time::{Duration, Instant};

/// Whether the row group `name` runs: every group unless `BENCH_ROWS` names some.
fn wanted(name: &str) -> bool {
    std::env::var("BENCH_ROWS")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .is_none_or(|v| v.split(',').any(|g| g.trim() == name))
}

/// `--runtime <name>` for a baseline `docker run`, as the broker runs its sandboxes.
fn runtime_args() -> Vec<String> {
    match std::env::var("CODEBROKER_RUNTIME") {
        Ok(r) if !r.trim().is_empty() => vec!["--runtime".into(), r.trim().to_string()],
        _ => Vec::new(),
    }
}

/// How many samples rows take: the full run or the smoke run.
#[derive(Clone, Copy)]
struct Scale {
    /// `BENCH_QUICK` set.
    quick: bool,
    /// `BENCH_N`.
    n: usize,
}

impl Scale {
    /// `full` in a full run (times `BENCH_N`), `quick` in a smoke run.
    fn pick(self, full: usize, quick: usize) -> usize {
        if self.quick {
            quick
        } else {
            full * self.n
        }
    }
}

/// A broker in this process on a port of its own, driven by a client that keeps many
/// connections open (the parallel rows); its containers are removed when it stops.
struct Bench {
    /// The broker, from the tests' harness.
    broker: TestBroker,
}

impl std::ops::Deref for Bench {
    type Target = TestBroker;

    fn deref(&self) -> &TestBroker {
        &self.broker
    }
}

impl Bench {
    async fn start(tag: &str, data: &std::path::Path, adjust: impl FnOnce(&mut Config)) -> Bench {
        let instance = format!("bench-{tag}-{}", std::process::id());
        let mut config = Config::for_tests(data.join(tag), &instance);
        config.pool.pool_size = 0;
        adjust(&mut config);
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(64)
            .build()
            .expect("client");
        Bench {
            broker: TestBroker::serve_with_client(config, client).await,
        }
    }

    async fn try_exec(&self, body: &Value) -> Result<Value, String> {
        let resp = self
            .client
            .post(self.url("/exec"))
            .json(body)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let status = resp.status();
        let body: Value = resp.json().await.map_err(|e| e.to_string())?;
        if status != 200 {
            return Err(format!("{status}: {body}"));
        }
        Ok(body)
    }

    async fn exec(&self, body: Value) -> Value {
        self.try_exec(&body).await.expect("exec")
    }

    async fn health(&self) -> Value {
        self.client
            .get(self.url("/health"))
            .send()
            .await
            .expect("health")
            .json()
            .await
            .expect("json")
    }

    async fn wait_pool(&self, n: u64) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.health().await["pool"]["ready"].as_u64().unwrap_or(0) < n
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn upload(&self, name: &str, bytes: Vec<u8>) -> Value {
        let part = reqwest::multipart::Part::bytes(bytes).file_name(name.to_string());
        let form = reqwest::multipart::Form::new().part("file", part);
        let resp = self
            .client
            .post(self.url("/upload"))
            .multipart(form)
            .send()
            .await
            .expect("upload");
        assert_eq!(resp.status(), 200);
        resp.json().await.expect("json")
    }

    /// Stops serving, waits for the server to end, and removes the containers.
    async fn stop(self) {
        let instance = self.broker.instance.clone();
        self.broker.stop().await;
        common::remove_containers_of(&instance);
    }
}

/// Memory a container uses now, from its cgroup (v1, then v2), in bytes.
fn container_memory(id: &str) -> Option<u64> {
    [
        format!("/sys/fs/cgroup/memory/docker/{id}/memory.usage_in_bytes"),
        format!("/sys/fs/cgroup/system.slice/docker-{id}.scope/memory.current"),
    ]
    .iter()
    .find_map(|p| std::fs::read_to_string(p).ok())
    .and_then(|s| s.trim().parse().ok())
}

/// The resident memory of this process (the broker runs in it), in bytes.
fn own_rss() -> u64 {
    common::child::proc_status_bytes(std::process::id(), "VmRSS")
}

/// The CPU model, how many CPUs and how much memory this host has: figures from another
/// host are read against it.
fn host_description() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map_or("unknown CPU", |(_, m)| m.trim())
        .to_string();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let memory = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0.0, |kib| kib as f64 / (1024.0 * 1024.0));
    format!("{model}, {cpus} CPUs, {memory:.1} GiB")
}

/// What a group of rows took: wall time, the host's busy CPU time over it (everything on
/// the host, the bench's own load included) and the load average at its end.
struct GroupCost {
    /// When the group started.
    started: Instant,
    /// The host's busy CPU seconds then.
    busy: f64,
}

impl GroupCost {
    fn start() -> GroupCost {
        GroupCost {
            started: Instant::now(),
            busy: cpu::host_busy_seconds(),
        }
    }

    /// One line for the notes under the table.
    fn finish(self, name: &str) -> String {
        let wall = self.started.elapsed().as_secs_f64();
        let busy = cpu::host_busy_seconds() - self.busy;
        let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        let load1 = load.split_whitespace().next().unwrap_or("?");
        format!(
            "group {name}: {wall:.0} s, host CPU busy {busy:.0} s ({:.2} CPUs on average), load {load1} at its end",
            if wall > 0.0 { busy / wall } else { 0.0 }
        )
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn time_command(args: &[&str]) -> Duration {
    let started = Instant::now();
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .expect("command");
    let took = started.elapsed();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    took
}

async fn timed<F: std::future::Future>(f: F) -> (Duration, F::Output) {
    let started = Instant::now();
    let out = f.await;
    (started.elapsed(), out)
}

#[tokio::main]
async fn main() {
    // BENCH_LOG=<filter>: the broker's log on stderr, to see where a slow sample went.
    if let Ok(filter) = std::env::var("BENCH_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .init();
    }
    let scale = Scale {
        quick: std::env::var("BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0"),
        n: std::env::var("BENCH_N")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1),
    };
    let command: Vec<String> = std::env::args().collect();
    println!("codebroker bench");
    println!(
        "date: {}",
        String::from_utf8_lossy(
            &Command::new("date")
                .arg("-u")
                .output()
                .map(|o| o.stdout)
                .unwrap_or_default()
        )
        .trim()
    );
    println!("host: {}", host_description());
    println!(
        "load before: {}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    println!(
        "command: BENCH_QUICK={} BENCH_N={} BENCH_ROWS={} CODEBROKER_RUNTIME={} CODEBROKER_IMAGE={} {}",
        std::env::var("BENCH_QUICK").unwrap_or_default(),
        scale.n,
        std::env::var("BENCH_ROWS").unwrap_or_default(),
        std::env::var("CODEBROKER_RUNTIME").unwrap_or_default(),
        common::image(),
        command.join(" ")
    );
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut rows = Vec::new();
    let mut notes: Vec<String> = Vec::new();

    if wanted("warm") {
        let group = GroupCost::start();
        rows::warm::rows(scale, tmp.path(), &mut rows).await;
        notes.push(group.finish("warm"));
    }
    if wanted("new") {
        let group = GroupCost::start();
        rows::new_session::rows(scale, tmp.path(), &mut rows).await;
        notes.push(group.finish("new"));
    }
    if wanted("chat") {
        let group = GroupCost::start();
        rows::chat::rows(scale, tmp.path(), &mut rows).await;
        notes.push(group.finish("chat"));
    }
    if wanted("runsc") {
        let group = GroupCost::start();
        rows::chat::runsc_rows(scale, tmp.path(), &mut rows).await;
        notes.push(group.finish("runsc"));
    }
    if wanted("burst") {
        let group = GroupCost::start();
        rows::burst::rows(scale, tmp.path(), &mut rows, &mut notes).await;
        notes.push(group.finish("burst"));
    }
    if wanted("files") {
        let group = GroupCost::start();
        rows::files::rows(scale, tmp.path(), &mut rows).await;
        notes.push(group.finish("files"));
    }
    if wanted("idle") {
        let group = GroupCost::start();
        rows::idle::rows(scale, tmp.path(), &mut rows).await;
        notes.push(group.finish("idle"));
    }
    if wanted("e2b") {
        let group = GroupCost::start();
        rows::e2b::rows(scale, tmp.path(), &mut rows).await;
        notes.push(group.finish("e2b"));
    }
    if wanted("jupyter") {
        let group = GroupCost::start();
        rows::jupyter::rows(scale, tmp.path(), &mut rows).await;
        notes.push(group.finish("jupyter"));
    }
    if wanted("churn") {
        let group = GroupCost::start();
        rows::churn::rows(scale, tmp.path(), &mut rows, &mut notes).await;
        notes.push(group.finish("churn"));
    }

    println!(
        "load after: {}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    println!();
    table::print(&rows, &notes);
}
