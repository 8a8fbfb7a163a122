//! `make bench`: exec latency through the broker, side by side with the Docker baselines,
//! measured in one run (this machine is noisy, so only same-run numbers compare).
//!
//! Rows:
//! - warm `print(1)` in one session through `POST /exec`, and the same code through
//!   `docker exec` into that session's container (the baseline);
//! - the first exec of a new session with the pool warm, without a pool (a container
//!   start per session), and `docker run --rm` (the baseline).
//!
//! `BENCH_N` scales the sample counts (default 1).

use codebroker::config::Config;
use serde_json::{json, Value};
use std::process::Command;
use std::time::{Duration, Instant};

/// The image the broker under test uses: `CODEBROKER_IMAGE`, as the broker reads it.
fn image() -> String {
    std::env::var("CODEBROKER_IMAGE").unwrap_or_else(|_| "codebroker-sandbox:latest".into())
}

struct Row {
    name: String,
    samples: Vec<Duration>,
    baseline: Option<String>,
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

struct Bench {
    base: String,
    client: reqwest::Client,
    instance: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl Bench {
    async fn start(tag: &str, pool_size: usize, data: &std::path::Path) -> Bench {
        let instance = format!("bench-{tag}-{}", std::process::id());
        let mut config = Config::for_tests(data.join(tag), &instance);
        config.pool_size = pool_size;
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
            client: reqwest::Client::new(),
            instance,
            stop: Some(stop),
            server: Some(server),
        }
    }

    async fn exec(&self, body: Value) -> Value {
        let resp = self
            .client
            .post(format!("{}/exec", self.base))
            .json(&body)
            .send()
            .await
            .expect("exec");
        assert_eq!(resp.status(), 200);
        resp.json().await.expect("json")
    }

    async fn pool_ready(&self) -> u64 {
        let health: Value = self
            .client
            .get(format!("{}/health", self.base))
            .send()
            .await
            .expect("health")
            .json()
            .await
            .expect("json");
        health["pool"]["ready"].as_u64().unwrap_or(0)
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

fn remove_containers(instance: &str) {
    let out = Command::new("docker")
        .args([
            "ps",
            "-aq",
            "--filter",
            &format!("label=codebroker.instance={instance}"),
        ])
        .output()
        .expect("docker ps");
    let ids: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    if !ids.is_empty() {
        let _ = Command::new("docker")
            .arg("rm")
            .arg("-f")
            .args(&ids)
            .output();
    }
}

fn container_of(instance: &str) -> String {
    let out = Command::new("docker")
        .args([
            "ps",
            "-q",
            "--filter",
            &format!("label=codebroker.instance={instance}"),
        ])
        .output()
        .expect("docker ps");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .expect("a running container")
        .to_string()
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

#[tokio::main]
async fn main() {
    let scale: usize = std::env::var("BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut rows = Vec::new();

    // Warm exec in one session, and docker exec into the same container.
    let bench = Bench::start("warm", 0, tmp.path()).await;
    let first = bench.exec(json!({"lang": "py", "code": "print(1)"})).await;
    let session = first["session_id"].as_str().expect("session").to_string();
    for _ in 0..20 {
        bench
            .exec(json!({"lang": "py", "code": "print(1)", "session_id": session}))
            .await;
    }
    let mut warm = Vec::new();
    for _ in 0..500 * scale {
        let started = Instant::now();
        let r = bench
            .exec(json!({"lang": "py", "code": "print(1)", "session_id": session}))
            .await;
        warm.push(started.elapsed());
        assert_eq!(r["stdout"], "1\n");
    }
    let container = container_of(&bench.instance);
    let mut docker_exec = Vec::new();
    for _ in 0..30 * scale {
        docker_exec.push(time_command(&[
            "docker", "exec", &container, "python3", "-c", "print(1)",
        ]));
    }
    let mut warm_bash = Vec::new();
    for _ in 0..200 * scale {
        let started = Instant::now();
        bench
            .exec(json!({"lang": "bash", "code": "echo 1", "session_id": session}))
            .await;
        warm_bash.push(started.elapsed());
    }
    // Streaming: from the code's print to the first SSE byte at the client (same clock:
    // the container shares the host's).
    let mut first_byte = Vec::new();
    for _ in 0..50 * scale {
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

    // One tool-call round trip through /exec/programmatic: from sending a result to
    // receiving the next call (the client's own work is nothing here).
    let mut round_trips = Vec::new();
    let tools = json!([{"name": "add", "description": "adds",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}]);
    let resp: Value = bench
        .client
        .post(format!("{}/exec/programmatic", bench.base))
        .json(&json!({"session_id": session, "tools": tools, "timeout": 120000,
                      "code": format!("t = 0\nfor i in range({}):\n    t = await add(a=t, b=1)\nprint(t)", 200 * scale + 1)}))
        .send()
        .await
        .expect("ptc")
        .json()
        .await
        .expect("json");
    let mut resp = resp;
    while resp["status"] == "tool_call_required" {
        let call = &resp["tool_calls"][0];
        let a = call["input"]["a"].as_f64().unwrap_or(0.0);
        let body = json!({"continuation_token": resp["continuation_token"],
            "tool_results": [{"call_id": call["id"], "result": a + 1.0, "is_error": false}]});
        let started = Instant::now();
        resp = bench
            .client
            .post(format!("{}/exec/programmatic", bench.base))
            .json(&body)
            .send()
            .await
            .expect("ptc")
            .json()
            .await
            .expect("json");
        if resp["status"] == "tool_call_required" {
            round_trips.push(started.elapsed());
        }
    }
    assert_eq!(resp["status"], "completed", "{resp}");

    bench.stop().await;
    rows.push(Row {
        name: "print -> first SSE byte".into(),
        samples: first_byte,
        baseline: None,
    });
    rows.push(Row {
        name: "tool-call round trip, programmatic".into(),
        samples: round_trips,
        baseline: None,
    });
    rows.push(Row {
        name: "warm print(1), /exec".into(),
        samples: warm,
        baseline: Some("docker exec python3 -c print(1)".into()),
    });
    rows.push(Row {
        name: "docker exec python3 -c print(1)".into(),
        samples: docker_exec,
        baseline: None,
    });
    rows.push(Row {
        name: "warm echo 1 (bash), /exec".into(),
        samples: warm_bash,
        baseline: None,
    });

    // First exec of a new session, pool warm.
    let bench = Bench::start("pool", 2, tmp.path()).await;
    let mut pooled = Vec::new();
    for _ in 0..20 * scale {
        let deadline = Instant::now() + Duration::from_secs(30);
        while bench.pool_ready().await < 1 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let started = Instant::now();
        bench.exec(json!({"lang": "py", "code": "print(1)"})).await;
        pooled.push(started.elapsed());
    }
    bench.stop().await;
    rows.push(Row {
        name: "new session, pool warm".into(),
        samples: pooled,
        baseline: Some("docker run --rm".into()),
    });

    // First exec of a new session without a pool.
    let bench = Bench::start("cold", 0, tmp.path()).await;
    let mut cold = Vec::new();
    for _ in 0..10 * scale {
        let started = Instant::now();
        bench.exec(json!({"lang": "py", "code": "print(1)"})).await;
        cold.push(started.elapsed());
    }
    bench.stop().await;
    rows.push(Row {
        name: "new session, no pool".into(),
        samples: cold,
        baseline: Some("docker run --rm".into()),
    });

    let mut docker_run = Vec::new();
    for _ in 0..10 * scale {
        docker_run.push(time_command(&[
            "docker",
            "run",
            "--rm",
            "--network",
            "none",
            "--entrypoint",
            "python3",
            &image(),
            "-c",
            "print(1)",
        ]));
    }
    rows.push(Row {
        name: "docker run --rm python3 -c print(1)".into(),
        samples: docker_run,
        baseline: None,
    });

    println!();
    println!(
        "{:<38} {:>6} {:>9} {:>9} {:>9}   baseline (p50)",
        "benchmark", "n", "p50 ms", "p90 ms", "p99 ms"
    );
    let p50_of = |name: &str, rows: &[Row]| {
        rows.iter()
            .find(|r| r.name.starts_with(name))
            .map(|r| summary(&r.samples).0)
    };
    for row in &rows {
        let (p50, p90, p99) = summary(&row.samples);
        let baseline = row
            .baseline
            .as_deref()
            .and_then(|b| p50_of(b, &rows).map(|v| format!("{b}: {v:.1} ms ({:.0}x)", v / p50)))
            .unwrap_or_default();
        println!(
            "{:<38} {:>6} {:>9.2} {:>9.2} {:>9.2}   {}",
            row.name,
            row.samples.len(),
            p50,
            p90,
            p99,
            baseline
        );
    }
}
