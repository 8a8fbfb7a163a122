//! One uid per sandbox: code that escapes its container runs as a uid no other live
//! sandbox has, so it can neither signal nor read another session's processes, nor reach
//! another session's workspace, and it shares no per-uid kernel limit with them. A
//! session's files stay its own when its next sandbox runs as another uid.

mod common;

use codebroker::config::Config;
use common::{inspect, session, stdout, TestBroker};
use reqwest::multipart::{Form, Part};
use serde_json::{json, Value};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The uid and gid the sandbox of an answer ran as, from `id -u; id -g` as its first lines.
fn ids(resp: &Value) -> (u32, u32) {
    let mut lines = stdout(resp).lines();
    let mut next = || {
        lines
            .next()
            .and_then(|l| l.trim().parse().ok())
            .unwrap_or_else(|| panic!("no id in {resp}"))
    };
    (next(), next())
}

/// The session's files directory on the host (what its sandbox mounts).
fn files_dir(broker: &TestBroker, session: &str) -> PathBuf {
    broker.data.join("sessions").join(session).join("files")
}

/// Whether `argv` succeeds when run from the host as `uid`:`uid` with no other group and
/// no capability: what code escaping a sandbox of that uid could do.
fn as_uid(uid: u32, argv: &[&str]) -> bool {
    Command::new("setpriv")
        .arg(format!("--reuid={uid}"))
        .arg(format!("--regid={uid}"))
        .args(["--clear-groups", "--"])
        .args(argv)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("setpriv")
        .success()
}

/// The host pid of a container's init (its runner).
fn init_pid(container: &str) -> String {
    inspect(container)["State"]["Pid"].to_string()
}

/// Waits until the session has no container (its idle sandbox was removed).
async fn wait_until_gone(broker: &TestBroker, session: &str) {
    let label = format!("codebroker.session={session}");
    let deadline = Instant::now() + Duration::from_secs(90);
    while !common::containers_matching(&broker.instance, &[&label]).is_empty() {
        assert!(
            Instant::now() < deadline,
            "the idle container of {session} was not removed"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn two_live_sandboxes_run_as_different_uids_and_cannot_reach_each_other() {
    let broker = TestBroker::start("uid-two").await;
    let code = "id -u; id -g; echo mine > a.txt; mkdir -p d && echo deep > d/b.txt";
    let a = broker.run("bash", code, None).await;
    let b = broker.run("bash", code, None).await;
    let (sa, sb) = (session(&a), session(&b));
    let (uid_a, gid_a) = ids(&a);
    let (uid_b, gid_b) = ids(&b);
    assert_ne!(uid_a, uid_b, "two live sandboxes share a uid: {a} {b}");
    assert_eq!(
        (gid_a, gid_b),
        (uid_a, uid_b),
        "each sandbox's gid is its uid"
    );
    let ca = common::docker::container_of(&broker.instance, &sa);
    let cb = common::docker::container_of(&broker.instance, &sb);
    assert_eq!(
        inspect(&ca)["Config"]["User"],
        format!("{uid_a}:{uid_a}").as_str()
    );
    assert_eq!(
        inspect(&cb)["Config"]["User"],
        format!("{uid_b}:{uid_b}").as_str()
    );

    // Each workspace: the broker's, group of its own sandbox only, nothing for others;
    // the code's files are its sandbox's uid's.
    for (s, uid) in [(&sa, uid_a), (&sb, uid_b)] {
        let dir = files_dir(&broker, s);
        let meta = std::fs::metadata(&dir).expect("files dir");
        assert_eq!(
            (meta.uid(), meta.gid(), meta.mode() & 0o7777),
            (0, uid, 0o1770),
            "{}",
            dir.display()
        );
        for name in ["a.txt", "d", "d/b.txt"] {
            let meta = std::fs::symlink_metadata(dir.join(name)).expect("file");
            assert_eq!((meta.uid(), meta.gid()), (uid, uid), "{name} of {s}");
        }
    }

    // From the host, as B's uid (code that escaped B): A's processes can be neither
    // signalled nor looked into, A's workspace not listed through /proc. As A's own uid
    // the signal goes through, so the check can fail.
    let pid_a = init_pid(&ca);
    assert!(
        as_uid(uid_a, &["kill", "-0", &pid_a]),
        "the check cannot pass"
    );
    assert!(
        !as_uid(uid_b, &["kill", "-0", &pid_a]),
        "B's uid may signal A's runner"
    );
    let environ = format!("/proc/{pid_a}/environ");
    assert!(
        !as_uid(uid_b, &["cat", &environ]),
        "B's uid reads A's environ"
    );
    let root = format!("/proc/{pid_a}/root/mnt/data");
    assert!(
        !as_uid(uid_b, &["ls", &root]),
        "B's uid lists A's workspace"
    );
}

#[tokio::test]
async fn files_and_python_state_survive_a_new_sandbox_under_another_uid() {
    let broker = TestBroker::start_with("uid-again", |c| {
        c.lifecycle.idle_ttl_secs = 1;
        c.lifecycle.reap_interval_secs = 1;
    })
    .await;
    let first = broker
        .run(
            "py",
            "import os\nprint(os.getuid()); print(os.getgid())\nx = 41\n\
             open('keep.txt', 'w').write('kept')\nos.makedirs('d/e', exist_ok=True)\n\
             open('d/e/deep.txt', 'w').write('deep')\nos.chmod('d/e/deep.txt', 0o600)\n\
             os.symlink('keep.txt', 'link')",
            None,
        )
        .await;
    let s = session(&first);
    let (old_uid, _) = ids(&first);
    wait_until_gone(&broker, &s).await;
    // Another session takes a uid meanwhile, so the session's next sandbox cannot be
    // handed its old uid by chance.
    let other = broker.run("bash", "id -u; id -g", None).await;
    assert_ne!(ids(&other).0, old_uid, "{other}");

    let next = broker
        .run(
            "py",
            "import os\nprint(os.getuid()); print(os.getgid())\n\
             open('keep.txt', 'a').write('+more')\nopen('d/e/deep.txt', 'w').write('new')\n\
             os.mkdir('d/e/f')\nprint(open('keep.txt').read(), open('d/e/deep.txt').read(), \
             os.stat('keep.txt').st_uid == os.getuid(), x + 1)",
            Some(&s),
        )
        .await;
    let (new_uid, new_gid) = ids(&next);
    assert_ne!(new_uid, old_uid, "the new sandbox got the old uid: {next}");
    assert_eq!(new_gid, new_uid);
    assert_eq!(
        stdout(&next).lines().nth(2),
        Some("kept+more new True 42"),
        "{next}"
    );
    let dir = files_dir(&broker, &s);
    assert_eq!(std::fs::metadata(&dir).expect("files").gid(), new_uid);
    for name in ["keep.txt", "d", "d/e", "d/e/deep.txt", "d/e/f", "link"] {
        let meta = std::fs::symlink_metadata(dir.join(name)).expect("file");
        assert_eq!((meta.uid(), meta.gid()), (new_uid, new_uid), "{name}");
    }
}

#[tokio::test]
async fn read_only_uploads_stay_the_brokers_when_the_next_sandbox_is_handed_the_workspace() {
    let broker = TestBroker::start_with("uid-skill", |c| {
        c.lifecycle.idle_ttl_secs = 1;
        c.lifecycle.reap_interval_secs = 1;
    })
    .await;
    let form = Form::new()
        .part(
            "file",
            Part::bytes(b"# skill\n".to_vec()).file_name("skills/pptx/SKILL.md"),
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
    let shared = up["session_id"].as_str().expect("session").to_string();
    let file_id = up["files"][0]["fileId"].as_str().expect("fileId");
    let skill_ref = json!([{"id": file_id, "storage_session_id": shared,
                            "name": "skills/pptx/SKILL.md", "kind": "skill"}]);
    let attack = "id -u; id -g; \
        echo x >> skills/pptx/SKILL.md 2>/dev/null && echo APPENDED; \
        rm -f skills/pptx/SKILL.md 2>/dev/null; mv skills/pptx skills/x 2>/dev/null && echo MOVED; \
        cat skills/pptx/SKILL.md; echo mine >> notes.txt && cat notes.txt";
    let (status, first) = broker
        .exec(json!({"lang": "bash", "code": attack, "files": skill_ref}))
        .await;
    assert_eq!(status, 200, "{first}");
    let s = session(&first);
    let (old_uid, _) = ids(&first);
    assert_eq!(
        stdout(&first).lines().skip(2).collect::<Vec<_>>(),
        ["# skill", "mine"],
        "{first}"
    );
    wait_until_gone(&broker, &s).await;
    // The session's next sandbox, as another uid, is handed the code's file, not the skill.
    let next = broker.run("bash", attack, Some(&s)).await;
    let (new_uid, _) = ids(&next);
    assert_ne!(new_uid, old_uid, "{next}");
    assert_eq!(
        stdout(&next).lines().skip(2).collect::<Vec<_>>(),
        ["# skill", "mine", "mine"],
        "{next}"
    );
    let files = files_dir(&broker, &s);
    let meta = std::fs::metadata(files.join("skills/pptx/SKILL.md")).expect("skill");
    assert_eq!((meta.uid(), meta.mode() & 0o777), (0, 0o444));
    let meta = std::fs::metadata(files.join("skills/pptx")).expect("dir");
    assert_eq!(
        (meta.uid(), meta.gid(), meta.mode() & 0o7777),
        (0, new_uid, 0o1770)
    );
    assert_eq!(
        std::fs::metadata(files.join("notes.txt"))
            .expect("notes")
            .uid(),
        new_uid
    );
}

#[tokio::test]
async fn an_uploaded_file_is_the_pooled_sandboxs_that_takes_the_session() {
    let broker = TestBroker::start_with("uid-pool", |c| {
        c.pool.pool_size = 1;
        c.pool.pool_max = 1;
    })
    .await;
    broker.wait_for_pool(1).await;
    let pooled = broker.containers();
    assert_eq!(pooled.len(), 1, "{pooled:?}");
    let pooled_user = inspect(&pooled[0])["Config"]["User"].clone();
    let form = Form::new().part("file", Part::bytes(b"4,5\n".to_vec()).file_name("in.csv"));
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
    let s = up["session_id"].as_str().expect("session").to_string();
    let resp = broker
        .run(
            "bash",
            "id -u; id -g; echo 6 >> in.csv && cat in.csv && stat -c %u in.csv",
            Some(&s),
        )
        .await;
    let (uid, _) = ids(&resp);
    assert_eq!(pooled_user, format!("{uid}:{uid}").as_str(), "{resp}");
    assert!(
        broker.containers().contains(&pooled[0]),
        "not the pooled one"
    );
    assert_eq!(
        stdout(&resp).lines().skip(2).collect::<Vec<_>>(),
        ["4,5", "6", uid.to_string().as_str()],
        "{resp}"
    );
    let instance = broker.instance.clone();
    let _data = broker.stop().await;
    common::remove_containers_of(&instance);
}

#[tokio::test]
async fn a_restarted_broker_keeps_each_sandboxs_uid_and_hands_out_others() {
    let first = TestBroker::start("uid-restart").await;
    let a = first.run("bash", "id -u; id -g", None).await;
    let sa = session(&a);
    let (uid_a, _) = ids(&a);
    let instance = first.instance.clone();
    let data = first.data.clone();
    let tmp = first.stop().await;

    let mut config = Config::for_tests(data, &instance);
    config.pool.pool_size = 0;
    let second = TestBroker::serve(config).await;
    let b = second.run("bash", "id -u; id -g", None).await;
    assert_ne!(
        ids(&b).0,
        uid_a,
        "a restarted broker handed out a live uid: {b}"
    );
    let again = second.run("bash", "id -u; id -g", Some(&sa)).await;
    assert_eq!(session(&again), sa, "{again}");
    assert_eq!(ids(&again).0, uid_a, "{again}");
    drop(second);
    drop(tmp);
}

#[tokio::test]
async fn when_every_uid_is_taken_a_new_sandbox_is_refused_clearly_and_later_served() {
    // Two uids for sandboxes (the first of the range is given to none).
    let broker = TestBroker::start_with("uid-out", |c| {
        c.sandbox.sandbox_uids = "300000-300002".parse().expect("range");
        c.lifecycle.idle_ttl_secs = 15;
        c.lifecycle.reap_interval_secs = 1;
    })
    .await;
    let a = broker.run("bash", "id -u; id -g", None).await;
    let b = broker.run("bash", "id -u; id -g", None).await;
    let mut uids = [ids(&a).0, ids(&b).0];
    uids.sort();
    assert_eq!(uids, [300001, 300002], "{a} {b}");
    let (status, refused) = broker.exec(json!({"lang": "bash", "code": "id -u"})).await;
    assert_eq!(status, 503, "{refused}");
    assert!(
        refused.to_string().contains("CODEBROKER_SANDBOX_UIDS"),
        "{refused}"
    );
    // The live sessions are untouched.
    let again = broker.run("bash", "id -u; id -g", Some(&session(&a))).await;
    assert_eq!(session(&again), session(&a), "{again}");
    assert_eq!(ids(&again), ids(&a), "{again}");
    // Once an idle sandbox is gone, its uid serves a new session.
    wait_until_gone(&broker, &session(&b)).await;
    let c = broker.run("bash", "id -u; id -g", None).await;
    assert!([300001, 300002].contains(&ids(&c).0), "{c}");
}

#[tokio::test]
async fn one_configured_uid_runs_every_sandbox() {
    let broker = TestBroker::start_with("uid-one", |c| c.sandbox.sandbox_uid = Some(10001)).await;
    let a = broker.run("bash", "id -u; id -g", None).await;
    let b = broker.run("bash", "id -u; id -g", None).await;
    assert_eq!(ids(&a), (10001, 10001), "{a}");
    assert_eq!(ids(&b), (10001, 10001), "{b}");
}

#[tokio::test]
async fn a_sandbox_uid_has_a_name_so_programs_that_look_it_up_still_run() {
    let broker = TestBroker::start("uid-name").await;
    let resp = broker
        .run(
            "bash",
            "id -u; id -g; whoami; id -gn; getent passwd \"$(id -u)\" | cut -d: -f6; \
             echo hello > a.txt && soffice --headless --convert-to pdf --outdir /tmp a.txt \
             >/dev/null 2>&1; test -s /tmp/a.pdf && echo converted",
            None,
        )
        .await;
    let (uid, _) = ids(&resp);
    assert!((200_001..=265_535).contains(&uid), "{resp}");
    assert_eq!(
        stdout(&resp).lines().skip(2).collect::<Vec<_>>(),
        ["sandbox", "sandbox", "/mnt/data", "converted"],
        "{resp}"
    );
}

/// Python that opens inotify instances until the kernel refuses one (at most `n`), keeps
/// them in the kernel's globals, and prints how many it holds.
fn inotify_hog(n: usize) -> String {
    format!(
        "import ctypes\nlibc = ctypes.CDLL(None)\nheld = globals().setdefault('held', [])\n\
         for _ in range({n}):\n    fd = libc.inotify_init()\n    if fd < 0:\n        break\n    held.append(fd)\n\
         print(len(held))"
    )
}

#[tokio::test]
async fn a_sandbox_that_uses_up_a_per_uid_kernel_limit_leaves_the_others_theirs() {
    // fs.inotify.max_user_instances (128 by default) counts per uid, host-wide.
    let limit: usize = std::fs::read_to_string("/proc/sys/fs/inotify/max_user_instances")
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(128);
    let broker = TestBroker::start("uid-inotify").await;
    let hog = broker.run("py", &inotify_hog(limit + 10), None).await;
    let held: usize = stdout(&hog).trim().parse().expect("count");
    assert!(held <= limit, "{hog}");
    // The hog's uid has none left (so the limit was reached), and keeps them.
    let more = broker
        .run("py", &inotify_hog(1), Some(&session(&hog)))
        .await;
    assert_eq!(stdout(&more).trim(), held.to_string(), "{more}");
    // Another session's sandbox still gets its own.
    let other = broker.run("py", &inotify_hog(4), None).await;
    assert_eq!(stdout(&other).trim(), "4", "{other}");
}
