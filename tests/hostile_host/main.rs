//! The host side under attack: code in the sandbox, uploads and clients that try to make
//! the broker read, write or wait on something outside a workspace, reach the network or
//! another session, or leave the broker broken. One test per case; each checks that the
//! attack is contained, that the session attacked (or a fresh one, where the case must
//! end it) answers `echo ok` within 2 s afterwards, and that a bystander session that was
//! running all along is untouched.

#[path = "../common/mod.rs"]
mod common;

// One module per kind of attack.
mod auth;
mod files;
mod isolation;
mod lifecycle;
mod network;
mod runtime;

use codebroker::config::AuthMode;
use common::jwt::lc_ed_public_key;
use common::{session, stdout, TestBroker};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How soon an attacked session must answer again.
const RECOVERY: Duration = Duration::from_secs(2);

/// How soon a fresh session must answer, container start included: generous, because the
/// machine running the suite may be busy; the bench measures the real number.
const FRESH_START: Duration = Duration::from_secs(30);

/// A file on the host, outside every workspace, whose content must never come back
/// through the broker and which must never change.
struct HostSecret {
    _dir: tempfile::TempDir,
    path: PathBuf,
    content: String,
}

impl HostSecret {
    fn new() -> HostSecret {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("host-secret.txt");
        let content = format!("HOST-SECRET-{}", codebroker::ids::new_id());
        std::fs::write(&path, &content).expect("write secret");
        HostSecret {
            _dir: dir,
            path,
            content,
        }
    }

    /// The host file still holds exactly its content, and no byte of it reached the
    /// broker's data directory (blob store, staging, indexes).
    fn assert_contained(&self, data_dir: &Path) {
        let now = std::fs::read_to_string(&self.path).expect("secret still readable");
        assert_eq!(now, self.content, "the host file was modified");
        for entry in walk(data_dir) {
            if let Ok(bytes) = std::fs::read(&entry) {
                assert!(
                    !contains(&bytes, self.content.as_bytes()),
                    "the host file's content leaked into {}",
                    entry.display()
                );
            }
        }
    }
}

/// Every regular file below `dir` (symlinks not followed).
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for entry in entries.flatten() {
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        if kind.is_dir() {
            out.extend(walk(&entry.path()));
        } else if kind.is_file() {
            out.push(entry.path());
        }
    }
    out
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// Runs `echo ok` in bash in `session` and checks it answers within `limit`.
async fn echo_ok_within(broker: &TestBroker, session_id: &str, limit: Duration) {
    let started = Instant::now();
    let out = broker.run("bash", "echo ok", Some(session_id)).await;
    let took = started.elapsed();
    assert_eq!(stdout(&out), "ok\n", "{out}");
    assert_eq!(out["session_id"], session_id, "{out}");
    assert!(took < limit, "echo ok took {took:?} (limit {limit:?})");
}

/// The attacked session answers again within [`RECOVERY`].
async fn echo_ok(broker: &TestBroker, session_id: &str) {
    echo_ok_within(broker, session_id, RECOVERY).await;
}

/// A session started before the attack, holding a Python global, whose state must
/// survive whatever happens to the others.
struct Bystander {
    session: String,
    mark: String,
}

impl Bystander {
    async fn start(broker: &TestBroker) -> Bystander {
        let mark = codebroker::ids::new_id();
        let out = broker
            .run("py", &format!("BYSTANDER = {mark:?}\nprint('set')"), None)
            .await;
        assert_eq!(stdout(&out), "set\n", "{out}");
        Bystander {
            session: session(&out),
            mark,
        }
    }

    async fn check(&self, broker: &TestBroker) {
        let out = broker
            .run("py", "print(BYSTANDER)", Some(&self.session))
            .await;
        assert_eq!(
            stdout(&out).trim(),
            self.mark,
            "bystander lost its state: {out}"
        );
        echo_ok(broker, &self.session).await;
    }
}

/// Raw multipart upload, so that any bytes can be put in the file name.
async fn upload_raw(
    broker: &TestBroker,
    route: &str,
    file_name: &[u8],
    content: &[u8],
    session_id: Option<&str>,
) -> (u16, Value) {
    let fields: Vec<(&str, &[u8])> = session_id
        .map(|s| ("session_id", s.as_bytes()))
        .into_iter()
        .collect();
    let (content_type, body) = common::raw_multipart(
        &fields,
        file_name,
        Some("application/octet-stream"),
        content,
    );
    let resp = broker
        .client
        .post(broker.url(route))
        .header("content-type", content_type)
        .body(body)
        .send()
        .await
        .expect("upload");
    common::answer(resp).await
}

/// Names of the session's current files, as `/files` lists them.
async fn listed_names(broker: &TestBroker, session_id: &str) -> Vec<String> {
    let resp = broker
        .get(&format!("/files/{session_id}?detail=full"))
        .await;
    assert_eq!(resp.status(), 200);
    let list: Value = resp.json().await.expect("json");
    list.as_array()
        .expect("array")
        .iter()
        .filter_map(|f| {
            f["name"]
                .as_str()
                .map(|n| n.rsplit_once('/').map_or(n, |(_, b)| b).to_string())
        })
        .collect()
}

/// Downloads every file an exec reported and returns the bodies.
async fn download_all(broker: &TestBroker, out: &Value) -> Vec<(String, Vec<u8>)> {
    let mut bodies = Vec::new();
    for file in out["files"].as_array().into_iter().flatten() {
        let id = file["id"].as_str().expect("id");
        let resp = broker
            .get(&format!("/download/{}/{id}", session(out)))
            .await;
        assert_eq!(resp.status(), 200);
        let name = file["name"].as_str().unwrap_or("").to_string();
        bodies.push((name, resp.bytes().await.expect("bytes").to_vec()));
    }
    bodies
}

fn names_of(out: &Value) -> Vec<String> {
    out["files"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|f| f["name"].as_str().map(str::to_string))
        .collect()
}

/// A broker that takes the API key `KEY` and JWTs of `ed25519_a` (kid `lc-ed`).
async fn authed_broker(tag: &str) -> TestBroker {
    TestBroker::start_with(tag, |c| {
        c.access.auth = AuthMode::Key;
        c.access.api_key = vec![KEY.into()];
        c.access.jwt_public_keys = vec![lc_ed_public_key()];
    })
    .await
}

/// The API key of [`authed_broker`].
const KEY: &str = "hostile-host-key";

/// POST /exec with `token` as the bearer credential.
async fn exec_as(broker: &TestBroker, token: &str, body: Value) -> (u16, Value) {
    let bearer = format!("Bearer {token}");
    broker
        .exec_with(&[("authorization", bearer.as_str())], body)
        .await
}
