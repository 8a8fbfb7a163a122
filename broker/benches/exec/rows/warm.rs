//! One session: warm execs, streaming, the tool-call round trip, the compile cache,
//! 10,000 lines (one print, and a print loop), parallel execs.

use crate::common::docker::running_containers_of;
use crate::table::{p50, summary, Row};
use crate::{time_command, timed, Bench, Scale};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// One session: warm execs, streaming, the tool-call round trip, the compile cache,
/// 10,000 lines, parallel execs.
pub(crate) async fn rows(scale: Scale, data: &std::path::Path, rows: &mut Vec<Row>) {
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
    let container = running_containers_of(&bench.instance)
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
        "10,000 lines in one print, /exec",
        lines,
        "p50<=25",
        "",
    ));
    // The same lines as models write them: one print() each.
    let loops = crate::rows::chat::print_loop(&bench, &session, scale.pick(30, 5)).await;
    rows.push(Row::timed(
        "10,000 lines, print() in a loop, /exec",
        loops,
        "p50<=12",
        "issue: 72 (thehapyone: 280)",
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
