//! Who the broker runs as, checked once at start.
//!
//! The sandboxes run each as a uid of its own from `CODEBROKER_SANDBOX_UIDS`, or all as
//! `CODEBROKER_SANDBOX_UID`. A broker with another uid keeps its data and read-only
//! uploads out of their reach, but then must hand workspaces to those uids and read and
//! remove what the code creates with any mode: as root, or non-root with `CAP_CHOWN`,
//! `CAP_DAC_OVERRIDE` and `CAP_FOWNER` (what the broker image gives it). A broker running
//! as the one sandbox uid works, without that protection; a broker whose uid a sandbox
//! could be given does not start.

use crate::config::SandboxUids;
use std::io;

/// The capabilities a non-root broker with its own uid needs, with their bit numbers
/// (`linux/capability.h`).
const NEEDED: [(&str, u32); 3] = [("CAP_CHOWN", 0), ("CAP_DAC_OVERRIDE", 1), ("CAP_FOWNER", 3)];

/// What the identity of this process means for the sandboxes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Identity {
    /// Root, or its own uid with the capabilities it needs: sandboxes are kept apart.
    Separate,
    /// The sandbox's own uid: everything works, but read-only uploads are not protected.
    SameAsSandbox,
}

/// Checks this process can serve sandboxes running as `sandbox_uids`, then clears its
/// ambient and inheritable capabilities, so that no program it starts (an upstream MCP
/// server) inherits them, and keeps CAP_SETUID and CAP_SETGID, if it has them, out of its
/// effective set.
pub(crate) fn check(sandbox_uids: SandboxUids) -> anyhow::Result<Identity> {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    let identity = match sandbox_uids {
        SandboxUids::Shared(uid) if uid == euid => Identity::SameAsSandbox,
        SandboxUids::Own(range) if range.contains(euid) => anyhow::bail!(
            "the broker runs as uid {euid}, inside CODEBROKER_SANDBOX_UIDS ({range}): a \
             sandbox could be given the broker's own uid. Choose a range without it"
        ),
        _ => check_separate(euid, sandbox_uids.resting())?,
    };
    settle()?;
    Ok(identity)
}

/// Clears the calling thread's ambient and inheritable capabilities and, unless it is
/// root, takes CAP_SETUID and CAP_SETGID out of its effective set (keeping them
/// permitted: only the child that starts a `stdio:` upstream server raises them, to leave
/// the broker's uid, see [`become_upstream`]). Capability sets belong to each thread, and
/// a thread starts with its creator's: `main` calls this before the runtime starts any.
pub fn settle() -> io::Result<()> {
    // SAFETY: prctl with these arguments only changes this thread's ambient set.
    unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0,
            0,
            0,
        );
    }
    let mut sets = capget()?;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        sets[0].effective &= !UID_SWITCH;
    }
    for set in &mut sets {
        set.inheritable = 0;
    }
    capset(&sets)
}

/// Bit of CAP_SETGID (`linux/capability.h`).
const CAP_SETGID: u32 = 6;
/// Bit of CAP_SETUID.
const CAP_SETUID: u32 = 7;
/// `_LINUX_CAPABILITY_VERSION_3`: two 32-bit words per set.
const CAPABILITY_VERSION_3: u32 = 0x2008_0522;

/// `struct __user_cap_header_struct`.
#[repr(C)]
struct CapHeader {
    /// The layout asked for ([`CAPABILITY_VERSION_3`]).
    version: u32,
    /// 0: this thread.
    pid: libc::c_int,
}

/// `struct __user_cap_data_struct`: one 32-bit word of each set.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    /// The capabilities in use.
    effective: u32,
    /// The capabilities that may be made effective.
    permitted: u32,
    /// The capabilities kept across an exec of a program with file capabilities.
    inheritable: u32,
}

/// This thread's capability sets (both words). Async-signal-safe: one syscall.
fn capget() -> io::Result<[CapData; 2]> {
    let mut header = CapHeader {
        version: CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: the header and two data words are the layout version 3 reads and writes.
    let rc = unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) };
    if rc == 0 {
        Ok(data)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Sets this thread's capability sets. Async-signal-safe: one syscall.
fn capset(data: &[CapData; 2]) -> io::Result<()> {
    let mut header = CapHeader {
        version: CAPABILITY_VERSION_3,
        pid: 0,
    };
    // SAFETY: as in `capget`; the kernel only reads the data.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The bits of CAP_SETUID and CAP_SETGID.
const UID_SWITCH: u32 = (1 << CAP_SETUID) | (1 << CAP_SETGID);

/// Whether this process may switch a child to another uid: root, or CAP_SETUID and
/// CAP_SETGID permitted.
pub(crate) fn can_switch_uid() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    root || capget().is_ok_and(|sets| sets[0].permitted & UID_SWITCH == UID_SWITCH)
}

/// Run in the child of a `stdio:` upstream server between fork and exec: leaves every
/// supplementary group (the Docker socket's among them) and becomes `uid`:`uid` when
/// `switch`, then empties every capability set, ambient included, and sets no_new_privs,
/// so the program the code drives owns none of the broker's files and can gain nothing.
/// Async-signal-safe: syscalls only, nothing allocated.
pub(crate) fn become_upstream(uid: u32, switch: bool) -> io::Result<()> {
    let check = |rc: libc::c_int| {
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    };
    if switch {
        let mut sets = capget()?;
        sets[0].effective |= sets[0].permitted & UID_SWITCH;
        capset(&sets)?;
        // SAFETY: plain syscalls on this (single-threaded) child.
        unsafe {
            check(libc::setgroups(0, std::ptr::null()))?;
            check(libc::setresgid(uid, uid, uid))?;
            check(libc::setresuid(uid, uid, uid))?;
        }
    }
    capset(&[CapData::default(); 2])?;
    // SAFETY: prctl with these arguments only changes this process's own state.
    unsafe {
        check(libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0,
            0,
            0,
        ))?;
        check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))?;
    }
    Ok(())
}

/// A broker of its own uid `euid`: root, or holding the capabilities it needs to hand
/// workspaces to the sandboxes' uids (`sandbox_uid` names one, for the message).
fn check_separate(euid: u32, sandbox_uid: u32) -> anyhow::Result<Identity> {
    let identity = if euid == 0 {
        Identity::Separate
    } else {
        let effective = effective_caps()?;
        let missing: Vec<&str> = NEEDED
            .iter()
            .filter(|(_, bit)| effective & (1u64 << bit) == 0)
            .map(|(name, _)| *name)
            .collect();
        if !missing.is_empty() {
            anyhow::bail!(
                "the broker runs as uid {euid}, not root and not the sandbox uid \
                 (e.g. {sandbox_uid}), without {}: it could not hand workspaces to the sandbox \
                 nor read what the code creates. Run it as root, with those capabilities \
                 (the broker image's entrypoint does), or set CODEBROKER_SANDBOX_UID={euid}",
                missing.join(", ")
            );
        }
        Identity::Separate
    };
    Ok(identity)
}

/// This process's effective capability set, from `/proc/self/status`.
fn effective_caps() -> io::Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .ok_or_else(|| io::Error::other("no CapEff line in /proc/self/status"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_effective_set_is_read() {
        // Root in CI has every capability; anyone else has a readable set as well.
        let caps = effective_caps().expect("CapEff");
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            assert_ne!(caps & (1 << 0), 0);
        }
    }
}
