//! Which uid each Docker sandbox runs as. With CODEBROKER_SANDBOX_UIDS every live sandbox
//! has a uid no other live sandbox has: a uid is taken before its container is created and
//! given back only once the engine has removed the container (or never had it), so a
//! container the engine failed to remove keeps its uid until a later removal succeeds.
//! After a restart the uids of the containers found on the engine are held again, read
//! back from their label. The first uid of the range is handed to no sandbox: it owns
//! the workspaces that have none.

use crate::config::{SandboxUids, UidRange};
use crate::sync::LockExt as _;
use std::collections::HashMap;
use std::sync::Mutex;

/// Why no sandbox can be started now: every uid of the range is in use.
#[derive(Debug, thiserror::Error)]
#[error(
    "every sandbox uid of CODEBROKER_SANDBOX_UIDS ({range}) is in use by a live sandbox; \
     one is free again when an idle sandbox is removed"
)]
pub(crate) struct UidsExhausted {
    /// The configured range, for the message.
    range: UidRange,
}

/// The uids of live sandboxes, and the next to try.
#[derive(Debug, Default)]
struct InUse {
    /// Each live container's uid, by container id.
    by_container: HashMap<String, u32>,
    /// How many containers (or creations under way) hold each uid: more than one only
    /// for containers found on the engine that a broker before this one made so.
    holders: HashMap<u32, usize>,
    /// Where the search for a free uid starts: just after the last one handed out, so a
    /// uid given back is the last to be handed out again.
    next: u32,
}

/// Hands out the sandboxes' uids.
#[derive(Debug)]
pub(crate) struct SandboxUidPool {
    /// The configured choice: one shared uid, or a range to hand out.
    uids: SandboxUids,
    /// The uids in use (only for a range).
    in_use: Mutex<InUse>,
}

impl SandboxUidPool {
    /// A pool of `uids`, none in use.
    pub(crate) fn new(uids: SandboxUids) -> SandboxUidPool {
        SandboxUidPool {
            uids,
            in_use: Mutex::new(InUse::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, InUse> {
        self.in_use.locked()
    }

    /// A uid no live sandbox has (the shared uid, with one for all), held until
    /// [`SandboxUidPool::bind`] gives it to a container or [`SandboxUidPool::untake`] gives it back.
    pub(crate) fn take(&self) -> Result<u32, UidsExhausted> {
        let range = match self.uids {
            SandboxUids::Shared(uid) => return Ok(uid),
            SandboxUids::Own(range) => range,
        };
        // The first uid is the workspaces' at rest; the others are the sandboxes'.
        let (low, high) = (range.first + 1, range.last);
        let count = high - low + 1;
        let mut in_use = self.lock();
        let start = in_use.next.clamp(low, high);
        for step in 0..count {
            let uid = low + (start - low + step) % count;
            if let std::collections::hash_map::Entry::Vacant(free) = in_use.holders.entry(uid) {
                free.insert(1);
                in_use.next = if uid == high { low } else { uid + 1 };
                return Ok(uid);
            }
        }
        Err(UidsExhausted { range })
    }

    /// Gives back a uid taken for a container that was never created.
    pub(crate) fn untake(&self, uid: u32) {
        if matches!(self.uids, SandboxUids::Own(_)) {
            release_one(&mut self.lock(), uid);
        }
    }

    /// Records that container `id` was created with the taken `uid`.
    pub(crate) fn bind(&self, id: &str, uid: u32) {
        if matches!(self.uids, SandboxUids::Own(_)) {
            self.lock().by_container.insert(id.to_string(), uid);
        }
    }

    /// Holds the uid of container `id`, found on the engine (after a restart), unless it
    /// is held for that container already.
    pub(crate) fn hold(&self, id: &str, uid: u32) {
        let SandboxUids::Own(range) = self.uids else {
            return;
        };
        if !range.contains(uid) {
            return;
        }
        let mut in_use = self.lock();
        if in_use.by_container.contains_key(id) {
            return;
        }
        in_use.by_container.insert(id.to_string(), uid);
        *in_use.holders.entry(uid).or_insert(0) += 1;
    }

    /// Gives back the uid of container `id`, which the engine no longer has.
    pub(crate) fn release(&self, id: &str) {
        let mut in_use = self.lock();
        if let Some(uid) = in_use.by_container.remove(id) {
            release_one(&mut in_use, uid);
        }
    }

    /// How many uids live sandboxes hold.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.lock().holders.len()
    }
}

/// Drops one holder of `uid`.
fn release_one(in_use: &mut InUse, uid: u32) {
    if let Some(count) = in_use.holders.get_mut(&uid) {
        *count -= 1;
        if *count == 0 {
            in_use.holders.remove(&uid);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(first: u32, last: u32) -> SandboxUidPool {
        SandboxUidPool::new(SandboxUids::Own(UidRange { first, last }))
    }

    #[test]
    fn live_sandboxes_never_share_a_uid_and_the_first_is_given_to_none() {
        let pool = range(100, 103);
        let taken: Vec<u32> = (0..3).map(|_| pool.take().expect("uid")).collect();
        assert_eq!(taken, [101, 102, 103]);
        for (i, uid) in taken.iter().enumerate() {
            pool.bind(&format!("c{i}"), *uid);
        }
        // The limit: every uid is in use, and the answer says which setting.
        let err = pool.take().expect_err("exhausted");
        assert!(err
            .to_string()
            .contains("CODEBROKER_SANDBOX_UIDS (100-103)"));
        // The next call after a removal is served, with the uid given back.
        pool.release("c1");
        assert_eq!(pool.take().expect("uid"), 102);
        assert!(pool.take().is_err());
        // An unknown container, or one released twice, gives nothing back.
        pool.release("c1");
        pool.release("nope");
        assert!(pool.take().is_err());
        assert_eq!(pool.held(), 3);
    }

    #[test]
    fn a_uid_given_back_is_the_last_handed_out_again() {
        let pool = range(10, 20);
        let a = pool.take().expect("uid");
        pool.untake(a);
        let b = pool.take().expect("uid");
        assert_ne!(a, b);
        assert_eq!(pool.held(), 1);
    }

    #[test]
    fn uids_found_after_a_restart_are_held_until_their_containers_go() {
        let pool = range(100, 102);
        pool.hold("old", 101);
        pool.hold("old", 101);
        // Outside the range (a container of an older broker, run as 10001): not ours.
        pool.hold("older", 10001);
        assert_eq!(pool.take().expect("uid"), 102);
        assert!(pool.take().is_err());
        pool.release("old");
        assert_eq!(pool.take().expect("uid"), 101);
        // Two containers found with one uid: it stays held until both are gone.
        let pool = range(100, 101);
        pool.hold("a", 101);
        pool.hold("b", 101);
        pool.release("a");
        assert!(pool.take().is_err());
        pool.release("b");
        assert_eq!(pool.take().expect("uid"), 101);
    }

    #[test]
    fn one_shared_uid_serves_every_sandbox() {
        let pool = SandboxUidPool::new(SandboxUids::Shared(10001));
        for i in 0..5 {
            assert_eq!(pool.take().expect("uid"), 10001);
            pool.bind(&i.to_string(), 10001);
        }
        pool.hold("x", 10001);
        pool.release("0");
        assert_eq!(pool.held(), 0);
    }
}
