//! The HTTP edge against clients that hold connections, flood the log with bad
//! credentials, stall unauthenticated bodies, or ride on a browser's cached credentials:
//! one such client must not stop the broker for the others. The broker runs as a child
//! process (its own log, its own memory); every test ends by showing the next call works.

mod common;

use base64::Engine as _;
use common::child::{broker_binary, ChildBroker, Launch};
use serde_json::{json, Value};
use socket2::{Domain, Socket, Type};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

const KEY: &str = "hostile-edge-key";
const MIB: u64 = 1024 * 1024;

/// The broker binary with an API key and `env` on top.
async fn start(tag: &str, env: &[(&str, &str)]) -> ChildBroker {
    let mut all = vec![("CODEBROKER_API_KEY", KEY)];
    all.extend_from_slice(env);
    ChildBroker::start(tag, &all).await
}

/// A connection to the broker from `source` (any loopback address: all of 127/8 is
/// local on Linux), with a receive buffer of `rcvbuf` bytes when given.
fn connect_from(source: [u8; 4], port: u16, rcvbuf: Option<usize>) -> TcpStream {
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None).expect("socket");
    if let Some(size) = rcvbuf {
        socket.set_recv_buffer_size(size).expect("SO_RCVBUF");
    }
    socket
        .bind(&SocketAddr::from((source, 0)).into())
        .expect("bind the source address");
    socket
        .connect_timeout(
            &SocketAddr::from(([127, 0, 0, 1], port)).into(),
            Duration::from_secs(5),
        )
        .expect("connect");
    socket.into()
}

/// `GET /health` from a fresh connection: how long the answer took, `None` when none
/// came within `within`.
async fn health_within(broker: &ChildBroker, within: Duration) -> Option<Duration> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .expect("client");
    let started = Instant::now();
    let resp = client
        .get(broker.url("/health"))
        .timeout(within)
        .send()
        .await
        .ok()?;
    assert!(
        resp.status() == 200 || resp.status() == 503,
        "{}",
        resp.status()
    );
    Some(started.elapsed())
}

/// Whether the server has closed `stream`: reads (draining what was sent) until EOF or a
/// reset, for at most `within`.
fn closed_by_server(mut stream: TcpStream, within: Duration) -> bool {
    let _ = stream.set_nonblocking(false);
    let deadline = Instant::now() + within;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        let _ = stream.set_read_timeout(Some(left.min(Duration::from_secs(1))));
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return true,
        }
    }
}

/// The counter `name` of `/metrics` (0 when absent).
async fn metric(broker: &ChildBroker, name: &str) -> u64 {
    let text = reqwest::Client::new()
        .get(broker.url("/metrics"))
        .header("x-api-key", KEY)
        .send()
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("metrics text");
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

async fn exec_with_key(broker: &ChildBroker, code: &str) -> Value {
    let resp = reqwest::Client::new()
        .post(broker.url("/exec"))
        .header("x-api-key", KEY)
        .json(&json!({ "lang": "py", "code": code }))
        .send()
        .await
        .expect("POST /exec");
    assert_eq!(resp.status(), 200);
    resp.json().await.expect("JSON")
}

#[tokio::test]
async fn clients_that_pipeline_and_never_read_are_cut_and_others_are_served() {
    let broker = start(
        "edge-noread",
        &[
            ("CODEBROKER_MAX_CONNECTIONS", "64"),
            // Every socket from one address may hold a slot: the write timeout is tested.
            ("CODEBROKER_MAX_CONNECTIONS_PER_PEER", "64"),
            ("CODEBROKER_HEADER_READ_TIMEOUT_SECS", "2"),
            ("CODEBROKER_WRITE_TIMEOUT_SECS", "3"),
        ],
    )
    .await;
    let port = broker.port;
    let rss_before = broker.status_bytes("VmRSS");
    let request = b"GET /lobe/manifest.json HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
    let pipelined: Vec<u8> = request.repeat(5000);
    // 64 clients with a 1 KiB receive buffer pipeline 5,000 requests each and never read;
    // what does not fit their send buffers is dropped.
    let attackers: Vec<TcpStream> = (0..64)
        .map(|_| {
            let stream = connect_from([127, 0, 0, 1], port, Some(1024));
            stream.set_nonblocking(true).expect("nonblocking");
            let mut sent = 0;
            while sent < pipelined.len() {
                match (&stream).write(&pipelined[sent..]) {
                    Ok(n) => sent += n,
                    Err(_) => break,
                }
            }
            stream
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let answered = health_within(&broker, Duration::from_secs(10)).await;
    eprintln!("/health 5 s into the attack: answered after {answered:?} (None: no answer in 10 s)");
    let rss_growth = broker.status_bytes("VmRSS").saturating_sub(rss_before);
    eprintln!("broker RSS grew {} KiB", rss_growth / 1024);
    let closed = tokio::task::spawn_blocking(move || {
        let readers: Vec<_> = attackers
            .into_iter()
            .map(|s| std::thread::spawn(move || closed_by_server(s, Duration::from_secs(20))))
            .collect();
        readers
            .into_iter()
            .map(|r| r.join().unwrap_or(false))
            .filter(|closed| *closed)
            .count()
    })
    .await
    .expect("readers");
    eprintln!("{closed} of 64 stalled connections were closed by the broker");
    assert!(
        answered.is_some_and(|t| t < Duration::from_secs(10)),
        "/health was not answered within 10 s"
    );
    assert_eq!(closed, 64, "stalled connections left open");
    assert!(rss_growth < 32 * MIB, "RSS grew {} MiB", rss_growth / MIB);
    // The next call works, and so does a code run.
    assert!(health_within(&broker, Duration::from_secs(10))
        .await
        .is_some());
    let out = exec_with_key(&broker, "print('after')").await;
    assert_eq!(out["stdout"], "after\n", "{out}");
}

#[tokio::test]
async fn a_long_exec_whose_client_reads_outlives_the_write_timeout() {
    let broker = start(
        "edge-longexec",
        &[
            ("CODEBROKER_WRITE_TIMEOUT_SECS", "1"),
            ("CODEBROKER_HEADER_READ_TIMEOUT_SECS", "1"),
            ("CODEBROKER_EXEC_TIMEOUT_MS", "20000"),
        ],
    )
    .await;
    let started = Instant::now();
    let out = exec_with_key(&broker, "import time\ntime.sleep(6)\nprint('done')").await;
    assert_eq!(out["stdout"], "done\n", "{out}");
    assert!(started.elapsed() >= Duration::from_secs(6));
    // A stream quiet for longer than the timeout, and a large answer read as it comes.
    let resp = reqwest::Client::new()
        .post(broker.url("/exec/stream"))
        .header("x-api-key", KEY)
        .json(&json!({ "lang": "py",
            "code": "import time\nprint('first', flush=True)\ntime.sleep(4)\nprint('x' * 2000000)" }))
        .send()
        .await
        .expect("POST /exec/stream");
    assert_eq!(resp.status(), 200);
    let body = resp.text().await.expect("the stream ends cleanly");
    assert!(
        body.contains("first") && body.contains("xxxx"),
        "{}",
        &body[..body.len().min(400)]
    );
    assert!(body.contains("event: result"), "no result event");
}

#[tokio::test]
async fn one_address_cannot_take_every_connection() {
    let broker = start(
        "edge-perpeer",
        &[
            ("CODEBROKER_MAX_CONNECTIONS", "8"),
            ("CODEBROKER_MAX_CONNECTIONS_PER_PEER", "4"),
            ("CODEBROKER_HEADER_READ_TIMEOUT_SECS", "60"),
        ],
    )
    .await;
    let port = broker.port;
    // 127.0.0.2 opens 8 connections, each with half a request head, and waits.
    let held: Vec<TcpStream> = (0..8)
        .map(|_| {
            let mut s = connect_from([127, 0, 0, 2], port, None);
            let _ = s.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n");
            s
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Its excess is told so and closed at once.
    let refused = tokio::task::spawn_blocking(move || {
        let mut refused = 0;
        let mut kept = Vec::new();
        for mut s in held {
            s.set_read_timeout(Some(Duration::from_millis(300)))
                .expect("timeout");
            let mut buf = [0u8; 512];
            match s.read(&mut buf) {
                Ok(n) if String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 503") => {
                    refused += 1
                }
                _ => kept.push(s),
            }
        }
        (refused, kept)
    });
    // Another address is served meanwhile.
    let answered = health_within(&broker, Duration::from_secs(5)).await;
    eprintln!("/health from 127.0.0.1 while 127.0.0.2 holds 8 connections: {answered:?}");
    let (refused, kept) = refused.await.expect("reads");
    eprintln!("{refused} of 127.0.0.2's 8 connections got 503");
    assert!(answered.is_some(), "another address was starved");
    assert_eq!(
        refused, 4,
        "connections over the per-peer cap were not refused"
    );
    // Once it closes one, 127.0.0.2 is served again.
    drop(kept);
    let again = tokio::task::spawn_blocking(move || {
        let mut s = connect_from([127, 0, 0, 2], port, None);
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        s.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            .expect("write");
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        answer
    })
    .await
    .expect("again");
    assert!(
        again.starts_with("HTTP/1.1 200") || again.starts_with("HTTP/1.1 503"),
        "{again:?}"
    );
    assert!(!again.contains("too many connections"), "{again:?}");
}

/// A token that looks like a JWT (so it is verified) whose header names a `kid` of
/// `kid_bytes` bytes that no key has; about 4/3 as long once encoded.
fn token_with_kid(kid_bytes: usize) -> String {
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let header = json!({ "alg": "EdDSA", "typ": "JWT", "kid": "K".repeat(kid_bytes) });
    let claims =
        json!({ "iss": "librechat", "aud": "codeapi", "sub": "u", "exp": 4_000_000_000u64 });
    format!(
        "{}.{}.{}",
        b64.encode(header.to_string()),
        b64.encode(claims.to_string()),
        b64.encode([0u8; 64])
    )
}

#[tokio::test]
async fn a_flood_of_bad_tokens_is_counted_and_costs_the_log_a_few_lines() {
    common::require_image();
    let data = tempfile::tempdir().expect("tempdir");
    let log_path = data.path().join("broker.log");
    let log = std::fs::File::create(&log_path).expect("log file");
    let mut command = std::process::Command::new(broker_binary());
    command.stdout(log.try_clone().expect("log")).stderr(log);
    let broker = Launch::program(
        command,
        &common::instance_name("edge-logflood"),
        data.path(),
    )
    .envs(&[
        ("CODEBROKER_API_KEY", KEY),
        (
            "CODEBROKER_JWT_PUBLIC_KEYS",
            &common::jwt::lc_ed_public_key(),
        ),
        ("RUST_LOG", "codebroker=info"),
    ])
    .spawn()
    .await;
    let size_before = std::fs::metadata(&log_path).expect("log").len();
    // 2,000 tokens of about 60 KiB, each naming a 45 KiB kid.
    let token = token_with_kid(45 * 1024);
    assert!(
        token.len() > 59 * 1024 && token.len() < 63 * 1024,
        "{}",
        token.len()
    );
    let client = reqwest::Client::new();
    let started = Instant::now();
    let statuses: Vec<u16> = futures::StreamExt::collect(futures::StreamExt::buffer_unordered(
        futures::stream::iter((0..2000).map(|_| {
            let request = client
                .get(broker.url("/v1/files/AAAAAAAAAAAAAAAAAAAAA"))
                .bearer_auth(&token);
            async move { request.send().await.map_or(0, |r| r.status().as_u16()) }
        })),
        8,
    ))
    .await;
    let took = started.elapsed();
    assert!(statuses.iter().all(|s| *s == 401), "{:?}", &statuses[..8]);
    // The summary of the last burst is written within a few seconds.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let failures = metric(&broker, "codebroker_auth_failures_total").await;
    let text = std::fs::read_to_string(&log_path).expect("log");
    let grown = text.len() as u64 - size_before;
    let lines = text
        .lines()
        .filter(|l| l.contains("JWT rejected") || l.contains("authentication failures"))
        .count();
    let longest = text.lines().map(str::len).max().unwrap_or(0);
    eprintln!(
        "2000 bad tokens in {took:?}: {lines} log lines, {grown} bytes of log (longest line \
         {longest} bytes); counter {failures}"
    );
    assert_eq!(failures, 2000, "every failure is counted");
    let secs = took.as_secs() + 8;
    assert!(
        (lines as u64) <= 6 * secs,
        "{lines} lines for {secs} s of failures"
    );
    assert!(grown < 64 * 1024, "the log grew {grown} bytes");
    assert!(longest < 1024, "a log line of {longest} bytes");
    assert!(
        text.contains("more authentication failures not logged"),
        "no summary line"
    );
    // The next call with a key works.
    let resp = client
        .get(broker.url("/health"))
        .header("x-api-key", KEY)
        .send()
        .await
        .expect("health");
    assert!(resp.status() == 200 || resp.status() == 503);
}

/// A body-key request head with `Transfer-Encoding: chunked` and one byte of the body:
/// a client that announces a body of unknown length and stops.
fn stalled_chunked_body(port: u16) -> TcpStream {
    let mut s = connect_from([127, 0, 0, 1], port, None);
    s.write_all(
        b"POST /exec HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
          Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n",
    )
    .expect("write");
    s
}

async fn body_key_exec(broker: &ChildBroker) -> (u16, Value, Duration) {
    let started = Instant::now();
    let resp = reqwest::Client::new()
        .post(broker.url("/exec"))
        .json(&json!({ "lang": "bash", "code": "echo body-key", "LIBRECHAT_CODE_API_KEY": KEY }))
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .expect("POST /exec");
    let status = resp.status().as_u16();
    let body = resp.json().await.unwrap_or(Value::Null);
    (status, body, started.elapsed())
}

#[tokio::test]
async fn stalled_chunked_bodies_do_not_lock_out_body_key_callers() {
    // The default budget (32 MiB), largest body (16 MiB) and header timeout (20 s): the
    // stalled bodies are cut after 20 s, so a call that waited for them would take that.
    let broker = start("edge-chunked", &[]).await;
    let stalled = [
        stalled_chunked_body(broker.port),
        stalled_chunked_body(broker.port),
    ];
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (status, body, took) = body_key_exec(&broker).await;
    eprintln!("a body-key exec behind two stalled chunked bodies: {status} after {took:?}");
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["stdout"], "body-key\n", "{body}");
    assert!(
        took < Duration::from_secs(10),
        "the body-key call waited {took:?} for the stalled bodies"
    );
    drop(stalled);
    let (status, _, _) = body_key_exec(&broker).await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn one_address_holds_at_most_half_of_the_unauthenticated_budget() {
    let broker = start(
        "edge-peerbudget",
        &[
            ("CODEBROKER_PREAUTH_BODY_BUDGET", "1MiB"),
            ("CODEBROKER_HEADER_READ_TIMEOUT_SECS", "4"),
        ],
    )
    .await;
    let port = broker.port;
    // 127.0.0.2 announces 500 KiB, sends 400 KiB of it and stops: it holds 400 KiB of the
    // budget until its body times out.
    let holder = tokio::task::spawn_blocking(move || {
        let mut s = connect_from([127, 0, 0, 2], port, None);
        let head = format!(
            "POST /exec HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n[",
            500 * 1024
        );
        s.write_all(head.as_bytes()).expect("head");
        s.write_all(&b"0,".repeat(200 * 1024)).expect("400 KiB");
        s
    })
    .await
    .expect("holder");
    tokio::time::sleep(Duration::from_millis(300)).await;
    // A second body of 200 KiB from the same address is over its half: 503 at once.
    let second = tokio::task::spawn_blocking(move || {
        let mut s = connect_from([127, 0, 0, 2], port, None);
        s.set_read_timeout(Some(Duration::from_secs(3)))
            .expect("timeout");
        let body = b"["
            .iter()
            .chain(b"0,".repeat(100 * 1024).iter())
            .copied()
            .collect::<Vec<u8>>();
        let head = format!(
            "POST /exec HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n",
            body.len() + 1
        );
        let started = Instant::now();
        s.write_all(head.as_bytes()).expect("head");
        let _ = s.write_all(&body);
        let mut buf = [0u8; 1024];
        let n = s.read(&mut buf).unwrap_or(0);
        (
            String::from_utf8_lossy(&buf[..n]).to_string(),
            started.elapsed(),
        )
    })
    .await
    .expect("second");
    eprintln!(
        "a second body from the same address: {:?} after {:?}",
        &second.0[..second.0.len().min(12)],
        second.1
    );
    assert!(second.0.starts_with("HTTP/1.1 503"), "{:?}", second.0);
    assert!(second.0.contains("this address"), "{:?}", second.0);
    // Another address's body-key call is served meanwhile.
    let (status, body, _) = body_key_exec(&broker).await;
    assert_eq!(status, 200, "{body}");
    // The holder is cut after the timeout, and then its address is served again.
    let cut =
        tokio::task::spawn_blocking(move || closed_by_server(holder, Duration::from_secs(20)))
            .await
            .expect("cut");
    assert!(cut, "the stalled body was never cut");
    let again = tokio::task::spawn_blocking(move || {
        let mut s = connect_from([127, 0, 0, 2], port, None);
        s.set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        let body = json!({ "lang": "bash", "code": "echo again", "LIBRECHAT_CODE_API_KEY": KEY })
            .to_string();
        let request = format!(
            "POST /exec HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(request.as_bytes()).expect("write");
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        answer
    })
    .await
    .expect("again");
    assert!(again.starts_with("HTTP/1.1 200"), "{again:?}");
    assert!(again.contains("again"), "{again:?}");
}

fn basic(credentials: &str) -> String {
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(credentials)
    )
}

/// `GET /v1/files/<an unknown session>` with `headers`: the status and the message.
async fn files_with(broker: &ChildBroker, headers: &[(&str, String)]) -> (u16, String) {
    let mut request =
        reqwest::Client::new().get(broker.url("/v1/files/AAAAAAAAAAAAAAAAAAAAA?detail=summary"));
    for (name, value) in headers {
        request = request.header(*name, value);
    }
    let resp = request.send().await.expect("request");
    let status = resp.status().as_u16();
    (status, resp.text().await.unwrap_or_default())
}

/// What a request is, its headers, and whether it is served.
type Case<'a> = (&'a str, Vec<(&'a str, String)>, bool);

#[tokio::test]
async fn basic_credentials_from_another_sites_page_are_refused() {
    let broker = start("edge-crosssite", &[]).await;
    let own_origin = broker.base.clone();
    let cases: Vec<Case> = vec![
        (
            "Basic alone (LibreChat)",
            vec![("authorization", basic(KEY))],
            true,
        ),
        (
            "Basic from the broker's own page",
            vec![
                ("authorization", basic(&format!(":{KEY}"))),
                ("sec-fetch-site", "same-origin".into()),
                ("origin", own_origin.clone()),
            ],
            true,
        ),
        (
            "Basic, Sec-Fetch-Site: cross-site",
            vec![
                ("authorization", basic(KEY)),
                ("sec-fetch-site", "cross-site".into()),
            ],
            false,
        ),
        (
            "Basic, a foreign Origin",
            vec![
                ("authorization", basic(&format!("{KEY}:"))),
                ("origin", "https://evil.example".into()),
            ],
            false,
        ),
        (
            "Basic, a foreign Origin on the broker's port",
            vec![
                ("authorization", basic(KEY)),
                ("origin", "http://evil.example:1234".into()),
                ("sec-fetch-site", "same-site".into()),
            ],
            false,
        ),
    ];
    for (what, headers, served) in cases {
        let (status, text) = files_with(&broker, &headers).await;
        eprintln!("{what}: {status} {text}");
        if served {
            assert_eq!(status, 200, "{what}: {text}");
        } else {
            assert_eq!(status, 403, "{what}: {text}");
            assert!(text.contains("Basic"), "{what}: {text}");
        }
    }
    // The forms a page can send without asking: a multipart upload and a text/plain run.
    let client = reqwest::Client::new();
    let form = reqwest::multipart::Form::new().part(
        "file",
        reqwest::multipart::Part::bytes(b"hello".to_vec()).file_name("a.txt"),
    );
    let upload = client
        .post(broker.url("/upload"))
        .header("authorization", basic(KEY))
        .header("sec-fetch-site", "cross-site")
        .header("origin", "https://evil.example")
        .multipart(form)
        .send()
        .await
        .expect("upload");
    assert_eq!(upload.status(), 403);
    let run = client
        .post(broker.url("/lobe/run"))
        .header("authorization", basic(KEY))
        .header("sec-fetch-site", "cross-site")
        .header("content-type", "text/plain")
        .body(r#"{"apiName":"runCode","arguments":"{\"lang\":\"bash\",\"code\":\"echo hi\"}"}"#)
        .send()
        .await
        .expect("lobe run");
    assert_eq!(run.status(), 403);
    // A header key, which no page can send without a preflight, and the next call work.
    let (status, text) = files_with(
        &broker,
        &[
            ("x-api-key", KEY.into()),
            ("sec-fetch-site", "cross-site".into()),
        ],
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let (status, text) = files_with(&broker, &[("authorization", basic(KEY))]).await;
    assert_eq!(status, 200, "{text}");
}

#[tokio::test]
async fn requests_pipelined_behind_a_refused_one_are_not_read() {
    let broker = start("edge-pipeline401", &[]).await;
    let port = broker.port;
    let answers = tokio::task::spawn_blocking(move || {
        let mut s = connect_from([127, 0, 0, 1], port, None);
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let request = b"GET /v1/files/AAAAAAAAAAAAAAAAAAAAA HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
        s.write_all(&request.repeat(50)).expect("write");
        let mut all = Vec::new();
        let _ = s.read_to_end(&mut all);
        String::from_utf8_lossy(&all).matches("HTTP/1.1 ").count()
    })
    .await
    .expect("client");
    eprintln!("50 pipelined unauthenticated requests: {answers} answered before the close");
    assert_eq!(answers, 1, "requests behind a 401 were read");
    // A keyed call still works.
    let (status, text) = files_with(&broker, &[("x-api-key", KEY.into())]).await;
    assert_eq!(status, 200, "{text}");
}

#[tokio::test]
async fn a_token_in_the_query_never_reaches_the_log() {
    // Jupyter's clients send the key as `?token=`; request spans would log the URI.
    common::require_image();
    let data = tempfile::tempdir().expect("tempdir");
    let log_path = data.path().join("broker.log");
    let log = std::fs::File::create(&log_path).expect("log file");
    let mut command = std::process::Command::new(broker_binary());
    command.stdout(log.try_clone().expect("log")).stderr(log);
    let broker = Launch::program(
        command,
        &common::instance_name("edge-querylog"),
        data.path(),
    )
    .envs(&[("CODEBROKER_API_KEY", KEY), ("RUST_LOG", "debug")])
    .spawn()
    .await;
    let client = reqwest::Client::new();
    let wrong = "wrong-token-in-the-query-0123";
    for (token, status) in [(KEY, 200), (wrong, 401)] {
        let resp = client
            .get(broker.url(&format!("/jupyter/api/kernels?token={token}")))
            .send()
            .await
            .expect("request");
        assert_eq!(resp.status(), status);
    }
    drop(broker);
    let text = std::fs::read_to_string(&log_path).expect("log");
    // The requests were logged (their spans at debug), without their queries.
    assert!(text.contains("/jupyter/api/kernels"), "{text}");
    assert!(!text.contains(KEY), "the key is in the log");
    assert!(!text.contains(wrong), "the wrong token is in the log");
}
