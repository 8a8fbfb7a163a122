//! What models write: a new session whose first exec imports pandas and plots (LibreChat
//! sends no session id, so almost every call is such a first exec), with the pool at its
//! default settings and again without the preload; `print` in a loop (the `warm` group has
//! it under runc); both again under gVisor when Docker has `runsc`.

use crate::table::{p50, Row};
use crate::{timed, Bench, Scale};
use clap::Parser;
use codebroker::config::{Config, PreloadModules};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// The first exec of the "new session, pandas + plot" row: what a chat model writes first.
pub(crate) const PANDAS_PLOT: &str = "import pandas as pd\n\
    import matplotlib.pyplot as plt\n\
    df = pd.DataFrame({'x': range(10), 'y': [i * i for i in range(10)]})\n\
    df.plot()\n\
    plt.savefig('/mnt/data/plot.png')\n\
    print(df['y'].sum())";

/// `print` in a loop, as models write it (10,000 `write`s through the kernel's pipe).
pub(crate) const PRINT_LOOP: &str = "for i in range(10000):\n    print(i)";

/// How far apart the pandas + plot calls start: two new sessions a second, a busy chat's
/// pace, not a burst; and one a second.
const PACE: Duration = Duration::from_millis(500);
const SLOW_PACE: Duration = Duration::from_millis(1000);

/// The pool group as a fresh install has it (size, maximum, refill, preload), and the
/// rules that remove a session's container: the single-use TTL and the container cap,
/// which the bench's one caller reaches as many users would. The per-user caps stay off:
/// the bench's caller stands for many users.
fn default_pool(config: &mut Config) {
    let shipped = Config::parse_from(["codebroker"]);
    config.pool = shipped.pool;
    config.lifecycle.single_use_ttl_secs = shipped.lifecycle.single_use_ttl_secs;
    config.caps.max_containers = shipped.caps.max_containers;
}

/// `n` new sessions, one every `pace`, each running [`PANDAS_PLOT`] as its first exec.
async fn pandas_plot(bench: &Bench, n: usize, pace: Duration) -> Vec<Duration> {
    let shipped = Config::parse_from(["codebroker"]).pool.pool_size;
    bench.wait_pool(shipped as u64).await;
    // Give the pool's kernels the time a pool has between chat turns.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let mut samples = Vec::new();
    let mut next = Instant::now();
    for _ in 0..n {
        tokio::time::sleep_until(next.into()).await;
        next += pace;
        let (took, r) = timed(bench.exec(json!({"lang": "py", "code": PANDAS_PLOT}))).await;
        assert_eq!(r["stdout"], "285\n", "{r}");
        assert!(
            r["files"]
                .as_array()
                .is_some_and(|f| f.iter().any(|f| f["name"] == "plot.png")),
            "{r}"
        );
        if std::env::var_os("BENCH_SAMPLES").is_some() {
            eprintln!("pandas_plot {:?}", took);
        }
        samples.push(took);
    }
    samples
}

/// [`PRINT_LOOP`] `n` times in one warm session.
pub(crate) async fn print_loop(bench: &Bench, session: &str, n: usize) -> Vec<Duration> {
    let mut samples = Vec::new();
    for _ in 0..n {
        let (took, r) = timed(bench.exec(json!({"lang": "py", "session_id": session,
            "code": PRINT_LOOP})))
        .await;
        let out = r["stdout"].as_str().unwrap_or("");
        assert!(out.starts_with("0\n1\n") && out.ends_with("9999\n"), "{r}");
        samples.push(took);
    }
    samples
}

/// Whether the Docker daemon has the `runsc` runtime registered.
fn runsc_registered() -> bool {
    std::process::Command::new("docker")
        .args(["info", "--format", "{{json .Runtimes}}"])
        .output()
        .ok()
        .and_then(|o| serde_json::from_slice::<Value>(&o.stdout).ok())
        .is_some_and(|runtimes| runtimes.get("runsc").is_some())
}

/// What one pooled container costs until it is idle: the CPU its cgroup used from its start
/// (runner, kernel, preload; the engine's own part is the same either way) and the memory
/// it holds then (all of it, and its anonymous memory alone). `None` where the cgroup
/// cannot be read.
async fn pooled_cost(
    data: &std::path::Path,
    tag: &str,
    preload: PreloadModules,
) -> Option<(Duration, (u64, u64))> {
    let bench = Bench::start(tag, data, |c| {
        c.pool.pool_size = 1;
        c.pool.pool_max = 1;
        c.pool.preload = preload;
    })
    .await;
    bench.wait_for_preloaded_pool(1).await;
    let id = crate::common::containers_of(&bench.instance)
        .into_iter()
        .next()?;
    let cpu = crate::common::docker::wait_until_idle(&id, Duration::from_secs(30)).await;
    let memory = crate::common::docker::container_memory(&id);
    bench.stop().await;
    Some((cpu?, memory?))
}

/// The "new session, pandas + plot" rows: the pool at its defaults, then without the
/// preload (the same run's baseline); what a pooled container costs either way.
pub(crate) async fn rows(scale: Scale, data: &std::path::Path, rows: &mut Vec<Row>) {
    let preload = Config::for_tests(data.to_path_buf(), "defaults")
        .pool
        .preload;
    let with = pooled_cost(data, "cost-preload", preload.clone()).await;
    let without = pooled_cost(data, "cost-none", PreloadModules::default()).await;
    if let (Some((cpu, (mem, anon))), Some((cpu0, (mem0, anon0)))) = (with, without) {
        rows.push(Row::figure(
            "idle pooled container: anonymous memory",
            format!("{:.1} MiB", crate::mib(anon)),
            "",
            &format!(
                "without preload: {:.1} MiB; preload: {}",
                crate::mib(anon0),
                preload.names().join(",")
            ),
        ));
        rows.push(Row::figure(
            "  the same, cgroup total (with page cache)",
            format!("{:.1} MiB", crate::mib(mem)),
            "",
            &format!(
                "without preload: {:.1} MiB; the cache is shared by every container",
                crate::mib(mem0)
            ),
        ));
        rows.push(Row::figure(
            "one pool refill: CPU in the container",
            format!("{:.0} ms", cpu.as_secs_f64() * 1000.0),
            "",
            &format!("without preload: {:.0} ms", cpu0.as_secs_f64() * 1000.0),
        ));
    }

    let n = scale.pick(40, 6);
    let bench = Bench::start("chat", data, default_pool).await;
    let preloaded = pandas_plot(&bench, n, PACE).await;
    bench.stop().await;

    let bench = Bench::start("chat-slow", data, default_pool).await;
    let slow = pandas_plot(&bench, scale.pick(20, 4), SLOW_PACE).await;
    bench.stop().await;

    let bench = Bench::start("chat-nopreload", data, |c| {
        default_pool(c);
        c.pool.preload = PreloadModules::default();
    })
    .await;
    let plain = pandas_plot(&bench, n, PACE).await;
    bench.stop().await;

    let plain50 = p50(&plain);
    let plain99 = crate::table::summary(&plain).2;
    rows.push(
        Row::timed(
            "new session, pandas + plot (0.5 s apart)",
            preloaded,
            "p50<=200",
            &format!("no preload: p50 {plain50:.0}, p99 {plain99:.0}; issue: 807, p99 1158"),
        )
        .on_idle_cpu(),
    );
    rows.push(Row::timed(
        "  the same, CODEBROKER_PRELOAD empty",
        plain,
        "",
        "before the preload",
    ));
    rows.push(
        Row::timed(
            "new session, pandas + plot (1 s apart)",
            slow,
            "p50<=120 p99<=300",
            "",
        )
        .on_idle_cpu(),
    );
}

/// The print-loop and pandas + plot rows under gVisor, or a row saying why not.
pub(crate) async fn runsc_rows(scale: Scale, data: &std::path::Path, rows: &mut Vec<Row>) {
    if !runsc_registered() {
        for name in [
            "print loop, /exec (runsc)",
            "new session, pandas + plot (runsc)",
        ] {
            rows.push(Row::figure(
                name,
                "skipped".into(),
                "",
                "runsc is not registered with Docker (scripts/runsc-up.sh)",
            ));
        }
        return;
    }
    let runsc = |c: &mut Config| {
        default_pool(c);
        c.sandbox.runtime = "runsc".into();
    };
    let bench = Bench::start("runsc-print", data, runsc).await;
    let first = bench.exec(json!({"lang": "py", "code": "print(1)"})).await;
    let session = first["session_id"].as_str().expect("session").to_string();
    let loops = print_loop(&bench, &session, scale.pick(20, 3)).await;
    bench.stop().await;
    rows.push(Row::timed(
        "print loop, /exec (runsc)",
        loops,
        "as low as runc allows",
        "issue: 502",
    ));

    let bench = Bench::start("runsc-chat", data, runsc).await;
    let plots = pandas_plot(&bench, scale.pick(20, 4), PACE).await;
    bench.stop().await;
    rows.push(
        Row::timed(
            "new session, pandas + plot (runsc)",
            plots,
            "as low as runc allows",
            "issue: 3000",
        )
        .on_idle_cpu(),
    );
}
