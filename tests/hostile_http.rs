//! The broker's HTTP edge under abuse: what an unauthenticated client, a slow client, a
//! client that opens many connections and an oversized multipart form cost the broker
//! process. The broker runs as a child process so that its memory is measured on its own.

mod common;

use futures::StreamExt;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const KEY: &str = "hostile-http-key";
const MIB: u64 = 1024 * 1024;

use common::child::{proc_status_bytes, ChildBroker as Broker};

/// The broker binary with an API key and `env` on top.
async fn start(tag: &str, env: &[(&str, &str)]) -> Broker {
    let mut all = vec![("CODEBROKER_API_KEY", KEY)];
    all.extend_from_slice(env);
    Broker::start(tag, &all).await
}

/// Samples the broker's RSS every few milliseconds until dropped; the highest seen.
struct RssSampler {
    peak: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RssSampler {
    fn start(pid: u32) -> RssSampler {
        let peak = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (peak, stop) = (peak.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    peak.fetch_max(proc_status_bytes(pid, "VmRSS"), Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(5));
                }
            })
        };
        RssSampler {
            peak,
            stop,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.peak.load(Ordering::Relaxed)
    }
}

/// How much the broker's memory grew during `attack`: the highest RSS seen (sampled, and
/// the kernel's high-water mark when the attack raised it) over the RSS before.
async fn rss_growth<F: std::future::Future<Output = ()>>(broker: &Broker, attack: F) -> u64 {
    let before = broker.status_bytes("VmRSS");
    let hwm_before = broker.status_bytes("VmHWM");
    let sampler = RssSampler::start(broker.pid());
    attack.await;
    let sampled = sampler.finish();
    let hwm_after = broker.status_bytes("VmHWM");
    let peak = if hwm_after > hwm_before {
        hwm_after.max(sampled)
    } else {
        sampled
    };
    let growth = peak.saturating_sub(before);
    eprintln!(
        "broker RSS before {} MiB, peak {} MiB (HWM {} -> {} MiB): growth {} MiB",
        before / MIB,
        peak / MIB,
        hwm_before / MIB,
        hwm_after / MIB,
        growth / MIB
    );
    growth
}

/// A JSON body of `size` bytes: one long array of zeros, the costliest shape to parse
/// into a tree.
fn zeros_json(size: usize) -> Vec<u8> {
    let mut body = Vec::with_capacity(size);
    body.push(b'[');
    while body.len() + 3 < size {
        body.extend_from_slice(b"0,");
    }
    body.extend_from_slice(b"0]");
    body
}

async fn exec_with_key(broker: &Broker, client: &reqwest::Client) -> Value {
    let resp = client
        .post(broker.url("/exec"))
        .header("x-api-key", KEY)
        .json(&json!({ "lang": "bash", "code": "echo fine" }))
        .send()
        .await
        .expect("POST /exec");
    assert_eq!(resp.status(), 200);
    resp.json().await.expect("JSON")
}

#[tokio::test]
async fn unauthenticated_json_bodies_cost_the_broker_little() {
    common::require_image();
    let broker = start("http-preauth", &[]).await;
    let client = reqwest::Client::new();
    // Warm the paths up, so first-use allocations are not counted as the attack's.
    exec_with_key(&broker, &client).await;
    let small = client
        .post(broker.url("/exec"))
        .header("content-type", "application/json")
        .body(zeros_json(1024))
        .send()
        .await
        .expect("send");
    assert_eq!(small.status(), 401);

    let body = bytes::Bytes::from(zeros_json(14 * MIB as usize));
    let statuses = Arc::new(std::sync::Mutex::new(Vec::new()));
    let growth = rss_growth(&broker, async {
        let attacks = (0..6).map(|_| {
            let (client, body, url, statuses) = (
                client.clone(),
                body.clone(),
                broker.url("/exec"),
                statuses.clone(),
            );
            async move {
                let status = client
                    .post(url)
                    .header("content-type", "application/json")
                    .body(body)
                    .timeout(Duration::from_secs(120))
                    .send()
                    .await
                    .map(|r| r.status().as_u16())
                    .unwrap_or(0);
                statuses.lock().expect("lock").push(status);
            }
        });
        futures::future::join_all(attacks).await;
    })
    .await;
    let statuses = statuses.lock().expect("lock").clone();
    // Refused: 401 once read, or 503 at once for bodies past this address's half of the
    // pre-auth budget (read side by side, all six may pass it before any is done).
    assert!(
        statuses.iter().all(|s| *s == 401 || *s == 503),
        "every unauthenticated body is refused: {statuses:?}"
    );
    assert!(
        growth < 64 * MIB,
        "six 14 MiB unauthenticated bodies grew the broker by {} MiB",
        growth / MIB
    );

    // LibreChat 0.8.5's body key still works, and so does the header key.
    let resp = client
        .post(broker.url("/exec"))
        .json(&json!({ "lang": "bash", "code": "echo body-key", "LIBRECHAT_CODE_API_KEY": KEY }))
        .send()
        .await
        .expect("POST /exec");
    assert_eq!(resp.status(), 200);
    let out: Value = resp.json().await.expect("JSON");
    assert_eq!(out["stdout"], "body-key\n", "{out}");
    exec_with_key(&broker, &client).await;
}

#[tokio::test]
async fn a_wrong_header_key_is_refused_before_the_body_is_read() {
    let broker = start("http-hdrkey", &[]).await;
    let port = broker.port;
    // A body announced as 1 GiB of which nothing has arrived: only a refusal made before
    // reading it can answer.
    let answer = tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(20)))
            .expect("timeout");
        let head = format!(
            "POST /exec HTTP/1.1\r\nHost: 127.0.0.1\r\nX-API-Key: wrong\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            1u64 << 30
        );
        s.write_all(head.as_bytes()).expect("head");
        // The answer is read before any of the body is sent (sending first could meet a
        // reset from a broker that answered and closed without reading it).
        let mut buf = [0u8; 256];
        let n = s.read(&mut buf).unwrap_or(0);
        let _ = s.write_all(&[b' '; 64 * 1024]);
        String::from_utf8_lossy(&buf[..n]).to_string()
    })
    .await
    .expect("client");
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer:?}");
}

/// Sends `head` one byte at a time, `every` apart, for at most `within`; how long the
/// broker kept the connection open (`None`: it never closed it).
fn trickle(port: u16, head: &[u8], every: Duration, within: Duration) -> Option<Duration> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_millis(10)))
        .expect("timeout");
    let started = Instant::now();
    let mut sent = 0;
    while started.elapsed() < within {
        let byte = head[sent % head.len()];
        if stream.write_all(&[byte]).is_err() {
            return Some(started.elapsed());
        }
        sent += 1;
        let mut buf = [0u8; 1024];
        match stream.read(&mut buf) {
            // Closed, or answered (a timeout answer is a 408 or similar): either way cut.
            Ok(_) => return Some(started.elapsed()),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => return Some(started.elapsed()),
        }
        std::thread::sleep(every);
    }
    None
}

#[tokio::test]
async fn a_slow_header_sender_is_cut_after_the_header_timeout() {
    let broker = start(
        "http-slowloris",
        &[("CODEBROKER_HEADER_READ_TIMEOUT_SECS", "3")],
    )
    .await;
    let port = broker.port;
    let slow = tokio::task::spawn_blocking(move || {
        let head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
        trickle(
            port,
            head,
            Duration::from_millis(250),
            Duration::from_secs(25),
        )
    });
    // While the slow client trickles, others are served.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let resp = reqwest::get(broker.url("/health")).await.expect("health");
    assert!(resp.status() == 200 || resp.status() == 503);
    let cut = slow.await.expect("trickle");
    let cut = cut.expect("the slow client was never cut off");
    eprintln!("the slow client was cut after {cut:?}");
    assert!(
        cut < Duration::from_secs(15),
        "the slow client held its connection for {cut:?}"
    );
    // An idle keep-alive connection is closed by the same timer.
    let idle = tokio::task::spawn_blocking(move || {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        let started = Instant::now();
        let mut buf = [0u8; 4096];
        let n = stream.read(&mut buf).unwrap_or(0);
        (n, started.elapsed())
    });
    let (n, after) = idle.await.expect("idle");
    assert_eq!(n, 0, "an idle connection got bytes");
    assert!(after < Duration::from_secs(15), "idle for {after:?}");
    let resp = reqwest::get(broker.url("/health")).await.expect("health");
    assert!(resp.status() == 200 || resp.status() == 503);
}

#[tokio::test]
async fn connections_over_the_cap_wait_and_cost_nothing() {
    // Every connection comes from 127.0.0.1: the per-address cap is lifted to the total
    // (tests/hostile_edge.rs tests it).
    let broker = start(
        "http-conncap",
        &[
            ("CODEBROKER_MAX_CONNECTIONS", "16"),
            ("CODEBROKER_MAX_CONNECTIONS_PER_PEER", "16"),
        ],
    )
    .await;
    let port = broker.port;
    let before = broker.status_bytes("VmRSS");
    // Sixteen connections that send part of a request and then nothing.
    let mut held = Vec::new();
    for _ in 0..16 {
        let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        s.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            .expect("write");
        held.push(s);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Over the cap: a request is not served while they are open...
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .expect("client");
    let over = client
        .get(broker.url("/health"))
        .timeout(Duration::from_secs(3))
        .send()
        .await;
    assert!(over.is_err(), "a connection over the cap was served");
    // ...and many more waiting ones, each with a partial header, cost the broker nothing.
    let mut waiting = Vec::new();
    for _ in 0..300 {
        let Ok(mut s) = TcpStream::connect_timeout(
            &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
            Duration::from_secs(2),
        ) else {
            break;
        };
        let _ = s.set_write_timeout(Some(Duration::from_millis(200)));
        let _ = s.write_all(
            format!("GET /health HTTP/1.1\r\nX-Pad: {}", "a".repeat(32 * 1024)).as_bytes(),
        );
        waiting.push(s);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let growth = broker.status_bytes("VmRSS").saturating_sub(before);
    eprintln!(
        "{} waiting connections; broker RSS grew {} KiB",
        waiting.len(),
        growth / 1024
    );
    assert!(growth < 16 * MIB, "grew {} MiB", growth / MIB);
    // Once they close, calls are served again.
    drop(held);
    drop(waiting);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let fresh = client
            .get(broker.url("/health"))
            .timeout(Duration::from_secs(5))
            .send()
            .await;
        if let Ok(resp) = fresh {
            assert!(resp.status() == 200 || resp.status() == 503);
            break;
        }
        assert!(Instant::now() < deadline, "no call served after the flood");
    }
}

/// A multipart body: `fields` text parts, then one file part.
fn form(fields: &[(&str, Vec<u8>)], file: &[u8]) -> (String, Vec<u8>) {
    let fields: Vec<(&str, &[u8])> = fields.iter().map(|(n, v)| (*n, v.as_slice())).collect();
    common::raw_multipart(&fields, b"b.txt", None, file)
}

async fn upload(broker: &Broker, route: &str, (ctype, body): (String, Vec<u8>)) -> (u16, Value) {
    let resp = reqwest::Client::new()
        .post(broker.url(route))
        .header("x-api-key", KEY)
        .header("content-type", ctype)
        .body(body)
        .send()
        .await
        .expect("upload");
    common::answer(resp).await
}

async fn file_names(broker: &Broker, session: &str) -> Vec<String> {
    let list: Value = reqwest::Client::new()
        .get(broker.url(&format!("/files/{session}")))
        .header("x-api-key", KEY)
        .send()
        .await
        .expect("list")
        .json()
        .await
        .expect("JSON");
    let mut names: Vec<String> = list
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|f| f["name"].as_str())
        .map(|n| n.rsplit('/').next().unwrap_or(n).to_string())
        .collect();
    names.sort();
    names
}

#[tokio::test]
async fn multipart_text_fields_are_capped_in_size_and_count() {
    let broker = start("http-fields", &[]).await;
    let (status, first) = upload(&broker, "/upload", form(&[], b"one")).await;
    assert_eq!(status, 200, "{first}");
    let session = first["session_id"]
        .as_str()
        .expect("session_id")
        .to_string();
    let before = file_names(&broker, &session).await;

    let sid = session.clone().into_bytes();
    for route in ["/upload", "/upload/batch"] {
        // One field over the size cap, after a file part: refused, nothing stored.
        let big = form(
            &[("session_id", sid.clone()), ("kind", vec![b'k'; 9 * 1024])],
            b"two",
        );
        let (status, body) = upload(&broker, route, big).await;
        assert!(status == 413 || status == 400, "{route}: {status} {body}");
        assert!(body["error"].is_string(), "{body}");
        assert!(
            body["message"].as_str().unwrap_or("").contains("field"),
            "{body}"
        );
        // Too many small fields.
        let many: Vec<(String, Vec<u8>)> =
            (0..200).map(|i| (format!("f{i}"), b"x".to_vec())).collect();
        let mut fields: Vec<(&str, Vec<u8>)> = vec![("session_id", sid.clone())];
        fields.extend(many.iter().map(|(n, v)| (n.as_str(), v.clone())));
        let (status, body) = upload(&broker, route, form(&fields, b"three")).await;
        assert!(status == 413 || status == 400, "{route}: {status} {body}");
        assert!(
            body["message"].as_str().unwrap_or("").contains("field"),
            "{body}"
        );
        assert_eq!(file_names(&broker, &session).await, before, "{route}");
    }

    // The next upload works.
    let ok = form(&[("session_id", sid)], b"four");
    let (status, body) = upload(&broker, "/upload", ok).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["session_id"], session.as_str());
}

/// Field size for the huge-field test: 1 GiB, or `HOSTILE_HTTP_FIELD_MIB`.
fn huge_field_bytes() -> u64 {
    std::env::var("HOSTILE_HTTP_FIELD_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1024)
        * MIB
}

#[tokio::test]
async fn a_huge_multipart_text_field_is_refused_without_buffering() {
    let broker = start("http-hugefield", &[]).await;
    let total = huge_field_bytes();
    let boundary = "edge-boundary-9a7e";
    let head = format!("--{boundary}\r\nContent-Disposition: form-data; name=\"junk\"\r\n\r\n");
    let tail = format!(
        "\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.txt\"\r\n\r\nx\r\n--{boundary}--\r\n"
    );
    let chunk = bytes::Bytes::from(vec![b'A'; MIB as usize]);
    let parts = futures::stream::iter(
        std::iter::once(bytes::Bytes::from(head))
            .chain((0..total / MIB).map(move |_| chunk.clone()))
            .chain(std::iter::once(bytes::Bytes::from(tail))),
    )
    .map(Ok::<_, std::io::Error>);
    let mut outcome = String::new();
    let growth = rss_growth(&broker, async {
        let resp = reqwest::Client::new()
            .post(broker.url("/upload"))
            .header("x-api-key", KEY)
            .header(
                "content-type",
                format!("multipart/form-data; boundary={boundary}"),
            )
            .body(reqwest::Body::wrap_stream(parts))
            .timeout(Duration::from_secs(300))
            .send()
            .await;
        outcome = match resp {
            Ok(r) => {
                let status = r.status().as_u16();
                format!("{status} {}", r.text().await.unwrap_or_default())
            }
            // The broker answered and closed while the body was still being sent.
            Err(e) => format!("cut: {e}"),
        };
    })
    .await;
    eprintln!("a {} MiB text field: {outcome}", total / MIB);
    assert!(
        outcome.starts_with("413") || outcome.starts_with("400") || outcome.starts_with("cut"),
        "{outcome}"
    );
    assert!(
        growth < 64 * MIB,
        "a {} MiB text field grew the broker by {} MiB",
        total / MIB,
        growth / MIB
    );
    let (status, body) = upload(&broker, "/upload", form(&[], b"after")).await;
    assert_eq!(status, 200, "{body}");
}

/// A POST of `body` to `/exec` with the given `Host` and `Content-Type`.
async fn post_as(
    broker: &common::TestBroker,
    host: &str,
    content_type: &str,
    body: &str,
) -> (u16, Value) {
    let resp = broker
        .client
        .post(broker.url("/exec"))
        .header("host", host)
        .header("content-type", content_type)
        .body(body.to_string())
        .send()
        .await
        .expect("POST /exec");
    common::answer(resp).await
}

#[tokio::test]
async fn without_auth_only_known_hosts_and_json_bodies_are_served() {
    common::require_image();
    let broker = common::TestBroker::start("http-rebind").await;
    let port = broker.base.rsplit(':').next().expect("port").to_string();
    let code = r#"{"lang":"bash","code":"echo hi"}"#;
    // What a web page can send across origins without asking: text/plain, any Host.
    let (status, body) = post_as(&broker, "evil.example", "text/plain", code).await;
    assert_eq!(status, 403, "{body}");
    let (status, body) = post_as(&broker, "evil.example", "application/json", code).await;
    assert_eq!(status, 403, "{body}");
    let (status, body) = post_as(
        &broker,
        &format!("evil.example:{port}"),
        "application/json",
        code,
    )
    .await;
    assert_eq!(status, 403, "{body}");
    let files = broker
        .client
        .get(broker.url("/files/abc"))
        .header("host", "evil.example")
        .send()
        .await
        .expect("GET");
    assert_eq!(files.status(), 403);
    // A page of another origin cannot post even to a known host: not /exec, and not
    // /lobe/run, which takes text/plain because LobeChat's gateway sends it.
    for route in ["/exec", "/lobe/run"] {
        let resp = broker
            .client
            .post(broker.url(route))
            .header("origin", "http://evil.example")
            .header("content-type", "text/plain;charset=UTF-8")
            .body(code)
            .send()
            .await
            .expect("POST");
        assert_eq!(resp.status(), 403, "{route}");
    }
    let same_origin = broker
        .client
        .post(broker.url("/lobe/run"))
        .header("origin", format!("http://127.0.0.1:{port}"))
        .header("content-type", "text/plain;charset=UTF-8")
        .body(code)
        .send()
        .await
        .expect("POST");
    assert_eq!(same_origin.status(), 200);
    // A known host still needs a JSON body.
    let (status, body) = post_as(&broker, &format!("127.0.0.1:{port}"), "text/plain", code).await;
    assert_eq!(status, 415, "{body}");
    assert_eq!(body["error"], "unsupported_media_type", "{body}");
    // A proper call works, under any known name.
    for host in [format!("127.0.0.1:{port}"), format!("localhost:{port}")] {
        let (status, body) = post_as(&broker, &host, "application/json; charset=utf-8", code).await;
        assert_eq!(status, 200, "{host}: {body}");
        assert_eq!(body["stdout"], "hi\n", "{body}");
    }
}

#[tokio::test]
async fn any_host_still_refuses_pages_of_other_origins() {
    common::require_image();
    // `*` serves every Host name, but a page of another origin is still refused.
    let broker = common::TestBroker::start_with("http-anyhost", |c| {
        c.mcp_allowed_hosts = vec!["*".into()];
    })
    .await;
    let port = broker.base.rsplit(':').next().expect("port").to_string();
    let code = r#"{"lang":"bash","code":"echo hi"}"#;
    let resp = broker
        .client
        .post(broker.url("/lobe/run"))
        .header("origin", "http://evil.example")
        .header("content-type", "text/plain;charset=UTF-8")
        .body(code)
        .send()
        .await
        .expect("POST");
    assert_eq!(resp.status(), 403);
    let (status, body) = post_as(
        &broker,
        &format!("any.name.example:{port}"),
        "application/json",
        code,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let same_origin = broker
        .client
        .post(broker.url("/lobe/run"))
        .header("origin", format!("http://127.0.0.1:{port}"))
        .header("content-type", "text/plain;charset=UTF-8")
        .body(code)
        .send()
        .await
        .expect("POST");
    assert_eq!(same_origin.status(), 200);
}

#[tokio::test]
async fn health_shows_load_only_to_callers_with_credentials() {
    let broker = start("http-health", &[]).await;
    let client = reqwest::Client::new();
    let public: Value = client
        .get(broker.url("/health"))
        .send()
        .await
        .expect("health")
        .json()
        .await
        .expect("JSON");
    assert!(public["status"].is_string(), "{public}");
    assert!(public["languages"].is_array(), "{public}");
    for private in ["sessions", "sandboxes", "pool"] {
        assert!(public.get(private).is_none(), "{public}");
    }
    let keyed: Value = client
        .get(broker.url("/health"))
        .header("x-api-key", KEY)
        .send()
        .await
        .expect("health")
        .json()
        .await
        .expect("JSON");
    assert!(keyed["sessions"].is_number(), "{keyed}");
    assert!(keyed["pool"]["target"].is_number(), "{keyed}");
}

#[tokio::test]
async fn a_long_exec_and_a_quiet_stream_outlive_the_header_timeout() {
    common::require_image();
    let broker = start(
        "http-longexec",
        &[
            ("CODEBROKER_HEADER_READ_TIMEOUT_SECS", "2"),
            ("CODEBROKER_EXEC_TIMEOUT_MS", "20000"),
        ],
    )
    .await;
    let client = reqwest::Client::new();
    let resp = client
        .post(broker.url("/exec"))
        .header("x-api-key", KEY)
        .json(&json!({ "lang": "bash", "code": "sleep 5; echo done" }))
        .send()
        .await
        .expect("POST /exec");
    assert_eq!(resp.status(), 200);
    let out: Value = resp.json().await.expect("JSON");
    assert_eq!(out["stdout"], "done\n", "{out}");
    // A stream silent for longer than the timeout between two events.
    let resp = client
        .post(broker.url("/exec/stream"))
        .header("x-api-key", KEY)
        .json(&json!({ "lang": "bash", "code": "echo first; sleep 5; echo second" }))
        .send()
        .await
        .expect("POST /exec/stream");
    assert_eq!(resp.status(), 200);
    let body = resp.text().await.expect("the stream ends cleanly");
    assert!(body.contains("first") && body.contains("second"), "{body}");
    assert!(body.contains("event: result"), "{body}");
}
