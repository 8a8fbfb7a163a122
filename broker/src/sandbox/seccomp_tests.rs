//! The built-in seccomp profile (`seccomp.json`) read the way runc hands it to libseccomp,
//! and asked which calls it lets through: the argument filters on `socket` and `ioctl`
//! are many rules whose union must be exactly what the profile's comments say.

use super::docker::BUILTIN_SECCOMP;
use serde_json::Value;
use std::sync::LazyLock;

/// TIOCSTI, TIOCLINUX and TIOCSETD: the ioctl requests the profile refuses.
const REFUSED_IOCTLS: [u64; 3] = [0x5412, 0x541C, 0x5423];

/// The profile's rules, parsed once.
static RULES: LazyLock<Vec<Value>> = LazyLock::new(|| {
    let profile: Value = serde_json::from_str(BUILTIN_SECCOMP).expect("the profile is JSON");
    profile["syscalls"].as_array().expect("rules").clone()
});

/// The allow rules for syscall `name` on x86-64.
fn allow_rules(name: &str) -> Vec<&'static Value> {
    RULES
        .iter()
        .filter(|r| {
            r["action"] == "SCMP_ACT_ALLOW"
                && r["names"]
                    .as_array()
                    .is_some_and(|n| n.iter().any(|x| x == name))
                && r["includes"]["arches"]
                    .as_array()
                    .is_none_or(|a| a.iter().any(|x| x == "amd64"))
        })
        .collect()
}

/// Whether one condition of a rule holds for the call's arguments.
fn holds(condition: &Value, args: &[u64; 6]) -> bool {
    let index = condition["index"].as_u64().expect("an index");
    let value = condition["value"].as_u64().expect("a value");
    let arg = args[usize::try_from(index).expect("a small index")];
    match condition["op"].as_str().expect("an op") {
        "SCMP_CMP_EQ" => arg == value,
        "SCMP_CMP_NE" => arg != value,
        "SCMP_CMP_LT" => arg < value,
        "SCMP_CMP_LE" => arg <= value,
        "SCMP_CMP_GT" => arg > value,
        "SCMP_CMP_GE" => arg >= value,
        "SCMP_CMP_MASKED_EQ" => arg & value == condition["valueTwo"].as_u64().unwrap_or(0),
        op => panic!("unknown op {op}"),
    }
}

/// Whether the profile lets syscall `name` through with `args`. runc loads each rule's
/// conditions as one libseccomp rule (all must hold), unless two are on the same argument:
/// then each becomes a rule of its own, and any one of them allows the call.
fn allows(name: &str, args: [u64; 6]) -> bool {
    allow_rules(name).iter().any(|rule| {
        let conditions = rule["args"].as_array().cloned().unwrap_or_default();
        let mut indexes: Vec<u64> = conditions
            .iter()
            .map(|c| c["index"].as_u64().expect("an index"))
            .collect();
        indexes.sort_unstable();
        indexes.dedup();
        if indexes.len() < conditions.len() {
            conditions.iter().any(|c| holds(c, &args))
        } else {
            conditions.iter().all(|c| holds(c, &args))
        }
    })
}

fn socket(family: u64, kind: u64, protocol: u64) -> bool {
    allows("socket", [family, kind, protocol, 0, 0, 0])
}

fn ioctl(request: u64) -> bool {
    allows("ioctl", [3, request, 0, 0, 0, 0])
}

#[test]
fn sockets_are_limited_to_four_families_and_their_usual_protocols() {
    const SOCK_CLOEXEC: u64 = 0o2000000;
    for family in 0..64 {
        for protocol in (0..300).chain([1 << 32, (1 << 32) | 6, u64::MAX]) {
            for kind in [1, 2, 3, 5, 6, 2 | SOCK_CLOEXEC] {
                let expected = match family {
                    1 => true,
                    2 | 10 => [0, 6, 17].contains(&protocol),
                    16 => protocol == 0,
                    _ => false,
                };
                assert_eq!(
                    socket(family, kind, protocol),
                    expected,
                    "socket({family}, {kind}, {protocol})"
                );
            }
        }
    }
    // A family with bits above the int the kernel reads matches no rule.
    assert!(!socket((1 << 32) | 38, 5, 0));
    assert!(!socket((1 << 32) | 2, 1, 132));
}

#[test]
fn ioctl_refuses_three_requests_whatever_the_high_bits() {
    for request in REFUSED_IOCTLS {
        for high in [0, 1 << 32, 0xffff_ffff << 32, 1 << 63] {
            assert!(!ioctl(high | request), "{:#x} is allowed", high | request);
        }
    }
    // Every other request of the tty and file range, and ones with the direction bits
    // set (TIOCGPTN, FS_IOC_GETFLAGS) however the caller widened them.
    for request in 0..0x1_0000 {
        assert_eq!(
            ioctl(request),
            !REFUSED_IOCTLS.contains(&request),
            "{request:#x}"
        );
    }
    for request in [0x8004_5430, 0xffff_ffff_8004_5430, 0x8008_6601, 0x4008_6602] {
        assert!(ioctl(request), "{request:#x} is refused");
    }
}

/// The ioctl rules are blocks of the 32-bit request (a mask of high bits, and their
/// value): that the blocks are disjoint, hold none of the refused requests and together
/// count 2^32 - 3 requests proves they allow every other request, without trying 2^32.
#[test]
fn the_ioctl_blocks_cover_every_other_request_exactly_once() {
    let blocks: Vec<(u64, u64)> = allow_rules("ioctl")
        .iter()
        .map(|rule| {
            let conditions = rule["args"].as_array().expect("conditions");
            assert_eq!(conditions.len(), 1, "{rule}");
            let c = &conditions[0];
            assert_eq!(
                (c["index"].as_u64(), c["op"].as_str()),
                (Some(1), Some("SCMP_CMP_MASKED_EQ"))
            );
            let mask = c["value"].as_u64().expect("a mask");
            let value = c["valueTwo"].as_u64().expect("a value");
            // High bits of the low 32 only, and a value inside them.
            assert!(
                mask <= 0xffff_ffff && mask.leading_zeros() == 32,
                "{mask:#x}"
            );
            assert_eq!(
                (mask >> mask.trailing_zeros()).count_ones(),
                32 - mask.trailing_zeros()
            );
            assert_eq!(value & !mask, 0, "{value:#x}");
            (mask, value)
        })
        .collect();
    let mut count: u64 = 0;
    for (i, &(mask, value)) in blocks.iter().enumerate() {
        count += 1 << mask.trailing_zeros();
        for request in REFUSED_IOCTLS {
            assert_ne!(request & mask, value, "block {i} holds {request:#x}");
        }
        for &(other_mask, other_value) in &blocks[i + 1..] {
            let common = mask & other_mask;
            assert_ne!(value & common, other_value & common, "blocks overlap");
        }
    }
    assert_eq!(count, (1 << 32) - 3);
}

#[test]
fn tracing_other_processes_and_flushing_the_host_are_refused() {
    for name in ["ptrace", "process_vm_readv", "process_vm_writev", "sync"] {
        assert!(allow_rules(name).is_empty(), "{name} is allowed");
    }
    // What code uses to make its own files durable stays.
    for name in ["fsync", "fdatasync", "syncfs", "sync_file_range"] {
        assert!(allows(name, [3, 0, 0, 0, 0, 0]), "{name} is refused");
    }
}
