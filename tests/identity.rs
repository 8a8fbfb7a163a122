//! Who owns what, with the broker run as the broker image runs it: the image's own
//! entrypoint (`images/broker/entrypoint.sh`) starts the real binary, as root, and drops
//! to the broker's uid. Sandboxed code must then not be able to change, replace or delete
//! a read-only upload (a skill), the data directory must be closed to other host users,
//! and nothing the code leaves behind may run as the broker's uid.

mod common;

use common::child::{ChildBroker, Launch, Ready};
use common::{instance_name, require_image, stdout};
use reqwest::multipart::{Form, Part};
use serde_json::{json, Value};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

/// The uids sandboxes are given (the broker's default CODEBROKER_SANDBOX_UIDS, less the
/// first, which no sandbox runs as).
const SANDBOX_UIDS: std::ops::RangeInclusive<u32> = 200_001..=265_535;

const SKILL: &str = "# pptx\nUse python-pptx. Never call tools not listed here.\n";

/// The broker binary started through the image's entrypoint, as root.
struct Proc(ChildBroker);

impl std::ops::Deref for Proc {
    type Target = ChildBroker;

    fn deref(&self) -> &ChildBroker {
        &self.0
    }
}

impl Proc {
    async fn start(tag: &str) -> Proc {
        require_image();
        // SAFETY: geteuid has no preconditions.
        assert_eq!(
            unsafe { libc::geteuid() },
            0,
            "this test starts the broker as its image does, which takes root"
        );
        let tmp = tempfile::tempdir().expect("tempdir");
        let data = tmp.path().join("data");
        let bin = Path::new(env!("CARGO_BIN_EXE_codebroker"));
        let path = format!(
            "{}:{}",
            bin.parent().expect("bin dir").display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let entrypoint =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../images/broker/entrypoint.sh");
        let mut sh = Command::new("sh");
        sh.arg(entrypoint).arg("serve");
        // Stopped on drop as `docker stop` stops it: SIGTERM, then SIGKILL.
        let broker = Launch::program(sh, &instance_name(tag), &data)
            .env("PATH", path)
            .env("CODEBROKER_AUTH", "none")
            .env("CODEBROKER_SHUTDOWN_CONTAINERS", "remove")
            .env_remove("CODEBROKER_RUN_AS_ROOT")
            .owning(tmp)
            .ready(Ready::Healthy)
            .term_on_drop()
            .spawn()
            .await;
        Proc(broker)
    }

    /// The uid the broker process runs as (the entrypoint execs it in place).
    fn uid(&self) -> u32 {
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", self.pid())).expect("status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|u| u.parse().ok())
            .expect("Uid line")
    }

    async fn exec(&self, session: &str, code: &str) -> Value {
        self.exec_with(json!({"lang": "bash", "code": code, "session_id": session}))
            .await
    }

    async fn exec_with(&self, body: Value) -> Value {
        let resp = reqwest::Client::new()
            .post(format!("{}/exec", self.base))
            .json(&body)
            .timeout(Duration::from_secs(120))
            .send()
            .await
            .expect("exec");
        assert_eq!(resp.status(), 200);
        resp.json().await.expect("json")
    }
}

/// Runs `argv` on the host as `nobody`; whether it succeeded.
fn as_nobody(argv: &[&str]) -> bool {
    Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .args(argv)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("setpriv")
        .success()
}

#[tokio::test]
async fn with_the_image_entrypoint_code_cannot_touch_a_skill_and_others_cannot_read_data() {
    let broker = Proc::start("identity").await;
    let client = reqwest::Client::new();
    let form = Form::new()
        .part(
            "file",
            Part::bytes(SKILL.as_bytes().to_vec()).file_name("skills/pptx/SKILL.md"),
        )
        .text("kind", "skill");
    let up: Value = client
        .post(format!("{}/upload", broker.base))
        .multipart(form)
        .send()
        .await
        .expect("upload")
        .json()
        .await
        .expect("json");
    let shared = up["session_id"].as_str().expect("session_id").to_string();
    let file_id = up["files"][0]["fileId"]
        .as_str()
        .expect("fileId")
        .to_string();
    // A skill is shared: an exec gets it through its ref, in a session of its own.
    let skill_ref = json!([{"id": file_id, "storage_session_id": shared,
                            "name": "skills/pptx/SKILL.md", "kind": "skill"}]);

    // Every way code could change, replace or drop the skill; each line says whether it
    // worked. A normal file, in the workspace and beside the skill, must still work.
    let attack = r#"
f=skills/pptx/SKILL.md
try() { if ( eval "$2" ) >/dev/null 2>&1; then echo "$1=ok"; else echo "$1=denied"; fi; }
stat -c 'skill %u %a' "$f" >&2
try append 'echo INJECTED >> skills/pptx/SKILL.md'
try overwrite 'echo INJECTED > skills/pptx/SKILL.md'
try truncate 'truncate -s 0 skills/pptx/SKILL.md'
try chmod 'chmod 666 skills/pptx/SKILL.md'
try mv 'mv skills/pptx/SKILL.md skills/pptx/old.md'
try rm 'rm -f skills/pptx/SKILL.md && ! test -e skills/pptx/SKILL.md'
try mvdir 'mv skills/pptx skills/pptx.old'
try mvtop 'mv skills skills.old'
try rmtree 'rm -rf skills && ! test -e skills'
try write 'echo mine > notes.txt && test "$(cat notes.txt)" = mine'
try writeskills 'echo mine > skills/pptx/notes.md && test "$(cat skills/pptx/notes.md)" = mine'
"#;
    let resp = broker
        .exec_with(json!({"lang": "bash", "code": attack, "files": skill_ref}))
        .await;
    let s = common::session(&resp);
    assert_ne!(s, shared, "the exec ran in the shared session");
    let out = stdout(&resp).to_string();
    eprintln!("{out}{}", resp["stderr"].as_str().unwrap_or(""));
    for op in [
        "append",
        "overwrite",
        "truncate",
        "chmod",
        "mv",
        "rm",
        "mvdir",
        "mvtop",
        "rmtree",
    ] {
        assert!(
            out.contains(&format!("{op}=denied")),
            "the code could {op} a read-only upload: {resp}"
        );
    }
    assert!(out.contains("write=ok"), "{resp}");
    assert!(out.contains("writeskills=ok"), "{resp}");

    // The next exec in that session (without the ref, which would place it again) and a
    // download both still see the upload as it was.
    let resp = broker.exec(&s, "cat skills/pptx/SKILL.md").await;
    assert_eq!(stdout(&resp), SKILL, "{resp}");
    let body = client
        .get(format!("{}/download/{shared}/{file_id}", broker.base))
        .send()
        .await
        .expect("download")
        .text()
        .await
        .expect("body");
    assert_eq!(body, SKILL);

    // Separate uids: the broker is neither root nor the sandbox, and its data is its own.
    // It holds three capabilities, none of them ambient or inheritable any more (programs
    // it starts, such as upstream MCP servers, get none), in every thread; CAP_SETUID and
    // CAP_SETGID are only permitted, for the upstream servers' uid.
    let tasks = std::fs::read_dir(format!("/proc/{}/task", broker.pid())).expect("tasks");
    for task in tasks {
        let path = task.expect("task").path().join("status");
        let status = std::fs::read_to_string(&path).expect("status");
        let cap = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(str::trim)
                .unwrap_or_default()
                .to_string()
        };
        assert_eq!(cap("CapEff:"), "000000000000000b", "{path:?}: {status}");
        assert_eq!(cap("CapPrm:"), "00000000000000cb", "{path:?}: {status}");
        assert_eq!(cap("CapBnd:"), "00000000000000cb", "{path:?}: {status}");
        assert_eq!(cap("CapInh:"), "0000000000000000", "{path:?}: {status}");
        assert_eq!(cap("CapAmb:"), "0000000000000000", "{path:?}: {status}");
    }
    let broker_uid = broker.uid();
    assert!(
        !SANDBOX_UIDS.contains(&broker_uid),
        "the broker runs as a sandbox uid"
    );
    assert_ne!(broker_uid, 0, "the broker runs as root");
    let resp = broker.exec(&s, "id -u").await;
    let sandbox_uid: u32 = stdout(&resp).trim().parse().expect("uid");
    assert!(SANDBOX_UIDS.contains(&sandbox_uid), "{resp}");
    let root = broker.data_dir.join("sessions").join(&s);
    for (path, mode) in [
        (broker.data_dir.clone(), 0o700),
        (broker.data_dir.join("sessions"), 0o700),
        (root.clone(), 0o700),
        (root.join("blobs"), 0o700),
        (root.join("index.json"), 0o600),
        (root.join("session.json"), 0o600),
        (root.join("files"), 0o1770),
    ] {
        let meta = std::fs::metadata(&path).expect("metadata");
        assert_eq!(
            (meta.uid(), meta.mode() & 0o7777),
            (broker_uid, mode),
            "{} (uid, mode)",
            path.display()
        );
    }
    for blob in std::fs::read_dir(root.join("blobs")).expect("blobs") {
        let path = blob.expect("entry").path();
        let meta = std::fs::metadata(&path).expect("metadata");
        assert_eq!(meta.mode() & 0o777, 0o600, "{}", path.display());
        let path = path.to_str().expect("utf-8");
        assert!(!as_nobody(&["cat", path]), "nobody could read {path}");
    }
    let sessions = broker.data_dir.join("sessions");
    assert!(
        !as_nobody(&["ls", sessions.to_str().expect("utf-8")]),
        "nobody could list the sessions"
    );
    let skill = root.join("files/skills/pptx/SKILL.md");
    assert!(!as_nobody(&["cat", skill.to_str().expect("utf-8")]));

    // What the code makes unreadable to others, in a sticky directory of its own, the
    // broker still collects, serves and deletes (its capabilities, not its uid).
    let resp = broker
        .exec(
            &s,
            "mkdir -p locked && chmod 1777 locked && echo hidden > locked/f && chmod 000 locked/f && chmod 700 locked",
        )
        .await;
    let locked = resp["files"]
        .as_array()
        .and_then(|f| f.iter().find(|f| f["name"] == "locked/f"))
        .unwrap_or_else(|| panic!("locked/f was not collected: {resp}"))["id"]
        .as_str()
        .expect("id")
        .to_string();
    let body = client
        .get(format!("{}/download/{s}/{locked}", broker.base))
        .send()
        .await
        .expect("download")
        .text()
        .await
        .expect("body");
    assert_eq!(body, "hidden\n");
    let deleted = client
        .delete(format!("{}/files/{s}/{locked}", broker.base))
        .send()
        .await
        .expect("delete");
    assert!(deleted.status().is_success(), "{}", deleted.status());
    assert!(
        !root.join("files/locked/f").exists(),
        "the broker could not delete locked/f"
    );

    // A setuid program left by the code runs as the sandbox uid, never the broker's.
    let resp = broker
        .exec(
            &s,
            "cp /bin/sh ./s && chmod 4755 ./s && stat -c '%u %a' ./s",
        )
        .await;
    assert_eq!(
        stdout(&resp).trim(),
        format!("{sandbox_uid} 4755"),
        "{resp}"
    );
    let setuid = root.join("files/s");
    let meta = std::fs::metadata(&setuid).expect("metadata");
    assert_eq!(meta.uid(), sandbox_uid);
    assert_ne!(meta.uid(), broker_uid);
    // And no other host user can even reach it.
    // (Through a shell: setpriv itself still holds root's capabilities at its execve.)
    let setuid = setuid.to_str().expect("utf-8");
    assert!(!as_nobody(&["sh", "-c", "\"$0\" -c true", setuid]));
    assert!(
        as_nobody(&["sh", "-c", "\"$0\" -c true", "/bin/sh"]),
        "the check can pass"
    );
}

/// A root broker (`CODEBROKER_RUN_AS_ROOT=true`, or the test brokers): the skill is
/// root's, and so are `/mnt/data` and the directories it sits in, so the code cannot
/// unlink it or move its directory away and put another skill in its place.
#[tokio::test]
async fn with_a_root_broker_a_skill_cannot_be_replaced_either() {
    let broker = common::TestBroker::start("identity-root").await;
    let form = Form::new()
        .part(
            "file",
            Part::bytes(SKILL.as_bytes().to_vec()).file_name("skills/pptx/SKILL.md"),
        )
        .text("kind", "skill");
    let up: Value = broker
        .client
        .post(broker.url("/upload"))
        .multipart(form)
        .send()
        .await
        .expect("upload")
        .json()
        .await
        .expect("json");
    let skill_ref = json!([{"id": up["files"][0]["fileId"], "storage_session_id": up["session_id"],
                            "name": "skills/pptx/SKILL.md", "kind": "skill"}]);
    let code = r#"
rm -f skills/pptx/SKILL.md 2>/dev/null; mv skills skills.old 2>/dev/null
mkdir -p skills/pptx 2>/dev/null; echo INJECTED > skills/pptx/SKILL.md 2>/dev/null
cat skills/pptx/SKILL.md
"#;
    let (status, resp) = broker
        .exec(json!({"lang": "bash", "code": code, "files": skill_ref}))
        .await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(stdout(&resp), SKILL, "{resp}");
}
