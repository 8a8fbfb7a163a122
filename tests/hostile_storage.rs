//! Storage the broker keeps for a session is budgeted: code that rewrites its files with
//! new bytes at every exec, or that leaves thousands of oversized files behind, must not
//! fill the broker's disk or flood every later answer.

mod common;

use common::{session, stderr, stdout, TestBroker};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::path::Path;

const MIB: u64 = 1024 * 1024;

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

/// The session's directory on the broker's disk.
fn session_dir(broker: &TestBroker, session_id: &str) -> std::path::PathBuf {
    broker.data.join("sessions").join(session_id)
}

/// Lines of `text` that contain `needle`.
fn lines_with(text: &str, needle: &str) -> usize {
    text.lines().filter(|l| l.contains(needle)).count()
}

async fn download(broker: &TestBroker, session_id: &str, file_id: &str) -> (u16, Vec<u8>) {
    let resp = broker
        .get(&format!("/download/{session_id}/{file_id}"))
        .await;
    let status = resp.status().as_u16();
    (status, resp.bytes().await.expect("body").to_vec())
}

/// Python that rewrites `count` files of `mib` MiB each with new random bytes and prints
/// `name sha256` for each.
fn rewrite(count: usize, mib: u64) -> String {
    format!(
        "import os, hashlib\n\
         for i in range({count}):\n\
         \x20   b = os.urandom({mib} * 2**20)\n\
         \x20   open(f'/mnt/data/f{{i:02}}.bin', 'wb').write(b)\n\
         \x20   print(f'f{{i:02}}.bin', hashlib.sha256(b).hexdigest())\n"
    )
}

fn files_of(resp: &Value) -> Vec<(String, String)> {
    resp["files"]
        .as_array()
        .map(|files| {
            files
                .iter()
                .map(|f| {
                    (
                        f["name"].as_str().unwrap_or("").to_string(),
                        f["id"].as_str().unwrap_or("").to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The case: 20 files of 5 MiB rewritten six times kept 700 MiB on disk.
#[tokio::test]
async fn rewriting_files_at_every_exec_stays_within_the_storage_budget() {
    let broker = TestBroker::start("rewrite").await;
    let code = rewrite(20, 5);
    let mut session_id: Option<String> = None;
    let mut answers = Vec::new();
    for round in 0..6 {
        let resp = broker.run("py", &code, session_id.as_deref()).await;
        let s = session(&resp);
        session_id = Some(s.clone());
        assert_eq!(
            files_of(&resp).len(),
            20,
            "round {round}: every rewritten file is reported: {}",
            stderr(&resp)
        );
        answers.push(resp);
    }
    let s = session_id.expect("session");
    let dir = session_dir(&broker, &s);
    let blobs = allocated(&dir.join("blobs"));
    let files = allocated(&dir.join("files"));
    let total = allocated(&dir);
    eprintln!(
        "after six rewrites: blobs {} MiB, files {} MiB, session directory {} MiB",
        blobs / MIB,
        files / MIB,
        total / MIB
    );
    assert!(
        total < 400 * MIB,
        "the session keeps {} MiB on the broker's disk (blobs {} MiB)",
        total / MIB,
        blobs / MIB
    );

    // What was dropped is said, once per answer that dropped something.
    let dropped: Vec<usize> = answers
        .iter()
        .map(|a| lines_with(stderr(a), "storage budget"))
        .collect();
    assert!(
        dropped.contains(&1),
        "no answer says older versions were dropped: {dropped:?}"
    );
    assert!(
        dropped.iter().all(|n| *n <= 1),
        "said more than once: {dropped:?}"
    );

    // The first versions were dropped: their ids answer 404 as an expired file does.
    let first = files_of(&answers[0]);
    let (status, _) = download(&broker, &s, &first[0].1).await;
    assert_eq!(status, 404, "the oldest version is gone");

    // The current files still download, byte for byte.
    let last = &answers[5];
    let hashes: std::collections::HashMap<&str, &str> = stdout(last)
        .lines()
        .filter_map(|l| l.split_once(' '))
        .collect();
    for (name, id) in files_of(last) {
        let (status, bytes) = download(&broker, &s, &id).await;
        assert_eq!(status, 200, "{name}");
        assert_eq!(
            hex::encode(Sha256::digest(&bytes)),
            hashes[name.as_str()],
            "{name}"
        );
    }
    let listed: Vec<Value> = broker
        .get(&format!("/files/{s}?detail=simple"))
        .await
        .json()
        .await
        .expect("listing");
    assert_eq!(listed.len(), 20, "{listed:?}");

    // And the session goes on.
    let next = broker.run("py", "print(1)", Some(&s)).await;
    assert_eq!(stdout(&next).trim(), "1", "{next}");
}

/// The review's case: thousands of sparse files over the size limit, with long names,
/// were each noted in stderr, on that exec and every later one.
#[tokio::test]
async fn oversized_files_are_noted_in_one_bounded_line() {
    let broker = TestBroker::start("oversize").await;
    let code = "import os\n\
                for i in range(2000):\n\
                \x20   open('/mnt/data/' + 'N' * 240 + str(i), 'wb').truncate(11 << 20)\n\
                print('made')";
    let made = broker.run("py", code, None).await;
    assert_eq!(stdout(&made).trim(), "made", "{made}");
    let s = session(&made);
    let cap = 64 * 1024;
    let first = stderr(&made).len();
    eprintln!("stderr after making them: {first} bytes");
    assert!(
        first <= 4096,
        "stderr of {first} bytes: {}",
        &stderr(&made)[..first.min(600)]
    );
    assert_eq!(
        lines_with(stderr(&made), "2000 files"),
        1,
        "one line names how many: {}",
        stderr(&made)
    );
    let next = broker.run("py", "print(1)", Some(&s)).await;
    assert_eq!(stdout(&next).trim(), "1", "{next}");
    let again = stderr(&next).len();
    eprintln!("stderr of the next exec: {again} bytes");
    assert!(again <= 4096 && again < cap, "stderr of {again} bytes");
}

/// A version that does not fit even after every old version is dropped is not kept: not
/// in `files`, not listed, said once, and not noted again while it stays unchanged.
#[tokio::test]
async fn a_new_version_over_the_budget_is_not_kept_and_said_once() {
    let broker = TestBroker::start_with("refuse", |c| c.caps.session_storage = 16 * MIB).await;
    let made = broker.run("py", &rewrite(3, 6), None).await;
    let s = session(&made);
    let names: Vec<String> = files_of(&made).into_iter().map(|(n, _)| n).collect();
    eprintln!("stderr: {}", stderr(&made));
    assert_eq!(names, ["f00.bin", "f01.bin"], "{made}");
    assert_eq!(lines_with(stderr(&made), "storage budget"), 1, "{made}");
    assert!(
        stderr(&made).contains("f02.bin") && stderr(&made).contains("not kept"),
        "{made}"
    );
    assert!(
        stderr(&made).contains("CODEBROKER_SESSION_STORAGE"),
        "{made}"
    );
    let listed: Vec<Value> = broker
        .get(&format!("/files/{s}?detail=simple"))
        .await
        .json()
        .await
        .expect("listing");
    assert_eq!(listed.len(), 2, "{listed:?}");
    let blobs = allocated(&session_dir(&broker, &s).join("blobs"));
    assert!(blobs <= 16 * MIB, "blobs take {} bytes", blobs);

    // Unchanged, it is not noted (or copied) again; the session goes on.
    let next = broker.run("py", "print(1)", Some(&s)).await;
    assert_eq!(stdout(&next).trim(), "1", "{next}");
    assert_eq!(stderr(&next), "", "{next}");

    // Rewriting the kept ones replaces them: their old versions make room.
    let again = broker
        .run(
            "py",
            "import os\nfor n in ('f00.bin', 'f01.bin'):\n    open(n, 'wb').write(os.urandom(6 << 20))",
            Some(&s),
        )
        .await;
    assert_eq!(files_of(&again).len(), 2, "{again}");
    assert_eq!(lines_with(stderr(&again), "storage budget"), 1, "{again}");
    for (name, id) in files_of(&again) {
        let (status, bytes) = download(&broker, &s, &id).await;
        assert_eq!((status, bytes.len() as u64), (200, 6 * MIB), "{name}");
    }
    let (status, _) = download(&broker, &s, &files_of(&made)[0].1).await;
    assert_eq!(status, 404, "the replaced version is gone");
}

/// The user's budget counts all their sessions; other users are not affected.
#[tokio::test]
async fn the_users_budget_spans_their_sessions() {
    let broker = TestBroker::start_with("user-budget", |c| c.caps.user_storage = 16 * MIB).await;
    let exec = |user: &str| json!({ "lang": "py", "code": rewrite(1, 10), "user_id": user });
    let (status, first) = broker.exec(exec("u1")).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(files_of(&first).len(), 1, "{first}");
    let (status, second) = broker.exec(exec("u1")).await;
    assert_eq!(status, 200, "{second}");
    assert_ne!(session(&first), session(&second));
    assert!(files_of(&second).is_empty(), "{second}");
    assert_eq!(lines_with(stderr(&second), "storage budget"), 1, "{second}");
    assert!(
        stderr(&second).contains("CODEBROKER_USER_STORAGE"),
        "{second}"
    );
    let (status, other) = broker.exec(exec("u2")).await;
    assert_eq!(status, 200, "{other}");
    assert_eq!(
        files_of(&other).len(),
        1,
        "another user has their own: {other}"
    );
    // The first session's file still downloads.
    let (status, _) = download(&broker, &session(&first), &files_of(&first)[0].1).await;
    assert_eq!(status, 200);
    // Copying it into the second session as an input is a new version there: refused too.
    let (status, copied) = broker
        .exec(json!({
            "lang": "bash", "code": "ls /mnt/data", "user_id": "u1",
            "session_id": session(&second),
            "files": [{ "id": files_of(&first)[0].1, "session_id": session(&first), "name": "copy.bin" }],
        }))
        .await;
    assert_eq!(status, 200, "{copied}");
    assert!(
        lines_with(stderr(&copied), "was not placed: ") == 1
            && stderr(&copied).contains("copy.bin")
            && stderr(&copied).contains("CODEBROKER_USER_STORAGE"),
        "{copied}"
    );
    assert!(!stdout(&copied).contains("copy.bin"), "{copied}");
}

async fn upload(
    broker: &TestBroker,
    session_id: Option<&str>,
    name: &str,
    bytes: Vec<u8>,
) -> (u16, Value) {
    let mut form = reqwest::multipart::Form::new().part(
        "file",
        reqwest::multipart::Part::bytes(bytes).file_name(name.to_string()),
    );
    if let Some(s) = session_id {
        form = form.text("session_id", s.to_string());
    }
    let resp = broker
        .client
        .post(broker.url("/upload"))
        .multipart(form)
        .send()
        .await
        .expect("upload");
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

fn noise(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8)
        .collect()
}

/// Uploads are kept as versions too, and each is charged twice (its version and its copy
/// in /mnt/data): one over the budget is a 413 that says why, and a new version of an
/// uploaded file replaces the old one.
#[tokio::test]
async fn an_upload_over_the_budget_is_refused_with_413() {
    let broker =
        TestBroker::start_with("upload-budget", |c| c.caps.session_storage = 16 * MIB).await;
    let (status, first) = upload(&broker, None, "a.bin", noise(6 << 20, 1)).await;
    assert_eq!(status, 200, "{first}");
    let s = first["session_id"].as_str().expect("session").to_string();
    let first_id = first["files"][0]["id"].as_str().expect("id").to_string();

    let (status, refused) = upload(&broker, Some(&s), "b.bin", noise(6 << 20, 2)).await;
    assert_eq!(status, 413, "{refused}");
    let message = refused.to_string();
    assert!(message.contains("storage budget"), "{message}");

    // A new version of a.bin fits: the old one is dropped for it.
    let (status, second) = upload(&broker, Some(&s), "a.bin", noise(6 << 20, 3)).await;
    assert_eq!(status, 200, "{second}");
    let second_id = second["files"][0]["id"].as_str().expect("id").to_string();
    let (status, _) = download(&broker, &s, &first_id).await;
    assert_eq!(status, 404, "the old version was dropped");
    let (status, bytes) = download(&broker, &s, &second_id).await;
    assert_eq!(status, 200);
    assert_eq!(bytes, noise(6 << 20, 3));

    let listed = broker.run("bash", "ls /mnt/data", Some(&s)).await;
    assert_eq!(stdout(&listed).trim(), "a.bin", "{listed}");
    let blobs = allocated(&session_dir(&broker, &s).join("blobs"));
    assert!(blobs <= 16 * MIB, "blobs take {blobs} bytes");
}

/// The budget is counted from the index when the broker starts again, and blobs a crash
/// left unnamed are removed then, so the count and the disk agree.
#[tokio::test]
async fn the_budget_holds_across_a_restart() {
    let first = TestBroker::start_with("restart", |c| c.caps.session_storage = 16 * MIB).await;
    let made = first.run("py", &rewrite(2, 6), None).await;
    assert_eq!(files_of(&made).len(), 2, "{made}");
    let s = session(&made);
    // What a crash between saving the index and deleting blobs leaves behind.
    let blobs = session_dir(&first, &s).join("blobs");
    std::fs::write(blobs.join("0".repeat(64)), vec![7u8; 4 << 20]).expect("plant");
    std::fs::write(blobs.join(".tmp-leftover"), vec![7u8; 1 << 20]).expect("plant");
    let instance = first.instance.clone();
    let data = first.data.clone();
    let _tmp = first.stop().await;

    let mut config = codebroker::config::Config::for_tests(data, &instance);
    config.pool.pool_size = 0;
    config.caps.session_storage = 16 * MIB;
    let second = TestBroker::serve(config).await;
    assert!(
        !blobs.join("0".repeat(64)).exists() && !blobs.join(".tmp-leftover").exists(),
        "unnamed blobs are swept at start"
    );
    let third = second
        .run(
            "py",
            "import os\nopen('f02.bin', 'wb').write(os.urandom(6 << 20))",
            Some(&s),
        )
        .await;
    assert!(files_of(&third).is_empty(), "{third}");
    assert_eq!(lines_with(stderr(&third), "storage budget"), 1, "{third}");
    for (name, id) in files_of(&made) {
        let (status, bytes) = download(&second, &s, &id).await;
        assert_eq!((status, bytes.len() as u64), (200, 6 * MIB), "{name}");
    }
    assert!(allocated(&blobs) <= 16 * MIB);
}
