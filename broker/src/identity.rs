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
/// ambient capabilities, so that no program it starts (an upstream MCP server) inherits
/// them.
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
    // SAFETY: prctl with these arguments only changes this process's ambient set.
    unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0,
            0,
            0,
        );
    }
    Ok(identity)
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
