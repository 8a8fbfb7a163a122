//! Python state across sandboxes, against Docker and the real image: a session's variables
//! survive the removal of its container (idle TTL, single-use TTL, eviction under the live
//! cap), what cannot be pickled is named in the next exec's stderr, the saved state is the session's
//! alone and never in its workspace, the size bound leaves names out without breaking the
//! next exec, a damaged state is refused, and the setting turns it all off. Runs with either
//! file path (`CODEBROKER_FILE_TRANSFER`): the state always moves through the runner.
//!
//! `cargo test -p codebroker --test python_state -- --ignored --nocapture` measures the save
//! and restore of a 100 MB DataFrame (docs/PERFORMANCE.md).

mod common;

use codebroker::config::{AuthMode, Config};
use common::{session, stderr, stdout, TestBroker};
use serde_json::{json, Value};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// A broker that removes a session's container one second after its last exec.
async fn idle_broker(tag: &str, adjust: impl FnOnce(&mut Config)) -> TestBroker {
    TestBroker::start_with(tag, |c| {
        c.lifecycle.idle_ttl_secs = 1;
        c.lifecycle.reap_interval_secs = 1;
        adjust(c);
    })
    .await
}

fn session_root(broker: &TestBroker, session: &str) -> PathBuf {
    broker.data.join("sessions").join(session)
}

/// Waits until the session's state (or its note) is on disk, which is saved just before
/// its container goes. (With a pool, the instance's containers are never all gone, and a
/// pooled container a session took carries the pool's label.)
async fn wait_for_removal(broker: &TestBroker, session: &str) {
    let meta = session_root(broker, session).join("python-state.json");
    let label = format!("codebroker.session={session}");
    let deadline = Instant::now() + Duration::from_secs(90);
    while !(meta.exists() && common::containers_matching(&broker.instance, &[&label]).is_empty()) {
        assert!(
            Instant::now() < deadline,
            "the idle container was not removed with its state saved"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

const DATA_STACK: &str = r#"
import numpy as np, pandas as pd
from sklearn.linear_model import LinearRegression
df = pd.DataFrame({"city": ["a", "b", "c"], "sales": [10.5, 20.25, 30.0]})
model = LinearRegression().fit(np.arange(10).reshape(-1, 1), np.arange(10) * 3.0)
arrays = {"ones": np.ones((3, 4)), "range": np.arange(5)}
class Account:
    def __init__(self, owner, balance):
        self.owner, self.balance = owner, balance
    def deposit(self, amount):
        self.balance += amount
        return self.balance
acct = Account("ada", 100)
log = open("log.txt", "w")
numbers = (n for n in range(3))
import threading
worker = threading.Thread(target=print)
print("ready")
"#;

const CHECK: &str = "print(df['sales'].sum(), round(float(model.predict([[20]])[0]), 6), \
                     arrays['ones'].shape, int(arrays['range'].sum()), acct.deposit(5), \
                     isinstance(acct, Account), type(df).__name__)";

#[tokio::test]
async fn a_dataframe_a_model_arrays_and_an_object_survive_an_idle_removal() {
    // A pooled container takes the session over: the state goes into a kernel that may be
    // preloading.
    let broker = idle_broker("state-idle", |c| c.pool.pool_size = 1).await;
    let first = broker.run("py", DATA_STACK, None).await;
    assert_eq!(stdout(&first), "ready\n", "{first}");
    let s = session(&first);
    wait_for_removal(&broker, &s).await;

    // The state is the broker's, beside the session's metadata, never in its workspace.
    let root = session_root(&broker, &s);
    for name in ["python-state.bin", "python-state.json"] {
        let meta = std::fs::metadata(root.join(name)).expect(name);
        assert_eq!(meta.mode() & 0o777, 0o600, "{name}");
    }
    assert_eq!(
        std::fs::metadata(&root).expect("root").mode() & 0o777,
        0o700
    );
    let saved: Value =
        serde_json::from_slice(&std::fs::read(root.join("python-state.json")).expect("read"))
            .expect("json");
    assert!(saved["bytes"].as_u64().unwrap_or(0) > 0, "{saved}");

    let next = broker.run("py", CHECK, Some(&s)).await;
    assert_eq!(
        stdout(&next),
        "60.75 60.0 (3, 4) 10 105 True DataFrame\n",
        "{next}"
    );
    assert_eq!(next["runtime_status"], "reused", "{next}");
    let err = stderr(&next);
    for left_out in [
        "log (an open file)",
        "numbers (a generator)",
        "worker (a thread)",
    ] {
        assert!(err.contains(left_out), "{left_out} not named: {err}");
    }
    // Used once: the next exec of the same container says nothing more, and the state
    // files are gone.
    assert!(!root.join("python-state.bin").exists());
    let again = broker.run("py", "print(acct.balance)", Some(&s)).await;
    assert_eq!(stdout(&again), "105\n", "{again}");
    assert_eq!(stderr(&again), "", "{again}");
    // Nothing of it reached the session's files.
    let files = broker.get(&format!("/files/{s}")).await;
    let listed = files.text().await.unwrap_or_default();
    assert!(!listed.contains("python-state"), "{listed}");
}

#[tokio::test]
async fn a_session_used_once_keeps_its_variables_past_the_single_use_ttl() {
    // The idle TTL is far away: only the single-use rule removes this container.
    let broker = TestBroker::start_with("state-single", |c| {
        c.lifecycle.idle_ttl_secs = 600;
        c.lifecycle.single_use_ttl_secs = 1;
        c.lifecycle.reap_interval_secs = 1;
    })
    .await;
    let once = broker
        .run(
            "py",
            "import pandas as pd\nframe = pd.DataFrame({'n': [1, 2, 3]})",
            None,
        )
        .await;
    assert_eq!(once["exit_code"], 0, "{once}");
    let s = session(&once);
    wait_for_removal(&broker, &s).await;
    let back = broker
        .run("py", "print(int(frame['n'].sum()), pd.__name__)", Some(&s))
        .await;
    assert_eq!(stdout(&back), "6 pandas\n", "{back}");
    assert_eq!(back["runtime_status"], "reused", "{back}");
}

#[tokio::test]
async fn a_session_evicted_under_the_live_cap_gets_its_variables_back() {
    let broker = TestBroker::start_with("state-cap", |c| c.caps.max_live_sandboxes = 1).await;
    let a = broker
        .run("py", "total = 41\nitems = ['x'] * 3", None)
        .await;
    let sa = session(&a);
    // A second session takes the only place: the first's container goes, saved first.
    let b = broker.run("py", "other = 1", None).await;
    assert_ne!(session(&b), sa);
    let back = broker
        .run("py", "print(total + 1, len(items))", Some(&sa))
        .await;
    assert_eq!(stdout(&back), "42 3\n", "{back}");
    assert_eq!(back["runtime_status"], "reused", "{back}");
}

#[tokio::test]
async fn another_user_cannot_reach_a_saved_state() {
    let broker = idle_broker("state-users", |c| {
        c.access.auth = AuthMode::Key;
        c.access.api_key = vec!["state-key".into()];
    })
    .await;
    let as_user = |user: &'static str| {
        vec![
            ("x-api-key", "state-key".to_string()),
            ("user-id", user.to_string()),
        ]
    };
    let exec = |user: &'static str, body: Value| {
        let headers = as_user(user);
        let broker = &broker;
        async move {
            let refs: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
            broker.exec_with(&refs, body).await
        }
    };
    let (status, first) = exec(
        "alice",
        json!({"lang": "py", "code": "secret = 'alice-only-7f3a'"}),
    )
    .await;
    assert_eq!(status, 200, "{first}");
    let s = session(&first);
    wait_for_removal(&broker, &s).await;

    // Bob naming Alice's session gets one of his own, empty; so do his other sessions.
    let (status, elsewhere) = exec(
        "bob",
        json!({"lang": "py", "code": "print('secret' in globals())", "session_id": s}),
    )
    .await;
    assert_eq!(
        (status, stdout(&elsewhere)),
        (200, "False\n"),
        "{elsewhere}"
    );
    assert_ne!(session(&elsewhere), s);
    assert_eq!(elsewhere["runtime_status"], "new");
    assert!(session_root(&broker, &s).join("python-state.bin").exists());
    let (status, own) = exec(
        "bob",
        json!({"lang": "py", "code": "print('secret' in globals())"}),
    )
    .await;
    assert_eq!((status, stdout(&own)), (200, "False\n"), "{own}");
    assert_eq!(own["runtime_status"], "new");
    // Bob's attempt used nothing up: Alice still gets it.
    let (status, back) = exec(
        "alice",
        json!({"lang": "py", "code": "print(secret)", "session_id": s}),
    )
    .await;
    assert_eq!(
        (status, stdout(&back)),
        (200, "alice-only-7f3a\n"),
        "{back}"
    );
    assert_eq!(back["runtime_status"], "reused");
}

#[tokio::test]
async fn names_over_the_size_bound_are_left_out_and_the_next_exec_still_works() {
    let broker = idle_broker("state-bound", |c| c.state.state_max_bytes = 1 << 20).await;
    let first = broker
        .run(
            "py",
            "import numpy as np\nbig = np.zeros(2_000_000)\nsmall = [1, 2, 3]",
            None,
        )
        .await;
    let s = session(&first);
    wait_for_removal(&broker, &s).await;
    let bin = session_root(&broker, &s).join("python-state.bin");
    assert!(std::fs::metadata(&bin).expect("saved").len() <= 1 << 20);
    let next = broker
        .run(
            "py",
            "print(sum(small), 'big' in globals(), np.pi > 3)",
            Some(&s),
        )
        .await;
    assert_eq!(stdout(&next), "6 False True\n", "{next}");
    assert!(
        stderr(&next).contains("big (too large: the saved state may hold"),
        "{next}"
    );
    let after = broker.run("py", "big = 1\nprint(big)", Some(&s)).await;
    assert_eq!(stdout(&after), "1\n", "{after}");
}

#[tokio::test]
async fn a_saved_state_gets_only_the_room_the_storage_budget_leaves() {
    // 2 MiB a session, of which its file takes 1.5 MiB: the state gets what is left.
    let broker = idle_broker("state-budget", |c| c.caps.session_storage = 2 << 20).await;
    let first = broker
        .run(
            "py",
            "import numpy as np\nopen('/mnt/data/data.bin', 'wb').write(b'x' * (3 << 19))\n\
             big = np.zeros(200_000)\nsmall = [1, 2, 3]",
            None,
        )
        .await;
    assert_eq!(first["files"].as_array().map(Vec::len), Some(1), "{first}");
    let s = session(&first);
    wait_for_removal(&broker, &s).await;
    let bin = session_root(&broker, &s).join("python-state.bin");
    assert!(std::fs::metadata(&bin).expect("saved").len() <= 1 << 19);
    let next = broker
        .run("py", "print(sum(small), 'big' in globals())", Some(&s))
        .await;
    assert_eq!(stdout(&next), "6 False\n", "{next}");
    assert_eq!(next["runtime_status"], "reused", "{next}");
    assert!(stderr(&next).contains("big (too large"), "{next}");
}

#[tokio::test]
async fn a_state_changed_on_disk_is_refused_and_the_exec_starts_fresh() {
    let broker = idle_broker("state-damaged", |_| {}).await;
    let first = broker.run("py", "x = 'before'", None).await;
    let s = session(&first);
    wait_for_removal(&broker, &s).await;
    let bin = session_root(&broker, &s).join("python-state.bin");
    let mut bytes = std::fs::read(&bin).expect("saved");
    let n = bytes.len();
    bytes[n / 2] ^= 0xff;
    std::fs::write(&bin, bytes).expect("spoil");
    let next = broker.run("py", "print('x' in globals())", Some(&s)).await;
    assert_eq!(stdout(&next), "False\n", "{next}");
    assert_eq!(next["runtime_status"], "new", "{next}");
    assert!(
        stderr(&next).contains("could not be restored in its new sandbox (it changed on disk"),
        "{next}"
    );
    assert!(!bin.exists(), "a refused state is dropped");
}

#[tokio::test]
async fn a_kernel_that_holds_nothing_leaves_no_state_and_other_languages_wait_for_theirs() {
    let broker = idle_broker("state-languages", |_| {}).await;
    // A bash-only session: its container goes with nothing to save.
    let bash = broker.run("bash", "echo hi", None).await;
    let sb = session(&bash);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !broker.containers().is_empty() {
        assert!(Instant::now() < deadline, "not removed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(!session_root(&broker, &sb)
        .join("python-state.json")
        .exists());
    // A Python session whose next exec is bash: the state waits for its next Python exec,
    // and the bash container's removal (nothing in its kernel) does not drop it.
    let py = broker.run("py", "kept = 'yes'", None).await;
    let sp = session(&py);
    wait_for_removal(&broker, &sp).await;
    let between = broker.run("bash", "echo between", Some(&sp)).await;
    assert_eq!(stdout(&between), "between\n");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !broker.containers().is_empty() {
        assert!(Instant::now() < deadline, "not removed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let back = broker.run("py", "print(kept)", Some(&sp)).await;
    assert_eq!(stdout(&back), "yes\n", "{back}");
    assert_eq!(back["runtime_status"], "reused");
}

#[tokio::test]
async fn with_the_setting_off_nothing_is_saved() {
    let broker = idle_broker("state-off", |c| c.state.persist_state = false).await;
    let first = broker.run("py", "x = 1", None).await;
    let s = session(&first);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !broker.containers().is_empty() {
        assert!(Instant::now() < deadline, "not removed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(!session_root(&broker, &s).join("python-state.json").exists());
    let next = broker.run("py", "print('x' in globals())", Some(&s)).await;
    assert_eq!(stdout(&next), "False\n", "{next}");
    assert_eq!(next["runtime_status"], "new");
    assert_eq!(stderr(&next), "", "{next}");
}

/// Save and restore of a 100 MB DataFrame, printed (docs/PERFORMANCE.md).
#[tokio::test]
#[ignore]
async fn measure_a_100_mb_dataframe() {
    let broker = idle_broker("state-measure", |c| {
        c.lifecycle.idle_ttl_secs = 2;
        c.sandbox.memory_mb = 2048;
    })
    .await;
    // 12.5 M float64 in one column and 1.25 M in each of... 100 MB of numbers in all.
    let make = "import numpy as np, pandas as pd\n\
                df = pd.DataFrame(np.random.default_rng(1).random((1_250_000, 10)), \
                columns=[f'c{i}' for i in range(10)])\n\
                print(df.memory_usage(index=False).sum())";
    let first = broker.run("py", make, None).await;
    let s = session(&first);
    println!("DataFrame bytes: {}", stdout(&first).trim());
    wait_for_removal(&broker, &s).await;
    let root = session_root(&broker, &s);
    let saved: Value =
        serde_json::from_slice(&std::fs::read(root.join("python-state.json")).expect("read"))
            .expect("json");
    println!(
        "save: {} ms in all, of which {} ms pickling in the sandbox; {} bytes on disk",
        saved["duration_ms"], saved["pickle_ms"], saved["bytes"]
    );
    let check = "print(df.shape, round(float(df['c0'].sum())))";
    let started = Instant::now();
    let restored = broker.run("py", check, Some(&s)).await;
    let restored_ms = started.elapsed().as_millis();
    assert_eq!(restored["runtime_status"], "reused", "{restored}");
    let started = Instant::now();
    let warm = broker.run("py", check, Some(&s)).await;
    let warm_ms = started.elapsed().as_millis();
    assert_eq!(stdout(&warm), stdout(&restored));
    println!(
        "first exec after the removal (new container, restore, exec): {restored_ms} ms; \
         the same exec warm: {warm_ms} ms"
    );
}

#[tokio::test]
async fn a_hostile_pickle_runs_only_in_the_sessions_own_sandbox() {
    let broker = idle_broker("state-hostile", |_| {}).await;
    // What the pickle runs when loaded: a line in the workspace, and a file at a path that
    // exists on the host too. Loaded by the broker, the host file would appear.
    let marker = std::env::temp_dir().join(format!("cb-state-marker-{}", std::process::id()));
    let _ = std::fs::remove_file(&marker);
    let code = format!(
        "import os\n\
         class Trap:\n\
         \x20   def __reduce__(self):\n\
         \x20       return (os.system, ('echo loaded > /mnt/data/trap.txt; touch {}',))\n\
         trap = Trap()",
        marker.display()
    );
    let first = broker.run("py", &code, None).await;
    let s = session(&first);
    wait_for_removal(&broker, &s).await;
    assert!(!marker.exists(), "the save ran the pickle on the host");
    let next = broker
        .run(
            "py",
            "print(open('trap.txt').read().strip(), trap)",
            Some(&s),
        )
        .await;
    assert_eq!(stdout(&next), "loaded 0\n", "{next}");
    assert!(!marker.exists(), "the broker loaded the pickle");
}
