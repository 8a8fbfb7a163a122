//! Idle sessions held: the broker's memory and each container's.

use crate::common::docker::running_containers_of;
use crate::rows::chat::PANDAS_PLOT;
use crate::table::Row;
use crate::{container_memory, mib, own_rss, Bench, Scale};
use codebroker::{read_meminfo, sandboxes_that_fit};
use serde_json::json;
use std::time::Duration;

/// Idle sessions held: the broker's memory and each container's; then how many idle and
/// busy sessions this host holds under `CODEBROKER_MAX_CONTAINERS=auto`.
pub(crate) async fn rows(scale: Scale, data: &std::path::Path, rows: &mut Vec<Row>) {
    let n = scale.pick(200, 10);
    // Read before the sessions below take any: what admission would see on a host
    // serving nobody yet.
    let available = meminfo("MemAvailable");
    let rss_before = own_rss();
    let bench = Bench::start("idle", data, |c| {
        c.caps.max_live_sandboxes = 0;
        c.pool.pool_size = 2;
        c.pool.pool_refill_concurrency = 4;
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
    let ids = running_containers_of(&bench.instance);
    let mut per: Vec<u64> = ids.iter().filter_map(|id| container_memory(id)).collect();
    per.sort();
    let live = bench.health().await["sandboxes"]["live"]
        .as_u64()
        .unwrap_or(0);
    bench.stop().await;
    let median = per.get(per.len() / 2).copied().unwrap_or(0);
    let total: u64 = per.iter().sum();
    let busy = busy_session_memory(scale, data).await;
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
    rows.push(Row::figure(
        "  memory per busy session container",
        format!("median {:.1} MiB", mib(busy)),
        "",
        "after pandas + plot",
    ));
    let total_memory = meminfo("MemTotal");
    let ceiling = sandboxes_that_fit(total_memory, u64::MAX, 1);
    let room = available.saturating_sub(total_memory / 4);
    // Unreadable cgroups: no figure.
    let holds = |each: u64| match each {
        0 => "n/a".to_string(),
        _ => sandboxes_that_fit(total_memory, available, each).to_string(),
    };
    rows.push(Row::figure(
        "sessions this host holds, MAX_CONTAINERS=auto",
        format!("{} idle, {} busy", holds(median), holds(busy)),
        "",
        &format!(
            "ceiling {ceiling}; {:.1} GiB available over a quarter kept; issue: 17",
            room as f64 / (1u64 << 30) as f64
        ),
    ));
}

/// The median memory of sessions that ran the chat workload (pandas + a plot), the most
/// an idle chat session keeps.
async fn busy_session_memory(scale: Scale, data: &std::path::Path) -> u64 {
    let bench = Bench::start("busy", data, |c| c.pool.pool_size = 2).await;
    let sessions = scale.pick(8, 2);
    for _ in 0..sessions {
        let r = bench.exec(json!({"lang": "py", "code": PANDAS_PLOT})).await;
        assert_eq!(r["exit_code"], 0, "{r}");
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut per: Vec<u64> = running_containers_of(&bench.instance)
        .iter()
        .filter_map(|id| container_memory(id))
        .collect();
    bench.stop().await;
    // The pool's containers are in the listing too (preloaded, no figure drawn): the
    // largest are the sessions'.
    per.sort();
    let busy = &per[per.len().saturating_sub(sessions)..];
    busy.get(busy.len() / 2).copied().unwrap_or(0)
}

/// A field of this host's `/proc/meminfo`, in bytes (0 when unreadable).
fn meminfo(field: &str) -> u64 {
    read_meminfo(std::path::Path::new("/proc"), field).unwrap_or(0)
}
