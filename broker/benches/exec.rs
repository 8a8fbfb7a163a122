//! `make bench`: the broker's latency, throughput and footprint, each beside its goal and
//! its baseline, measured in one run and printed as one table (this machine is shared and
//! noisy, so only same-run numbers compare).
//!
//! Rows: warm `print(1)` through `/exec` (baseline: `docker exec` into the same
//! container); the first exec of a new session with the pool warm and without a pool
//! (baseline: `docker run --rm`); 20 new sessions at once (the first burst, then again
//! with the pool grown, and where a burst of cold starts spends its CPU); 8 sessions x 200 warm execs in
//! parallel; 10,000 lines of output; a 1 MiB upload read by an exec; 100 MiB up and down;
//! 200 idle sessions held (broker RSS, memory per container); a C program compiled, then
//! rerun from the compile cache; the first `import pandas`; a tool-call round trip; a
//! LibreChat-like churn of many users (containers alive and memory over time).
//!
//! `BENCH_QUICK=1` runs every row with small counts (a smoke run of a minute or two);
//! `BENCH_N` multiplies the counts of the full run. `BENCH_ROWS=warm,new` runs only the
//! named groups (`warm`, `new`, `burst`, `files`, `idle`, `churn`), e.g. to compare
//! runtimes (`CODEBROKER_RUNTIME=runsc`, read by the broker and the `docker run` baseline).

use codebroker::config::Config;
use serde_json::{json, Value};
use std::process::Command;
use std::time::{Duration, Instant};

/// The image the broker under test uses: `CODEBROKER_IMAGE`, as the broker reads it.
fn image() -> String {
    std::env::var("CODEBROKER_IMAGE").unwrap_or_else(|_| "codebroker-sandbox:latest".into())
}

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

/// One line of the table.
struct Row {
    name: String,
    /// Samples, for percentiles; empty for a row with a single figure.
    samples: Vec<Duration>,
    /// The figure of a row without samples (throughput, memory), with its unit.
    figure: Option<String>,
    goal: String,
    baseline: String,
}

impl Row {
    fn timed(name: &str, samples: Vec<Duration>, goal: &str, baseline: &str) -> Row {
        Row {
            name: name.into(),
            samples,
            figure: None,
            goal: goal.into(),
            baseline: baseline.into(),
        }
    }

    fn figure(name: &str, figure: String, goal: &str, baseline: &str) -> Row {
        Row {
            name: name.into(),
            samples: Vec::new(),
            figure: Some(figure),
            goal: goal.into(),
            baseline: baseline.into(),
        }
    }
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[idx.min(sorted.len() - 1)].as_secs_f64() * 1000.0
}

fn summary(samples: &[Duration]) -> (f64, f64, f64) {
    let mut sorted = samples.to_vec();
    sorted.sort();
    (
        percentile(&sorted, 50.0),
        percentile(&sorted, 90.0),
        percentile(&sorted, 99.0),
    )
}

fn p50(samples: &[Duration]) -> f64 {
    summary(samples).0
}

struct Bench {
    base: String,
    client: reqwest::Client,
    instance: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl Bench {
    async fn start(tag: &str, data: &std::path::Path, adjust: impl FnOnce(&mut Config)) -> Bench {
        let instance = format!("bench-{tag}-{}", std::process::id());
        let mut config = Config::for_tests(data.join(tag), &instance);
        config.pool_size = 0;
        adjust(&mut config);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let broker = codebroker::build(config).await.expect("broker");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(codebroker::run(listener, broker, async move {
            let _ = stopped.await;
        }));
        Bench {
            base,
            client: reqwest::Client::builder()
                .pool_max_idle_per_host(64)
                .build()
                .expect("client"),
            instance,
            stop: Some(stop),
            server: Some(server),
        }
    }

    async fn try_exec(&self, body: &Value) -> Result<Value, String> {
        let resp = self
            .client
            .post(format!("{}/exec", self.base))
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
            .get(format!("{}/health", self.base))
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
            .post(format!("{}/upload", self.base))
            .multipart(form)
            .send()
            .await
            .expect("upload");
        assert_eq!(resp.status(), 200);
        resp.json().await.expect("json")
    }

    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(server) = self.server.take() {
            let _ = server.await;
        }
        remove_containers(&self.instance);
    }
}

fn containers(instance: &str, all: bool) -> Vec<String> {
    let mut args = vec!["ps", "-q", "--no-trunc"];
    if all {
        args.push("-a");
    }
    let filter = format!("label=codebroker.instance={instance}");
    args.extend(["--filter", &filter]);
    let out = Command::new("docker")
        .args(&args)
        .output()
        .expect("docker ps");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect()
}

fn remove_containers(instance: &str) {
    let ids = containers(instance, true);
    if !ids.is_empty() {
        let _ = Command::new("docker")
            .arg("rm")
            .arg("-f")
            .args(&ids)
            .output();
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
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .unwrap_or(0)
        * 1024
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
        image(),
        command.join(" ")
    );
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut rows = Vec::new();
    let mut notes: Vec<String> = Vec::new();

    if wanted("warm") {
        warm_rows(scale, tmp.path(), &mut rows).await;
    }
    if wanted("new") {
        new_session_rows(scale, tmp.path(), &mut rows).await;
    }
    if wanted("burst") {
        burst_rows(scale, tmp.path(), &mut rows, &mut notes).await;
    }
    if wanted("files") {
        file_rows(scale, tmp.path(), &mut rows).await;
    }
    if wanted("idle") {
        idle_rows(scale, tmp.path(), &mut rows).await;
    }
    if wanted("churn") {
        churn_rows(scale, tmp.path(), &mut rows, &mut notes).await;
    }

    println!(
        "load after: {}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    println!();
    println!(
        "| {:<44} | {:>5} | {:>9} | {:>9} | {:>9} | {:<22} | baseline",
        "benchmark", "n", "p50 ms", "p90 ms", "p99 ms", "goal"
    );
    println!(
        "|{}|{}|{}|{}|{}|{}|---",
        "-".repeat(46),
        "-".repeat(7),
        "-".repeat(11),
        "-".repeat(11),
        "-".repeat(11),
        "-".repeat(24)
    );
    for row in &rows {
        if let Some(figure) = &row.figure {
            println!(
                "| {:<44} | {:>5} | {:>33} | {:<22} | {}",
                row.name, "", figure, row.goal, row.baseline
            );
        } else {
            let (p50, p90, p99) = summary(&row.samples);
            println!(
                "| {:<44} | {:>5} | {:>9.2} | {:>9.2} | {:>9.2} | {:<22} | {}",
                row.name,
                row.samples.len(),
                p50,
                p90,
                p99,
                row.goal,
                row.baseline
            );
        }
    }
    for note in notes {
        println!("{note}");
    }
}

/// One session: warm execs, streaming, the tool-call round trip, the compile cache,
/// 10,000 lines, parallel execs.
async fn warm_rows(scale: Scale, data: &std::path::Path, rows: &mut Vec<Row>) {
    let bench = Bench::start("warm", data, |_| {}).await;
    let first = bench.exec(json!({"lang": "py", "code": "print(1)"})).await;
    let session = first["session_id"].as_str().expect("session").to_string();
    for _ in 0..20 {
        bench
            .exec(json!({"lang": "py", "code": "print(1)", "session_id": session}))
            .await;
    }
    let mut warm = Vec::new();
    for _ in 0..scale.pick(500, 50) {
        let (took, r) =
            timed(bench.exec(json!({"lang": "py", "code": "print(1)", "session_id": session})))
                .await;
        warm.push(took);
        assert_eq!(r["stdout"], "1\n");
    }
    let container = containers(&bench.instance, false)
        .into_iter()
        .next()
        .expect("a running container");
    let mut docker_exec = Vec::new();
    for _ in 0..scale.pick(30, 5) {
        docker_exec.push(time_command(&[
            "docker", "exec", &container, "python3", "-c", "print(1)",
        ]));
    }
    let (de50, de99) = {
        let (a, _, c) = summary(&docker_exec);
        (a, c)
    };
    rows.push(Row::timed(
        "warm print(1), /exec",
        warm,
        "p50<=3 p99<=10",
        &format!("docker exec: p50 {de50:.1}, p99 {de99:.1}; issue: 227"),
    ));

    // Streaming: from the code's print to the first SSE byte at the client (same clock).
    let mut first_byte = Vec::new();
    for _ in 0..scale.pick(50, 5) {
        let resp = bench
            .client
            .post(format!("{}/exec/stream", bench.base))
            .json(&json!({"lang": "py", "session_id": session,
                          "code": "import time\nprint(repr(time.time()), flush=True)\ntime.sleep(0.05)"}))
            .send()
            .await
            .expect("stream");
        let mut body = resp.bytes_stream();
        let mut buf = String::new();
        while let Some(chunk) = futures::StreamExt::next(&mut body).await {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .expect("clock")
                .as_secs_f64();
            buf.push_str(&String::from_utf8_lossy(&chunk.expect("chunk")));
            if let Some(line) = buf.lines().find_map(|l| l.strip_prefix("data: ")) {
                if let Ok(printed) = line.trim().parse::<f64>() {
                    first_byte.push(Duration::from_secs_f64((now - printed).max(0.0)));
                    break;
                }
            }
        }
        while futures::StreamExt::next(&mut body).await.is_some() {}
    }
    rows.push(Row::timed("print -> first SSE byte", first_byte, "", ""));

    // 10,000 lines of output.
    let mut lines = Vec::new();
    for _ in 0..scale.pick(30, 5) {
        let (took, r) = timed(bench.exec(json!({"lang": "py", "session_id": session,
            "code": "print('\\n'.join(str(i) for i in range(10000)))"})))
        .await;
        assert!(r["stdout"].as_str().unwrap_or("").ends_with("9999\n"));
        lines.push(took);
    }
    rows.push(Row::timed(
        "10,000-line output, /exec",
        lines,
        "p50<=25",
        "",
    ));

    // A C program compiled, then rerun from the compile cache.
    let c_code = |i: usize| {
        format!("#include <stdio.h>\nint main(void) {{ printf(\"%d\\n\", {i}); return 0; }}")
    };
    let mut compiled = Vec::new();
    let mut cached = Vec::new();
    for i in 0..scale.pick(10, 3) {
        let body = json!({"lang": "c", "session_id": session, "code": c_code(i)});
        let (took, r) = timed(bench.exec(body.clone())).await;
        assert_eq!(r["stdout"], format!("{i}\n"));
        compiled.push(took);
        let (took, again) = timed(bench.exec(body)).await;
        assert_eq!(again["stdout"], r["stdout"]);
        cached.push(took);
    }
    let metrics = bench
        .client
        .get(format!("{}/metrics", bench.base))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    let hits = metrics
        .lines()
        .find_map(|l| l.strip_prefix(r#"codebroker_compile_cache_total{outcome="hit"} "#))
        .unwrap_or("0")
        .trim()
        .to_string();
    let compiled_p50 = p50(&compiled);
    rows.push(Row::timed(
        "C program, first run (gcc -O2)",
        compiled,
        "",
        "",
    ));
    rows.push(Row::timed(
        &format!("C program, rerun ({hits} cache hits)"),
        cached,
        "cache hit",
        &format!("first run: p50 {compiled_p50:.1}"),
    ));

    // One tool-call round trip through /exec/programmatic: from sending a result to
    // receiving the next call (the client's own work is nothing here).
    let mut round_trips = Vec::new();
    let tools = json!([{"name": "add", "description": "adds",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}]);
    let mut resp: Value = bench
        .client
        .post(format!("{}/exec/programmatic", bench.base))
        .json(&json!({"session_id": session, "tools": tools, "timeout": 120000,
                      "code": format!("t = 0\nfor i in range({}):\n    t = await add(a=t, b=1)\nprint(t)", scale.pick(200, 20) + 1)}))
        .send()
        .await
        .expect("ptc")
        .json()
        .await
        .expect("json");
    while resp["status"] == "tool_call_required" {
        let call = &resp["tool_calls"][0];
        let a = call["input"]["a"].as_f64().unwrap_or(0.0);
        let body = json!({"continuation_token": resp["continuation_token"],
            "tool_results": [{"call_id": call["id"], "result": a + 1.0, "is_error": false}]});
        let (took, next) = timed(async {
            bench
                .client
                .post(format!("{}/exec/programmatic", bench.base))
                .json(&body)
                .send()
                .await
                .expect("ptc")
                .json::<Value>()
                .await
                .expect("json")
        })
        .await;
        resp = next;
        if resp["status"] == "tool_call_required" {
            round_trips.push(took);
        }
    }
    assert_eq!(resp["status"], "completed", "{resp}");
    rows.push(Row::timed(
        "tool-call round trip, programmatic",
        round_trips,
        "p50<=5",
        "attached stdin: 0.3",
    ));

    // 8 sessions x 200 warm execs in parallel.
    let sessions = 8;
    let per = scale.pick(200, 20);
    let mut ids = Vec::new();
    for _ in 0..sessions {
        let r = bench.exec(json!({"lang": "py", "code": "print(1)"})).await;
        ids.push(r["session_id"].as_str().expect("session").to_string());
    }
    let started = Instant::now();
    let tasks: Vec<_> = ids
        .iter()
        .map(|id| {
            let client = bench.client.clone();
            let url = format!("{}/exec", bench.base);
            let id = id.clone();
            tokio::spawn(async move {
                let mut samples = Vec::new();
                for _ in 0..per {
                    let t = Instant::now();
                    let r: Value = client
                        .post(&url)
                        .json(&json!({"lang": "py", "code": "print(1)", "session_id": id}))
                        .send()
                        .await
                        .expect("exec")
                        .json()
                        .await
                        .expect("json");
                    assert_eq!(r["stdout"], "1\n");
                    samples.push(t.elapsed());
                }
                samples
            })
        })
        .collect();
    let mut parallel = Vec::new();
    for t in tasks {
        parallel.extend(t.await.expect("task"));
    }
    let rate = parallel.len() as f64 / started.elapsed().as_secs_f64();
    rows.push(Row::timed(
        &format!("{sessions}x{per} warm execs in parallel: {rate:.0}/s"),
        parallel,
        ">=500 execs/s",
        "issue: 25 execs/s",
    ));
    bench.stop().await;
}

/// The first exec of a new session: pool warm, no pool, `docker run`, `import pandas`.
async fn new_session_rows(scale: Scale, data: &std::path::Path, rows: &mut Vec<Row>) {
    let mut docker_run = Vec::new();
    let runtime = runtime_args();
    for _ in 0..scale.pick(10, 3) {
        let image = image();
        let mut args = vec!["docker", "run", "--rm", "--network", "none"];
        args.extend(runtime.iter().map(String::as_str));
        args.extend(["--entrypoint", "python3", &image, "-c", "print(1)"]);
        docker_run.push(time_command(&args));
    }
    let run50 = p50(&docker_run);

    let bench = Bench::start("pool", data, |c| c.pool_size = 2).await;
    let mut pooled = Vec::new();
    let mut pandas = Vec::new();
    for i in 0..scale.pick(20, 4) {
        bench.wait_pool(1).await;
        let (took, r) = timed(bench.exec(json!({"lang": "py", "code": "print(1)"}))).await;
        pooled.push(took);
        if i % 2 == 0 {
            let s = r["session_id"].as_str().expect("session");
            let (took, r) = timed(bench.exec(json!({"lang": "py", "session_id": s,
                "code": "import pandas\nprint(pandas.__name__)"})))
            .await;
            assert_eq!(r["stdout"], "pandas\n", "{r}");
            pandas.push(took);
        }
    }
    bench.stop().await;
    rows.push(Row::timed(
        "new session, pool warm",
        pooled,
        "p50<=25",
        &format!("docker run: p50 {run50:.1}; issue: 1457"),
    ));
    rows.push(Row::timed(
        "first import pandas in a session",
        pandas,
        "",
        "",
    ));

    let bench = Bench::start("cold", data, |_| {}).await;
    let mut cold = Vec::new();
    for _ in 0..scale.pick(10, 3) {
        let (took, _) = timed(bench.exec(json!({"lang": "py", "code": "print(1)"}))).await;
        cold.push(took);
    }
    bench.stop().await;
    rows.push(Row::timed(
        "new session, no pool",
        cold,
        "",
        &format!("docker run: p50 {run50:.1}"),
    ));
    rows.push(Row::timed(
        "docker run --rm python3 -c print(1)",
        docker_run,
        "",
        "issue: 361",
    ));
}

/// 20 new sessions at once: the first burst after start (the pool at its size, so most
/// are cold starts), then again once the pool has grown to the burst; then where the CPU
/// of a burst of cold starts goes.
async fn burst_rows(
    scale: Scale,
    data: &std::path::Path,
    rows: &mut Vec<Row>,
    notes: &mut Vec<String>,
) {
    let n = scale.pick(20, 8);
    let bench = Bench::start("burst", data, |c| {
        c.pool_size = 2;
        c.pool_max = 16;
    })
    .await;
    bench.wait_pool(2).await;
    let (first, failed) = burst(&bench, n).await;
    rows.push(Row::timed(
        &format!("{n} new sessions at once, pool 2 ({failed} failed)"),
        first,
        "p99<=1500, 0 failed",
        "first burst: cold starts",
    ));
    let target = bench.health().await["pool"]["target"].as_u64().unwrap_or(0);
    bench.wait_pool(target).await;
    let (grown, failed) = burst(&bench, n).await;
    rows.push(Row::timed(
        &format!("{n} new sessions at once, pool {target} ({failed} failed)"),
        grown,
        "p99<=1500, 0 failed",
        "pool grown by the first",
    ));
    bench.stop().await;

    // The same burst with no pool at all, with the CPU time of each part of the host.
    let cold_n = n - 2;
    let bench = Bench::start("coldburst", data, |_| {}).await;
    let before = CpuSnapshot::take();
    let (cold, failed) = burst(&bench, cold_n).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = CpuSnapshot::take();
    bench.stop().await;
    let (p50, _, p99) = summary(&cold);
    notes.push(format!(
        "\nwhere the CPU of {cold_n} cold starts at once goes (no pool; p50 {p50:.0} ms, p99 {p99:.0} ms, {failed} failed; {} cores):",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    ));
    notes.extend(after.report_since(&before, cold_n));
}

/// Starts `n` new sessions at once, each running `print(1)`; their latencies and how many
/// failed.
async fn burst(bench: &Bench, n: usize) -> (Vec<Duration>, usize) {
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let client = bench.client.clone();
            let url = format!("{}/exec", bench.base);
            tokio::spawn(async move {
                let t = Instant::now();
                let ok = match client
                    .post(&url)
                    .json(&json!({"lang": "py", "code": "print(1)"}))
                    .send()
                    .await
                {
                    Ok(resp) if resp.status() == 200 => resp
                        .json::<Value>()
                        .await
                        .is_ok_and(|v| v["stdout"] == "1\n"),
                    _ => false,
                };
                (t.elapsed(), ok)
            })
        })
        .collect();
    let mut samples = Vec::new();
    let mut failed = 0;
    for t in tasks {
        let (took, ok) = t.await.expect("task");
        samples.push(took);
        failed += usize::from(!ok);
    }
    (samples, failed)
}

/// CPU seconds used so far by the host and by each part of a container start.
struct CpuSnapshot {
    /// All CPUs, busy time.
    busy: f64,
    /// Per process of a part, by pid: the part and its CPU seconds. Parts: the engine
    /// (`dockerd`), `containerd`, the per-container shims with the `runc` runs they waited
    /// for, and this process (the broker and the bench client). By pid, so processes that
    /// exit between two snapshots (the shims of removed containers) do not count.
    processes: std::collections::HashMap<u32, (usize, f64)>,
    /// Per container cgroup (the runner, the kernel, `runc init`), by cgroup directory.
    containers: std::collections::HashMap<String, f64>,
}

/// The parts of [`CpuSnapshot::processes`], in report order.
const CPU_PARTS: [&str; 4] = [
    "dockerd",
    "containerd",
    "shims and runc",
    "broker + bench client",
];

impl CpuSnapshot {
    fn take() -> CpuSnapshot {
        let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        let busy = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| {
                let v: Vec<f64> = s
                    .lines()
                    .next()?
                    .split_whitespace()
                    .skip(1)
                    .filter_map(|x| x.parse().ok())
                    .collect();
                let idle = v.get(3)? + v.get(4)?;
                Some((v.iter().sum::<f64>() - idle) / tick)
            })
            .unwrap_or(0.0);
        let mut processes = std::collections::HashMap::new();
        let me = std::process::id();
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
                continue;
            };
            let comm = &stat[open + 1..close];
            // After the state letter: utime, stime, cutime, cstime are fields 11 to 14.
            let f: Vec<f64> = stat[close + 1..]
                .split_whitespace()
                .skip(1)
                .filter_map(|x| x.parse().ok())
                .collect();
            let part = match comm {
                "dockerd" => 0,
                "containerd" => 1,
                c if c.starts_with("containerd-shim") => 2,
                _ if pid == me => 3,
                _ => continue,
            };
            let own = f.get(10).unwrap_or(&0.0) + f.get(11).unwrap_or(&0.0);
            // Waited-for children: a shim's runc runs (not this process's own children).
            let kids = f.get(12).unwrap_or(&0.0) + f.get(13).unwrap_or(&0.0);
            let cpu = (own + if part == 3 { 0.0 } else { kids }) / tick;
            processes.insert(pid, (part, cpu));
        }
        CpuSnapshot {
            busy,
            processes,
            containers: container_cpu(),
        }
    }

    /// One line per part: CPU seconds since `before`, and per session of `n`.
    fn report_since(&self, before: &CpuSnapshot, n: usize) -> Vec<String> {
        let total = self.busy - before.busy;
        let mut lines = Vec::new();
        let mut counted = 0.0;
        let mut line = |name: &str, secs: f64| {
            lines.push(format!(
                "  {name:<46} {secs:>6.2} s  {:>6.1} ms per session",
                secs / n.max(1) as f64 * 1000.0
            ));
        };
        for (part, name) in CPU_PARTS.iter().enumerate() {
            let secs: f64 = self
                .processes
                .iter()
                .filter(|(_, (p, _))| *p == part)
                .map(|(pid, (_, now))| now - before.processes.get(pid).map_or(0.0, |b| b.1))
                .sum();
            counted += secs;
            line(name, secs);
        }
        let inside: f64 = self
            .containers
            .iter()
            .map(|(id, now)| now - before.containers.get(id).unwrap_or(&0.0))
            .sum();
        counted += inside;
        line("in the containers (runc init, runner, kernel)", inside);
        line("the host kernel and the rest", (total - counted).max(0.0));
        line("all CPUs busy", total);
        lines
    }
}

/// CPU seconds of each Docker container cgroup (cgroup v1 or v2, cgroupfs or systemd).
fn container_cpu() -> std::collections::HashMap<String, f64> {
    let mut out = std::collections::HashMap::new();
    let v1 = [
        "/sys/fs/cgroup/cpuacct/docker",
        "/sys/fs/cgroup/cpu,cpuacct/docker",
    ];
    for dir in v1 {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            if let Some(ns) = std::fs::read_to_string(entry.path().join("cpuacct.usage"))
                .ok()
                .and_then(|s| s.trim().parse::<f64>().ok())
            {
                out.insert(entry.file_name().to_string_lossy().to_string(), ns / 1e9);
            }
        }
    }
    for dir in ["/sys/fs/cgroup/docker", "/sys/fs/cgroup/system.slice"] {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().to_string();
            if dir.ends_with("system.slice") && !name.starts_with("docker-") {
                continue;
            }
            let usec = std::fs::read_to_string(entry.path().join("cpu.stat"))
                .ok()
                .and_then(|s| {
                    s.lines()
                        .find_map(|l| l.strip_prefix("usage_usec "))
                        .and_then(|v| v.trim().parse::<f64>().ok())
                });
            if let Some(usec) = usec {
                out.insert(name, usec / 1e6);
            }
        }
    }
    out
}

/// Uploads and downloads.
async fn file_rows(scale: Scale, data: &std::path::Path, rows: &mut Vec<Row>) {
    let bench = Bench::start("files", data, |c| {
        c.max_upload_mb = 128;
        c.pool_size = 2;
    })
    .await;
    let mut small = Vec::new();
    let one_mib = vec![b'x'; 1024 * 1024];
    for _ in 0..scale.pick(10, 3) {
        // The upload's session has no sandbox; its first exec is handed a pooled one.
        bench.wait_pool(1).await;
        let (took, _) = timed(async {
            let up = bench.upload("in.bin", one_mib.clone()).await;
            let s = up["session_id"].as_str().expect("session").to_string();
            let id = up["files"][0]["id"].as_str().expect("id").to_string();
            let r = bench
                .exec(
                    json!({"lang": "py", "code": "print(len(open('/mnt/data/in.bin','rb').read()))",
                    "files": [{"id": id, "session_id": s, "name": "in.bin"}]}),
                )
                .await;
            assert_eq!(r["stdout"], "1048576\n", "{r}");
        })
        .await;
        small.push(took);
    }
    rows.push(Row::timed(
        "1 MiB upload, then an exec reads it",
        small,
        "",
        "pool warm",
    ));

    let size = 100 * 1024 * 1024;
    let big: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
    let mut up_rates = Vec::new();
    let mut down_rates = Vec::new();
    let mut up_times = Vec::new();
    let mut down_times = Vec::new();
    for _ in 0..scale.pick(3, 1) {
        let (took, up) = timed(bench.upload("big.bin", big.clone())).await;
        up_times.push(took);
        up_rates.push(size as f64 / 1e6 / took.as_secs_f64());
        let s = up["session_id"].as_str().expect("session").to_string();
        let id = up["files"][0]["id"].as_str().expect("id").to_string();
        let (took, len) = timed(async {
            let resp = bench
                .client
                .get(format!("{}/download/{s}/{id}", bench.base))
                .send()
                .await
                .expect("download");
            let mut body = resp.bytes_stream();
            let mut len = 0;
            while let Some(chunk) = futures::StreamExt::next(&mut body).await {
                len += chunk.expect("chunk").len();
            }
            len
        })
        .await;
        assert_eq!(len, size);
        down_times.push(took);
        down_rates.push(size as f64 / 1e6 / took.as_secs_f64());
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let up = median(&mut up_rates);
    let down = median(&mut down_rates);
    rows.push(Row::timed(
        &format!("100 MiB upload: {up:.0} MB/s"),
        up_times,
        ">=200 MB/s",
        "",
    ));
    rows.push(Row::timed(
        &format!("100 MiB download: {down:.0} MB/s"),
        down_times,
        ">=200 MB/s",
        "",
    ));
    bench.stop().await;
}

/// Idle sessions held: the broker's memory and each container's.
async fn idle_rows(scale: Scale, data: &std::path::Path, rows: &mut Vec<Row>) {
    let n = scale.pick(200, 10);
    let rss_before = own_rss();
    let bench = Bench::start("idle", data, |c| {
        c.max_live_sandboxes = 0;
        c.pool_size = 2;
        c.pool_refill_concurrency = 4;
    })
    .await;
    // Sessions are made a few at a time, as users would, each with one Python exec.
    let mut made = 0;
    while made < n {
        let batch = (n - made).min(4);
        let tasks: Vec<_> = (0..batch)
            .map(|_| {
                let client = bench.client.clone();
                let url = format!("{}/exec", bench.base);
                tokio::spawn(async move {
                    client
                        .post(&url)
                        .json(&json!({"lang": "py", "code": "x = 1"}))
                        .send()
                        .await
                        .map(|r| r.status() == 200)
                        .unwrap_or(false)
                })
            })
            .collect();
        for t in tasks {
            assert!(t.await.expect("task"), "a session could not start");
        }
        made += batch;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss = own_rss();
    let ids = containers(&bench.instance, false);
    let mut per: Vec<u64> = ids.iter().filter_map(|id| container_memory(id)).collect();
    per.sort();
    let live = bench.health().await["sandboxes"]["live"]
        .as_u64()
        .unwrap_or(0);
    bench.stop().await;
    let median = per.get(per.len() / 2).copied().unwrap_or(0);
    let total: u64 = per.iter().sum();
    rows.push(Row::figure(
        &format!("{live} idle sessions held: broker RSS"),
        format!("{:.1} MiB ({:.1} before)", mib(rss), mib(rss_before)),
        "<=100 MiB",
        "",
    ));
    rows.push(Row::figure(
        "  memory per idle session container",
        format!("median {:.1} MiB, {:.0} MiB total", mib(median), mib(total)),
        "",
        "cgroup memory.usage",
    ));
}

/// A LibreChat-like churn: each simulated user makes a call every few seconds; most send
/// no session id and no refs (a new session each), some send refs to a file of their
/// last session (that session is reused).
async fn churn_rows(
    scale: Scale,
    data: &std::path::Path,
    rows: &mut Vec<Row>,
    notes: &mut Vec<String>,
) {
    let users = scale.pick(20, 6);
    let duration = Duration::from_secs(scale.pick(90, 20) as u64);
    let cap = 16;
    let bench = Bench::start("churn", data, |c| {
        c.pool_size = 2;
        c.max_live_sandboxes = cap;
        c.single_use_ttl_secs = 10;
        c.reap_interval_secs = 2;
    })
    .await;
    let started = Instant::now();
    let tasks: Vec<_> = (0..users)
        .map(|u| {
            let client = bench.client.clone();
            let base = bench.base.clone();
            tokio::spawn(async move {
                let mut samples = Vec::new();
                let mut failed = 0usize;
                let mut last_file: Option<(String, String)> = None;
                let mut call = 0u64;
                // Spread the users over the first seconds.
                tokio::time::sleep(Duration::from_millis(250 * u as u64)).await;
                while started.elapsed() < duration {
                    call += 1;
                    let with_refs = call % 4 == 0 && last_file.is_some();
                    let mut body = json!({"lang": "py",
                        "code": "open('/mnt/data/note.txt','w').write('x')\nprint(1)"});
                    if with_refs {
                        let (s, id) = last_file.clone().expect("a file");
                        body["files"] = json!([{"id": id, "session_id": s, "name": "note.txt"}]);
                    }
                    let t = Instant::now();
                    let resp = client.post(format!("{base}/exec")).json(&body).send().await;
                    match resp {
                        Ok(r) if r.status() == 200 => {
                            let v: Value = r.json().await.unwrap_or_default();
                            if let (Some(s), Some(id)) =
                                (v["session_id"].as_str(), v["files"][0]["id"].as_str())
                            {
                                last_file = Some((s.to_string(), id.to_string()));
                            }
                            samples.push(t.elapsed());
                        }
                        _ => failed += 1,
                    }
                    // One call every 3 to 5 seconds.
                    tokio::time::sleep(Duration::from_millis(
                        3000 + (u as u64 * 373 + call * 211) % 2000,
                    ))
                    .await;
                }
                (samples, failed)
            })
        })
        .collect();
    let mut series = Vec::new();
    let mut peak_alive = 0;
    while started.elapsed() < duration + Duration::from_secs(15) {
        tokio::time::sleep(Duration::from_secs(5)).await;
        let ids = containers(&bench.instance, false);
        let memory: u64 = ids.iter().filter_map(|id| container_memory(id)).sum();
        let health = bench.health().await;
        let live = health["sandboxes"]["live"].as_u64().unwrap_or(0);
        peak_alive = peak_alive.max(live);
        series.push(format!(
            "  t={:>3}s containers={:>3} (sessions {:>3}, pool {}) memory={:>6.0} MiB broker_rss={:.0} MiB",
            started.elapsed().as_secs(),
            ids.len(),
            live,
            health["pool"]["ready"],
            mib(memory),
            mib(own_rss())
        ));
    }
    let mut samples = Vec::new();
    let mut failed = 0;
    for t in tasks {
        let (s, f) = t.await.expect("task");
        samples.extend(s);
        failed += f;
    }
    let sessions = bench.health().await["sessions"].as_u64().unwrap_or(0);
    bench.stop().await;
    rows.push(Row::timed(
        &format!("churn: {users} users, {sessions} sessions, {failed} failed"),
        samples,
        &format!("alive <= cap {cap}"),
        &format!("peak alive {peak_alive}"),
    ));
    notes.push(format!(
        "\nchurn over time ({users} users, one call every 3-5 s, 1 in 4 with refs; cap {cap}, single-use TTL 10 s):"
    ));
    notes.extend(series);
}
