//! Rate limits and capacity, each a setting and each off at 0: a per-user exec rate (a
//! token bucket), a per-user cap on live sessions (sessions with a running container) and
//! a cap on session containers for the whole broker, derived by default from the Docker
//! host's memory. Going over any of them is a 429 `rate_limited` with
//! `retry_after_seconds` (docs/API.md, "Limits"). Before a cap refuses, the broker removes the least
//! recently used idle container in the way (`session::evict`), so only running code
//! holds a place.
//!
//! A user is counted in their tenant: `alice` of one key (or JWT tenant) and `alice` of
//! another have budgets of their own. Callers of one tenant that name no user (an API key
//! alone, or auth off) share one budget: such a caller is one front end acting for
//! everyone behind it (LobeChat, an MCP client, the playground), and nothing in its
//! requests tells its users apart; a front end that names its users (`User-Id`, a JWT)
//! gets a budget per user.

use crate::clock::now_ms;
use crate::config::{Caps, ContainerCap};
use crate::core::capacity::HostMemory;
use crate::core::error::{Error, Result};
use crate::session::{OwnerKey, Registry};
use crate::sync::LockExt as _;
use sha2::Digest as _;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::time::Instant;

/// Most input refs (`files[]`) one exec may carry: each places a copy of a file in the
/// workspace, and one request must not turn one upload into thousands of copies.
pub(crate) const MAX_INPUT_REFS: usize = 100;

/// Most names in `/mnt/data` at which the broker places one file's bytes (an upload, an
/// input ref) in a session, for files of more than [`NAMES_CAP_FROM_BYTES`]: each name is
/// a full copy, and a client has no reason to want a large file under many names.
/// Smaller files (an empty `__init__.py` in every package) are bounded by the storage
/// budget alone.
pub(crate) const MAX_NAMES_PER_BLOB: usize = 16;

/// Files up to this size may be placed under any number of names (each copy still
/// counts against the storage budget).
pub(crate) const NAMES_CAP_FROM_BYTES: u64 = 64 * 1024;

/// Whether one more placed copy of a file of `size` bytes, already placed under
/// `placed_names` other names, goes over [`MAX_NAMES_PER_BLOB`].
pub(crate) fn too_many_names(size: u64, placed_names: usize) -> bool {
    size > NAMES_CAP_FROM_BYTES && placed_names >= MAX_NAMES_PER_BLOB
}

/// Refuses (400) an exec that carries `count` input refs, more than [`MAX_INPUT_REFS`],
/// before anything is placed.
pub(crate) fn check_input_refs(count: usize) -> Result<()> {
    if count > MAX_INPUT_REFS {
        return Err(Error::BadRequest(format!(
            "an exec may carry at most {MAX_INPUT_REFS} input files; this one carries {count}"
        )));
    }
    Ok(())
}

/// Above this many users' buckets, the full ones (users idle long enough to have their
/// whole budget back) are forgotten, so the map does not grow with every user ever seen.
const PRUNE_ABOVE: usize = 4096;

/// Most users' buckets kept at once. Past it (after pruning), a user not yet in the map
/// gets a 503 until buckets fill up again: the map stays within a few MiB (keys are
/// digests) however many user names a caller makes up, and known users keep their
/// budgets.
pub(crate) const MAX_BUCKETS: usize = 65_536;

/// Least time between two prunes of the bucket map while it is over [`PRUNE_ABOVE`], so a
/// flood of new names does not rescan it on every exec.
const PRUNE_EVERY: Duration = Duration::from_secs(1);

/// Who a budget or a cap is for: the tenant, and the user in it or `None` for the
/// tenant's callers that name none.
type UserKey = OwnerKey;

/// A rate bucket's key: a digest of the [`UserKey`], so that a bucket costs the same
/// whatever the length of the name it is for.
type BucketKey = [u8; 16];

fn bucket_key(owner: &UserKey) -> BucketKey {
    let mut digest = sha2::Sha256::new();
    for part in [&owner.0, &owner.1] {
        match part {
            // Length-prefixed, so that no two keys run together into one.
            Some(text) => {
                digest.update([1]);
                digest.update((text.len() as u64).to_le_bytes());
                digest.update(text.as_bytes());
            }
            None => digest.update([0]),
        }
    }
    let mut key = [0; 16];
    key.copy_from_slice(&digest.finalize()[..16]);
    key
}

/// Every limit of the broker.
pub(crate) struct Limits {
    /// The per-user exec rate; `None` when `CODEBROKER_RATE_EXECS_PER_MINUTE` is 0.
    exec_rate: Option<TokenBuckets>,
    /// Most live sessions one user may have (0: no cap): the setting, and never more
    /// than CODEBROKER_USER_SHARE_PERCENT of `max_total` (at least 1).
    max_per_user: usize,
    /// Most session containers in all (0: no cap), CODEBROKER_MAX_CONTAINERS resolved.
    max_total: usize,
    /// How long an exec may run at most, in ms: a busy container frees its place by then,
    /// which is what a capacity 429's `retry_after_seconds` is made from.
    busy_for_ms: u64,
    /// Container starts admitted but not yet live, so that starts racing each other cannot
    /// all pass a cap that only one of them fits under.
    starting: Arc<Mutex<Starting>>,
    /// With CODEBROKER_MAX_CONTAINERS=auto on the Docker host: admission by the memory
    /// the host has now, below `max_total` (the hard ceiling).
    memory: Option<HostMemory>,
}

/// Seconds a client refused for want of memory is told to wait: memory comes back as
/// idle sandboxes are removed, not when an exec ends.
const MEMORY_RETRY_SECS: u64 = 5;

/// Container starts under way.
#[derive(Default)]
struct Starting {
    /// All of them.
    total: usize,
    /// Per user.
    per_user: HashMap<UserKey, usize>,
}

/// A session that holds a running container, as the caps see it.
#[derive(Debug, Clone)]
pub(crate) struct LiveSession {
    /// Its owner.
    pub(crate) user: UserKey,
    /// Milliseconds since the epoch of its last use (an exec touches it as it starts).
    pub(crate) last_used_ms: u64,
    /// Whether code runs in it (or waits to): only those hold a place a new session
    /// cannot take, since idle ones are removed to make room.
    pub(crate) busy: bool,
}

/// The right to start (or hand out) one session container. Hold it until the container
/// is set on its session; dropping it frees the place it reserved.
#[must_use = "the reservation ends when the slot is dropped"]
pub(crate) struct ContainerSlot {
    /// Where the reservation is counted: owned, so that admission can hand the slot to the
    /// exec's task, which starts the container.
    starting: Arc<Mutex<Starting>>,
    /// The user it is counted for; `None` when no cap is on and nothing was counted.
    user: Option<UserKey>,
}

impl Drop for ContainerSlot {
    fn drop(&mut self) {
        let Some(user) = self.user.take() else {
            return;
        };
        Limits::release(&mut self.starting.locked(), &user);
    }
}

impl Limits {
    /// The limits `caps` asks for, on a host with `host_memory` bytes of RAM (`None`:
    /// unknown) running sandboxes of `sandbox_memory_mb` each; a session stays busy for at
    /// most `busy_for_ms` (the longest exec allowed).
    pub(crate) fn new(
        caps: &Caps,
        sandbox_memory_mb: u64,
        busy_for_ms: u64,
        host_memory: Option<u64>,
    ) -> Limits {
        let exec_rate = (caps.rate_execs_per_minute > 0).then(|| {
            let burst = if caps.rate_burst > 0 {
                caps.rate_burst
            } else {
                caps.rate_execs_per_minute
            };
            TokenBuckets::new(caps.rate_execs_per_minute, burst)
        });
        let memory = match caps.max_containers {
            ContainerCap::Auto => HostMemory::for_host(&caps.host_proc, host_memory),
            ContainerCap::Count(_) => None,
        };
        let max_total = match (&memory, host_memory) {
            (Some(_), Some(host)) => crate::config::auto_ceiling(host),
            _ => caps.max_containers.resolve(host_memory, sandbox_memory_mb),
        };
        let max_per_user = match (caps.max_sessions_per_user, max_total) {
            (0, _) => 0,
            (n, 0) => n,
            (n, total) => n.min(user_share(total, caps.user_share_percent)),
        };
        Limits {
            exec_rate,
            max_per_user,
            max_total,
            busy_for_ms,
            starting: Arc::default(),
            memory,
        }
    }

    /// Whether the host's memory refuses one more sandbox now (with the starts under way
    /// counted): then a start first takes an idle sandbox's place, as at the ceiling.
    pub(crate) fn memory_is_short(&self) -> bool {
        let Some(memory) = &self.memory else {
            return false;
        };
        let starting = self.lock().total;
        memory.room(starting).is_err()
    }

    /// Most session containers in all (0: no cap).
    pub(crate) fn max_containers(&self) -> usize {
        self.max_total
    }

    /// Most live sessions per user (0: no cap).
    pub(crate) fn max_sessions_per_user(&self) -> usize {
        self.max_per_user
    }

    /// Takes one exec from `owner`'s budget, or says when the next one is allowed.
    pub(crate) fn check_exec(&self, owner: &UserKey) -> Result<()> {
        let Some(rate) = &self.exec_rate else {
            return Ok(());
        };
        rate.take(owner, Instant::now()).map_err(|refused| match refused {
            Refused::Wait(retry_after_seconds) => Error::RateLimited {
                message: format!(
                    "too many executions: at most {} per minute{}; retry in {retry_after_seconds} s",
                    rate.per_minute,
                    if owner.1.is_some() { " per user" } else { "" },
                ),
                retry_after_seconds,
            },
            Refused::Full => Error::Unavailable(format!(
                "too many users are being rate limited at once ({MAX_BUCKETS}); retry shortly"
            )),
        })
    }

    /// The sessions holding a running container, as the caps see them.
    fn live(registry: &Registry) -> Vec<LiveSession> {
        registry
            .all()
            .iter()
            .filter(|s| s.sandbox().is_some_and(|sb| sb.is_alive()))
            .map(|s| LiveSession {
                user: s.owner_key(),
                last_used_ms: s.last_used_ms(),
                busy: s.is_busy(),
            })
            .collect()
    }

    /// The 429 [`Limits::container_slot`] would answer `owner` however many idle
    /// containers were removed first: when their sessions running code (and their starts
    /// under way) already fill the per-user cap. Checked before any removal, so that a
    /// request refused anyway takes no other user's idle container.
    pub(crate) fn check_user_room(&self, registry: &Registry, owner: &UserKey) -> Result<()> {
        if self.max_per_user == 0 {
            return Ok(());
        }
        let live = Self::live(registry);
        let starting = self.lock();
        self.user_room(&starting, &live, owner, now_ms())
    }

    /// See [`Limits::check_user_room`].
    fn user_room(
        &self,
        starting: &Starting,
        live: &[LiveSession],
        owner: &UserKey,
        now_ms: u64,
    ) -> Result<()> {
        let busy = live.iter().filter(|s| s.busy && &s.user == owner);
        let starting_mine = starting.per_user.get(owner).copied().unwrap_or(0);
        if busy.clone().count() + starting_mine >= self.max_per_user {
            return Err(self.user_cap_error(owner, busy, now_ms));
        }
        Ok(())
    }

    fn user_cap_error<'a>(
        &self,
        owner: &UserKey,
        mine: impl Iterator<Item = &'a LiveSession>,
        now_ms: u64,
    ) -> Error {
        Error::RateLimited {
            message: format!(
                "too many live sessions: at most {} with a running sandbox{}; reuse a \
                 session_id or retry later",
                self.max_per_user,
                if owner.1.is_some() { " per user" } else { "" },
            ),
            retry_after_seconds: self.retry_after(mine, now_ms),
        }
    }

    /// Reserves a place for one more container of `owner`'s, when the caps allow it.
    ///
    /// `room_made`: idle sandboxes were just removed for this start, so the memory they
    /// free is about to come back and the host's memory is not read for it.
    pub(crate) fn container_slot(
        &self,
        registry: &Registry,
        owner: &UserKey,
        room_made: bool,
    ) -> Result<ContainerSlot> {
        if self.max_per_user == 0 && self.max_total == 0 {
            return Ok(ContainerSlot {
                starting: self.starting.clone(),
                user: None,
            });
        }
        let live = Self::live(registry);
        // Counted under the lock, so that two starts cannot both take the last place.
        let mut starting = self.lock();
        self.admit(&mut starting, &live, owner, now_ms())?;
        if !room_made {
            if let Some(Err(why)) = self.memory.as_ref().map(|m| m.room(starting.total - 1)) {
                Self::release(&mut starting, owner);
                return Err(Error::RateLimited {
                    message: format!("{why}, and every sandbox is running code; retry later"),
                    retry_after_seconds: MEMORY_RETRY_SECS,
                });
            }
        }
        Ok(ContainerSlot {
            starting: self.starting.clone(),
            user: Some(owner.clone()),
        })
    }

    /// Checks both caps against the live sessions plus the starts under way, and counts
    /// one more start.
    fn admit(
        &self,
        starting: &mut Starting,
        live: &[LiveSession],
        owner: &UserKey,
        now_ms: u64,
    ) -> Result<()> {
        let key: UserKey = owner.clone();
        if self.max_total > 0 && live.len() + starting.total >= self.max_total {
            return Err(Error::RateLimited {
                message: format!(
                    "the broker is at capacity ({} sandboxes running); retry later",
                    self.max_total
                ),
                retry_after_seconds: self.retry_after(live.iter(), now_ms),
            });
        }
        let starting_mine = starting.per_user.get(&key).copied().unwrap_or(0);
        let mine = live.iter().filter(|s| s.user == key);
        if self.max_per_user > 0 && mine.clone().count() + starting_mine >= self.max_per_user {
            return Err(self.user_cap_error(owner, mine, now_ms));
        }
        starting.total += 1;
        *starting.per_user.entry(key).or_insert(0) += 1;
        Ok(())
    }

    /// Seconds until the first of `live` frees its place: a busy one when its exec has
    /// run the longest an exec may, an idle one (the eviction lost a race to a new exec)
    /// at once; at least 1.
    fn retry_after<'a>(&self, live: impl Iterator<Item = &'a LiveSession>, now_ms: u64) -> u64 {
        live.map(|s| {
            if s.busy {
                s.last_used_ms
                    .saturating_add(self.busy_for_ms)
                    .saturating_sub(now_ms)
            } else {
                0
            }
        })
        .min()
        .map_or(1, |ms| ms.div_ceil(1000).max(1))
    }

    /// Uncounts one start of `user`'s (admitted by [`Limits::admit`]).
    fn release(starting: &mut Starting, user: &UserKey) {
        starting.total = starting.total.saturating_sub(1);
        if let Some(n) = starting.per_user.get_mut(user) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                starting.per_user.remove(user);
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, Starting> {
        // Counters only; a panic elsewhere leaves them usable.
        self.starting.locked()
    }
}

/// Most live sessions one user may have under a cap of `total` containers:
/// `percent` of it, at least one.
fn user_share(total: usize, percent: u8) -> usize {
    (total.saturating_mul(usize::from(percent)) / 100).max(1)
}

/// Why the rate buckets refused an exec.
#[derive(Debug, PartialEq, Eq)]
enum Refused {
    /// The user's budget is spent: seconds until the next token.
    Wait(u64),
    /// The map holds [`MAX_BUCKETS`] users' buckets, none of them full, and this user has
    /// none yet.
    Full,
}

/// One token bucket per user: `burst` tokens at most, refilled at `per_minute` a minute.
struct TokenBuckets {
    /// Refill rate, for messages.
    per_minute: u32,
    /// Refill rate in tokens a second.
    per_second: f64,
    /// Bucket size: how many execs may come at once after a pause.
    burst: f64,
    /// The buckets, by user.
    buckets: Mutex<Buckets>,
}

/// The buckets, and when they were last pruned.
struct Buckets {
    /// By the digest of the user's key.
    by_user: HashMap<BucketKey, Bucket>,
    /// When full buckets were last dropped (see [`PRUNE_EVERY`]).
    pruned_at: Option<Instant>,
}

/// One user's budget.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    /// Tokens left at `at`.
    tokens: f64,
    /// When `tokens` was computed.
    at: Instant,
}

impl Bucket {
    fn tokens_at(&self, now: Instant, per_second: f64, burst: f64) -> f64 {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        (self.tokens + elapsed * per_second).min(burst)
    }
}

impl TokenBuckets {
    fn new(per_minute: u32, burst: u32) -> TokenBuckets {
        TokenBuckets {
            per_minute,
            per_second: f64::from(per_minute) / 60.0,
            burst: f64::from(burst.max(1)),
            buckets: Mutex::new(Buckets {
                by_user: HashMap::new(),
                pruned_at: None,
            }),
        }
    }

    /// Takes a token of `owner`'s at `now`, or says why not.
    fn take(&self, owner: &UserKey, now: Instant) -> Result<(), Refused> {
        let mut guard = self.buckets.locked();
        let buckets = &mut *guard;
        let key = bucket_key(owner);
        if !buckets.by_user.contains_key(&key) && buckets.by_user.len() > PRUNE_ABOVE {
            // A full bucket is what a user without one gets: forgetting it changes nothing.
            let due = buckets
                .pruned_at
                .is_none_or(|at| now.saturating_duration_since(at) >= PRUNE_EVERY);
            if due {
                let (rate, burst) = (self.per_second, self.burst);
                buckets
                    .by_user
                    .retain(|_, b| b.tokens_at(now, rate, burst) < burst);
                buckets.pruned_at = Some(now);
            }
            if buckets.by_user.len() >= MAX_BUCKETS {
                return Err(Refused::Full);
            }
        }
        let bucket = buckets.by_user.entry(key).or_insert(Bucket {
            tokens: self.burst,
            at: now,
        });
        bucket.tokens = bucket.tokens_at(now, self.per_second, self.burst);
        bucket.at = now;
        // A hair below 1 is float error after waiting exactly the time we told.
        if bucket.tokens >= 1.0 - 1e-9 {
            bucket.tokens = (bucket.tokens - 1.0).max(0.0);
            return Ok(());
        }
        let wait = (1.0 - bucket.tokens) / self.per_second;
        Err(Refused::Wait((wait.ceil() as u64).max(1)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, ContainerCap};

    /// `name` in tenant `t`.
    fn u(name: &str) -> UserKey {
        (Some("t".into()), Some(name.into()))
    }

    /// Tenant `t`'s callers that name no user.
    fn nobody() -> UserKey {
        (Some("t".into()), None)
    }

    fn limits(adjust: impl FnOnce(&mut Config)) -> Limits {
        let mut config = Config::for_tests("/tmp".into(), "limits-test");
        adjust(&mut config);
        Limits::new(
            &config.caps,
            config.sandbox.memory_mb,
            config.exec_limits.max_exec_timeout_ms,
            None,
        )
    }

    fn retry_after(err: Error) -> u64 {
        match err {
            Error::RateLimited {
                retry_after_seconds,
                ..
            } => retry_after_seconds,
            other => panic!("expected rate_limited, got {other:?}"),
        }
    }

    #[test]
    fn token_bucket_refills_at_the_rate() {
        let buckets = TokenBuckets::new(6, 2); // one token every 10 s, two at once
        let t0 = Instant::now();
        assert!(buckets.take(&u("a"), t0).is_ok());
        assert!(buckets.take(&u("a"), t0).is_ok());
        assert_eq!(buckets.take(&u("a"), t0), Err(Refused::Wait(10)));
        // Another user has a budget of their own.
        assert!(buckets.take(&u("b"), t0).is_ok());
        assert_eq!(
            buckets.take(&u("a"), t0 + Duration::from_secs(4)),
            Err(Refused::Wait(6))
        );
        assert!(buckets.take(&u("a"), t0 + Duration::from_secs(10)).is_ok());
        assert!(buckets.take(&u("a"), t0 + Duration::from_secs(10)).is_err());
        // A long pause gives back the burst, not more.
        let later = t0 + Duration::from_secs(3600);
        assert!(buckets.take(&u("a"), later).is_ok());
        assert!(buckets.take(&u("a"), later).is_ok());
        assert!(buckets.take(&u("a"), later).is_err());
        // Callers naming no user share one bucket.
        assert!(buckets.take(&nobody(), t0).is_ok());
        assert!(buckets.take(&nobody(), t0).is_ok());
        assert!(buckets.take(&nobody(), t0).is_err());
    }

    /// A user is a user of one tenant: the same name under another key or JWT tenant has
    /// a budget of its own, and so do each tenant's unnamed callers.
    #[test]
    fn each_tenant_has_its_own_buckets() {
        let buckets = TokenBuckets::new(6, 1);
        let t0 = Instant::now();
        let in_tenant =
            |t: &str, user: Option<&str>| (Some(t.to_string()), user.map(str::to_string));
        assert!(buckets.take(&in_tenant("t1", Some("alice")), t0).is_ok());
        assert!(buckets.take(&in_tenant("t1", Some("alice")), t0).is_err());
        assert!(buckets.take(&in_tenant("t2", Some("alice")), t0).is_ok());
        assert!(buckets.take(&in_tenant("t1", None), t0).is_ok());
        assert!(buckets.take(&in_tenant("t2", None), t0).is_ok());
        // Names that would run together if joined do not meet.
        assert!(buckets.take(&in_tenant("t1a", Some("lice")), t0).is_ok());
    }

    #[test]
    fn waiting_the_time_told_is_enough() {
        let buckets = TokenBuckets::new(7, 1);
        let mut now = Instant::now();
        for _ in 0..20 {
            if let Err(Refused::Wait(wait)) = buckets.take(&u("u"), now) {
                now += Duration::from_secs(wait);
                assert!(buckets.take(&u("u"), now).is_ok());
            }
        }
    }

    #[test]
    fn idle_buckets_are_pruned() {
        let buckets = TokenBuckets::new(60, 1);
        let t0 = Instant::now();
        for i in 0..=PRUNE_ABOVE {
            assert!(buckets.take(&u(&i.to_string()), t0).is_ok());
        }
        assert!(buckets
            .take(&u("late"), t0 + Duration::from_secs(5))
            .is_ok());
        assert!(buckets.buckets.lock().expect("lock").by_user.len() <= 2);
    }

    #[test]
    fn exec_rate_from_settings() {
        let off = limits(|_| {});
        for _ in 0..100 {
            assert!(off.check_exec(&u("u")).is_ok());
        }
        let on = limits(|c| {
            c.caps.rate_execs_per_minute = 60;
            c.caps.rate_burst = 2;
        });
        assert!(on.check_exec(&u("u")).is_ok());
        assert!(on.check_exec(&u("u")).is_ok());
        let err = on.check_exec(&u("u")).expect_err("third is over");
        assert_eq!(retry_after(err), 1);
        // The burst defaults to the per-minute rate.
        let default_burst = limits(|c| c.caps.rate_execs_per_minute = 3);
        for _ in 0..3 {
            assert!(default_burst.check_exec(&nobody()).is_ok());
        }
        assert_eq!(
            retry_after(default_burst.check_exec(&nobody()).expect_err("4th")),
            20
        );
    }

    fn live(user: &str, last_used_ms: u64, busy: bool) -> LiveSession {
        LiveSession {
            user: u(user),
            last_used_ms,
            busy,
        }
    }

    #[test]
    fn global_container_cap() {
        let limits = limits(|c| {
            c.caps.max_containers = ContainerCap::Count(2);
            c.exec_limits.max_exec_timeout_ms = 30_000;
        });
        let now = 1_000_000;
        let mut starting = Starting::default();
        let running = [live("a", now - 20_000, true), live("b", now - 5_000, true)];
        let err = limits
            .admit(&mut starting, &running, &u("c"), now)
            .expect_err("full");
        // a's exec started 20 s ago: it ends within the 30 s an exec may run.
        assert_eq!(retry_after(err), 10);
        assert!(limits
            .admit(&mut starting, &running[..1], &u("c"), now)
            .is_ok());
        // The start under way takes the last place.
        assert!(limits
            .admit(&mut starting, &running[..1], &u("d"), now)
            .is_err());
        // An idle one still counted (it was used again before it could be removed):
        // retry at once.
        let idle = [live("a", now - 20_000, true), live("b", now, false)];
        let err = limits
            .admit(&mut Starting::default(), &idle, &u("c"), now)
            .expect_err("full");
        assert_eq!(retry_after(err), 1);
    }

    #[test]
    fn per_user_session_cap() {
        let limits = limits(|c| {
            c.caps.max_sessions_per_user = 1;
            c.exec_limits.max_exec_timeout_ms = 5_000;
        });
        let now = 1_000_000;
        let mut starting = Starting::default();
        let running = [live("a", now, true)];
        let err = limits
            .admit(&mut starting, &running, &u("a"), now)
            .expect_err("a has one");
        assert_eq!(retry_after(err), 5);
        assert!(limits.admit(&mut starting, &running, &u("b"), now).is_ok());
        assert!(limits.admit(&mut starting, &running, &u("b"), now).is_err());
        // Long past the longest exec (a client that hangs on): retry soon, not never.
        let stale = [live("a", 0, true)];
        let err = limits
            .admit(&mut Starting::default(), &stale, &u("a"), now)
            .expect_err("still counted");
        assert_eq!(retry_after(err), 1);
    }

    #[test]
    fn one_user_gets_at_most_a_quarter_of_the_containers() {
        let capped = |per_user, total, percent| {
            limits(|c| {
                c.caps.max_sessions_per_user = per_user;
                c.caps.max_containers = ContainerCap::Count(total);
                c.caps.user_share_percent = percent;
            })
            .max_sessions_per_user()
        };
        assert_eq!(capped(8, 64, 25), 8);
        assert_eq!(capped(8, 17, 25), 4);
        assert_eq!(capped(8, 8, 25), 2);
        assert_eq!(capped(8, 6, 25), 1);
        assert_eq!(capped(8, 3, 25), 1, "at least one");
        assert_eq!(capped(8, 1, 25), 1);
        assert_eq!(capped(8, 0, 25), 8, "no total cap");
        assert_eq!(capped(0, 6, 25), 0, "no per-user cap");
        // The share is a setting: half, as before, or all of it.
        assert_eq!(capped(8, 6, 50), 3);
        assert_eq!(capped(8, 6, 100), 6);
        // The default is a quarter.
        let config = Config::for_tests("/tmp".into(), "limits-test");
        assert_eq!(config.caps.user_share_percent, 25);
        // auto on an unknown host: its minimum of two, one each.
        let auto = limits(|c| {
            c.caps.max_sessions_per_user = 8;
            c.caps.max_containers = ContainerCap::Auto;
        });
        assert_eq!(auto.max_containers(), crate::config::AUTO_CONTAINERS_MIN);
        assert_eq!(auto.max_sessions_per_user(), 1);
    }

    /// Four users at their share fill a cap of 16: no two or three of them can.
    #[test]
    fn three_users_do_not_fill_the_host() {
        let limits = limits(|c| {
            c.caps.max_sessions_per_user = 8;
            c.caps.max_containers = ContainerCap::Count(16);
        });
        let now = 1_000_000;
        let mut starting = Starting::default();
        let mut live = Vec::new();
        for user in ["a", "b", "c"] {
            for _ in 0..4 {
                live.push(live_of(user, now, true));
            }
            assert!(limits
                .admit(&mut Starting::default(), &live, &u(user), now)
                .is_err());
        }
        assert!(limits.admit(&mut starting, &live, &u("d"), now).is_ok());
    }

    fn live_of(user: &str, last_used_ms: u64, busy: bool) -> LiveSession {
        live(user, last_used_ms, busy)
    }

    /// A capacity 429's `retry_after_seconds` is made from the longest exec the broker
    /// runs: code mode's 60 s when it is on, not the 30 s of a plain exec.
    #[test]
    fn retry_after_matches_the_longest_exec() {
        let mut config = Config::for_tests("/tmp".into(), "limits-test");
        config.exec_limits.max_exec_timeout_ms = 30_000;
        config.code_mode.codemode_timeout_ms = 60_000;
        config.code_mode.codemode = false;
        assert_eq!(config.longest_exec_ms(), 30_000);
        config.code_mode.codemode = true;
        assert_eq!(config.longest_exec_ms(), 60_000);
        config.caps.max_containers = ContainerCap::Count(1);
        let limits = Limits::new(
            &config.caps,
            config.sandbox.memory_mb,
            config.longest_exec_ms(),
            None,
        );
        let now = 1_000_000;
        // A code-mode exec that started 40 s ago may run 20 s more.
        let running = [live("a", now - 40_000, true)];
        let err = limits
            .admit(&mut Starting::default(), &running, &u("b"), now)
            .expect_err("full");
        assert_eq!(retry_after(err), 20);
    }

    /// A request the per-user cap refuses anyway is refused before anything is evicted:
    /// only the user's busy sessions (and starts) count, since their idle ones would make
    /// room.
    #[test]
    fn the_user_cap_is_checked_before_any_eviction() {
        let limits = limits(|c| {
            c.caps.max_sessions_per_user = 1;
            c.caps.max_containers = ContainerCap::Count(2);
            c.exec_limits.max_exec_timeout_ms = 10_000;
        });
        let now = 1_000_000;
        let a_busy_b_idle = [live("a", now - 4_000, true), live("b", now, false)];
        let err = limits
            .user_room(&Starting::default(), &a_busy_b_idle, &u("a"), now)
            .expect_err("a's one place runs code");
        assert_eq!(retry_after(err), 6);
        // b's idle one is not b's obstacle, nor a's idle one a's.
        assert!(limits
            .user_room(&Starting::default(), &a_busy_b_idle, &u("b"), now)
            .is_ok());
        let a_idle = [live("a", now, false)];
        assert!(limits
            .user_room(&Starting::default(), &a_idle, &u("a"), now)
            .is_ok());
        // A start under way counts.
        let mut starting = Starting::default();
        assert!(limits.admit(&mut starting, &[], &u("c"), now).is_ok());
        assert!(limits.user_room(&starting, &[], &u("c"), now).is_err());
        // The same name in another tenant is another user.
        let other_tenant = (Some("t2".to_string()), Some("a".to_string()));
        assert!(limits
            .user_room(&Starting::default(), &a_busy_b_idle, &other_tenant, now)
            .is_ok());
    }

    /// Made-up user names cannot grow the bucket map without bound: past
    /// [`MAX_BUCKETS`] a new name gets a 503 while known users keep their budgets, and
    /// once buckets have filled up again (by age) new names are served.
    #[tokio::test(start_paused = true)]
    async fn the_rate_map_is_bounded() {
        let limits = limits(|c| {
            c.caps.rate_execs_per_minute = 1;
            c.caps.rate_burst = 1;
        });
        for i in 0..MAX_BUCKETS {
            limits
                .check_exec(&u(&format!("user-{i}")))
                .expect("first exec");
        }
        let buckets = limits.exec_rate.as_ref().expect("rate on");
        let size = || buckets.buckets.lock().expect("lock").by_user.len();
        assert_eq!(size(), MAX_BUCKETS);
        match limits.check_exec(&u("one-more")) {
            Err(Error::Unavailable(message)) => {
                assert!(message.contains("rate limited"), "{message}")
            }
            other => panic!("expected 503, got {other:?}"),
        }
        assert_eq!(size(), MAX_BUCKETS, "nothing added");
        // A known user is still rated as before: spent, told when to retry.
        assert_eq!(
            retry_after(limits.check_exec(&u("user-7")).expect_err("spent")),
            60
        );
        // A long name costs what a short one does.
        let long = "x".repeat(100_000);
        assert!(matches!(
            limits.check_exec(&u(&long)),
            Err(Error::Unavailable(_))
        ));
        // A minute on, every bucket is full again and is forgotten: new names are served.
        tokio::time::advance(Duration::from_secs(61)).await;
        limits.check_exec(&u("one-more")).expect("served");
        assert!(size() <= 2, "{}", size());
        limits.check_exec(&u(&long)).expect("served");
    }

    #[test]
    fn slots_hold_a_place_until_dropped() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let registry = Registry::new(tmp.path(), None);
        let limits = limits(|c| c.caps.max_containers = ContainerCap::Count(1));
        let slot = limits
            .container_slot(&registry, &u("a"), false)
            .expect("free");
        assert!(limits.container_slot(&registry, &u("b"), false).is_err());
        drop(slot);
        assert!(limits.container_slot(&registry, &u("b"), false).is_ok());
        // No cap: nothing is counted.
        let open = self::limits(|_| {});
        let slots: Vec<_> = (0..10)
            .map(|_| {
                open.container_slot(&registry, &nobody(), false)
                    .expect("open")
            })
            .collect();
        assert_eq!(slots.len(), 10);
        assert_eq!(open.lock().total, 0);
    }
}
