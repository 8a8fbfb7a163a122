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

/// Tries the socket protocols, tty ioctls and process-inspection calls the filter looks
/// at, and prints `{name: errno or "open"}` as JSON. x86-64 syscall numbers; `hi` puts a
/// bit above the low 32 of an argument the kernel reads as a 32-bit int, which a filter
/// comparing all 64 bits would miss.
const NARROW_PROBE: &str = r#"
import ctypes, fcntl, json, os, socket, struct, termios
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
found = {}
hi = 1 << 32

def call(name, *args):
    ctypes.set_errno(0)
    r = libc.syscall(*[ctypes.c_long(a) if a < 1 << 63 else ctypes.c_ulong(a) for a in args])
    found[name] = "open" if r >= 0 else ctypes.get_errno()
    if r >= 0 and name.startswith("socket"):
        os.close(r)

# socket(2) is 41: (family, type, protocol).
for name, family, kind, proto in [
        ("inet_sctp", 2, 1, 132), ("inet_sctp_seqpacket", 2, 5, 132), ("inet6_sctp", 10, 1, 132),
        ("inet_dccp", 2, 6, 33), ("inet6_dccp", 10, 6, 33), ("inet_l2tp", 2, 2, 115),
        ("inet_udplite", 2, 2, 136), ("inet_icmp", 2, 2, 1), ("inet6_mptcp", 10, 1, 262),
        ("netlink_generic", 16, 3, 16), ("netlink_audit", 16, 3, 9),
        ("netlink_kobject_uevent", 16, 2, 15), ("inet_sctp_hi", 2, 1, hi | 132),
        ("ok_inet_stream", 2, 1, 0), ("ok_inet_tcp", 2, 1, 6), ("ok_inet_dgram", 2, 2, 0),
        ("ok_inet_udp", 2, 2, 17), ("ok_inet6_stream", 10, 1, 0), ("ok_inet6_tcp", 10, 1, 6),
        ("ok_inet6_udp", 10, 2, 17), ("ok_netlink_route", 16, 3, 0),
        ("ok_netlink_route_dgram", 16, 2, 0), ("ok_unix_stream", 1, 1, 0),
        ("ok_unix_dgram", 1, 2, 0), ("ok_inet_stream_cloexec", 2, 1 | 0o2000000, 6)]:
    call("socket_" + name, 41, family, kind, proto)

# ioctl(2) is 16, on a pty from /dev/ptmx, in a child whose controlling terminal it is
# (the kernel refuses TIOCSTI on another tty itself). TIOCSETD sets N_TTY (0), which the
# kernel allows anyone: only the filter can refuse it.
results, report = os.pipe()
pid = os.fork()
if pid == 0:
    tty = {}
    try:
        def ioctl(name, fd, request, arg):
            ctypes.set_errno(0)
            r = libc.syscall(ctypes.c_long(16), ctypes.c_long(fd), ctypes.c_ulong(request), ctypes.c_void_p(arg))
            tty["ioctl_" + name] = "open" if r >= 0 else ctypes.get_errno()
        os.setsid()
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
        c_int = ctypes.c_int(0)
        buf = ctypes.create_string_buffer(64)
        for name, request, arg in [("TIOCSTI", 0x5412, ctypes.addressof(buf)),
                                   ("TIOCSTI_hi", hi | 0x5412, ctypes.addressof(buf)),
                                   ("TIOCSETD", 0x5423, ctypes.addressof(c_int)),
                                   ("TIOCSETD_hi", (0xffffffff << 32) | 0x5423, ctypes.addressof(c_int)),
                                   ("TIOCLINUX", 0x541C, ctypes.addressof(buf)),
                                   ("ok_TCGETS", 0x5401, ctypes.addressof(buf)),
                                   ("ok_TIOCGWINSZ", 0x5413, ctypes.addressof(buf)),
                                   ("ok_TIOCGETD", 0x5424, ctypes.addressof(buf))]:
            ioctl(name, slave, request, arg)
        ioctl("ok_TIOCGPTN", master, 0x80045430, ctypes.addressof(buf))
        r, w = os.pipe()
        ioctl("ok_FIONREAD", r, 0x541B, ctypes.addressof(buf))
        ioctl("ok_FIONBIO", r, 0x5421, ctypes.addressof(c_int))
        tty["tty_ok"] = [termios.tcgetattr(slave)[4] > 0,
                         struct.unpack("HHHH", fcntl.ioctl(slave, termios.TIOCGWINSZ, b"\0" * 8))[0] >= 0]
    except Exception as e:
        tty["ioctl_probe_failed"] = repr(e)
    os.write(report, json.dumps(tty).encode())
    os._exit(0)
os.close(report)
found.update(json.loads(os.read(results, 65536)))
os.waitpid(pid, 0)

# ptrace(PTRACE_TRACEME) in a child, which exits at once: 100 if it was allowed.
pid = os.fork()
if pid == 0:
    ctypes.set_errno(0)
    os._exit(100 if libc.ptrace(0, 0, 0, 0) == 0 else ctypes.get_errno())
code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
found["ptrace_traceme"] = "open" if code == 100 else code
# process_vm_readv and process_vm_writev (310, 311) of zero vectors at our own pid.
call("process_vm_readv", 310, os.getpid(), 0, 0, 0, 0, 0)
call("process_vm_writev", 311, os.getpid(), 0, 0, 0, 0, 0)
# sync (162) flushes every filesystem of the host; syncfs (306) only the workspace's.
call("sync", 162)
call("ok_syncfs", 306, results)
call("ok_fsync", 74, os.open(".", os.O_RDONLY))
print(json.dumps(found))
"#;

#[tokio::test]
async fn kernel_modules_ttys_and_other_processes_are_out_of_reach() {
    let broker = TestBroker::start("syscalls-narrow").await;
    let out = broker.run("py", NARROW_PROBE, None).await;
    let found: Value = serde_json::from_str(stdout(&out).trim()).unwrap_or(out.clone());
    let names: Vec<&String> = found
        .as_object()
        .expect("the probe's answer")
        .keys()
        .collect();
    let refused: Vec<&&String> = names
        .iter()
        .filter(|n| !n.contains("ok_") && n.as_str() != "tty_ok")
        .collect();
    assert_eq!(refused.len(), 22, "{found}");
    for name in refused {
        if other_runtime() {
            // gVisor answers these in its own kernel (no module autoload, no host tty).
            continue;
        }
        assert_eq!(
            found[name], 1,
            "{name} is not refused by the filter: {found}"
        );
    }
    // What code does use still works: sockets of the usual protocols (the network is
    // off, the call is not), the tty ioctls of terminals and pipes, fsync and syncfs.
    for name in names.iter().filter(|n| n.contains("ok_")) {
        assert_eq!(found[name], "open", "{name} is refused: {found}");
    }
    assert_eq!(found["tty_ok"], serde_json::json!([true, true]), "{found}");
    // `sync` (the command) does not fail for a refused sync(2): the call returns nothing.
    let out = broker
        .run("bash", "sync && sync -f . && echo synced", None)
        .await;
    assert_eq!(stdout(&out), "synced\n", "{out}");
}
