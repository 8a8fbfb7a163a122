//! Idle sessions held: the broker's memory and each container's.

use crate::common::docker::running_containers_of;
use crate::table::Row;
use crate::{container_memory, mib, own_rss, Bench, Scale};
use serde_json::json;
use std::time::Duration;

/// Idle sessions held: the broker's memory and each container's.
pub(crate) async fn rows(scale: Scale, data: &std::path::Path, rows: &mut Vec<Row>) {
    let n = scale.pick(200, 10);
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
