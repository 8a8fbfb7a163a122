//! Sandboxed code against the broker's streaming paths: display events in a loop (code
//! mode and `/exec/stream`, with a client that stops reading), one large file shown again
//! and again, and large tool-call frames in a loop. The broker runs as a child process so
//! its memory and CPU are its own.

mod common;
#[path = "common/mcp_client.rs"]
mod mcp_client;

use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;

/// Growth of the broker's RSS the tests allow while an attack runs (the figure).
const MAX_GROWTH_KIB: u64 = 64 * 1024;

/// The note an exec's answer carries once when display events were dropped.
const DROPPED: &str = "Display events beyond";

/// Python that finds the kernel and sends display events of `size` bytes straight on its
/// event channel for `secs` seconds; its value is how many it sent.
fn flood_py(secs: u32, size: usize) -> String {
    format!(
        "import gc, time\n\
         k = next(o for o in gc.get_objects() if type(o).__name__ == 'Kernel')\n\
         blob = 'A' * {size}\n\
         t = time.time(); n = 0\n\
         while time.time() - t < {secs}:\n\
         \x20   k.channel.send({{'event': 'display', 'id': k.request_id, 'mime': 'text/plain', 'data': blob}})\n\
         \x20   n += 1\n"
    )
}

use common::child::ChildBroker;
use mcp_client::Client;

/// The broker binary without auth, whose single-use sessions keep their containers, with
/// `env` on top.
async fn start(tag: &str, env: &[(&str, &str)]) -> ChildBroker {
    let mut all = vec![
        ("CODEBROKER_AUTH", "none"),
        ("CODEBROKER_SINGLE_USE_TTL_SECS", "0"),
    ];
    all.extend_from_slice(env);
    ChildBroker::start(tag, &all).await
}

fn rss_kib(broker: &ChildBroker) -> u64 {
    broker.status_bytes("VmRSS") / 1024
}

async fn exec(broker: &ChildBroker, body: Value) -> Value {
    reqwest::Client::new()
        .post(broker.url("/exec"))
        .json(&body)
        .timeout(Duration::from_secs(180))
        .send()
        .await
        .expect("/exec answers")
        .json()
        .await
        .expect("json")
}

/// An MCP client on the broker's `/mcp`, without credentials.
async fn mcp(broker: &ChildBroker) -> Client {
    mcp_client::connect_to(&broker.url("/mcp"), None)
        .await
        .expect("MCP client")
}

/// Code mode's `execute`: its structured `{result, logs, error}`.
async fn execute(client: &Client, lang: &str, code: &str) -> Value {
    let result = mcp_client::call(client, "execute", json!({"lang": lang, "code": code})).await;
    mcp_client::structured(&result).clone()
}

/// Samples the broker's RSS while `work` runs; fails as soon as it grew past the limit
/// (the broker is then killed by the drop, before it takes the machine).
async fn watch_rss<T>(broker: &ChildBroker, work: impl std::future::Future<Output = T>) -> T {
    let before = rss_kib(broker);
    tokio::pin!(work);
    let mut peak = before;
    loop {
        tokio::select! {
            out = &mut work => {
                eprintln!("broker RSS: {before} KiB before, {peak} KiB at most");
                return out;
            }
            _ = tokio::time::sleep(Duration::from_millis(250)) => {
                let now = rss_kib(broker);
                peak = peak.max(now);
                assert!(
                    now.saturating_sub(before) < MAX_GROWTH_KIB,
                    "broker RSS grew from {before} KiB to {now} KiB"
                );
            }
        }
    }
}

fn count(text: &str, needle: &str) -> usize {
    text.matches(needle).count()
}

#[tokio::test]
async fn codemode_display_flood_is_dropped_and_memory_stays_bounded() {
    let broker = start(
        "hs-cm-display",
        &[
            ("CODEBROKER_CODEMODE", "true"),
            ("CODEBROKER_CODEMODE_TIMEOUT_MS", "40000"),
        ],
    )
    .await;
    let client = mcp(&broker).await;
    let warm = execute(&client, "py", "1 + 1").await;
    assert_eq!(warm["result"], 2, "{warm}");

    let code = format!("{}n\n", flood_py(25, 1_000_000));
    let out = watch_rss(&broker, execute(&client, "py", &code)).await;
    let sent = out["result"].as_u64().unwrap_or(0);
    // 8 MiB of display per exec by default: 16 events of 1 MB are well past it.
    assert!(sent > 16, "the loop must outrun the budget: {out}");
    let logs = out["logs"].to_string();
    assert_eq!(count(&logs, DROPPED), 1, "said once: {logs}");

    // The same MCP session goes on.
    let next = execute(&client, "py", "40 + 2").await;
    assert_eq!(next["result"], 42, "{next}");
}

/// Writes a streamed exec request on a raw socket with a tiny receive buffer and never
/// reads the answer.
async fn stalled_stream(broker: &ChildBroker, body: &Value) -> tokio::net::TcpStream {
    let addr: std::net::SocketAddr = broker.base["http://".len()..].parse().expect("addr");
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
    let mut stream = socket.connect(addr).await.expect("connect");
    let body = body.to_string();
    let head = format!(
        "POST /exec/stream HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.expect("write");
    stream.write_all(body.as_bytes()).await.expect("write");
    stream
}

#[tokio::test]
async fn stream_client_that_stops_reading_holds_the_exec_not_memory() {
    let broker = start("hs-stalled", &[]).await;
    let first = exec(
        &broker,
        json!({"lang": "py", "code": "x = 41\nprint('set')"}),
    )
    .await;
    assert_eq!(first["stdout"], "set\n", "{first}");
    let session = first["session_id"].as_str().expect("session").to_string();

    // Events of 100 kB: more of them per second than of 1 MB.
    let body = json!({"lang": "py", "session_id": session, "timeout_ms": 40000,
                      "code": flood_py(25, 100_000)});
    let stalled = stalled_stream(&broker, &body).await;
    // A bystander session keeps working while the stalled one holds its exec.
    let bystander = async {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let started = Instant::now();
        let out = exec(&broker, json!({"lang": "bash", "code": "echo fine"})).await;
        assert_eq!(out["stdout"], "fine\n", "{out}");
        started.elapsed()
    };
    let took = watch_rss(&broker, async {
        let took = bystander.await;
        tokio::time::sleep(Duration::from_secs(25).saturating_sub(took)).await;
        took
    })
    .await;
    assert!(took < Duration::from_secs(30), "bystander took {took:?}");

    // The client goes away: the exec is cancelled, the session's next exec runs.
    drop(stalled);
    let started = Instant::now();
    let next = exec(
        &broker,
        json!({"lang": "py", "session_id": session, "code": "print('next')"}),
    )
    .await;
    assert_eq!(next["stdout"], "next\n", "{next}");
    assert!(
        started.elapsed() < Duration::from_secs(40),
        "the next exec waited {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn display_loop_of_one_large_file_sends_bounded_bytes() {
    let broker = start("hs-bigfile", &[]).await;
    let code = "import gc, os\n\
                open('/mnt/data/big.png', 'wb').write(os.urandom(4 << 20))\n\
                k = next(o for o in gc.get_objects() if type(o).__name__ == 'Kernel')\n\
                for _ in range(1000):\n\
                \x20   k.display('image/png', 'big.png')\n\
                print('shown')\n";
    let response = reqwest::Client::new()
        .post(broker.url("/exec/stream"))
        .header("accept", "application/x-ndjson")
        .json(&json!({"lang": "py", "code": code, "timeout_ms": 60000}))
        .timeout(Duration::from_secs(180))
        .send()
        .await
        .expect("/exec/stream");
    assert_eq!(response.status(), 200);
    let mut body = response.bytes_stream();
    let mut received = Vec::new();
    while let Some(chunk) = futures::StreamExt::next(&mut body).await {
        received.extend_from_slice(&chunk.expect("chunk"));
        assert!(
            received.len() < 64 << 20,
            "more than 64 MiB sent for one exec and still going"
        );
    }
    let events: Vec<Value> = received
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).expect("NDJSON"))
        .collect();
    let displays = events.iter().filter(|e| e["event"] == "display").count();
    let inlined = events
        .iter()
        .filter(|e| e["event"] == "display" && e["data"]["data"].is_string())
        .count();
    let result = events.last().expect("events");
    assert_eq!(result["event"], "result", "{result}");
    let stderr = result["data"]["stderr"].as_str().unwrap_or_default();
    eprintln!(
        "{} bytes sent, {displays} display events, {inlined} inlined",
        received.len()
    );
    assert_eq!(result["data"]["stdout"], "shown\n", "{result}");
    assert!(
        received.len() < 24 << 20,
        "{} bytes sent for one exec",
        received.len()
    );
    assert!((1..=256).contains(&displays), "{displays} display events");
    assert!(inlined >= 1, "a first display of the file is still inlined");
    assert_eq!(count(stderr, DROPPED), 1, "said once: {stderr}");

    // The next exec of the session shows the file again, inlined: the budget is per exec.
    let session = result["data"]["session_id"].as_str().expect("session");
    let again = reqwest::Client::new()
        .post(broker.url("/exec/stream"))
        .header("accept", "application/x-ndjson")
        .json(&json!({"lang": "py", "session_id": session,
                      "code": "k.display('image/png', 'big.png')"}))
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .expect("/exec/stream")
        .text()
        .await
        .expect("body");
    assert!(again.contains("\"event\":\"display\""), "{again:.300}");
    assert!(again.len() > 4 << 20, "the file is inlined again");
}

/// Every attacker calls a tool with a string of `size` bytes in a loop for `secs`: the
/// calls made, and the broker's CPU meanwhile.
async fn frame_attack(
    broker: &ChildBroker,
    attackers: &[Client],
    size: usize,
    secs: u64,
) -> (u64, Duration) {
    let code = format!(
        "const big = 'A'.repeat({size}); const t = Date.now(); let n = 0;\n\
         while (Date.now() - t < {ms}) {{\n\
           try {{ await codemode.env.get({{key: big}}); }} catch (e) {{}}\n\
           n++;\n\
         }}\n\
         return n;",
        ms = secs * 1000
    );
    let cpu_before = broker.cpu();
    let results =
        futures::future::join_all(attackers.iter().map(|c| execute(c, "js", &code))).await;
    let cpu = broker.cpu() - cpu_before;
    let calls = results
        .iter()
        .map(|r| r["result"].as_u64().unwrap_or(0))
        .sum();
    (calls, cpu)
}

#[tokio::test]
async fn tool_call_frames_of_4_mib_in_a_loop_do_not_pin_the_broker() {
    let broker = start(
        "hs-frames",
        &[
            ("CODEBROKER_CODEMODE", "true"),
            ("CODEBROKER_CODEMODE_TIMEOUT_MS", "40000"),
        ],
    )
    .await;
    // One attacker per core, as the review ran it.
    let attackers = [mcp(&broker).await, mcp(&broker).await];
    for client in &attackers {
        let warm = execute(client, "js", "return 1").await;
        assert_eq!(warm["result"], 1, "{warm}");
    }
    let bystander = exec(&broker, json!({"lang": "bash", "code": "echo warm"})).await;
    let bystander_session = bystander["session_id"]
        .as_str()
        .expect("session")
        .to_string();

    // The same attack with frames a quarter the size first: what a frame costs the broker
    // per byte on this host, whatever its speed.
    let (small_calls, small_cpu) = frame_attack(&broker, &attackers, 1_000_000, 6).await;
    let attack = frame_attack(&broker, &attackers, 4_000_000, 15);
    let probe = async {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let client = reqwest::Client::new();
        let mut slowest = Duration::ZERO;
        for _ in 0..10 {
            let started = Instant::now();
            let health = client
                .get(broker.url("/health"))
                .timeout(Duration::from_secs(60))
                .send()
                .await
                .expect("/health");
            assert!(health.status().is_success());
            slowest = slowest.max(started.elapsed());
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        let started = Instant::now();
        let out = exec(
            &broker,
            json!({"lang": "bash", "session_id": bystander_session, "code": "echo still"}),
        )
        .await;
        assert_eq!(out["stdout"], "still\n", "{out}");
        (slowest, started.elapsed())
    };
    let ((calls, cpu), (health, warm_exec)) = tokio::join!(attack, probe);
    let per_mb =
        |cpu: Duration, calls: u64, mb: f64| cpu.as_secs_f64() * 1e3 / (calls.max(1) as f64 * mb);
    let (small_per_mb, big_per_mb) = (per_mb(small_cpu, small_calls, 1.0), per_mb(cpu, calls, 4.0));
    eprintln!(
        "{calls} calls of 4 MB: broker CPU {cpu:?} ({big_per_mb:.1} ms per MB); {small_calls} \
         calls of 1 MB: {small_cpu:?} ({small_per_mb:.1} ms per MB); slowest /health \
         {health:?}; warm exec {warm_exec:?}"
    );
    assert!(calls >= 5 && small_calls >= 5, "the attack hardly ran");
    // The quadratic scan this guards against cost 645 ms per 4 MB frame on a host where a
    // linear one cost 25-85 ms (debug build); a linear one costs 300 ms on another host of
    // the same kind, so no fixed bound fits both. A linear scan costs a byte about the same
    // in 1 MB and 4 MB frames (77 against 81 ms per MB measured), a quadratic one more in
    // the longer frames (173 against 112 with the scan made quadratic on purpose): the
    // test compares the two sizes on the same host.
    assert!(
        big_per_mb < 1.3 * small_per_mb,
        "a byte of a 4 MB frame costs {big_per_mb:.1} ms per MB against {small_per_mb:.1} in \
         1 MB frames: the broker's cost grows faster than the frame"
    );
    assert!(health < Duration::from_secs(2), "/health took {health:?}");
    assert!(
        warm_exec < Duration::from_secs(10),
        "a warm exec took {warm_exec:?}"
    );
}
