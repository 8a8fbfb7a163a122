//! Package installs through the egress proxy, against real registries on loopback
//! (pypiserver, verdaccio, an HTTPS server with a test CA), real pip and npm in the real
//! sandbox image, and the attacks SECURITY.md lists for the path. The sandbox keeps
//! `NetworkMode=none` throughout: every byte goes through the runner's forwarder and the
//! broker's proxy.

mod common;

use common::registries::{self, Server};
use common::*;
use serde_json::{json, Value};
use std::path::Path;

/// The registries of one test, on loopback, with their names as the sandbox uses them.
struct Registries {
    /// Wheels and verdaccio's storage.
    _home: tempfile::TempDir,
    pypi: Server,
    npm: Server,
    tls: Server,
    /// The test CA's certificate, which the sandbox's client is given.
    ca: String,
}

async fn registries() -> Registries {
    let home = tempfile::tempdir().expect("tempdir");
    let wheels = home.path().join("wheels");
    std::fs::create_dir_all(&wheels).expect("wheels");
    registries::build_wheel(&wheels, "cbdemo", "1.0", "installed through the proxy", 0);
    // The size the issue measures an install at.
    registries::build_wheel(&wheels, "cbbig", "1.0", "ten MiB", 10 << 20);
    let pypi = registries::pypiserver(&wheels);
    let npm_home = home.path().join("verdaccio");
    std::fs::create_dir_all(&npm_home).expect("verdaccio home");
    let npm = registries::verdaccio(&npm_home);
    registries::publish_npm(&npm_home, npm.port, "cbdemo-npm", "from verdaccio").await;
    let tls_home = home.path().join("tls");
    std::fs::create_dir_all(&tls_home).expect("tls home");
    let (tls, ca) = registries::tls_server(&tls_home, "tls.test", "hello over tls");
    Registries {
        _home: home,
        pypi,
        npm,
        tls,
        ca,
    }
}

impl Registries {
    /// CODEBROKER_EGRESS: the three servers by name, `localhost` (which resolves to
    /// loopback and must stay refused), and the broker's port by name and by address.
    fn egress(&self) -> String {
        format!(
            "pypi.test:{},npm.test:{},tls.test:{},localhost,broker.test:{BROKER_PORT_MARK},127.0.0.1:{BROKER_PORT_MARK}",
            self.pypi.port, self.npm.port, self.tls.port
        )
    }
}

/// Stands for the broker's port in the allowlist until it is known (the broker binds
/// port 0; the test rewrites the list once it listens).
const BROKER_PORT_MARK: &str = "1";

fn egress_config(c: &mut codebroker::config::Config, regs: &Registries) {
    c.egress.egress = regs.egress();
    c.egress.egress_resolve =
        "pypi.test=127.0.0.1,npm.test=127.0.0.1,tls.test=127.0.0.1,broker.test=127.0.0.1".into();
    c.egress.pip_index_url = format!("http://pypi.test:{}/simple/", regs.pypi.port);
    c.egress.npm_registry = format!("http://npm.test:{}/", regs.npm.port);
    c.audit_log = c.data_dir.join("audit.jsonl").display().to_string();
}

/// A broker with egress on. `CODEBROKER_EGRESS_TRANSPORT=runner` in the test's environment
/// tunnels it over the runner channel (`make test-runner-files`); on the Kubernetes backend
/// (`make test-k8s`) that is the transport anyway.
async fn egress_broker(
    tag: &str,
    adjust: impl FnOnce(&mut codebroker::config::Config),
) -> TestBroker {
    TestBroker::start_with(tag, |config| {
        config.egress.egress_transport = transport_from_env();
        adjust(config)
    })
    .await
}

/// The egress transport the test's environment asks for, if any.
fn transport_from_env() -> Option<codebroker::config::EgressTransport> {
    match std::env::var("CODEBROKER_EGRESS_TRANSPORT").as_deref() {
        Ok("runner") => Some(codebroker::config::EgressTransport::Runner),
        Ok("socket") => Some(codebroker::config::EgressTransport::Socket),
        _ => None,
    }
}

/// Python that asks the sandbox's proxy to CONNECT to each target and prints each status
/// line (what a client of the proxy reads).
fn connect_probe(targets: &[String]) -> String {
    format!(
        r#"
import socket
def ask(target):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=20)
    s.sendall(("CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (target, target)).encode())
    data = b""
    while b"\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    s.close()
    return data.split(b"\r\n")[0].decode()
for t in {targets:?}:
    print(t, "->", ask(t))
"#
    )
}

fn pip(args: &str) -> String {
    format!(
        "import subprocess, sys\n\
         r = subprocess.run([sys.executable, '-m', 'pip', {args}], capture_output=True, text=True)\n\
         print('pip exit', r.returncode)\n\
         print(r.stdout[-2000:])\n\
         print(r.stderr[-2000:])\n"
    )
}

fn audit_records(broker: &TestBroker) -> Vec<Value> {
    let text = std::fs::read_to_string(broker.data.join("audit.jsonl")).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|r| r["event"] == "egress")
        .collect()
}

#[tokio::test]
async fn pip_installs_into_the_session_from_an_allowed_index_and_the_kernel_imports_it() {
    let regs = registries().await;
    let broker = egress_broker("egress-pip", |c| egress_config(c, &regs)).await;

    // Installed and imported in one cell, in the same kernel.
    let code = pip("'install', 'cbdemo'") + "import cbdemo\nprint('VALUE', cbdemo.VALUE)\n";
    let first = broker.run("py", &code, None).await;
    let out = stdout(&first);
    assert!(out.contains("pip exit 0"), "{first}");
    assert!(out.contains("VALUE installed through the proxy"), "{first}");
    let session = session(&first);
    // Hidden from the harvest: nothing of the install comes back as a file.
    assert_eq!(first["files"], json!([]), "{first}");

    // `pip install --user` and the next cell see it too.
    let again = broker
        .run(
            "py",
            &(pip("'install', '--user', 'cbdemo'") + "import cbdemo\nprint(cbdemo.VALUE)\n"),
            Some(&session),
        )
        .await;
    assert!(
        stdout(&again).contains("installed through the proxy"),
        "{again}"
    );

    // Also from the shell, and the file listing shows none of it.
    let listed = broker
        .get(&format!("/files/{session}?detail=full"))
        .await
        .text()
        .await
        .expect("listing");
    assert!(
        !listed.contains(".local") && !listed.contains("cbdemo"),
        "{listed}"
    );

    // The container is killed (not removed by the broker); the install stays with the
    // session, in the workspace the container mounted. Not on Kubernetes, where a pod lost
    // that way takes its disk along (installs_survive_the_idle_removal_of_their_sandbox is
    // the orderly removal, which keeps them there too).
    if !docker::kubernetes() {
        let container = docker::container_of(&broker.instance, &session);
        docker::docker(&["rm", "-f", &container]);
        assert_still_installed(&broker, &session).await;
    }

    // The notebook habit a model brings: `!pip install` in a Python cell.
    let notebook = broker
        .run(
            "py",
            "!pip install -q cbdemo\nimport cbdemo\nprint('notebook', cbdemo.VALUE)",
            None,
        )
        .await;
    assert!(
        stdout(&notebook).contains("notebook installed through the proxy"),
        "{notebook}"
    );

    // A new session does not have it.
    let other = broker
        .run(
            "py",
            "try:\n    import cbdemo\n    print('present')\nexcept ImportError:\n    print('absent')",
            None,
        )
        .await;
    assert_eq!(stdout(&other).trim(), "absent", "{other}");

    // Every connection is in the audit log with where it went and what it moved.
    let records = audit_records(&broker);
    let allowed: Vec<&Value> = records
        .iter()
        .filter(|r| r["verdict"] == "allowed" && r["host"] == "pypi.test")
        .collect();
    assert!(!allowed.is_empty(), "{records:?}");
    assert!(allowed
        .iter()
        .all(|r| r["session"] == json!(session) || r["session"].is_string()));
    assert!(
        allowed
            .iter()
            .any(|r| r["bytes_down"].as_u64().unwrap_or(0) > 0),
        "{allowed:?}"
    );
    let metrics = broker.get("/metrics").await.text().await.expect("metrics");
    assert!(
        metrics.contains("codebroker_egress_connections_total{verdict=\"allowed\",reason=\"\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains("codebroker_egress_bytes_total{direction=\"down\"}"),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_ten_mib_wheel_installs_and_counts_against_the_quota() {
    let regs = registries().await;
    let broker = egress_broker("egress-big", |c| {
        egress_config(c, &regs);
        c.sandbox.workspace_quota = 64 << 20;
    })
    .await;
    let started = std::time::Instant::now();
    let first = broker
        .run(
            "py",
            &("import time\nt0 = time.perf_counter()\n".to_string()
                + &pip("'install', 'cbbig'")
                + "print('pip took', round(time.perf_counter() - t0, 2))\n"
                + "import cbbig, os\nprint(cbbig.VALUE, os.path.getsize(os.path.join(os.path.dirname(cbbig.__file__), 'payload.bin')))\n"),
            None,
        )
        .await;
    let took = started.elapsed();
    assert!(
        stdout(&first).contains(&format!("ten MiB {}", 10 << 20)),
        "{first}"
    );
    let pip_took = stdout(&first)
        .lines()
        .find(|l| l.starts_with("pip took"))
        .unwrap_or_default()
        .to_string();
    println!("a 10 MiB wheel through the proxy: {pip_took} s in the sandbox, {took:?} with the exec around it");

    // The install is the session's: it counts against its quota. With 16 MiB, the 10 MiB
    // install fits, and 8 MiB more does not.
    let tight = TestBroker::start_with("egress-quota", |c| {
        egress_config(c, &regs);
        c.sandbox.workspace_quota = 16 << 20;
    })
    .await;
    let installed = tight.run("py", &pip("'install', 'cbbig'"), None).await;
    assert!(stdout(&installed).contains("pip exit 0"), "{installed}");
    let s = session(&installed);
    let (status, over) = tight
        .exec(json!({
            "lang": "py",
            "code": "open('fill.bin', 'wb').write(b'x' * (8 << 20))",
            "session_id": s,
        }))
        .await;
    assert_eq!(status, 200, "{over}");
    let limits: Vec<String> = serde_json::from_value(over["limits"].clone()).unwrap_or_default();
    assert!(
        limits.contains(&"Disk quota exceeded".to_string()),
        "{over}"
    );
    // A wheel bigger than the quota cannot even be downloaded (the file size limit is the
    // quota), and pip says so.
    let tiny = TestBroker::start_with("egress-tiny", |c| {
        egress_config(c, &regs);
        c.sandbox.workspace_quota = 4 << 20;
    })
    .await;
    let refused = tiny.run("py", &pip("'install', 'cbbig'"), None).await;
    if docker::kubernetes() {
        // A pod has no file size limit: the runner's quota watch stops the exec instead.
        let limits: Vec<String> =
            serde_json::from_value(refused["limits"].clone()).unwrap_or_default();
        assert!(
            limits.contains(&"Disk quota exceeded".to_string()),
            "{refused}"
        );
    } else {
        assert!(stdout(&refused).contains("pip exit 1"), "{refused}");
        assert!(stdout(&refused).contains("File too large"), "{refused}");
    }
    // The next calls still work.
    let next = tight
        .run("py", "import cbbig\nprint('fine')", Some(&s))
        .await;
    assert_eq!(stdout(&next).trim(), "fine", "{next}");
    let next = tiny
        .run("py", "print('fine')", Some(&session(&refused)))
        .await;
    assert_eq!(stdout(&next).trim(), "fine", "{next}");
}

/// `cbdemo` imports in `session`'s next exec; that exec's answer.
async fn assert_still_installed(broker: &TestBroker, session: &str) -> Value {
    let py = broker
        .run(
            "py",
            "import cbdemo\nprint('still', cbdemo.VALUE)",
            Some(session),
        )
        .await;
    assert!(
        stdout(&py).contains("still installed through the proxy"),
        "{py}"
    );
    py
}

/// Waits until the idle TTL has removed the session's sandbox.
async fn wait_for_idle_removal(broker: &TestBroker, session: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(90);
    let label = format!("codebroker.session={session}");
    while !docker::containers_matching(&broker.instance, &[&label]).is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the idle sandbox was not removed"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// Installs go with the session when the idle TTL removes its sandbox: on Docker in the
/// workspace, which outlives the container; on Kubernetes, whose pods' disks do not,
/// packed before the pod goes and unpacked into the next before its first exec.
#[tokio::test]
async fn installs_survive_the_idle_removal_of_their_sandbox() {
    let regs = registries().await;
    let broker = egress_broker("egress-idle", |c| {
        egress_config(c, &regs);
        c.lifecycle.idle_ttl_secs = 1;
        c.lifecycle.reap_interval_secs = 1;
    })
    .await;
    let code = pip("'install', 'cbdemo'")
        + "r = subprocess.run(['npm', 'install', 'cbdemo-npm'], capture_output=True, text=True)\n\
           print('npm exit', r.returncode, r.stderr[-1500:])\n";
    let first = broker.run("py", &code, None).await;
    assert!(stdout(&first).contains("pip exit 0"), "{first}");
    assert!(stdout(&first).contains("npm exit 0"), "{first}");
    let session = session(&first);
    let before = docker::container_of(&broker.instance, &session);

    // The idle TTL removes the sandbox (and the kept archive, on Kubernetes, is written
    // before it goes).
    wait_for_idle_removal(&broker, &session).await;
    let kept = broker
        .data
        .join("sessions")
        .join(&session)
        .join("installs.tar");
    assert_eq!(kept.exists(), docker::kubernetes(), "{}", kept.display());

    let py = assert_still_installed(&broker, &session).await;
    assert!(!stderr(&py).contains("Packages installed"), "{py}");
    assert_ne!(
        docker::container_of(&broker.instance, &session),
        before,
        "the same sandbox"
    );
    let js = broker
        .run(
            "js",
            "console.log('value', require('cbdemo-npm').value)",
            Some(&session),
        )
        .await;
    assert_eq!(stdout(&js).trim(), "value from verdaccio", "{js}");
}

/// Installs past CODEBROKER_INSTALLS_MAX_BYTES are not kept when a pod goes; the next exec
/// says so and runs. Kubernetes only: on Docker the workspace keeps them.
#[tokio::test]
async fn installs_past_their_bound_are_not_kept_and_the_next_exec_says_so() {
    if !docker::kubernetes() {
        eprintln!("skipped: Docker's workspace outlives the container");
        return;
    }
    let regs = registries().await;
    let broker = egress_broker("egress-bound", |c| {
        egress_config(c, &regs);
        c.lifecycle.idle_ttl_secs = 1;
        c.lifecycle.reap_interval_secs = 1;
        c.state.installs_max_bytes = 1024;
    })
    .await;
    let first = broker.run("py", &pip("'install', 'cbdemo'"), None).await;
    assert!(stdout(&first).contains("pip exit 0"), "{first}");
    let session = session(&first);
    wait_for_idle_removal(&broker, &session).await;
    let next = broker
        .run(
            "py",
            "try:\n    import cbdemo\n    print('present')\nexcept ImportError:\n    print('absent')",
            Some(&session),
        )
        .await;
    assert_eq!(stdout(&next).trim(), "absent", "{next}");
    let err = stderr(&next);
    assert!(
        err.contains("Packages installed earlier in this session were not kept")
            && err.contains("more than 1024 bytes (CODEBROKER_INSTALLS_MAX_BYTES)"),
        "{next}"
    );
    // Said once; the session goes on.
    let again = broker.run("py", "print(6 * 7)", Some(&session)).await;
    assert_eq!(stdout(&again).trim(), "42", "{again}");
    assert!(!stderr(&again).contains("Packages"), "{again}");
}

#[tokio::test]
async fn npm_installs_from_the_allowed_registry_and_node_requires_it() {
    let regs = registries().await;
    let broker = egress_broker("egress-npm", |c| egress_config(c, &regs)).await;
    let installed = broker
        .run(
            "py",
            "import subprocess\n\
             r = subprocess.run(['npm', 'install', 'cbdemo-npm'], capture_output=True, text=True)\n\
             print('npm exit', r.returncode)\nprint(r.stdout[-1500:], r.stderr[-1500:])\n",
            None,
        )
        .await;
    assert!(stdout(&installed).contains("npm exit 0"), "{installed}");
    let session = session(&installed);
    assert_eq!(
        installed["files"],
        json!([]),
        "no package.json or lock file: {installed}"
    );
    let required = broker
        .run(
            "js",
            "console.log('value', require('cbdemo-npm').value)",
            Some(&session),
        )
        .await;
    assert_eq!(
        stdout(&required).trim(),
        "value from verdaccio",
        "{required}"
    );
    let other = broker
        .run(
            "js",
            "try { require('cbdemo-npm'); console.log('present') } catch (e) { console.log('absent') }",
            None,
        )
        .await;
    assert_eq!(stdout(&other).trim(), "absent", "{other}");
}

#[tokio::test]
async fn https_goes_through_connect_end_to_end() {
    let regs = registries().await;
    let broker = egress_broker("egress-tls", |c| egress_config(c, &regs)).await;
    let code = format!(
        "import ssl, urllib.request\n\
         open('ca.pem', 'w').write({ca:?})\n\
         ctx = ssl.create_default_context(cafile='ca.pem')\n\
         print(urllib.request.urlopen('https://tls.test:{port}/', context=ctx, timeout=20).read().decode())\n",
        ca = regs.ca,
        port = regs.tls.port
    );
    let out = broker.run("py", &code, None).await;
    assert_eq!(stdout(&out).trim(), "hello over tls", "{out}");
    let records = audit_records(&broker);
    assert!(
        records.iter().any(|r| r["host"] == "tls.test"
            && r["method"] == "CONNECT"
            && r["verdict"] == "allowed"),
        "{records:?}"
    );
}

#[tokio::test]
async fn what_is_not_allowed_is_refused_with_a_reason_and_the_broker_is_never_reached() {
    let regs = registries().await;
    // The list names the broker's own port, by a listed address and by a pinned name.
    let broker = TestBroker::start_knowing_port("egress-attacks", |c, port| {
        c.egress.egress_transport = transport_from_env();
        egress_config(c, &regs);
        c.egress.egress = c
            .egress
            .egress
            .replace(&format!(":{BROKER_PORT_MARK}"), &format!(":{port}"));
    })
    .await;
    let port: u16 = broker
        .base
        .rsplit(':')
        .next()
        .expect("port")
        .parse()
        .expect("port");
    let targets: Vec<String> = vec![
        "example.com:443".into(),
        format!("pypi.test:{}", regs.pypi.port + 1),
        "93.184.216.34:443".into(),
        "127.0.0.1:443".into(),
        "localhost:443".into(),
        format!("127.0.0.1:{port}"),
        format!("localhost:{port}"),
        format!("[::1]:{port}"),
        format!("broker.test:{port}"),
        "2130706433:443".into(),
    ];
    let out = broker.run("py", &connect_probe(&targets), None).await;
    let lines: Vec<&str> = stdout(&out).lines().collect();
    assert_eq!(lines.len(), targets.len(), "{out}");
    for line in &lines {
        assert!(line.contains("-> HTTP/1.1 403 egress: "), "{line}\n{out}");
        assert!(!line.contains(" 200 "), "{line}");
    }
    assert!(
        lines[0].contains("example.com is not in CODEBROKER_EGRESS"),
        "{}",
        lines[0]
    );
    assert!(
        lines[1].contains("is not in CODEBROKER_EGRESS"),
        "{}",
        lines[1]
    );
    assert!(lines[2].contains("is an IP address"), "{}", lines[2]);
    assert!(
        lines[4].contains("which is not a public address"),
        "{}",
        lines[4]
    );
    // The broker's own port, by every spelling: never opened.
    for line in &lines[5..9] {
        assert!(
            line.contains("the broker's own port")
                || line.contains("is an IP address")
                || line.contains("not a public address")
                || line.contains("is not in CODEBROKER_EGRESS"),
            "{line}"
        );
    }
    assert!(lines[5].contains("the broker's own port"), "{}", lines[5]);
    assert!(lines[8].contains("the broker's own port"), "{}", lines[8]);

    // A direct socket: still no network.
    let direct = broker
        .run(
            "py",
            "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 443), timeout=5)\n    print('connected')\nexcept OSError as e:\n    print('no network:', e)",
            None,
        )
        .await;
    assert!(stdout(&direct).starts_with("no network:"), "{direct}");

    // Refusals are counted and audited by reason.
    let metrics = broker.get("/metrics").await.text().await.expect("metrics");
    for reason in ["not_listed", "ip_literal", "not_public", "broker_port"] {
        assert!(
            metrics.contains(&format!(
                "codebroker_egress_connections_total{{verdict=\"refused\",reason=\"{reason}\"}}"
            )),
            "{reason}: {metrics}"
        );
    }
    let records = audit_records(&broker);
    assert!(records
        .iter()
        .any(|r| r["host"] == "example.com" && r["reason"] == "not_listed"));
}

#[tokio::test]
async fn caps_cut_a_download_and_refuse_a_flood_and_the_next_exec_works() {
    let regs = registries().await;
    let broker = egress_broker("egress-caps", |c| {
        egress_config(c, &regs);
        c.egress.egress_exec_bytes = 2 << 20;
        c.egress.egress_exec_connections = 5;
    })
    .await;
    // Over the byte cap: the 10 MiB wheel's download is cut, and pip says it failed.
    let cut = broker.run("py", &pip("'install', 'cbbig'"), None).await;
    assert!(!stdout(&cut).contains("pip exit 0"), "{cut}");
    let session = session(&cut);
    let records = audit_records(&broker);
    assert!(
        records.iter().any(|r| r["reason"] == "exec_bytes"),
        "{records:?}"
    );

    // A flood: 12 connections in one exec, 5 allowed.
    let targets: Vec<String> = (0..12)
        .map(|_| format!("pypi.test:{}", regs.pypi.port))
        .collect();
    let flood = broker
        .run("py", &connect_probe(&targets), Some(&session))
        .await;
    let text = stdout(&flood);
    assert_eq!(
        text.matches("200 Connection established").count(),
        5,
        "{flood}"
    );
    assert_eq!(
        text.matches("cap of 5 connections is spent").count(),
        7,
        "{flood}"
    );

    // A new exec has a new budget.
    let next = broker
        .run(
            "py",
            &(pip("'install', 'cbdemo'") + "import cbdemo\nprint(cbdemo.VALUE)"),
            Some(&session),
        )
        .await;
    assert!(
        stdout(&next).contains("installed through the proxy"),
        "{next}"
    );
}

#[tokio::test]
async fn with_egress_off_pip_fails_at_once_saying_so() {
    let broker = TestBroker::start("egress-off").await;
    let started = std::time::Instant::now();
    let out = broker
        .run("py", &pip("'install', 'requests-toolbelt'"), None)
        .await;
    let text = stdout(&out);
    assert!(!text.contains("pip exit 0"), "{out}");
    assert!(
        text.contains("egress is off (CODEBROKER_EGRESS is empty)"),
        "{out}"
    );
    println!("pip with egress off failed after {:?}", started.elapsed());
    // npm too.
    let npm = broker
        .run(
            "py",
            "import subprocess\nr = subprocess.run(['npm', 'install', 'left-pad'], capture_output=True, text=True)\nprint('npm exit', r.returncode)\nprint(r.stdout, r.stderr)",
            Some(&session(&out)),
        )
        .await;
    assert!(!stdout(&npm).contains("npm exit 0"), "{npm}");
    assert!(stdout(&npm).contains("403"), "{npm}");
}

#[test]
fn the_servers_are_installed() {
    for tool in [".venv/bin/pypi-server", "node_modules/.bin/verdaccio"] {
        let path = registries::dir().join(tool);
        assert!(
            Path::new(&path).exists(),
            "{} is missing: run `make registries`",
            path.display()
        );
    }
}

/// A plain-HTTP server on loopback that answers every request with `size` bytes.
async fn bulk_server(size: usize) -> u16 {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let answer = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {size}\r\nConnection: close\r\n\r\n"
                );
                if s.write_all(answer.as_bytes()).await.is_err() {
                    return;
                }
                let chunk = vec![7u8; 1 << 20];
                let mut left = size;
                while left > 0 {
                    let n = left.min(chunk.len());
                    if s.write_all(&chunk[..n]).await.is_err() {
                        return;
                    }
                    left -= n;
                }
            });
        }
    });
    port
}

/// The throughput of the path: 100 MiB from a server on loopback, read by Python in the
/// sandbox through its proxy (the runner's forwarder, the socket, the broker's proxy),
/// timed inside the sandbox; three runs, each in a fresh exec. Run with
/// `cargo test -p codebroker --release --test egress measure -- --ignored --nocapture`
/// (add CODEBROKER_RUNTIME=runsc for gVisor).
#[tokio::test]
#[ignore = "a measurement: run it by name"]
async fn measure_a_100_mib_download_through_the_proxy() {
    let port = bulk_server(100 << 20).await;
    let broker = egress_broker("egress-measure", |c| {
        c.egress.egress = format!("bulk.test:{port}");
        c.egress.egress_resolve = "bulk.test=127.0.0.1".into();
    })
    .await;
    let code = format!(
        "import time, urllib.request\n\
         t = time.perf_counter(); n = 0\n\
         with urllib.request.urlopen('http://bulk.test:{port}/', timeout=60) as r:\n\
         \x20   while True:\n\
         \x20       b = r.read(1 << 20)\n\
         \x20       if not b:\n\
         \x20           break\n\
         \x20       n += len(b)\n\
         dt = time.perf_counter() - t\n\
         print(n, round(n / dt / 1e6, 1))\n"
    );
    let mut session_id: Option<String> = None;
    for run in 1..=3 {
        let out = broker.run("py", &code, session_id.as_deref()).await;
        session_id = Some(session(&out));
        let text = stdout(&out).trim().to_string();
        let mut parts = text.split_whitespace();
        assert_eq!(parts.next(), Some(&*(100u64 << 20).to_string()), "{out}");
        println!(
            "run {run}: 100 MiB through the egress path at {} MB/s (runtime {:?}, load {})",
            parts.next().unwrap_or("?"),
            std::env::var("CODEBROKER_RUNTIME").unwrap_or_default(),
            std::fs::read_to_string("/proc/loadavg")
                .unwrap_or_default()
                .trim()
        );
    }
}
