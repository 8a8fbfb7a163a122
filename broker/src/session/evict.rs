//! Which session containers to remove, and why: the idle TTL, the shorter TTL of sessions
//! used only once, the cap on live session containers and the per-user cap (least
//! recently used first). Busy containers are never removed: where they fill a cap, the
//! caps in `ratelimit` refuse the next start instead.
//!
//! Clients such as LibreChat's `execute_code` send no session id, so most calls start a
//! new session that is never used again; without these rules each leaves an idle
//! container behind for the whole idle TTL. The rules are a pure function of a snapshot,
//! so they are tested without containers or clocks.

/// Why a session's container is removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reason {
    /// Idle past the idle TTL.
    Idle,
    /// Used at most once and idle past the single-use TTL.
    SingleUse,
    /// The least recently used, removed to stay under the cap.
    OverCap,
    /// The least recently used of one user's, removed to stay under the per-user cap.
    OverUserCap,
}

impl Reason {
    /// The label value in metrics and the audit log.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Reason::Idle => "idle",
            Reason::SingleUse => "single_use",
            Reason::OverCap => "over_cap",
            Reason::OverUserCap => "over_user_cap",
        }
    }
}

/// The rules, from the configuration.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Policy {
    /// A container idle this long goes (ms).
    pub(crate) idle_ttl_ms: u64,
    /// A container whose session ran at most one exec goes after this idle time (ms);
    /// 0 turns the rule off.
    pub(crate) single_use_ttl_ms: u64,
    /// Most session containers alive at once; 0: no cap.
    pub(crate) max_live: usize,
    /// Most session containers alive at once for one user; 0: no cap.
    pub(crate) max_per_user: usize,
}

/// What the rules look at of one session that holds a container.
#[derive(Debug, Clone)]
pub(crate) struct Live {
    /// Milliseconds since the epoch of its last use.
    pub(crate) last_used_ms: u64,
    /// Execs it ran.
    pub(crate) execs: u64,
    /// Whether an exec is running or queued: a busy container is never removed.
    pub(crate) busy: bool,
    /// Its uses when the snapshot was taken: a removal is dropped if it was used since.
    pub(crate) uses: u64,
    /// Its owner (tenant and user), for the per-user cap.
    pub(crate) user: super::OwnerKey,
}

/// The containers about to start, for which the caps must leave room.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Room<'a> {
    /// How many, all users together.
    pub(crate) total: usize,
    /// The owner of the one a request is waiting for, who gets room under the per-user
    /// cap too; `None`: no such request.
    pub(crate) user: Option<&'a super::OwnerKey>,
}

/// The containers to remove, as indexes into `live` with the reason, so that after
/// `room.total` more containers start, no more than the cap are alive, and no more than
/// the per-user cap are `room.user`'s. TTL victims come first, then the user's least
/// recently used idle ones, then anyone's. Busy containers are kept even over a cap (the
/// cap is then reached again as they finish).
pub(crate) fn victims(
    policy: &Policy,
    live: &[Live],
    now_ms: u64,
    room: Room,
) -> Vec<(usize, Reason)> {
    let mut out = Vec::new();
    let mut keep = Vec::new();
    for (i, s) in live.iter().enumerate() {
        let idle_for = now_ms.saturating_sub(s.last_used_ms);
        let reason = if s.busy {
            None
        } else if idle_for >= policy.idle_ttl_ms {
            Some(Reason::Idle)
        } else if policy.single_use_ttl_ms > 0
            && s.execs <= 1
            && idle_for >= policy.single_use_ttl_ms
        {
            Some(Reason::SingleUse)
        } else {
            None
        };
        match reason {
            Some(r) => out.push((i, r)),
            None => keep.push(i),
        }
    }
    if let (true, Some(user)) = (policy.max_per_user > 0, room.user) {
        let mine = |i: &usize| &live[*i].user == user;
        let wanted = keep.iter().filter(|i| mine(i)).count() + 1;
        let excess = wanted.saturating_sub(policy.max_per_user);
        let mut idle: Vec<usize> = keep
            .iter()
            .copied()
            .filter(|i| mine(i) && !live[*i].busy)
            .collect();
        idle.sort_by_key(|&i| (live[i].last_used_ms, i));
        idle.truncate(excess);
        keep.retain(|i| !idle.contains(i));
        out.extend(idle.into_iter().map(|i| (i, Reason::OverUserCap)));
    }
    if policy.max_live > 0 {
        let wanted = keep.len() + room.total;
        let excess = wanted.saturating_sub(policy.max_live);
        let mut idle: Vec<usize> = keep.into_iter().filter(|&i| !live[i].busy).collect();
        idle.sort_by_key(|&i| (live[i].last_used_ms, i));
        out.extend(idle.into_iter().take(excess).map(|i| (i, Reason::OverCap)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1000;

    fn live(last_used_s: u64, execs: u64, busy: bool) -> Live {
        Live {
            last_used_ms: last_used_s * SEC,
            execs,
            busy,
            uses: 0,
            user: (None, None),
        }
    }

    fn policy(max_live: usize) -> Policy {
        Policy {
            idle_ttl_ms: 600 * SEC,
            single_use_ttl_ms: 30 * SEC,
            max_live,
            max_per_user: 0,
        }
    }

    /// Room for `total` more, none of them for a waiting user.
    fn room(total: usize) -> Room<'static> {
        Room { total, user: None }
    }

    #[test]
    fn ttls_remove_idle_and_single_use_containers() {
        let now = 1000 * SEC;
        let sessions = [
            live(1000, 1, false), // just used once
            live(960, 1, false),  // used once, 40 s ago: single-use TTL
            live(960, 5, false),  // used often, 40 s ago: stays
            live(300, 9, false),  // idle 700 s: idle TTL
            live(100, 0, true),   // busy: never removed
            live(971, 1, false),  // used once, 29 s ago: stays
        ];
        assert_eq!(
            victims(&policy(0), &sessions, now, room(0)),
            vec![(1, Reason::SingleUse), (3, Reason::Idle)]
        );
        // Turned off, only the idle TTL applies.
        let mut p = policy(0);
        p.single_use_ttl_ms = 0;
        assert_eq!(
            victims(&p, &sessions, now, room(0)),
            vec![(3, Reason::Idle)]
        );
    }

    #[test]
    fn the_cap_evicts_least_recently_used_idle_containers() {
        let now = 100 * SEC;
        let sessions = [
            live(90, 3, false),
            live(80, 3, true), // the oldest, but busy
            live(85, 3, false),
            live(95, 3, false),
        ];
        // Four alive, cap four: room for one more means one goes, the oldest idle one.
        assert_eq!(
            victims(&policy(4), &sessions, now, room(1)),
            vec![(2, Reason::OverCap)]
        );
        assert_eq!(victims(&policy(4), &sessions, now, room(0)), vec![]);
        // Cap two, room for one: three go, never the busy one.
        assert_eq!(
            victims(&policy(2), &sessions, now, room(1)),
            vec![
                (2, Reason::OverCap),
                (0, Reason::OverCap),
                (3, Reason::OverCap)
            ]
        );
        // All busy: nothing can go.
        let busy = [live(1, 1, true), live(2, 1, true)];
        assert_eq!(victims(&policy(1), &busy, now, room(1)), vec![]);
    }

    #[test]
    fn ttl_victims_count_towards_the_cap() {
        let now = 100 * SEC;
        let sessions = [
            live(10, 1, false), // single-use, expired
            live(90, 2, false),
            live(95, 2, false),
        ];
        // After the single-use one goes, two remain: room for one more under a cap of 3.
        assert_eq!(
            victims(&policy(3), &sessions, now, room(1)),
            vec![(0, Reason::SingleUse)]
        );
        assert_eq!(
            victims(&policy(2), &sessions, now, room(1)),
            vec![(0, Reason::SingleUse), (1, Reason::OverCap)]
        );
    }

    #[test]
    fn the_per_user_cap_evicts_that_users_least_recently_used_idle_container() {
        let now = 100 * SEC;
        let of = |user: &str, last_used_s: u64, busy: bool| Live {
            user: (Some("t".into()), Some(user.into())),
            ..live(last_used_s, 3, busy)
        };
        let sessions = [
            of("a", 90, false),
            of("b", 10, false), // the oldest of all, but not a's
            of("a", 80, true),  // a's oldest, but busy
            of("a", 85, false),
        ];
        let mut p = policy(0);
        p.max_per_user = 3;
        let (a, b) = (
            (Some("t".to_string()), Some("a".to_string())),
            (Some("t".to_string()), Some("b".to_string())),
        );
        let for_a = Room {
            total: 1,
            user: Some(&a),
        };
        assert_eq!(
            victims(&p, &sessions, now, for_a),
            vec![(3, Reason::OverUserCap)]
        );
        // Room for b: b has one of three.
        let for_b = Room {
            total: 1,
            user: Some(&b),
        };
        assert_eq!(victims(&p, &sessions, now, for_b), vec![]);
        // Cap one: both of a's idle ones go, the busy one stays (the caller then gets 429).
        p.max_per_user = 1;
        assert_eq!(
            victims(&p, &sessions, now, for_a),
            vec![(3, Reason::OverUserCap), (0, Reason::OverUserCap)]
        );
        // With a global cap too, what the user's own removal freed counts.
        p.max_per_user = 3;
        p.max_live = 4;
        assert_eq!(
            victims(&p, &sessions, now, for_a),
            vec![(3, Reason::OverUserCap)]
        );
        p.max_live = 3;
        assert_eq!(
            victims(&p, &sessions, now, for_a),
            vec![(3, Reason::OverUserCap), (1, Reason::OverCap)]
        );
    }
}
