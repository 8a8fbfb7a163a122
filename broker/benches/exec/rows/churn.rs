//! A LibreChat-like churn of many users: containers alive and memory over time.

use crate::common::docker::running_containers_of;
use crate::table::Row;
use crate::{container_memory, mib, own_rss, Bench, Scale};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// A LibreChat-like churn: each simulated user makes a call every few seconds; most send
/// no session id and no refs (a new session each), some send refs to a file of their
/// last session (that session is reused).
pub(crate) async fn rows(
    scale: Scale,
    data: &std::path::Path,
    rows: &mut Vec<Row>,
    notes: &mut Vec<String>,
) {
    let users = scale.pick(20, 6);
    let duration = Duration::from_secs(scale.pick(90, 20) as u64);
    let cap = 16;
    let bench = Bench::start("churn", data, |c| {
        c.pool.pool_size = 2;
        c.caps.max_live_sandboxes = cap;
        c.lifecycle.single_use_ttl_secs = 10;
        c.lifecycle.reap_interval_secs = 2;
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
        let ids = running_containers_of(&bench.instance);
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
