//! Network: no route out of a sandbox, to the host, the broker or the metadata service,
//! no DNS, no Docker socket and no privilege inside.

use super::*;

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
    // A uid of its own from CODEBROKER_SANDBOX_UIDS, not root.
    assert!(
        text.lines()
            .filter_map(|l| l.parse::<u32>().ok())
            .any(|uid| (200_001..=265_535).contains(&uid)),
        "{out}"
    );
    assert!(text.contains("root-read-only"), "{out}");
    assert!(text.contains("done"), "{out}");
    let s = session(&out);
    echo_ok(&broker, &s).await;
    bystander.check(&broker).await;
}
