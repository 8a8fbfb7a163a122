//! Rate limits and capacity, each a setting and each off at 0: a per-user exec rate (a
//! token bucket), a per-user cap on live sessions (sessions with a running container) and
//! a cap on session containers for the whole broker, derived by default from the Docker
//! host's memory. Going over any of them is a 429 `rate_limited` with
//! `retry_after_seconds` (docs/API.md, "Limits"). Before a cap refuses, the broker removes the least
//! recently used idle container in the way (`session::evict`), so only running code
//! holds a place.
//!
//! Callers that name no user (an API key alone, or auth off) share one budget: such a
//! caller is one front end acting for everyone behind it (LobeChat, an MCP client, the
//! playground), and nothing in its requests tells its users apart. Per-key budgets would
//! not either, as all those users share the key; a front end that names its users
//! (`User-Id`, a JWT) gets a budget per user.

use crate::clock::now_ms;
use crate::config::Caps;
use crate::core::error::{Error, Result};
use crate::session::Registry;
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use tokio::time::Instant;

/// Most input refs (`files[]`) one exec may carry: each places a copy of a file in the
/// workspace, and one request must not turn one upload into thousands of copies.
pub(crate) const MAX_INPUT_REFS: usize = 100;

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

/// Who a budget or a cap is for: the user, or `None` for callers that name none.
type UserKey = Option<String>;

/// Every limit of the broker.
pub struct Limits {
    /// The per-user exec rate; `None` when `CODEBROKER_RATE_EXECS_PER_MINUTE` is 0.
    exec_rate: Option<TokenBuckets>,
    /// Most live sessions one user may have (0: no cap): the setting, and never more
    /// than half of `max_total`.
    max_per_user: usize,
    /// Most session containers in all (0: no cap), CODEBROKER_MAX_CONTAINERS resolved.
    max_total: usize,
    /// How long an exec may run at most, in ms: a busy container frees its place by then,
    /// which is what a capacity 429's `retry_after_seconds` is made from.
    busy_for_ms: u64,
    /// Container starts admitted but not yet live, so that starts racing each other cannot
    /// all pass a cap that only one of them fits under.
    starting: Mutex<Starting>,
}

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
pub(crate) struct ContainerSlot<'a> {
    /// Where the reservation is counted.
    limits: &'a Limits,
    /// The user it is counted for; `None` when no cap is on and nothing was counted.
    user: Option<UserKey>,
}

impl Drop for ContainerSlot<'_> {
    fn drop(&mut self) {
        let Some(user) = self.user.take() else {
            return;
        };
        let mut starting = self.limits.lock();
        starting.total = starting.total.saturating_sub(1);
        if let Some(n) = starting.per_user.get_mut(&user) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                starting.per_user.remove(&user);
            }
        }
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
        let max_total = caps.max_containers.resolve(host_memory, sandbox_memory_mb);
        let max_per_user = match (caps.max_sessions_per_user, max_total) {
            (0, _) => 0,
            (n, 0) => n,
            (n, total) => n.min(total.div_ceil(2)),
        };
        Limits {
            exec_rate,
            max_per_user,
            max_total,
            busy_for_ms,
            starting: Mutex::new(Starting::default()),
        }
    }

    /// Most session containers in all (0: no cap).
    pub fn max_containers(&self) -> usize {
        self.max_total
    }

    /// Most live sessions per user (0: no cap).
    pub fn max_sessions_per_user(&self) -> usize {
        self.max_per_user
    }

    /// Takes one exec from `user`'s budget, or says when the next one is allowed.
    pub(crate) fn check_exec(&self, user: Option<&str>) -> Result<()> {
        let Some(rate) = &self.exec_rate else {
            return Ok(());
        };
        rate.take(user, Instant::now())
            .map_err(|retry_after_seconds| Error::RateLimited {
                message: format!(
                    "too many executions: at most {} per minute{}; retry in {retry_after_seconds} s",
                    rate.per_minute,
                    if user.is_some() { " per user" } else { "" },
                ),
                retry_after_seconds,
            })
    }

    /// Reserves a place for one more container of `user`'s, when the caps allow it.
    pub(crate) fn container_slot(
        &self,
        registry: &Registry,
        user: Option<&str>,
    ) -> Result<ContainerSlot<'_>> {
        if self.max_per_user == 0 && self.max_total == 0 {
            return Ok(ContainerSlot {
                limits: self,
                user: None,
            });
        }
        // Counted under the lock, so that two starts cannot both take the last place.
        let mut starting = self.lock();
        let live: Vec<LiveSession> = registry
            .all()
            .iter()
            .filter(|s| s.sandbox().is_some_and(|sb| sb.is_alive()))
            .map(|s| LiveSession {
                user: s.meta.user.clone(),
                last_used_ms: s.last_used_ms(),
                busy: s.is_busy(),
            })
            .collect();
        self.admit(&mut starting, &live, user, now_ms())?;
        Ok(ContainerSlot {
            limits: self,
            user: Some(user.map(str::to_string)),
        })
    }

    /// Checks both caps against the live sessions plus the starts under way, and counts
    /// one more start.
    fn admit(
        &self,
        starting: &mut Starting,
        live: &[LiveSession],
        user: Option<&str>,
        now_ms: u64,
    ) -> Result<()> {
        let key: UserKey = user.map(str::to_string);
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
            return Err(Error::RateLimited {
                message: format!(
                    "too many live sessions: at most {} with a running sandbox{}; reuse a \
                     session_id or retry later",
                    self.max_per_user,
                    if user.is_some() { " per user" } else { "" },
                ),
                retry_after_seconds: self.retry_after(mine, now_ms),
            });
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

    fn lock(&self) -> MutexGuard<'_, Starting> {
        // Counters only; a panic elsewhere leaves them usable.
        self.starting.lock().unwrap_or_else(|p| p.into_inner())
    }
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
    buckets: Mutex<HashMap<UserKey, Bucket>>,
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
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes a token of `user`'s at `now`, or returns the seconds until one is there.
    fn take(&self, user: Option<&str>, now: Instant) -> Result<(), u64> {
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let key: UserKey = user.map(str::to_string);
        if buckets.len() > PRUNE_ABOVE && !buckets.contains_key(&key) {
            let (rate, burst) = (self.per_second, self.burst);
            buckets.retain(|_, b| b.tokens_at(now, rate, burst) < burst);
        }
        let bucket = buckets.entry(key).or_insert(Bucket {
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
        Err((wait.ceil() as u64).max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, ContainerCap};
    use std::time::Duration;

    fn limits(adjust: impl FnOnce(&mut Config)) -> Limits {
        let mut config = Config::for_tests("/tmp".into(), "limits-test");
        adjust(&mut config);
        Limits::new(
            &config.caps,
            config.sandbox.memory_mb,
            config.max_exec_timeout_ms,
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
        assert!(buckets.take(Some("a"), t0).is_ok());
        assert!(buckets.take(Some("a"), t0).is_ok());
        assert_eq!(buckets.take(Some("a"), t0), Err(10));
        // Another user has a budget of their own.
        assert!(buckets.take(Some("b"), t0).is_ok());
        assert_eq!(buckets.take(Some("a"), t0 + Duration::from_secs(4)), Err(6));
        assert!(buckets
            .take(Some("a"), t0 + Duration::from_secs(10))
            .is_ok());
        assert!(buckets
            .take(Some("a"), t0 + Duration::from_secs(10))
            .is_err());
        // A long pause gives back the burst, not more.
        let later = t0 + Duration::from_secs(3600);
        assert!(buckets.take(Some("a"), later).is_ok());
        assert!(buckets.take(Some("a"), later).is_ok());
        assert!(buckets.take(Some("a"), later).is_err());
        // Callers naming no user share one bucket.
        assert!(buckets.take(None, t0).is_ok());
        assert!(buckets.take(None, t0).is_ok());
        assert!(buckets.take(None, t0).is_err());
    }

    #[test]
    fn waiting_the_time_told_is_enough() {
        let buckets = TokenBuckets::new(7, 1);
        let mut now = Instant::now();
        for _ in 0..20 {
            if let Err(wait) = buckets.take(Some("u"), now) {
                now += Duration::from_secs(wait);
                assert!(buckets.take(Some("u"), now).is_ok());
            }
        }
    }

    #[test]
    fn idle_buckets_are_pruned() {
        let buckets = TokenBuckets::new(60, 1);
        let t0 = Instant::now();
        for i in 0..=PRUNE_ABOVE {
            assert!(buckets.take(Some(&i.to_string()), t0).is_ok());
        }
        assert!(buckets
            .take(Some("late"), t0 + Duration::from_secs(5))
            .is_ok());
        assert!(buckets.buckets.lock().expect("lock").len() <= 2);
    }

    #[test]
    fn exec_rate_from_settings() {
        let off = limits(|_| {});
        for _ in 0..100 {
            assert!(off.check_exec(Some("u")).is_ok());
        }
        let on = limits(|c| {
            c.caps.rate_execs_per_minute = 60;
            c.caps.rate_burst = 2;
        });
        assert!(on.check_exec(Some("u")).is_ok());
        assert!(on.check_exec(Some("u")).is_ok());
        let err = on.check_exec(Some("u")).expect_err("third is over");
        assert_eq!(retry_after(err), 1);
        // The burst defaults to the per-minute rate.
        let default_burst = limits(|c| c.caps.rate_execs_per_minute = 3);
        for _ in 0..3 {
            assert!(default_burst.check_exec(None).is_ok());
        }
        assert_eq!(
            retry_after(default_burst.check_exec(None).expect_err("4th")),
            20
        );
    }

    fn live(user: &str, last_used_ms: u64, busy: bool) -> LiveSession {
        LiveSession {
            user: Some(user.into()),
            last_used_ms,
            busy,
        }
    }

    #[test]
    fn global_container_cap() {
        let limits = limits(|c| {
            c.caps.max_containers = ContainerCap::Count(2);
            c.max_exec_timeout_ms = 30_000;
        });
        let now = 1_000_000;
        let mut starting = Starting::default();
        let running = [live("a", now - 20_000, true), live("b", now - 5_000, true)];
        let err = limits
            .admit(&mut starting, &running, Some("c"), now)
            .expect_err("full");
        // a's exec started 20 s ago: it ends within the 30 s an exec may run.
        assert_eq!(retry_after(err), 10);
        assert!(limits
            .admit(&mut starting, &running[..1], Some("c"), now)
            .is_ok());
        // The start under way takes the last place.
        assert!(limits
            .admit(&mut starting, &running[..1], Some("d"), now)
            .is_err());
        // An idle one still counted (it was used again before it could be removed):
        // retry at once.
        let idle = [live("a", now - 20_000, true), live("b", now, false)];
        let err = limits
            .admit(&mut Starting::default(), &idle, Some("c"), now)
            .expect_err("full");
        assert_eq!(retry_after(err), 1);
    }

    #[test]
    fn per_user_session_cap() {
        let limits = limits(|c| {
            c.caps.max_sessions_per_user = 1;
            c.max_exec_timeout_ms = 5_000;
        });
        let now = 1_000_000;
        let mut starting = Starting::default();
        let running = [live("a", now, true)];
        let err = limits
            .admit(&mut starting, &running, Some("a"), now)
            .expect_err("a has one");
        assert_eq!(retry_after(err), 5);
        assert!(limits
            .admit(&mut starting, &running, Some("b"), now)
            .is_ok());
        assert!(limits
            .admit(&mut starting, &running, Some("b"), now)
            .is_err());
        // Long past the longest exec (a client that hangs on): retry soon, not never.
        let stale = [live("a", 0, true)];
        let err = limits
            .admit(&mut Starting::default(), &stale, Some("a"), now)
            .expect_err("still counted");
        assert_eq!(retry_after(err), 1);
    }

    #[test]
    fn one_user_gets_at_most_half_the_containers() {
        let capped = |per_user, total| {
            limits(|c| {
                c.caps.max_sessions_per_user = per_user;
                c.caps.max_containers = ContainerCap::Count(total);
            })
            .max_sessions_per_user()
        };
        assert_eq!(capped(8, 17), 8);
        assert_eq!(capped(8, 6), 3);
        assert_eq!(capped(8, 3), 2);
        assert_eq!(capped(8, 1), 1);
        assert_eq!(capped(8, 0), 8);
        assert_eq!(capped(0, 6), 0);
        // auto on an unknown host: its minimum of two, one each.
        let auto = limits(|c| {
            c.caps.max_sessions_per_user = 8;
            c.caps.max_containers = ContainerCap::Auto;
        });
        assert_eq!(auto.max_containers(), crate::config::AUTO_CONTAINERS_MIN);
        assert_eq!(auto.max_sessions_per_user(), 1);
    }

    #[test]
    fn slots_hold_a_place_until_dropped() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let registry = Registry::new(tmp.path());
        let limits = limits(|c| c.caps.max_containers = ContainerCap::Count(1));
        let slot = limits.container_slot(&registry, Some("a")).expect("free");
        assert!(limits.container_slot(&registry, Some("b")).is_err());
        drop(slot);
        assert!(limits.container_slot(&registry, Some("b")).is_ok());
        // No cap: nothing is counted.
        let open = self::limits(|_| {});
        let slots: Vec<_> = (0..10)
            .map(|_| open.container_slot(&registry, None).expect("open"))
            .collect();
        assert_eq!(slots.len(), 10);
        assert_eq!(open.lock().total, 0);
    }
}
