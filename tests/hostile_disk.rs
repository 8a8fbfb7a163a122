//! One request must not multiply the broker's disk or memory: input refs and uploads that
//! place many copies of one file are charged per copy, an exec carries a bounded number of
//! refs, an upload that drips is cut, and a multipart body that never reaches its first
//! boundary or the end of a part's headers is refused before it costs memory. After each
//! refusal the same session still works.

mod common;

use common::{stderr, stdout, TestBroker};
use futures::StreamExt;
use reqwest::multipart::{Form, Part};
use serde_json::{json, Value};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: u64 = 1024 * 1024;

/// The tests of this file measure the process's memory and the data directory: one at a
/// time, so that no other test's bytes show in their figures.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Bytes allocated on disk below `dir` (what `du` counts).
fn allocated(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    for entry in entries.flatten() {
        let Ok(meta) = entry.path().symlink_metadata() else {
            continue;
        };
        total += meta.blocks() * 512;
        if meta.is_dir() {
            total += allocated(&entry.path());
        }
    }
    total
}

/// Uploads `files` (name, bytes) in one request, into `session_id` when given.
async fn upload(
    broker: &TestBroker,
    session_id: Option<&str>,
    files: &[(String, Vec<u8>)],
) -> (u16, Value) {
    let mut form = Form::new();
    if let Some(id) = session_id {
        form = form.text("session_id", id.to_string());
    }
    for (name, bytes) in files {
        form = form.part("file", Part::bytes(bytes.clone()).file_name(name.clone()));
    }
    let resp = broker
        .client
        .post(broker.url("/upload"))
        .multipart(form)
        .send()
        .await
        .expect("upload");
    common::answer(resp).await
}

/// Uploads one small file into `session_id` and checks that it is stored.
async fn small_upload_works(broker: &TestBroker, session_id: &str) {
    let (status, body) = upload(
        broker,
        Some(session_id),
        &[("ok.txt".into(), b"ok".to_vec())],
    )
    .await;
    assert_eq!(status, 200, "the next upload still works: {body}");
    assert_eq!(body["session_id"], session_id, "{body}");
}

/// Runs `echo ok` in `session_id` and checks that it ran there.
async fn next_exec_works(broker: &TestBroker, session_id: &str) {
    let (status, body) = broker
        .exec(json!({"lang": "bash", "code": "echo ok", "session_id": session_id}))
        .await;
    assert_eq!(status, 200, "the next exec still works: {body}");
    assert_eq!(stdout(&body).trim(), "ok", "{body}");
    assert_eq!(body["session_id"], session_id, "{body}");
}

/// A broker with a small storage budget and workspace quota, so that the copies a request
/// could multiply are measurable in seconds.
async fn small_budget_broker(tag: &str) -> TestBroker {
    TestBroker::start_with(tag, |config| {
        config.caps.session_storage = 64 * MIB;
        config.sandbox.workspace_quota = 128 * MIB;
    })
    .await
}

/// Bytes that do not compress or deduplicate on any filesystem.
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn input_refs_to_one_upload_cannot_multiply_it_on_disk() {
    let _serial = SERIAL.lock().await;
    let broker = small_budget_broker("refs-amplify").await;
    let (status, body) = upload(
        &broker,
        None,
        &[("big.bin".into(), noise(16 * MIB as usize, 1))],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let session_id = body["session_id"].as_str().expect("session").to_string();
    let file_id = body["files"][0]["fileId"]
        .as_str()
        .expect("file id")
        .to_string();
    let refs: Vec<Value> = (0..60)
        .map(|i| json!({"id": file_id, "session_id": session_id, "name": format!("c{i}.bin")}))
        .collect();
    let (status, body) = broker
        .exec(json!({"lang": "bash", "code": "true", "session_id": session_id, "files": refs}))
        .await;
    let grown = allocated(&broker.data);
    eprintln!(
        "60 refs to a 16 MiB upload: status {status}, data directory {} MiB",
        grown / MIB
    );
    assert!(
        grown <= (64 + 128) * MIB,
        "the data directory holds {} MiB, over the session budget (64 MiB) plus the \
         workspace quota (128 MiB)",
        grown / MIB
    );
    // Why, in one line: a 4xx naming the budget, or one line of stderr.
    if status == 200 {
        let why: Vec<&str> = stderr(&body)
            .lines()
            .filter(|l| l.contains("storage budget"))
            .collect();
        eprintln!("why: {why:?}");
        assert_eq!(why.len(), 1, "one line says why: {body}");
        assert!(why[0].len() < 600, "the line is bounded: {}", why[0]);
    } else {
        assert!((400..500).contains(&status), "{status} {body}");
        assert!(body["message"].to_string().contains("budget"), "{body}");
    }
    next_exec_works(&broker, &session_id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn more_refs_than_an_exec_may_carry_get_a_400() {
    let _serial = SERIAL.lock().await;
    let broker = TestBroker::start("refs-cap").await;
    let (status, body) = upload(&broker, None, &[("one.txt".into(), b"1".to_vec())]).await;
    assert_eq!(status, 200, "{body}");
    let session_id = body["session_id"].as_str().expect("session").to_string();
    let file_id = body["files"][0]["fileId"]
        .as_str()
        .expect("file id")
        .to_string();
    let refs = |n: usize| -> Vec<Value> {
        (0..n)
            .map(|i| json!({"id": file_id, "session_id": session_id, "name": format!("r{i}.txt")}))
            .collect()
    };
    let (status, body) = broker
        .exec(json!({"lang": "bash", "code": "ls | wc -l", "session_id": session_id, "files": refs(101)}))
        .await;
    assert_eq!(status, 400, "101 refs: {body}");
    assert!(body["message"].to_string().contains("100"), "{body}");
    // The most an exec may carry still runs.
    let (status, body) = broker
        .exec(json!({"lang": "bash", "code": "ls | wc -l", "session_id": session_id, "files": refs(100)}))
        .await;
    assert_eq!(status, 200, "100 refs: {body}");
    next_exec_works(&broker, &session_id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hundred_bad_refs_give_one_bounded_note() {
    let _serial = SERIAL.lock().await;
    let broker = TestBroker::start("refs-notes").await;
    let (status, body) = broker
        .exec(json!({"lang": "bash", "code": "echo ran"}))
        .await;
    assert_eq!(status, 200, "{body}");
    let session_id = body["session_id"].as_str().expect("session").to_string();
    // Unknown ids under long names: each would be one line echoing its name.
    let refs: Vec<Value> = (0..100)
        .map(|i| {
            json!({
                "id": format!("{i:0>21}"),
                "session_id": session_id,
                "name": format!("{}{i}.csv", "n".repeat(900)),
            })
        })
        .collect();
    let (status, body) = broker
        .exec(json!({"lang": "bash", "code": "echo ran", "session_id": session_id, "files": refs}))
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(stdout(&body).trim(), "ran", "{body}");
    let err = stderr(&body);
    let lines: Vec<&str> = err.lines().filter(|l| l.contains("not found")).collect();
    eprintln!(
        "100 bad refs: {} note lines, {} bytes of stderr",
        lines.len(),
        err.len()
    );
    eprintln!("note: {lines:?}");
    assert_eq!(lines.len(), 1, "one line for all missing inputs: {err}");
    assert!(lines[0].len() < 600, "the line is bounded: {}", lines[0]);
    assert!(lines[0].contains("100"), "it counts them: {}", lines[0]);
    next_exec_works(&broker, &session_id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn identical_parts_under_many_names_are_charged_per_copy() {
    let _serial = SERIAL.lock().await;
    let broker = small_budget_broker("same-parts").await;
    let (status, body) = upload(&broker, None, &[("first.txt".into(), b"1".to_vec())]).await;
    assert_eq!(status, 200, "{body}");
    let session_id = body["session_id"].as_str().expect("session").to_string();
    let same = noise(MIB as usize, 2);
    let parts: Vec<(String, Vec<u8>)> = (0..100)
        .map(|i| (format!("p{i}.bin"), same.clone()))
        .collect();
    let (status, body) = upload(&broker, Some(&session_id), &parts).await;
    let held = allocated(&broker.data);
    eprintln!(
        "100 identical 1 MiB parts: status {status}, data directory {} MiB",
        held / MIB
    );
    assert_eq!(status, 413, "{body}");
    assert!(
        body["message"].to_string().contains("storage budget"),
        "{body}"
    );
    assert!(
        held <= 64 * MIB + MIB,
        "the data directory holds {} MiB, over the 64 MiB budget",
        held / MIB
    );
    small_upload_works(&broker, &session_id).await;
    next_exec_works(&broker, &session_id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn refs_put_a_large_file_under_at_most_sixteen_names() {
    let _serial = SERIAL.lock().await;
    // A budget that would hold 40 copies, so only the names cap can stop them.
    let broker = TestBroker::start_with("names-cap", |config| {
        config.caps.session_storage = 256 * MIB;
    })
    .await;
    let (status, body) = upload(
        &broker,
        None,
        &[
            ("big.bin".into(), noise(MIB as usize, 3)),
            ("small.txt".into(), b"tiny".to_vec()),
        ],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let session_id = body["session_id"].as_str().expect("session").to_string();
    let id = |i: usize| body["files"][i]["fileId"].as_str().expect("id").to_string();
    let (big, small) = (id(0), id(1));
    let mut refs: Vec<Value> = (0..40)
        .map(|i| json!({"id": big, "session_id": session_id, "name": format!("big{i}.bin")}))
        .collect();
    refs.extend(
        (0..40).map(
            |i| json!({"id": small, "session_id": session_id, "name": format!("small{i}.txt")}),
        ),
    );
    let (status, out) = broker
        .exec(json!({
            "lang": "bash", "session_id": session_id, "files": refs,
            "code": "ls big*.bin | wc -l; ls small*.txt | wc -l",
        }))
        .await;
    assert_eq!(status, 200, "{out}");
    // big.bin itself is one of the 16 names; small files are bounded by the budget only.
    assert_eq!(
        stdout(&out).split_whitespace().collect::<Vec<_>>(),
        ["16", "41"],
        "{out}"
    );
    let err = stderr(&out);
    let why: Vec<&str> = err.lines().filter(|l| l.contains("16 names")).collect();
    eprintln!("40 refs to a 1 MiB file: {why:?}");
    assert_eq!(why.len(), 1, "one line says why: {err}");
    assert!(why[0].contains("25 input files"), "{}", why[0]);
    assert!(why[0].len() < 600, "the line is bounded: {}", why[0]);
    // Names that already hold the bytes are placed again (a re-run of the same call).
    let again: Vec<Value> = (0..15)
        .map(|i| json!({"id": big, "session_id": session_id, "name": format!("big{i}.bin")}))
        .collect();
    let (status, out) = broker
        .exec(json!({"lang": "bash", "session_id": session_id, "files": again, "code": "true"}))
        .await;
    assert_eq!(status, 200, "{out}");
    assert!(!stderr(&out).contains("names"), "{out}");
    // An upload of the same bytes under a 17th name is refused, with the reason.
    let (status, body) = upload(
        &broker,
        Some(&session_id),
        &[("big-again.bin".into(), noise(MIB as usize, 3))],
    )
    .await;
    assert_eq!(status, 413, "{body}");
    assert!(body["message"].to_string().contains("16 names"), "{body}");
    small_upload_works(&broker, &session_id).await;
    next_exec_works(&broker, &session_id).await;
}

/// The start of a multipart upload into `session_id`: its field, then the head of a file
/// part whose content is to follow.
fn drip_head(boundary: &str, session_id: &str) -> Vec<u8> {
    format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"session_id\"\r\n\r\n{session_id}\r\n\
         --{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"drip.txt\"\r\n\r\n"
    )
    .into_bytes()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_slow_drip_upload_is_cut() {
    let _serial = SERIAL.lock().await;
    let broker = TestBroker::start_with("drip", |config| {
        config.caps.upload_stall_secs = 2;
    })
    .await;
    let (status, body) = upload(&broker, None, &[("first.txt".into(), b"1".to_vec())]).await;
    assert_eq!(status, 200, "{body}");
    let session_id = body["session_id"].as_str().expect("session").to_string();
    let boundary = "drip-boundary";
    let head = drip_head(boundary, &session_id);
    // The head, then one byte every 100 ms: 10 bytes a second, for ever.
    let chunks = futures::stream::once(async move { Ok::<_, std::io::Error>(head) }).chain(
        futures::stream::unfold((), |()| async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            Some((Ok::<_, std::io::Error>(b"x".to_vec()), ()))
        }),
    );
    let started = Instant::now();
    let sent = broker
        .client
        .post(broker.url("/upload"))
        .header(
            "content-type",
            format!("multipart/form-data; boundary={boundary}"),
        )
        .body(reqwest::Body::wrap_stream(chunks))
        .send();
    let answer = tokio::time::timeout(Duration::from_secs(20), sent).await;
    let elapsed = started.elapsed();
    let Ok(Ok(resp)) = answer else {
        panic!("no answer {elapsed:?} into an upload that sends 10 bytes a second");
    };
    let (status, body) = common::answer(resp).await;
    eprintln!("slow drip: {status} after {elapsed:?}: {body}");
    assert_eq!(status, 408, "{body}");
    assert!(body["message"].to_string().contains("too slow"), "{body}");
    assert!(elapsed < Duration::from_secs(10), "cut after {elapsed:?}");
    small_upload_works(&broker, &session_id).await;
}

/// What a multipart body that never gets anywhere did: the status of its answer (`None`
/// when none came), how many bytes were sent before it, and how much the process's memory
/// grew meanwhile.
struct Flood {
    status: Option<u16>,
    sent_before_answer: u64,
    rss_growth: u64,
}

/// Streams `head` then up to 512 MiB of `A` to `/upload` with boundary `B`, and stops as
/// soon as an answer comes, or 10 s after 64 MiB went without one.
async fn flood_upload(broker: &TestBroker, head: &'static [u8]) -> Flood {
    let sent = Arc::new(AtomicU64::new(0));
    let chunk = bytes::Bytes::from(vec![b'A'; 64 * 1024]);
    let counter = sent.clone();
    let body =
        futures::stream::once(
            async move { Ok::<_, std::io::Error>(bytes::Bytes::from_static(head)) },
        )
        .chain(
            futures::stream::iter(0..(512 * MIB / chunk.len() as u64)).then(move |_| {
                let chunk = chunk.clone();
                let counter = counter.clone();
                async move {
                    // Past 64 MiB the test has failed already: no need to push the broker on.
                    if counter.load(Ordering::SeqCst) >= 64 * MIB {
                        std::future::pending::<()>().await;
                    }
                    counter.fetch_add(chunk.len() as u64, Ordering::SeqCst);
                    Ok::<_, std::io::Error>(chunk)
                }
            }),
        );
    let rss_before = common::rss_bytes();
    let mut peak = rss_before;
    let request = broker
        .client
        .post(broker.url("/upload"))
        .header("content-type", "multipart/form-data; boundary=B")
        .body(reqwest::Body::wrap_stream(body))
        .send();
    tokio::pin!(request);
    let mut stalled_since: Option<Instant> = None;
    let status = loop {
        tokio::select! {
            resp = &mut request => break resp.ok().map(|r| r.status().as_u16()),
            () = tokio::time::sleep(Duration::from_millis(100)) => {
                peak = peak.max(common::rss_bytes());
                if sent.load(Ordering::SeqCst) >= 64 * MIB {
                    let since = *stalled_since.get_or_insert_with(Instant::now);
                    if since.elapsed() > Duration::from_secs(10) {
                        break None;
                    }
                }
            }
        }
    };
    let sent_before_answer = sent.load(Ordering::SeqCst);
    peak = peak.max(common::rss_bytes());
    Flood {
        status,
        sent_before_answer,
        rss_growth: peak.saturating_sub(rss_before),
    }
}

async fn multipart_flood_is_refused_early(tag: &str, head: &'static [u8]) {
    let _serial = SERIAL.lock().await;
    let broker = TestBroker::start(tag).await;
    let (status, body) = upload(&broker, None, &[("first.txt".into(), b"1".to_vec())]).await;
    assert_eq!(status, 200, "{body}");
    let session_id = body["session_id"].as_str().expect("session").to_string();
    let flood = flood_upload(&broker, head).await;
    eprintln!(
        "{tag}: answer {:?} after {} KiB sent; RSS grew by {} MiB",
        flood.status,
        flood.sent_before_answer / 1024,
        flood.rss_growth / MIB
    );
    let status = flood.status.expect("an answer before 64 MiB were sent");
    assert!((400..500).contains(&status), "a 4xx: {status}");
    assert!(
        flood.sent_before_answer < 64 * MIB,
        "{} MiB sent before the answer",
        flood.sent_before_answer / MIB
    );
    assert!(
        flood.rss_growth < 32 * MIB,
        "RSS grew by {} MiB",
        flood.rss_growth / MIB
    );
    small_upload_works(&broker, &session_id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_multipart_body_without_a_boundary_is_refused_early() {
    multipart_flood_is_refused_early("no-boundary", b"").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_part_header_without_an_end_is_refused_early() {
    multipart_flood_is_refused_early(
        "endless-header",
        b"--B\r\nContent-Disposition: form-data; name=\"x\"",
    )
    .await;
}
