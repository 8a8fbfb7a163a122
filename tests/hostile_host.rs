//! The host side under attack: code in the sandbox, uploads and clients that try to make
//! the broker read, write or wait on something outside a workspace, reach the network or
//! another session, or leave the broker broken. One test per case; each checks that the
//! attack is contained, that the session attacked (or a fresh one, where the case must
//! end it) answers `echo ok` within 2 s afterwards, and that a bystander session that was
//! running all along is untouched.

mod common;

use codebroker::config::{AuthMode, ContainerCap};
use common::{containers_of, session, stderr, stdout, TestBroker};
use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How soon an attacked session must answer again.
const RECOVERY: Duration = Duration::from_secs(2);

/// How soon a fresh session must answer, container start included: generous, because the
/// machine running the suite may be busy; the bench measures the real number.
const FRESH_START: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

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
    let boundary = "hostile-boundary-7d1f";
    let mut body = Vec::new();
    if let Some(s) = session_id {
        body.extend_from_slice(
            format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"session_id\"\r\n\r\n{s}\r\n"
            )
            .as_bytes(),
        );
    }
    body.extend_from_slice(
        format!("--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"")
            .as_bytes(),
    );
    body.extend_from_slice(file_name);
    body.extend_from_slice(b"\"\r\nContent-Type: application/octet-stream\r\n\r\n");
    body.extend_from_slice(content);
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    let resp = broker
        .client
        .post(broker.url(route))
        .header(
            "content-type",
            format!("multipart/form-data; boundary={boundary}"),
        )
        .body(body)
        .send()
        .await
        .expect("upload");
    let status = resp.status().as_u16();
    let text = resp.text().await.expect("body");
    (
        status,
        serde_json::from_str(text.trim()).unwrap_or(Value::String(text)),
    )
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

// ---------------------------------------------------------------------------------------
// Files and paths
// ---------------------------------------------------------------------------------------

/// Python that finds the kernel's `display(mime, name)` (the hook `plt.show()` calls) and
/// names it `d`, so that code can send display events naming any path it likes.
const FIND_DISPLAY: &str = "import gc\n\
    d = next(o[0] for o in gc.get_objects() if isinstance(o, list) and len(o) == 1 \
    and getattr(o[0], '__name__', None) == 'display' and hasattr(o[0], '__self__'))\n";

#[tokio::test]
async fn symlinks_out_of_the_workspace_are_never_followed() {
    let broker = TestBroker::start("hh-symlink").await;
    let bystander = Bystander::start(&broker).await;
    let secret = HostSecret::new();
    let host = secret.path.display().to_string();
    // A regular file first, so that it has an id, then every name turned into a link
    // out: to the host file's path, /etc/shadow, / and a parent-relative escape.
    let first = broker
        .run(
            "bash",
            "echo regular > /mnt/data/x && mkdir -p /mnt/data/sub && echo inner > /mnt/data/sub/f",
            None,
        )
        .await;
    let s = session(&first);
    let original_id = first["files"]
        .as_array()
        .and_then(|f| f.iter().find(|f| f["name"] == "x"))
        .and_then(|f| f["id"].as_str())
        .expect("x harvested")
        .to_string();
    // `ls -A`, not `ls -la`: under the runsc Debian ships, coreutils' statx fails (EINVAL).
    let plant = format!(
        "cd /mnt/data && ln -sfn {host:?} x && ln -sfn /etc/shadow shadow && ln -sfn / root \
         && ln -sfn ../../../../../../ up && ln -sfn {host:?} host && rm -rf sub && ln -sfn / sub \
         && ls -A && echo planted"
    );
    let out = broker.run("bash", &plant, Some(&s)).await;
    assert!(stdout(&out).contains("planted"), "{out}");
    assert!(
        out["files"].as_array().is_some_and(|f| f.is_empty()),
        "links were reported as files: {out}"
    );
    // Through the links, nothing: not listed, and the old id still serves the old bytes.
    let names = listed_names(&broker, &s).await;
    for link in ["shadow", "root", "up", "host"] {
        assert!(
            !names.contains(&link.to_string()),
            "{link} listed: {names:?}"
        );
    }
    let resp = broker.get(&format!("/download/{s}/{original_id}")).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.unwrap(), "regular\n");
    // Downloads by a path instead of an id are refused.
    for path in [
        format!("/download/{s}/..%2F..%2F..%2Fetc%2Fpasswd"),
        format!("/download/{s}/x"),
        format!("/download/..%2F{s}/{original_id}"),
        format!("/files/{s}/..%2Fshadow"),
    ] {
        let resp = broker.get(&path).await;
        assert!(
            matches!(resp.status().as_u16(), 400 | 404 | 405),
            "{path}: {}",
            resp.status()
        );
    }
    // An upload to a linked name replaces the link; it never writes through it.
    let (status, body) = upload_raw(&broker, "/upload", b"x", b"uploaded", Some(&s)).await;
    assert_eq!(status, 200, "{body}");
    // An upload beneath a linked directory is refused with a clear 409.
    let (status, body) = upload_raw(&broker, "/upload", b"sub/planted.txt", b"p", Some(&s)).await;
    assert_eq!(status, 409, "{body}");
    assert!(!Path::new("/planted.txt").exists());
    let (status, body) = upload_raw(&broker, "/upload", b"root/tmp/p.txt", b"p", Some(&s)).await;
    assert_eq!(status, 409, "{body}");
    let (status, body) = upload_raw(&broker, "/upload", b"host/p.txt", b"p", Some(&s)).await;
    assert_eq!(status, 409, "{body}");
    let check = broker
        .run(
            "bash",
            "cat /mnt/data/x; test -L /mnt/data/x && echo STILL-LINK; true",
            Some(&s),
        )
        .await;
    assert_eq!(stdout(&check), "uploaded", "{check}");
    // A display event naming a link shows no bytes of its target.
    let streamed = broker
        .client
        .post(broker.url("/exec/stream"))
        .header("accept", "application/x-ndjson")
        .json(&json!({ "lang": "py", "session_id": s, "code":
            format!("{FIND_DISPLAY}\
             d('image/png', 'shadow'); d('image/png', 'host'); d('image/png', '../../../etc/passwd')\n\
             print('shown')") }))
        .send()
        .await
        .expect("stream")
        .text()
        .await
        .expect("stream body");
    assert!(streamed.contains("shown"), "{streamed}");
    assert!(!streamed.contains("root:"), "{streamed}");
    let mut displays = 0;
    for line in streamed.lines() {
        let event: Value = serde_json::from_str(line).expect("ndjson");
        if event["event"] == "display" {
            displays += 1;
            assert!(event["data"]["data"].is_null(), "{line}");
        }
    }
    assert_eq!(displays, 3, "{streamed}");
    secret.assert_contained(&broker.data);
    echo_ok(&broker, &s).await;
    bystander.check(&broker).await;
}

#[tokio::test]
async fn a_symlink_swapped_in_during_the_harvest_is_contained() {
    let broker = TestBroker::start("hh-race").await;
    let bystander = Bystander::start(&broker).await;
    let secret = HostSecret::new();
    let host = secret.path.display().to_string();
    // A kernel thread keeps swapping a regular file and a link to the host file, so that
    // every harvest runs while the name changes under it.
    let start = format!(
        "import os, threading, time\n\
         SWAP = True\n\
         def swap():\n\
         \x20   n = 0\n\
         \x20   while SWAP:\n\
         \x20       n += 1\n\
         \x20       with open('/mnt/data/.race.tmp', 'w') as f: f.write('regular %d' % n)\n\
         \x20       os.replace('/mnt/data/.race.tmp', '/mnt/data/race.txt')\n\
         \x20       time.sleep(0.0005)\n\
         \x20       try: os.unlink('/mnt/data/.race.lnk')\n\
         \x20       except FileNotFoundError: pass\n\
         \x20       os.symlink({host:?}, '/mnt/data/.race.lnk')\n\
         \x20       os.replace('/mnt/data/.race.lnk', '/mnt/data/race.txt')\n\
         \x20       time.sleep(0.0005)\n\
         threading.Thread(target=swap, daemon=True).start()\n\
         print('racing')"
    );
    let out = broker.run("py", &start, None).await;
    let s = session(&out);
    assert_eq!(stdout(&out), "racing\n", "{out}");
    // The same from a shell process left behind by a bash exec.
    let shell = format!(
        "(cd /mnt/data; for i in $(seq 1 20000); do echo shell $i > .sh.tmp; mv -f .sh.tmp shell.txt; \
         ln -sfn {host:?} .sh.lnk; mv -Tf .sh.lnk shell.txt; done) > /dev/null 2>&1 &\necho started"
    );
    let out = broker.run("bash", &shell, Some(&s)).await;
    assert!(stdout(&out).contains("started"), "{out}");
    let mut harvested = 0;
    for _ in 0..15 {
        let out = broker.run("py", "print('tick')", Some(&s)).await;
        for (name, bytes) in download_all(&broker, &out).await {
            harvested += 1;
            assert!(
                !contains(&bytes, secret.content.as_bytes()),
                "{name} served the host file"
            );
            let text = String::from_utf8_lossy(&bytes);
            assert!(
                text.starts_with("regular ") || text.starts_with("shell "),
                "{name}: {text:?}"
            );
        }
    }
    assert!(harvested > 0, "the race never produced a regular file");
    let out = broker
        .run("py", "SWAP = False\nprint('stopped')", Some(&s))
        .await;
    assert_eq!(stdout(&out), "stopped\n", "{out}");
    secret.assert_contained(&broker.data);
    echo_ok(&broker, &s).await;
    bystander.check(&broker).await;
}

#[tokio::test]
async fn fifos_sockets_and_device_names_never_block_the_host() {
    let broker = TestBroker::start("hh-fifo").await;
    let bystander = Bystander::start(&broker).await;
    let code = "cd /mnt/data\n\
        mkfifo fifo && mkfifo data.csv && echo fifo-made\n\
        python3 -c \"import socket; s=socket.socket(socket.AF_UNIX); s.bind('/mnt/data/sock'); print('sock-made')\"\n\
        mknod dev c 1 5 2>/dev/null && echo MKNOD-WORKED || echo mknod-refused\n\
        echo plain > null; echo plain > con; echo plain > 'aux.txt'\n\
        ln -s /dev/zero zero; ln -s /dev/urandom random; ln -s /proc/self/fd/0 stdin; ln -s /dev/tty tty\n\
        mkdir -p dev && ln -s /dev/zero dev/zero\n\
        echo done";
    let started = Instant::now();
    let out = broker.run("bash", code, None).await;
    let s = session(&out);
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the harvest hung"
    );
    let text = stdout(&out);
    assert!(text.contains("fifo-made"), "{out}");
    assert!(text.contains("sock-made"), "{out}");
    assert!(text.contains("mknod-refused"), "{out}");
    assert!(text.contains("done"), "{out}");
    let mut names = names_of(&out);
    names.sort();
    assert_eq!(names, ["aux.txt", "con", "null"], "{out}");
    for (_, bytes) in download_all(&broker, &out).await {
        assert_eq!(bytes, b"plain\n");
    }
    // The names once more, through every host path that touches them: another harvest,
    // uploads over them, a display of them, input refs onto them.
    let again = broker.run("bash", "touch /mnt/data/other", Some(&s)).await;
    assert_eq!(names_of(&again), ["other"], "{again}");
    for name in ["fifo", "sock", "zero", "dev/zero", "data.csv"] {
        let started = Instant::now();
        let (status, body) =
            upload_raw(&broker, "/upload", name.as_bytes(), b"uploaded", Some(&s)).await;
        assert!(started.elapsed() < Duration::from_secs(10), "{name} hung");
        assert_eq!(status, 200, "{name}: {body}");
    }
    let check = broker
        .run(
            "bash",
            "cd /mnt/data; for f in fifo sock zero dev/zero data.csv; do test -f $f && cat $f; echo; done",
            Some(&s),
        )
        .await;
    assert_eq!(stdout(&check), "uploaded\n".repeat(5), "{check}");
    let streamed = tokio::time::timeout(
        Duration::from_secs(30),
        broker
            .client
            .post(broker.url("/exec/stream"))
            .header("accept", "application/x-ndjson")
            .json(&json!({ "lang": "py", "session_id": s, "code":
                format!("import os\n{FIND_DISPLAY}os.mkfifo('/mnt/data/plot.png')\n\
                 d('image/png', 'plot.png')\nprint('shown')") }))
            .send(),
    )
    .await
    .expect("a display of a FIFO hung")
    .expect("stream");
    let body = tokio::time::timeout(Duration::from_secs(30), streamed.text())
        .await
        .expect("a display of a FIFO hung")
        .expect("body");
    assert!(body.contains("shown"), "{body}");
    echo_ok(&broker, &s).await;
    bystander.check(&broker).await;
}

#[tokio::test]
async fn hard_links_cannot_reach_files_outside_the_workspace() {
    let broker = TestBroker::start("hh-hardlink").await;
    let bystander = Bystander::start(&broker).await;
    // /etc and /tmp are other filesystems than the workspace's bind mount: link(2) fails
    // with EXDEV, so no host or image file can be given a name in /mnt/data.
    let code = "cd /mnt/data\n\
        echo tmp > /tmp/t\n\
        for src in /etc/passwd /tmp/t /proc/self/status /opt/codebroker/libraries.json; do\n\
          ln \"$src\" \"link$(echo $src | tr / _)\" 2>&1 && echo LINKED $src\n\
        done\n\
        echo inside > a && ln a b && echo inner-linked\n\
        echo done";
    let out = broker.run("bash", code, None).await;
    let s = session(&out);
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert!(!text.contains("LINKED"), "{out}");
    assert!(
        text.matches("Invalid cross-device link").count() >= 3,
        "{out}"
    );
    assert!(
        text.contains("inner-linked") && text.contains("done"),
        "{out}"
    );
    let mut names = names_of(&out);
    names.sort();
    assert_eq!(names, ["a", "b"], "{out}");
    // A hard link to an uploaded read-only file does not make it writable through the
    // other name's harvest either: the read-only upload keeps its bytes.
    let (status, body) = upload_raw(&broker, "/upload", b"ro.txt", b"pinned", Some(&s)).await;
    assert_eq!(status, 200, "{body}");
    echo_ok(&broker, &s).await;
    bystander.check(&broker).await;
}

#[tokio::test]
async fn hostile_upload_names_are_refused_or_confined() {
    let broker = TestBroker::start("hh-names").await;
    let bystander = Bystander::start(&broker).await;
    let first = broker.run("bash", "echo start", None).await;
    let s = session(&first);
    let long_component = "a".repeat(4096);
    let long_path = format!("{}/x", vec!["d"; 600].join("/"));
    let refused: Vec<Vec<u8>> = vec![
        b"../../etc/x".to_vec(),
        b"/etc/x".to_vec(),
        b"a\0b".to_vec(),
        b"x/../../y".to_vec(),
        b"x/../y".to_vec(),
        b"..".to_vec(),
        b"/".to_vec(),
        long_component.clone().into_bytes(),
        long_path.clone().into_bytes(),
    ];
    for name in &refused {
        for route in ["/upload", "/upload/batch"] {
            let (status, body) = upload_raw(&broker, route, name, b"evil", Some(&s)).await;
            let shown = String::from_utf8_lossy(&name[..name.len().min(40)]).into_owned();
            match route {
                "/upload" => {
                    assert_eq!(status, 400, "{shown}: {body}");
                    assert!(body["message"].is_string(), "{shown}: {body}");
                }
                _ => {
                    assert!(
                        status == 400 || body["failed"] == 1,
                        "{shown}: {status} {body}"
                    );
                }
            }
        }
    }
    // Names that are odd but harmless land beneath /mnt/data, byte for byte.
    let zip = zip_with_escaping_entry();
    let confined: Vec<(&[u8], &[u8])> = vec![
        (b"a.zip", &zip),
        (b"..\\..\\windows.txt", b"backslashes"),
        (b"./dot/./x.txt", b"dots"),
        (b"nested//double.txt", b"double"),
        (b"-rf", b"dash"),
        (b"$(touch pwned).txt", b"shell"),
    ];
    for (name, content) in &confined {
        let (status, body) = upload_raw(&broker, "/upload", name, content, Some(&s)).await;
        assert_eq!(status, 200, "{}: {body}", String::from_utf8_lossy(name));
        let id = body["files"][0]["id"].as_str().expect("id");
        let resp = broker.get(&format!("/download/{s}/{id}")).await;
        assert_eq!(resp.bytes().await.unwrap().as_ref(), *content);
    }
    let listing = broker
        .run(
            "bash",
            "cd /mnt/data && find . -mindepth 1 | sort; ls / | grep -c pwned; true",
            Some(&s),
        )
        .await;
    let found = stdout(&listing);
    for expected in [
        "./a.zip",
        "./..\\..\\windows.txt",
        "./dot/x.txt",
        "./nested/double.txt",
        "./-rf",
        "./$(touch pwned).txt",
    ] {
        assert!(found.contains(expected), "{expected} missing: {found}");
    }
    // The archive is a file: never unpacked, so its `../` entry exists nowhere.
    assert!(!found.contains("escaped"), "{found}");
    for path in walk(&broker.data) {
        assert!(
            !path.to_string_lossy().contains("escaped"),
            "{}",
            path.display()
        );
        assert!(!path.to_string_lossy().contains("evil"));
    }
    assert!(!broker.data.join("etc").exists());
    // Nothing was staged and left behind by the refusals.
    let staged: Vec<_> = walk(&broker.data.join("staging"));
    assert!(staged.is_empty(), "{staged:?}");
    echo_ok(&broker, &s).await;
    bystander.check(&broker).await;
}

/// A stored (uncompressed) zip archive with one entry named `../../escaped.txt`.
fn zip_with_escaping_entry() -> Vec<u8> {
    let name = b"../../escaped.txt";
    let data = b"escaped";
    let crc = crc32(data);
    let mut out = Vec::new();
    let local = |out: &mut Vec<u8>| {
        out.extend_from_slice(&0x04034b50u32.to_le_bytes());
        out.extend_from_slice(&[20, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        out.extend_from_slice(&crc.to_le_bytes());
        out.extend_from_slice(&(data.len() as u32).to_le_bytes());
        out.extend_from_slice(&(data.len() as u32).to_le_bytes());
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(name);
        out.extend_from_slice(data);
    };
    local(&mut out);
    let central_at = out.len() as u32;
    out.extend_from_slice(&0x02014b50u32.to_le_bytes());
    out.extend_from_slice(&[20, 0, 20, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    out.extend_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(&(data.len() as u32).to_le_bytes());
    out.extend_from_slice(&(data.len() as u32).to_le_bytes());
    out.extend_from_slice(&(name.len() as u16).to_le_bytes());
    out.extend_from_slice(&[0; 12]);
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(name);
    let central_len = out.len() as u32 - central_at;
    out.extend_from_slice(&0x06054b50u32.to_le_bytes());
    out.extend_from_slice(&[0, 0, 0, 0, 1, 0, 1, 0]);
    out.extend_from_slice(&central_len.to_le_bytes());
    out.extend_from_slice(&central_at.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out
}

fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

// ---------------------------------------------------------------------------------------
// Network
// ---------------------------------------------------------------------------------------

/// Python that tries each `(host, port)` and prints `OPEN` or `BLOCKED <error>` per line.
fn connect_attempts(targets: &[(String, u16)]) -> String {
    let list: Vec<String> = targets
        .iter()
        .map(|(h, p)| format!("({h:?}, {p})"))
        .collect();
    format!(
        "import socket\n\
         for host, port in [{}]:\n\
         \x20   try:\n\
         \x20       socket.create_connection((host, port), timeout=2).close()\n\
         \x20       print(host, port, 'OPEN')\n\
         \x20   except Exception as e:\n\
         \x20       print(host, port, 'BLOCKED', type(e).__name__)\n",
        list.join(", ")
    )
}

fn assert_all_blocked(out: &Value, expected_lines: usize) {
    let text = stdout(out);
    assert_eq!(text.lines().count(), expected_lines, "{out}");
    assert!(!text.contains("OPEN"), "{out}");
    assert_eq!(text.matches("BLOCKED").count(), expected_lines, "{out}");
}

#[tokio::test]
async fn no_route_to_the_internet_or_the_metadata_service() {
    let broker = TestBroker::start("hh-net-out").await;
    let bystander = Bystander::start(&broker).await;
    let targets: Vec<(String, u16)> = vec![
        ("1.1.1.1".into(), 443),
        ("1.1.1.1".into(), 53),
        ("8.8.8.8".into(), 53),
        ("169.254.169.254".into(), 80),
        ("2606:4700:4700::1111".into(), 443),
    ];
    let out = broker.run("py", &connect_attempts(&targets), None).await;
    assert_all_blocked(&out, targets.len());
    let s = session(&out);
    // No interface but loopback (from /proc/net/dev: gVisor has no /sys/class/net).
    let ifaces = broker
        .run(
            "bash",
            "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | sort | tr '\\n' ' '",
            Some(&s),
        )
        .await;
    assert_eq!(stdout(&ifaces).trim(), "lo", "{ifaces}");
    echo_ok(&broker, &s).await;
    bystander.check(&broker).await;
}

#[tokio::test]
async fn no_route_to_the_docker_bridge_or_the_broker() {
    let broker = TestBroker::start("hh-net-host").await;
    let bystander = Bystander::start(&broker).await;
    // A listener on every host address, beside the broker's own port.
    let listener = std::net::TcpListener::bind("0.0.0.0:0").expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    let port = listener.local_addr().expect("addr").port();
    let broker_port: u16 = broker
        .base
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("broker port");
    let host_ip = host_address().unwrap_or_else(|| "172.17.0.1".into());
    let targets: Vec<(String, u16)> = vec![
        ("172.17.0.1".into(), port),
        ("172.17.0.1".into(), broker_port),
        ("172.17.0.1".into(), 2375),
        (host_ip.clone(), port),
        (host_ip, broker_port),
        ("127.0.0.1".into(), broker_port),
        ("127.0.0.1".into(), port),
        ("host.docker.internal".into(), broker_port),
    ];
    let out = broker.run("py", &connect_attempts(&targets), None).await;
    assert_all_blocked(&out, targets.len());
    assert!(
        listener.accept().is_err(),
        "a connection from the sandbox reached the host"
    );
    let s = session(&out);
    echo_ok(&broker, &s).await;
    bystander.check(&broker).await;
}

/// The host's first non-loopback IPv4 address, from `hostname -I`.
fn host_address() -> Option<String> {
    let out = std::process::Command::new("hostname")
        .arg("-I")
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .find(|a| a.contains('.') && !a.starts_with("127."))
        .map(str::to_string)
}

#[tokio::test]
async fn dns_does_not_resolve() {
    let broker = TestBroker::start("hh-dns").await;
    let bystander = Bystander::start(&broker).await;
    let code = "import socket\n\
        for name in ['example.com', 'pypi.org', 'host.docker.internal', 'metadata.google.internal']:\n\
        \x20   try:\n\
        \x20       print(name, 'RESOLVED', socket.getaddrinfo(name, 80)[0][4])\n\
        \x20   except OSError as e:\n\
        \x20       print(name, 'FAILED', type(e).__name__)\n";
    let out = broker.run("py", code, None).await;
    let text = stdout(&out);
    assert_eq!(text.matches("FAILED").count(), 4, "{out}");
    assert!(!text.contains("RESOLVED"), "{out}");
    let s = session(&out);
    let nslookup = broker
        .run(
            "bash",
            "getent hosts example.com && echo RESOLVED || echo failed",
            Some(&s),
        )
        .await;
    assert_eq!(stdout(&nslookup).trim(), "failed", "{nslookup}");
    echo_ok(&broker, &s).await;
    bystander.check(&broker).await;
}

#[tokio::test]
async fn no_docker_socket_or_privilege_inside() {
    let broker = TestBroker::start("hh-sock").await;
    let bystander = Bystander::start(&broker).await;
    // no_new_privs through prctl(PR_GET_NO_NEW_PRIVS): gVisor's /proc/self/status lacks it.
    let code = "for p in /var/run/docker.sock /run/docker.sock /run/containerd/containerd.sock \
                /var/run/docker/containerd/containerd.sock; do test -e $p && echo PRESENT $p; done\n\
        find / -xdev \\( -name 'docker.sock' -o -name 'containerd.sock' \\) 2>/dev/null | sed 's/^/FOUND /'\n\
        grep -E '^Cap(Eff|Prm|Bnd):' /proc/self/status\n\
        python3 -c 'import ctypes; print(\"NoNewPrivs:\", ctypes.CDLL(None).prctl(39, 0, 0, 0, 0))'\n\
        id -u\n\
        touch /usr/x 2>/dev/null && echo ROOT-WRITABLE || echo root-read-only\n\
        echo done";
    let out = broker.run("bash", code, None).await;
    let text = stdout(&out);
    assert!(!text.contains("PRESENT"), "{out}");
    assert!(!text.contains("FOUND"), "{out}");
    assert!(text.contains("CapEff:\t0000000000000000"), "{out}");
    assert!(text.contains("CapBnd:\t0000000000000000"), "{out}");
    assert!(text.contains("NoNewPrivs: 1"), "{out}");
    assert!(text.contains("10001\n"), "{out}");
    assert!(text.contains("root-read-only"), "{out}");
    assert!(text.contains("done"), "{out}");
    let s = session(&out);
    echo_ok(&broker, &s).await;
    bystander.check(&broker).await;
}

// ---------------------------------------------------------------------------------------
// Isolation
// ---------------------------------------------------------------------------------------

/// What one session leaves for another to find: a Python global, a file, a process.
const LEAVE_TRACES: &str = "import subprocess\n\
    TRACE = 'left-behind'\n\
    open('/mnt/data/trace.txt', 'w').write('trace')\n\
    open('/tmp/trace.txt', 'w').write('trace')\n\
    subprocess.Popen(['bash', '-c', 'exec -a trace-process sleep 300'], start_new_session=True)\n\
    print('traced')";

/// Python that prints what it finds of another session's traces.
const LOOK_FOR_TRACES: &str = "import os, subprocess\n\
    print('global', 'TRACE' in globals())\n\
    print('file', os.path.exists('/mnt/data/trace.txt'))\n\
    print('tmp', os.path.exists('/tmp/trace.txt'))\n\
    ps = subprocess.run(['ps', '-eo', 'pid,args'], capture_output=True, text=True).stdout\n\
    print('process', 'trace-process' in ps)\n\
    print('pids', len(ps.strip().splitlines()) - 1)";

fn assert_no_traces(out: &Value) {
    let text = stdout(out);
    for line in ["global False", "file False", "tmp False", "process False"] {
        assert!(text.contains(line), "{line}: {out}");
    }
    // Only this sandbox's own few processes: the runner, the kernel, ps and its shell.
    let pids: usize = text
        .lines()
        .find_map(|l| l.strip_prefix("pids "))
        .and_then(|n| n.trim().parse().ok())
        .expect("pid count");
    assert!(pids < 10, "{pids} processes visible: {out}");
}

#[tokio::test]
async fn sessions_of_one_user_share_nothing() {
    let broker = TestBroker::start_with("hh-iso-user", |c| {
        c.auth = AuthMode::Key;
        c.api_key = vec!["k".into()];
    })
    .await;
    let exec = |body: Value| {
        let broker = &broker;
        async move {
            let resp = broker
                .client
                .post(broker.url("/exec"))
                .header("x-api-key", "k")
                .json(&body)
                .send()
                .await
                .expect("exec");
            assert_eq!(resp.status(), 200);
            let text = resp.text().await.unwrap();
            serde_json::from_str::<Value>(text.trim()).unwrap()
        }
    };
    let a = exec(json!({ "lang": "py", "code": LEAVE_TRACES, "user_id": "u1" })).await;
    assert_eq!(stdout(&a), "traced\n", "{a}");
    let b = exec(json!({ "lang": "py", "code": LOOK_FOR_TRACES, "user_id": "u1" })).await;
    assert_ne!(session(&a), session(&b));
    assert_no_traces(&b);
    // The traces are still where they were left.
    let again = exec(
        json!({ "lang": "py", "code": "print(TRACE)", "user_id": "u1",
                             "session_id": session(&a) }),
    )
    .await;
    assert_eq!(stdout(&again), "left-behind\n", "{again}");
    let started = Instant::now();
    let ok = exec(json!({ "lang": "bash", "code": "echo ok", "user_id": "u1",
                          "session_id": session(&b) }))
    .await;
    assert_eq!(stdout(&ok), "ok\n");
    assert!(started.elapsed() < RECOVERY);
}

const ED_A: &[u8] = include_bytes!("keys/ed25519_a.pem");
const ED_B: &[u8] = include_bytes!("keys/ed25519_b.pem");

fn key_path(name: &str) -> String {
    format!("{}/../tests/keys/{name}", env!("CARGO_MANIFEST_DIR"))
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs()
}

/// A JWT with the given claims, signed by `key` as `alg`.
fn sign(alg: Algorithm, key: &EncodingKey, kid: Option<&str>, claims: &Value) -> String {
    let mut header = Header::new(alg);
    header.kid = kid.map(str::to_string);
    encode(&header, claims, key).expect("sign")
}

/// LibreChat's claims for `sub`, expiring in `exp_in` seconds.
fn claims(sub: &str, exp_in: i64, aud: &str, iss: &str) -> Value {
    let now = unix_now();
    json!({ "iss": iss, "aud": aud, "sub": sub, "iat": now, "nbf": now,
            "exp": now.saturating_add_signed(exp_in), "jti": codebroker::ids::new_id() })
}

fn jwt(sub: &str) -> String {
    let key = EncodingKey::from_ed_pem(ED_A).expect("key");
    sign(
        Algorithm::EdDSA,
        &key,
        Some("lc-ed"),
        &claims(sub, 300, "codeapi", "librechat"),
    )
}

/// A broker that takes the API key `KEY` and JWTs of `ed25519_a` (kid `lc-ed`).
async fn authed_broker(tag: &str) -> TestBroker {
    TestBroker::start_with(tag, |c| {
        c.auth = AuthMode::Key;
        c.api_key = vec![KEY.into()];
        c.jwt_public_keys = vec![format!("lc-ed={}", key_path("ed25519_a.pub.pem"))];
    })
    .await
}

const KEY: &str = "hostile-host-key";

async fn exec_as(broker: &TestBroker, token: &str, body: Value) -> (u16, Value) {
    let resp = broker
        .client
        .post(broker.url("/exec"))
        .bearer_auth(token)
        .json(&body)
        .send()
        .await
        .expect("exec");
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    (
        status,
        serde_json::from_str(text.trim()).unwrap_or(Value::String(text)),
    )
}

#[tokio::test]
async fn users_share_nothing() {
    let broker = authed_broker("hh-iso-users").await;
    let (alice, bob) = (jwt("alice"), jwt("bob"));
    let (status, a) = exec_as(
        &broker,
        &alice,
        json!({ "lang": "py", "code": LEAVE_TRACES }),
    )
    .await;
    assert_eq!(status, 200, "{a}");
    let s = session(&a);
    // Bob, even naming her session, gets his own with none of her traces.
    let (status, b) = exec_as(
        &broker,
        &bob,
        json!({ "lang": "py", "code": LOOK_FOR_TRACES, "session_id": s }),
    )
    .await;
    assert_eq!(status, 200, "{b}");
    assert_ne!(session(&b), s);
    assert_no_traces(&b);
    let listed = broker
        .client
        .get(broker.url(&format!("/files/{s}")))
        .bearer_auth(&bob)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!listed.contains("trace.txt"), "{listed}");
    // Alice's session is intact and answers.
    let started = Instant::now();
    let (status, ok) = exec_as(
        &broker,
        &alice,
        json!({ "lang": "bash", "code": "echo ok; cat /mnt/data/trace.txt", "session_id": s }),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(stdout(&ok), "ok\ntrace", "{ok}");
    assert!(started.elapsed() < RECOVERY);
}

#[tokio::test]
async fn a_pooled_container_never_carries_another_sessions_state() {
    let broker = TestBroker::start_with("hh-pool", |c| c.pool_size = 2).await;
    broker.wait_for_pool(2).await;
    let a = broker.run("py", LEAVE_TRACES, None).await;
    assert_eq!(stdout(&a), "traced\n", "{a}");
    let a_container = container_of(&broker.instance, &session(&a));
    // Every session the pool serves after A is clean, and never runs in A's container.
    for _ in 0..3 {
        broker.wait_for_pool(1).await;
        let b = broker.run("py", LOOK_FOR_TRACES, None).await;
        assert_ne!(session(&b), session(&a));
        assert_eq!(b["runtime_status"], "new", "{b}");
        assert_no_traces(&b);
        assert_ne!(container_of(&broker.instance, &session(&b)), a_container);
        echo_ok(&broker, &session(&b)).await;
    }
    let again = broker.run("py", "print(TRACE)", Some(&session(&a))).await;
    assert_eq!(stdout(&again), "left-behind\n");
    // A graceful stop first: it ends the pool's refills, so none creates a container after
    // the removal below (a slow runtime's refill is often still under way here).
    let instance = broker.instance.clone();
    let _data = broker.stop().await;
    common::remove_containers_of(&instance);
}

/// The id of the container labelled with `session_id`.
fn container_of(instance: &str, session_id: &str) -> String {
    let label = format!("codebroker.session={session_id}");
    let ids = common::containers_matching(instance, &[&label]);
    assert_eq!(ids.len(), 1, "containers of {session_id}: {ids:?}");
    ids[0].clone()
}

// ---------------------------------------------------------------------------------------
// Lifecycle and faults
// ---------------------------------------------------------------------------------------

/// Bash that appends a line to `/mnt/data/grow.txt` every 100 ms for a minute.
const GROW: &str = "for i in $(seq 1 600); do echo $i >> /mnt/data/grow.txt; sleep 0.1; done";

/// The size of `grow.txt` now and a second later, and whether the loop still runs.
const MEASURE_GROWTH: &str =
    "a=$(wc -l < /mnt/data/grow.txt); sleep 1; b=$(wc -l < /mnt/data/grow.txt)\n\
    echo \"$a $b\"; ps -eo args | grep -c '[s]eq 1 600'";

#[tokio::test]
async fn a_client_that_disconnects_stops_its_exec() {
    let broker = TestBroker::start("hh-disconnect").await;
    let bystander = Bystander::start(&broker).await;
    let first = broker.run("bash", "echo ready", None).await;
    let s = session(&first);
    // Gone before the first byte of the answer (1 s), and gone while the keep-alive
    // spaces already flow (5 s).
    for give_up_after in [Duration::from_secs(1), Duration::from_secs(5)] {
        let request = broker
            .client
            .post(broker.url("/exec"))
            .json(&json!({ "lang": "bash", "code": GROW, "session_id": s, "timeout": 30000 }))
            .send();
        let gave_up = tokio::time::timeout(give_up_after, async {
            let resp = request.await.expect("exec");
            resp.text().await
        })
        .await;
        assert!(gave_up.is_err(), "the exec ended on its own");
        let started = Instant::now();
        // The session's next call waits for the cancelled exec: it comes at once when the
        // cancel worked, and only after the loop's minute when it did not.
        let out = broker.run("bash", MEASURE_GROWTH, Some(&s)).await;
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "the exec ran on after its client left ({:?})",
            started.elapsed()
        );
        let lines: Vec<&str> = stdout(&out).lines().collect();
        let sizes: Vec<u64> = lines[0]
            .split_whitespace()
            .map(|n| n.parse().expect("count"))
            .collect();
        assert_eq!(sizes[0], sizes[1], "grow.txt still grows: {out}");
        assert!(sizes[0] > 0, "the loop never ran: {out}");
        assert_eq!(lines[1], "0", "the loop still runs: {out}");
        broker
            .run("bash", "rm -f /mnt/data/grow.txt", Some(&s))
            .await;
        echo_ok(&broker, &s).await;
    }
    bystander.check(&broker).await;
}

/// A broker binary run as a child process, killed with SIGKILL on drop.
struct BrokerProcess {
    child: std::process::Child,
    base: String,
}

impl BrokerProcess {
    async fn start(data_dir: &Path, instance: &str) -> BrokerProcess {
        let port = {
            let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            probe.local_addr().expect("addr").port()
        };
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_codebroker"))
            .env("CODEBROKER_AUTH", "none")
            .env("CODEBROKER_LISTEN", format!("127.0.0.1:{port}"))
            .env("CODEBROKER_DATA_DIR", data_dir)
            .env("CODEBROKER_INSTANCE", instance)
            .env("CODEBROKER_IMAGE", common::image())
            .env("CODEBROKER_POOL_SIZE", "0")
            // Ten sessions of one unnamed caller: over the shipped per-user cap (8), the
            // least recently used would make room, and this case is about the crash.
            .env("CODEBROKER_MAX_SESSIONS_PER_USER", "0")
            .env("RUST_LOG", "codebroker=warn")
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("spawn the broker");
        let base = format!("http://127.0.0.1:{port}");
        let client = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        while client.get(format!("{base}/health")).send().await.is_err() {
            assert!(Instant::now() < deadline, "the broker did not come up");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        BrokerProcess { child, base }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for BrokerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Removes an instance's containers when the test ends, however it ends.
struct RemoveContainers(String);

impl Drop for RemoveContainers {
    fn drop(&mut self) {
        common::remove_containers_of(&self.0);
    }
}

#[tokio::test]
async fn a_killed_broker_restarts_without_leaks_or_losses() {
    common::require_image();
    let tmp = tempfile::tempdir().expect("tempdir");
    let instance = common::instance_name("hh-kill");
    let _cleanup = RemoveContainers(instance.clone());
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap();
    let mut first = BrokerProcess::start(tmp.path(), &instance).await;
    // Ten sessions, each with a file and a kernel global.
    let mut sessions = Vec::new();
    for i in 0..10 {
        let out: Value = client
            .post(format!("{}/exec", first.base))
            .json(&json!({ "lang": "py", "code":
                format!("open('/mnt/data/kept-{i}.txt', 'w').write('kept {i}')\nKEPT = {i}\nprint('ok')") }))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(stdout(&out), "ok\n", "{out}");
        let file = out["files"][0]["id"].as_str().expect("file id").to_string();
        sessions.push((session(&out), file));
    }
    // Ten execs running when the broker dies.
    let mut running = Vec::new();
    for (s, _) in &sessions {
        let request = client.post(format!("{}/exec", first.base)).json(
            &json!({ "lang": "bash", "session_id": s,
                     "code": "for i in $(seq 1 50); do echo $i >> /mnt/data/during.txt; sleep 0.1; done" }),
        );
        running.push(tokio::spawn(request.send()));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    first.kill();
    for r in running {
        let _ = r.await;
    }
    // Restart on the same data directory and instance: the start-up reconcile re-attaches
    // to the running containers (or removes what it cannot use) before serving.
    let second = BrokerProcess::start(tmp.path(), &instance).await;
    let after_restart = containers_of(&instance);
    assert!(after_restart.len() <= sessions.len(), "{after_restart:?}");
    for id in &after_restart {
        assert_eq!(common::inspect(id)["State"]["Running"], true, "{id}");
    }
    for (i, (s, file)) in sessions.iter().enumerate() {
        // No file lost.
        let resp = client
            .get(format!("{}/download/{s}/{file}", second.base))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "session {i}");
        assert_eq!(resp.text().await.unwrap(), format!("kept {i}"));
        let started = Instant::now();
        let out: Value = client
            .post(format!("{}/exec", second.base))
            .json(&json!({ "lang": "bash", "code": "echo ok; cat /mnt/data/kept-*.txt", "session_id": s }))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(stdout(&out), format!("ok\nkept {i}"), "{out}");
        assert!(
            started.elapsed() < RECOVERY,
            "session {i} took {:?}",
            started.elapsed()
        );
        // Re-attached, not replaced: the kernel kept its state through the crash.
        let out: Value = client
            .post(format!("{}/exec", second.base))
            .json(&json!({ "lang": "py", "code": "print(KEPT)", "session_id": s }))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(stdout(&out), format!("{i}\n"), "{out}");
    }
    // Every container of the instance belongs to one of the sessions, one each, and runs:
    // re-attached (or replaced), none orphaned.
    let containers = containers_of(&instance);
    assert_eq!(containers.len(), sessions.len(), "{containers:?}");
    for (s, _) in &sessions {
        let id = container_of(&instance, s);
        assert_eq!(common::inspect(&id)["State"]["Running"], true);
    }
    drop(second);
}

/// Starts 64 sessions at once on a broker with `max_containers` (0: no cap); every
/// request is served or refused with 429, never a 5xx. Returns how many were served.
/// Each exec holds its sandbox busy for a moment, so that a cap is met by running code
/// (idle sandboxes make room instead of refusing).
async fn burst_of_64(tag: &str, max_containers: usize) -> usize {
    let broker = TestBroker::start_with(tag, |c| {
        c.max_containers = ContainerCap::Count(max_containers);
        // Room for the burst and the bystander: at the default cap of 64 live sandboxes
        // the 65th would rightly evict the least recently used idle one, the bystander
        // (that eviction is `churn.rs`'s to test).
        c.max_live_sandboxes = 65;
    })
    .await;
    let bystander = Bystander::start(&broker).await;
    let requests = (0..64).map(|i| {
        let broker = &broker;
        async move {
            let resp = broker
                .client
                .post(broker.url("/exec"))
                .json(&json!({ "lang": "bash", "code": format!("sleep 2; echo {i}") }))
                .send()
                .await
                .expect("exec");
            let status = resp.status().as_u16();
            let text = resp.text().await.unwrap();
            let body: Value = serde_json::from_str(text.trim()).unwrap_or(Value::String(text));
            (i, status, body)
        }
    });
    let answers = futures::future::join_all(requests).await;
    let mut served = Vec::new();
    let mut refused = 0;
    for (i, status, body) in &answers {
        match status {
            200 => {
                assert_eq!(stdout(body), format!("{i}\n"), "{body}");
                served.push(session(body));
            }
            429 => {
                assert!(body["retry_after_seconds"].is_number(), "{body}");
                refused += 1;
            }
            other => panic!("request {i}: {other} {body}"),
        }
    }
    assert!(!served.is_empty());
    assert_eq!(served.len() + refused, 64);
    echo_ok(&broker, &served[0]).await;
    if max_containers == 0 {
        bystander.check(&broker).await;
    } else {
        // The idle bystander was the least recently used sandbox, and made room at the
        // cap; its session still works, on a new sandbox.
        echo_ok(&broker, &bystander.session).await;
    }
    served.len()
}

#[tokio::test]
async fn sixty_four_sessions_at_once_are_all_served() {
    assert_eq!(burst_of_64("hh-burst", 0).await, 64);
}

#[tokio::test]
async fn sixty_four_sessions_over_the_cap_are_refused_with_429() {
    // 24 sandboxes at most: the idle bystander's makes room, the busy ones do not.
    assert_eq!(burst_of_64("hh-burst-cap", 24).await, 24);
}

#[tokio::test]
async fn idle_reaping_never_kills_a_starting_exec() {
    let broker = TestBroker::start_with("hh-reap", |c| {
        c.idle_ttl_secs = 1;
        c.reap_interval_secs = 1;
    })
    .await;
    let first = broker.run("bash", "echo start", None).await;
    let s = session(&first);
    // Execs that arrive around the moment the session turns idle (the reaper runs every
    // second with a one-second TTL), and execs that last longer than the TTL.
    let pauses_ms = [950u64, 1000, 1050, 1100, 900, 1200, 1000, 1020, 980, 1300];
    for (i, pause) in pauses_ms.iter().enumerate() {
        tokio::time::sleep(Duration::from_millis(*pause)).await;
        let code = if i % 2 == 0 {
            format!("echo run {i}")
        } else {
            format!("sleep 1.5; echo run {i}")
        };
        let out = broker.run("bash", &code, Some(&s)).await;
        assert_eq!(stdout(&out), format!("run {i}\n"), "{out}");
        assert_eq!(out["exit_code"], 0, "{out}");
        assert!(!stderr(&out).contains("stopped unexpectedly"), "{out}");
        assert_eq!(session(&out), s);
    }
    // Idle for real: the container goes (within a few reaper rounds, however busy the
    // engine), the files stay, the session answers again.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !broker.containers().is_empty() {
        assert!(Instant::now() < deadline, "an idle container stayed");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    echo_ok_within(&broker, &s, FRESH_START).await;
}

// ---------------------------------------------------------------------------------------
// Auth
// ---------------------------------------------------------------------------------------

/// Routes that are public on purpose: the health check, and static documents that carry no
/// session data (the OpenAPI description, the LobeChat manifest, which LobeChat fetches
/// without credentials, and the playground's page and assets, which ask for the key).
const PUBLIC: &[&str] = &[
    "/health",
    "/openapi.json",
    "/lobe/manifest.json",
    "/",
    "/playground/app.js",
];

/// Every route of the OpenAPI document, method and path with ids filled in.
async fn documented_routes(broker: &TestBroker, s: &str, f: &str) -> Vec<(String, String)> {
    let doc: Value = broker
        .get("/openapi.json")
        .await
        .json()
        .await
        .expect("openapi");
    let mut routes = Vec::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for method in ["get", "post", "put", "patch", "delete"] {
            if item.get(method).is_some() {
                let filled = path
                    .replace("{session_id}", s)
                    .replace("{file_id}", f)
                    .replace("{id}", f)
                    .replace("{asset}", "app.js");
                assert!(!filled.contains('{'), "unfilled parameter in {path}");
                routes.push((method.to_string(), filled));
            }
        }
    }
    routes
}

/// Sends `method path` with `credentials` (header name and value, or none).
async fn status_of(
    broker: &TestBroker,
    method: &str,
    path: &str,
    credentials: Option<(&str, String)>,
) -> u16 {
    let method = reqwest::Method::from_bytes(method.to_uppercase().as_bytes()).unwrap();
    let mut request = broker
        .client
        .request(method, broker.url(path))
        .header("accept", "application/json, text/event-stream")
        .header("content-type", "application/json")
        .body(r#"{"lang":"bash","code":"echo no"}"#);
    if let Some((name, value)) = credentials {
        request = request.header(name, value);
    }
    request.send().await.expect("request").status().as_u16()
}

#[tokio::test]
async fn every_route_but_the_public_ones_needs_credentials() {
    let broker = authed_broker("hh-routes").await;
    let a = exec_as(
        &broker,
        KEY,
        json!({ "lang": "bash", "code": "echo x > /mnt/data/f" }),
    )
    .await;
    assert_eq!(a.0, 200, "{}", a.1);
    let s = session(&a.1);
    let f = a.1["files"][0]["id"].as_str().expect("file").to_string();
    let routes = documented_routes(&broker, &s, &f).await;
    // The document covers what must be covered, so a new route is checked too.
    for must in [
        "/exec",
        "/upload",
        "/mcp",
        "/metrics",
        "/libraries",
        "/lobe/run",
    ] {
        assert!(
            routes.iter().any(|(_, p)| p == must),
            "{must} is not in /openapi.json"
        );
    }
    let forged = {
        let key = EncodingKey::from_ed_pem(ED_B).expect("key");
        sign(
            Algorithm::EdDSA,
            &key,
            Some("lc-ed"),
            &claims("alice", 300, "codeapi", "librechat"),
        )
    };
    let bad: Vec<Option<(&str, String)>> = vec![
        None,
        Some(("x-api-key", "wrong".into())),
        Some(("authorization", "Bearer wrong".into())),
        Some(("authorization", format!("Bearer {forged}"))),
        Some(("authorization", format!("Basic {KEY}"))),
        Some(("x-lobe-plugin-settings", r#"{"apiKey":"wrong"}"#.into())),
    ];
    let mut checked = 0;
    for (method, path) in &routes {
        for prefix in ["", "/v1"] {
            // The root route is `/v1` under the prefix, not `/v1/`.
            let full = match (prefix, path.as_str()) {
                ("/v1", "/") => prefix.to_string(),
                _ => format!("{prefix}{path}"),
            };
            let public = PUBLIC.contains(&path.as_str());
            for credentials in &bad {
                let status = status_of(&broker, method, &full, credentials.clone()).await;
                if public {
                    assert_ne!(status, 401, "{method} {full} is public");
                } else {
                    assert_eq!(status, 401, "{method} {full} with {credentials:?}");
                    checked += 1;
                }
            }
        }
    }
    assert!(checked >= 6 * 2 * 10, "only {checked} refusals checked");
    // The public documents say nothing about sessions.
    for path in PUBLIC {
        let body = broker.get(path).await.text().await.unwrap();
        assert!(!body.contains(&s) && !body.contains(&f), "{path} leaks ids");
    }
    // A refused caller left nothing behind; the right key still works at once.
    let started = Instant::now();
    let (status, ok) = exec_as(
        &broker,
        KEY,
        json!({ "lang": "bash", "code": "echo ok", "session_id": s }),
    )
    .await;
    assert_eq!((status, stdout(&ok)), (200, "ok\n"), "{ok}");
    assert!(started.elapsed() < RECOVERY);
}

/// A forged token is refused on `/exec`, `/mcp` and a download, and a good one still
/// runs `echo ok` in the same session right after.
async fn refuse_token(tag: &str, token: String) {
    let broker = authed_broker(tag).await;
    let (status, first) = exec_as(
        &broker,
        &jwt("alice"),
        json!({ "lang": "bash", "code": "echo x > /mnt/data/f" }),
    )
    .await;
    assert_eq!(status, 200, "{first}");
    let s = session(&first);
    let f = first["files"][0]["id"].as_str().expect("file").to_string();
    let (status, body) = exec_as(
        &broker,
        &token,
        json!({ "lang": "bash", "code": "echo pwned", "session_id": s }),
    )
    .await;
    assert_eq!(status, 401, "{body}");
    assert_eq!(body["error"], "unauthorized", "{body}");
    for (method, path) in [
        ("get", format!("/download/{s}/{f}")),
        ("post", "/mcp".into()),
    ] {
        let status = status_of(
            &broker,
            method,
            &path,
            Some(("authorization", format!("Bearer {token}"))),
        )
        .await;
        assert_eq!(status, 401, "{method} {path}");
    }
    let started = Instant::now();
    let (status, ok) = exec_as(
        &broker,
        &jwt("alice"),
        json!({ "lang": "bash", "code": "echo ok", "session_id": s }),
    )
    .await;
    assert_eq!((status, stdout(&ok)), (200, "ok\n"), "{ok}");
    assert_eq!(session(&ok), s);
    assert!(started.elapsed() < RECOVERY);
}

fn b64url(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

#[tokio::test]
async fn jwt_with_alg_none_is_refused() {
    let header = b64url(br#"{"alg":"none","typ":"JWT","kid":"lc-ed"}"#);
    let body = b64url(
        claims("alice", 300, "codeapi", "librechat")
            .to_string()
            .as_bytes(),
    );
    refuse_token("hh-jwt-none", format!("{header}.{body}.")).await;
}

#[tokio::test]
async fn jwt_signed_with_the_wrong_key_is_refused() {
    let key = EncodingKey::from_ed_pem(ED_B).expect("key");
    let token = sign(
        Algorithm::EdDSA,
        &key,
        Some("lc-ed"),
        &claims("alice", 300, "codeapi", "librechat"),
    );
    refuse_token("hh-jwt-key", token).await;
}

#[tokio::test]
async fn jwt_signed_with_the_public_key_as_hmac_secret_is_refused() {
    let public = std::fs::read(key_path("ed25519_a.pub.pem")).expect("public key");
    let token = sign(
        Algorithm::HS256,
        &EncodingKey::from_secret(&public),
        Some("lc-ed"),
        &claims("alice", 300, "codeapi", "librechat"),
    );
    refuse_token("hh-jwt-hmac", token).await;
}

#[tokio::test]
async fn expired_jwt_is_refused() {
    let key = EncodingKey::from_ed_pem(ED_A).expect("key");
    let token = sign(
        Algorithm::EdDSA,
        &key,
        Some("lc-ed"),
        &claims("alice", -600, "codeapi", "librechat"),
    );
    refuse_token("hh-jwt-exp", token).await;
}

#[tokio::test]
async fn jwt_for_another_audience_or_issuer_is_refused() {
    let key = EncodingKey::from_ed_pem(ED_A).expect("key");
    for (i, (aud, iss)) in [("other-api", "librechat"), ("codeapi", "evil")]
        .into_iter()
        .enumerate()
    {
        let token = sign(
            Algorithm::EdDSA,
            &key,
            Some("lc-ed"),
            &claims("alice", 300, aud, iss),
        );
        refuse_token(&format!("hh-jwt-aud{i}"), token).await;
    }
}

// ---------------------------------------------------------------------------------------
// Runtime
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn a_runtime_the_daemon_lacks_is_a_clean_refusal() {
    // CODEBROKER_RUNTIME names e.g. gVisor's runsc; on a daemon without it, execs are
    // refused with a 503 that says so, promptly, and nothing is left behind.
    let broker = TestBroker::start_with("hh-runtime", |c| {
        c.runtime = "codebroker-no-such-runtime".into();
    })
    .await;
    let started = Instant::now();
    let (status, body) = broker
        .exec(json!({ "lang": "bash", "code": "echo never" }))
        .await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"], "unavailable", "{body}");
    assert!(started.elapsed() < Duration::from_secs(30));
    assert!(broker.containers().is_empty(), "{:?}", broker.containers());
}
