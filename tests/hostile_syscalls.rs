//! The sandbox's syscall policy (the built-in seccomp profile) and the rest of the
//! container profile, seen from inside: kernel interfaces sandboxed code never needs are
//! refused by the filter (EPERM), not merely missing from this host's kernel.

mod common;

use common::{stdout, TestBroker};
use serde_json::Value;

/// Tries each interface and prints `{name: errno or "open"}` as JSON.
const PROBE: &str = r#"
import ctypes, json, socket
libc = ctypes.CDLL(None, use_errno=True)
found = {}
for name, family, kind in [("AF_ALG", 38, socket.SOCK_SEQPACKET), ("AF_KEY", 15, socket.SOCK_RAW),
                           ("AF_RXRPC", 33, socket.SOCK_DGRAM), ("AF_VSOCK", 40, socket.SOCK_STREAM),
                           ("AF_TIPC", 30, socket.SOCK_RDM)]:
    try:
        socket.socket(family, kind, 0).close()
        found[name] = "open"
    except OSError as e:
        found[name] = e.errno
# x86-64 numbers; arguments that are invalid on purpose: a permitted call fails with
# EFAULT or EINVAL, a filtered one with EPERM.
for name, number in [("io_uring_setup", 425), ("userfaultfd", 323), ("bpf", 321),
                     ("keyctl", 250), ("add_key", 248), ("request_key", 249)]:
    ctypes.set_errno(0)
    found[name] = "open" if libc.syscall(number, 0, 0, 0, 0) >= 0 else ctypes.get_errno()
print(json.dumps(found))
"#;

/// Whether sandboxes run under another runtime than the daemon's default (runc): gVisor
/// answers syscalls in its own kernel and does not apply the OCI seccomp profile, so
/// there the interfaces must fail, but not necessarily with the filter's EPERM.
fn other_runtime() -> bool {
    std::env::var("CODEBROKER_RUNTIME").is_ok_and(|r| !r.trim().is_empty())
}

#[tokio::test]
async fn kernel_interfaces_sandboxed_code_never_needs_are_refused() {
    let broker = TestBroker::start("syscalls").await;
    let out = broker.run("py", PROBE, None).await;
    let found: Value = serde_json::from_str(stdout(&out).trim()).unwrap_or(out.clone());
    for name in [
        "AF_ALG",
        "AF_KEY",
        "AF_RXRPC",
        "AF_VSOCK",
        "AF_TIPC",
        "io_uring_setup",
        "userfaultfd",
        "bpf",
        "keyctl",
        "add_key",
        "request_key",
    ] {
        if other_runtime() {
            assert!(found[name].is_number(), "{name} is open: {found}");
        } else {
            assert_eq!(
                found[name], 1,
                "{name} is not refused by the filter: {found}"
            );
        }
    }
    // What code does need still works: the sockets of local IPC and of libraries that
    // probe for a network, threads (clone; clone3 falls back), processes.
    let out = broker
        .run(
            "py",
            "import socket, threading, subprocess\n\
             for f in (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6): socket.socket(f).close()\n\
             socket.socket(socket.AF_NETLINK, socket.SOCK_RAW).close()\n\
             t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n\
             print(subprocess.run(['echo', 'child'], capture_output=True, text=True).stdout, end='')",
            None,
        )
        .await;
    assert_eq!(stdout(&out), "thread\nchild\n", "{out}");
}

#[tokio::test]
async fn the_daemon_profile_can_be_chosen_instead() {
    let broker = TestBroker::start_with("syscalls-daemon", |c| {
        c.sandbox.seccomp = codebroker::config::SeccompChoice::Daemon;
    })
    .await;
    let out = broker.run("py", PROBE, None).await;
    let found: Value = serde_json::from_str(stdout(&out).trim()).unwrap_or(out.clone());
    // Docker's default lets io_uring_setup through to the kernel, which refuses the
    // invalid arguments (EFAULT), unless the host turned io_uring off itself.
    let host_off = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
        .is_ok_and(|v| v.trim() != "0");
    if !host_off && !other_runtime() {
        assert_eq!(found["io_uring_setup"], 14, "{found}");
    }
    if !other_runtime() {
        // Not the built-in filter's EPERM: this host's kernel answers for itself.
        assert_eq!(
            found["AF_ALG"].as_u64().map(|e| e != 1),
            Some(true),
            "{found}"
        );
    }
}

#[tokio::test]
async fn no_new_privileges_and_a_private_cgroup_namespace_hold_without_dropping_capabilities() {
    let broker = TestBroker::start_with("syscalls-caps", |c| {
        c.sandbox.drop_capabilities = false;
    })
    .await;
    let out = broker
        .run(
            "bash",
            "grep NoNewPrivs /proc/self/status; grep -c docker /proc/self/cgroup || true",
            None,
        )
        .await;
    let text = stdout(&out);
    assert!(text.contains("NoNewPrivs:\t1"), "{out}");
    // In its own cgroup namespace the sandbox sees its cgroups as `/`, not the host's
    // `/docker/<id>` paths.
    assert_eq!(text.lines().last(), Some("0"), "{out}");
}
