//! New sessions at once: the first burst, the burst with the pool grown, and where the
//! CPU of a burst of cold starts goes.

use crate::cpu::CpuSnapshot;
use crate::table::{summary, Row};
use crate::{Bench, Scale};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// 20 new sessions at once: the first burst after start (the pool at its size, so most
/// are cold starts), then again once the pool has grown to the burst; then where the CPU
/// of a burst of cold starts goes.
pub(crate) async fn rows(
    scale: Scale,
    data: &std::path::Path,
    rows: &mut Vec<Row>,
    notes: &mut Vec<String>,
) {
    let n = scale.pick(20, 8);
    let default_preload = codebroker::config::Config::for_tests(data.to_path_buf(), "defaults")
        .pool
        .preload;
    // With the default preload (what a fresh install does), then, as the same run's
    // baseline, without it: a pool that preloads must not slow a burst down.
    for (tag, preload, note) in [
        ("burst", default_preload, ""),
        (
            "burst-nopreload",
            Default::default(),
            ", CODEBROKER_PRELOAD empty",
        ),
    ] {
        let bench = Bench::start(tag, data, |c| {
            c.pool.pool_size = 2;
            c.pool.pool_max = 16;
            c.pool.preload = preload;
        })
        .await;
        bench.wait_pool(2).await;
        let (first, failed) = burst(&bench, n).await;
        rows.push(Row::timed(
            &format!("{n} new sessions at once, pool 2{note} ({failed} failed)"),
            first,
            "p99<=1500, 0 failed",
            "first burst: cold starts",
        ));
        let target = bench.health().await["pool"]["target"].as_u64().unwrap_or(0);
        bench.wait_pool(target).await;
        let (grown, failed) = burst(&bench, n).await;
        rows.push(Row::timed(
            &format!("{n} new sessions at once, pool {target}{note} ({failed} failed)"),
            grown,
            "p99<=1500, 0 failed",
            "pool grown by the first",
        ));
        bench.stop().await;
    }

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
