//! A pool of started sandboxes, each already bound to a fresh empty workspace, so that a
//! new session costs a pool take instead of a container start.
//!
//! A pooled sandbox is handed to exactly one session and never comes back.
//!
//! The pool keeps `size` ready, and grows towards `max` after a burst: starting a
//! container is CPU-bound in the engine (about 150 ms of it each on a 2-core host, and
//! starts do not overlap there), so 20 sessions at once cannot all be cold starts within a
//! second and a half. It sizes itself to the most takes seen within [`BURST_SPAN`] during
//! the last [`DEMAND_WINDOW`], and shrinks back when the bursts stop.

use crate::config::{PoolConfig, PreloadModules};
use crate::ids::new_id;
use crate::sandbox::{CpuWeight, Sandbox, SandboxBackend, Warmup};
use crate::sync::LockExt as _;
use crate::workspace::Workspace;
use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

/// How long after a take the refill waits before starting a container: starting one costs
/// the engine and the new kernel over a second of CPU, which on a small host would slow
/// the very exec the taken sandbox was handed out for.
const REFILL_DELAY: Duration = Duration::from_millis(250);

/// Takes this close together count as one burst the pool should have absorbed.
const BURST_SPAN: Duration = Duration::from_secs(1);

/// How long the pool remembers a burst before it shrinks back towards its size.
const DEMAND_WINDOW: Duration = Duration::from_secs(300);

/// How long the refill yields to cold starts under way before it starts its own: both
/// queue in the same engine, and a cold start has a request waiting on it.
const YIELD_TO_COLD_STARTS: Duration = Duration::from_secs(2);

/// Takes remembered at most: the peak is clamped to the pool's maximum anyway.
const DEMAND_MEMORY: usize = 4096;

/// Recent takes (served or not), to size the pool to the largest recent burst.
#[derive(Default)]
pub(crate) struct Demand {
    /// When each take happened, oldest first, none older than [`DEMAND_WINDOW`].
    takes: VecDeque<Instant>,
}

impl Demand {
    /// Records one take at `now`.
    pub(crate) fn record(&mut self, now: Instant) {
        self.forget_before(now);
        if self.takes.len() == DEMAND_MEMORY {
            self.takes.pop_front();
        }
        self.takes.push_back(now);
    }

    /// The most takes within any [`BURST_SPAN`] of the last [`DEMAND_WINDOW`].
    pub(crate) fn peak(&mut self, now: Instant) -> usize {
        self.forget_before(now);
        let mut peak = 0;
        let mut first = 0;
        for (last, at) in self.takes.iter().enumerate() {
            while *at - self.takes[first] >= BURST_SPAN {
                first += 1;
            }
            peak = peak.max(last - first + 1);
        }
        peak
    }

    fn forget_before(&mut self, now: Instant) {
        while self
            .takes
            .front()
            .is_some_and(|t| now.saturating_duration_since(*t) > DEMAND_WINDOW)
        {
            self.takes.pop_front();
        }
    }
}

/// How often the pool asks its preloading sandboxes whether they are done, and starts
/// the preload of waiting ones.
const PRELOAD_POLL: Duration = Duration::from_millis(100);

/// Pooled kernels preloading at once. Each is one busy thread at the lowest CPU weight,
/// so two fill a 2-core host's idle time; more would only leave more imports half done
/// when a burst takes them (a taken kernel finishes the import under way, at the usual
/// weight), while a kernel that has not begun costs nothing to stop.
const PRELOADS_AT_ONCE: usize = 2;

/// How long one such question may take before it is asked again later.
const PRELOAD_ASK_TIMEOUT: Duration = Duration::from_secs(1);

/// A started sandbox waiting for its session.
pub(crate) struct Pooled {
    /// The id the session will have; the workspace directory is already named after it.
    pub(crate) session_id: String,
    /// The empty workspace the sandbox mounts.
    pub(crate) workspace: Workspace,
    /// The sandbox, its Python kernel already started.
    pub(crate) sandbox: Arc<Sandbox>,
    /// Where its preload stands. Shared: the pool's watcher holds it while a session may
    /// take the sandbox.
    pub(crate) preload: Arc<PreloadState>,
}

/// Where the preload of one pooled sandbox stands. A pooled sandbox starts at the usual CPU
/// weight with its kernel idle; the pool lowers the weight to the lowest before it asks
/// the kernel to preload, so the imports take only CPU that sessions leave idle, and
/// gives the usual weight back when the preload is done. A session that takes it
/// meanwhile gives the weight back itself (or, while the weight is being lowered, the
/// pool does once that is done).
pub(crate) struct PreloadState(AtomicU8);

impl PreloadState {
    /// Kernel idle, not asked to preload yet, at the usual weight.
    const WAITING: u8 = 0;
    /// The pool is lowering its weight, to ask it to preload then.
    const LOWERING: u8 = 1;
    /// Its kernel was asked to preload and has not finished; at the low weight.
    const PRELOADING: u8 = 2;
    /// Preloaded (or nothing to preload), at the usual weight.
    const DONE: u8 = 3;
    /// A session took it.
    const TAKEN: u8 = 4;

    fn new(preloads: bool) -> Self {
        PreloadState(AtomicU8::new(if preloads {
            Self::WAITING
        } else {
            Self::DONE
        }))
    }

    fn get(&self) -> u8 {
        self.0.load(Ordering::SeqCst)
    }

    fn moved(&self, from: u8, to: u8) -> bool {
        self.0
            .compare_exchange(from, to, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }

    /// Marks it taken; whether it waits at the low weight, which the taker must then give
    /// back (a sandbox taken while its weight is being lowered gets it back from the pool).
    pub(crate) fn take(&self) -> bool {
        self.0.swap(Self::TAKEN, Ordering::SeqCst) == Self::PRELOADING
    }

    /// Which to hand out first: preloaded, then preloading (its imports are under way
    /// anyway, and stop at its first exec), then the others.
    fn rank(&self) -> u8 {
        match self.get() {
            Self::DONE => 0,
            Self::PRELOADING => 1,
            _ => 2,
        }
    }
}

/// The warm pool.
pub(crate) struct Pool {
    /// Sandboxes ready to be taken, oldest first.
    ready: Mutex<VecDeque<Pooled>>,
    /// How many the pool keeps ready when no burst was seen lately (0: no pool).
    size: usize,
    /// How many it keeps ready at most, after a burst.
    max: usize,
    /// Recent takes, which decide where between `size` and `max` the pool stands.
    demand: Mutex<Demand>,
    /// How many it starts at once, so a burst does not stall the engine.
    concurrency: usize,
    /// Creations under way, so the refiller does not overshoot.
    creating: AtomicUsize,
    /// Sandboxes started for a waiting request outside the pool, which the refill lets go
    /// first.
    cold_starts: Arc<AtomicUsize>,
    /// Wakes the refiller after a take.
    wake: Notify,
    /// Pooled sandboxes found dead (their container exited) or handed back unused, for
    /// the refiller to remove with their workspace.
    discarded: Mutex<Vec<Pooled>>,
    /// When a sandbox was last taken, so the refill waits out [`REFILL_DELAY`].
    last_take: Mutex<Option<tokio::time::Instant>>,
    /// Set when draining: a creation that finishes later removes its sandbox instead of
    /// adding it, so nothing outlives the broker.
    closed: AtomicBool,
    /// The modules a pooled kernel imports while it waits, so a session's first
    /// `import pandas` is already done.
    preload: PreloadModules,
}

impl Pool {
    /// The pool the pool group of the settings describes.
    pub(crate) fn new(config: &PoolConfig) -> Pool {
        let (size, max, concurrency) = (
            config.pool_size,
            config.pool_max,
            config.pool_refill_concurrency,
        );
        Pool {
            ready: Mutex::new(VecDeque::new()),
            size,
            max: if size == 0 { 0 } else { max.max(size) },
            demand: Mutex::new(Demand::default()),
            concurrency: concurrency.max(1),
            creating: AtomicUsize::new(0),
            cold_starts: Arc::new(AtomicUsize::new(0)),
            wake: Notify::new(),
            discarded: Mutex::new(Vec::new()),
            last_take: Mutex::new(None),
            closed: AtomicBool::new(false),
            preload: config.preload.clone(),
        }
    }

    /// Marks a sandbox start for a waiting request (a pool miss) until the guard drops.
    pub(crate) fn cold_start(&self) -> ColdStart {
        self.cold_starts.fetch_add(1, Ordering::SeqCst);
        ColdStart(self.cold_starts.clone())
    }

    /// Hands back a taken sandbox that could not be used; the refiller removes it.
    pub(crate) fn discard(&self, pooled: Pooled) {
        pooled.sandbox.close("not handed out");
        self.discarded.locked().push(pooled);
        self.wake.notify_one();
    }

    /// How many sandboxes are being started outside the pool now.
    pub(crate) fn cold_starts(&self) -> usize {
        self.cold_starts.load(Ordering::SeqCst)
    }

    /// How many sandboxes are being started now.
    pub(crate) fn creating(&self) -> usize {
        self.creating.load(Ordering::SeqCst)
    }

    /// How many sandboxes are ready now.
    pub(crate) fn ready(&self) -> usize {
        self.lock().len()
    }

    /// How many of the ready sandboxes are not preloaded yet (waiting or preloading).
    pub(crate) fn preloading(&self) -> usize {
        self.lock()
            .iter()
            .filter(|p| p.preload.get() != PreloadState::DONE)
            .count()
    }

    /// How many the pool aims to keep now: its size, or the largest recent burst up to
    /// its maximum. While it preloads and has been taken from lately, [`PRELOADS_AT_ONCE`]
    /// more: a refill takes over a second to be preloaded, and at a chat's pace (two new
    /// sessions a second, so a peak of two) a pool of two would hand out kernels still
    /// importing.
    pub(crate) fn target(&self) -> usize {
        let peak = self.demand.locked().peak(Instant::now());
        let on_the_way = if peak > 0 && !self.preload.names().is_empty() {
            PRELOADS_AT_ONCE
        } else {
            0
        };
        (peak + on_the_way).clamp(self.size, self.max)
    }

    /// Takes a live pooled sandbox, if one is ready. Either way the take counts as demand.
    pub(crate) fn take(&self) -> Option<Pooled> {
        self.take_counting(true)
    }

    /// Takes a live pooled sandbox only if one is ready, counting demand only then: for a
    /// caller that falls back to [`Pool::take`] later, so a miss is counted once.
    pub(crate) fn take_if_ready(&self) -> Option<Pooled> {
        self.take_counting(false)
    }

    fn take_counting(&self, count_miss: bool) -> Option<Pooled> {
        if self.size == 0 {
            return None;
        }
        let now = Instant::now();
        let taken = {
            let mut ready = self.lock();
            // Dead ones go to the refiller, which removes their containers.
            let (alive, dead): (Vec<Pooled>, Vec<Pooled>) =
                ready.drain(..).partition(|p| p.sandbox.is_alive());
            *ready = alive.into();
            if !dead.is_empty() {
                self.discarded.locked().extend(dead);
            }
            // The oldest of the best rank (min_by_key keeps the first of equals).
            let pick = (0..ready.len())
                .min_by_key(|&i| ready[i].preload.rank())
                .unwrap_or(0);
            ready.remove(pick)
        };
        if taken.is_none() && !count_miss {
            return None;
        }
        self.demand.locked().record(now);
        *self.last_take.locked() = Some(now);
        self.wake.notify_one();
        taken
    }

    /// Keeps the pool full until `shutdown` is cancelled; then removes what it holds. New
    /// workspaces go under `data_dir`, owned by `sandbox_uid`.
    pub(crate) async fn run_refiller(
        self: Arc<Self>,
        backend: Arc<SandboxBackend>,
        data_dir: Arc<Path>,
        sandbox_uid: u32,
        shutdown: tokio_util::sync::CancellationToken,
    ) {
        if self.size == 0 {
            return;
        }
        if !self.preload.names().is_empty() {
            tokio::spawn(
                self.clone()
                    .watch_preloads(backend.clone(), shutdown.child_token()),
            );
        }
        loop {
            let last_take = *self.last_take.locked();
            if let Some(taken) = last_take {
                tokio::select! {
                    _ = tokio::time::sleep_until(taken + REFILL_DELAY) => {}
                    _ = shutdown.cancelled() => break,
                }
            }
            let dead = std::mem::take(&mut *self.discarded.locked());
            for pooled in dead {
                tracing::debug!(container = %crate::sandbox::short(&pooled.sandbox.container_id), "removing a discarded pooled sandbox");
                remove(&backend, pooled).await;
            }
            let target = self.target();
            self.shrink_to(target, &backend).await;
            let yield_until = tokio::time::Instant::now() + YIELD_TO_COLD_STARTS;
            while self.cold_starts.load(Ordering::SeqCst) > 0
                && tokio::time::Instant::now() < yield_until
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            if shutdown.is_cancelled() {
                break;
            }
            while self.ready() + self.creating.load(Ordering::SeqCst) < target
                && self.creating.load(Ordering::SeqCst) < self.concurrency
            {
                self.creating.fetch_add(1, Ordering::SeqCst);
                let pool = self.clone();
                let backend = backend.clone();
                let data_dir = data_dir.clone();
                tokio::spawn(async move {
                    match create_pooled(&backend, &data_dir, sandbox_uid, pool.preload.names())
                        .await
                    {
                        Ok(pooled) => {
                            let late = {
                                let mut ready = pool.lock();
                                if pool.closed.load(Ordering::SeqCst) {
                                    Some(pooled)
                                } else {
                                    ready.push_back(pooled);
                                    None
                                }
                            };
                            if let Some(pooled) = late {
                                remove(&backend, pooled).await;
                            }
                        }
                        Err(err) => {
                            tracing::warn!(error = ?err, "cannot start a pooled sandbox");
                            // Back off so a broken engine or image is not hammered.
                            tokio::time::sleep(Duration::from_secs(2)).await;
                        }
                    }
                    pool.creating.fetch_sub(1, Ordering::SeqCst);
                    pool.wake.notify_one();
                });
            }
            tokio::select! {
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(Duration::from_secs(5)) => {
                    let dead: Vec<Pooled> = {
                        let mut ready = self.lock();
                        let (alive, dead): (Vec<Pooled>, Vec<Pooled>) =
                            ready.drain(..).partition(|p| p.sandbox.is_alive());
                        *ready = alive.into();
                        dead
                    };
                    self.discarded
                        .locked()
                        .extend(dead);
                }
                _ = shutdown.cancelled() => break,
            }
        }
        // A container still being started would outlive the drain: wait for those first
        // (each start is bounded by the engine's own timeouts; this bound is a backstop).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while self.creating.load(Ordering::SeqCst) > 0 && tokio::time::Instant::now() < deadline {
            let _ = tokio::time::timeout(Duration::from_millis(100), self.wake.notified()).await;
        }
        self.drain(&backend).await;
    }

    /// Every [`PRELOAD_POLL`]: asks the ready sandboxes that preload whether they are
    /// done, and gives each that is its CPU weight back; then has the oldest waiting ones
    /// begin, [`PRELOADS_AT_ONCE`] at most. Waiting ones keep the usual weight, so a burst
    /// that takes them needs no engine call for it.
    async fn watch_preloads(
        self: Arc<Self>,
        backend: Arc<SandboxBackend>,
        shutdown: tokio_util::sync::CancellationToken,
    ) {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(PRELOAD_POLL) => {}
                _ = shutdown.cancelled() => return,
            }
            let pending: Vec<(Arc<Sandbox>, Arc<PreloadState>)> = self
                .lock()
                .iter()
                .filter(|p| p.preload.get() < PreloadState::DONE && p.sandbox.is_alive())
                .map(|p| (p.sandbox.clone(), p.preload.clone()))
                .collect();
            let mut preloading = 0;
            for (sandbox, state) in &pending {
                if state.get() != PreloadState::PRELOADING {
                    continue;
                }
                let asked =
                    tokio::time::timeout(PRELOAD_ASK_TIMEOUT, sandbox.hello(Warmup::Nothing)).await;
                match asked {
                    Ok(Ok(hello)) if !hello.preloading => {
                        if state.moved(PreloadState::PRELOADING, PreloadState::DONE) {
                            let id = &sandbox.container_id;
                            backend.engine().set_cpu_weight(id, CpuWeight::Usual).await;
                        }
                    }
                    // Still at it, or slow to answer (a dead one is found by the refiller).
                    _ => preloading += 1,
                }
            }
            for (sandbox, state) in &pending {
                if preloading >= PRELOADS_AT_ONCE {
                    break;
                }
                if !state.moved(PreloadState::WAITING, PreloadState::LOWERING) {
                    continue; // taken meanwhile, or already preloading
                }
                preloading += 1;
                self.begin_preload(&backend, sandbox, state).await;
            }
        }
    }

    /// Lowers a waiting sandbox's CPU weight, then asks its kernel to preload; a sandbox
    /// taken meanwhile gets the usual weight back and no preload.
    async fn begin_preload(
        &self,
        backend: &SandboxBackend,
        sandbox: &Sandbox,
        state: &PreloadState,
    ) {
        let id = &sandbox.container_id;
        let lowered = backend.engine().set_cpu_weight(id, CpuWeight::Low).await;
        if !state.moved(PreloadState::LOWERING, PreloadState::PRELOADING) {
            // Taken while the weight was being lowered: this sees that it comes back.
            if lowered {
                backend.engine().set_cpu_weight(id, CpuWeight::Usual).await;
            }
            return;
        }
        let asked =
            tokio::time::timeout(PRELOAD_ASK_TIMEOUT, sandbox.preload(self.preload.names())).await;
        if !matches!(asked, Ok(Ok(_))) {
            tracing::debug!(container = %crate::sandbox::short(id), "cannot ask a pooled sandbox to preload");
        }
    }

    /// Removes every pooled sandbox and its workspace, and those still being started
    /// once they are.
    pub(crate) async fn drain(&self, backend: &SandboxBackend) {
        let mut drained: Vec<Pooled> = {
            let mut ready = self.lock();
            self.closed.store(true, Ordering::SeqCst);
            ready.drain(..).collect()
        };
        // Dead ones not yet removed by the refiller go too.
        drained.append(&mut self.discarded.locked());
        for pooled in drained {
            remove(backend, pooled).await;
        }
        // Starts under way remove their own sandbox; wait for them (each is bounded by the
        // runner's hello timeout) so a shut-down broker leaves nothing behind.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while self.creating() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Removes the oldest ready sandboxes over `target`, once a burst is forgotten.
    async fn shrink_to(&self, target: usize, backend: &SandboxBackend) {
        let extra: Vec<Pooled> = {
            let mut ready = self.lock();
            let over = ready.len().saturating_sub(target);
            ready.drain(..over).collect()
        };
        for pooled in extra {
            remove(backend, pooled).await;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Pooled>> {
        self.ready.locked()
    }
}

/// A sandbox start outside the pool, counted while it lasts.
pub(crate) struct ColdStart(Arc<AtomicUsize>);

impl Drop for ColdStart {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn remove(backend: &SandboxBackend, pooled: Pooled) {
    pooled.sandbox.close("the pool is draining");
    backend.engine().remove(&pooled.sandbox.container_id).await;
    let _ = std::fs::remove_dir_all(pooled.workspace.root());
}

async fn create_pooled(
    backend: &SandboxBackend,
    data_dir: &Path,
    sandbox_uid: u32,
    preload: &[String],
) -> anyhow::Result<Pooled> {
    let session_id = new_id();
    let workspace = Workspace::new(data_dir, &session_id);
    workspace.create(sandbox_uid)?;
    let preloads = !preload.is_empty();
    match backend
        .engine()
        .create(&session_id, &workspace, Warmup::Kernel)
        .await
    {
        Ok(sandbox) => Ok(Pooled {
            session_id,
            workspace,
            sandbox: Arc::new(sandbox),
            preload: Arc::new(PreloadState::new(preloads)),
        }),
        Err(err) => {
            let _ = std::fs::remove_dir_all(workspace.root());
            Err(err)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(pool_size: usize, pool_max: usize, pool_refill_concurrency: usize) -> Pool {
        Pool::new(&PoolConfig {
            pool_size,
            pool_max,
            pool_refill_concurrency,
            preload: PreloadModules::default(),
        })
    }

    #[tokio::test(start_paused = true)]
    async fn the_pool_grows_to_a_burst_and_shrinks_after_the_window() {
        let pool = pool(2, 16, 2);
        assert_eq!(pool.target(), 2);
        for _ in 0..20 {
            assert!(pool.take().is_none());
        }
        assert_eq!(pool.target(), 16, "clamped to the maximum");
        tokio::time::advance(DEMAND_WINDOW / 2).await;
        assert_eq!(pool.target(), 16, "remembered for the window");
        tokio::time::advance(DEMAND_WINDOW).await;
        assert_eq!(pool.target(), 2, "back to its size");
    }

    #[tokio::test(start_paused = true)]
    async fn takes_spread_out_are_not_a_burst() {
        let pool = pool(1, 16, 2);
        for _ in 0..10 {
            pool.take();
            tokio::time::advance(BURST_SPAN).await;
        }
        assert_eq!(pool.target(), 1);
        for _ in 0..3 {
            pool.take();
            tokio::time::advance(BURST_SPAN / 4).await;
        }
        assert_eq!(pool.target(), 3, "three takes within one span");
    }

    #[tokio::test(start_paused = true)]
    async fn a_pool_of_size_zero_stays_off() {
        let pool = pool(0, 16, 2);
        for _ in 0..5 {
            assert!(pool.take().is_none());
        }
        assert_eq!(pool.target(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_maximum_below_the_size_is_the_size() {
        let pool = pool(4, 1, 2);
        assert_eq!(pool.target(), 4);
        for _ in 0..9 {
            pool.take();
        }
        assert_eq!(pool.target(), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn a_preloading_pool_keeps_some_on_the_way_while_it_is_taken_from() {
        let pool = Pool::new(&PoolConfig {
            pool_size: 2,
            pool_max: 16,
            pool_refill_concurrency: 2,
            preload: "numpy".parse().expect("names"),
        });
        assert_eq!(pool.target(), 2, "no takes yet: its size");
        // A chat's pace: one take every half second.
        for _ in 0..6 {
            pool.take();
            tokio::time::advance(BURST_SPAN / 2).await;
        }
        assert_eq!(pool.target(), 2 + PRELOADS_AT_ONCE);
        for _ in 0..30 {
            pool.take();
        }
        assert_eq!(pool.target(), 16, "still clamped to the maximum");
        tokio::time::advance(DEMAND_WINDOW * 2).await;
        assert_eq!(pool.target(), 2, "back to its size after the window");
    }

    #[tokio::test(start_paused = true)]
    async fn sandboxes_are_handed_out_preloaded_first_then_preloading() {
        let states = [
            PreloadState::WAITING,
            PreloadState::PRELOADING,
            PreloadState::LOWERING,
            PreloadState::DONE,
        ];
        let ranks: Vec<u8> = states
            .iter()
            .map(|&s| PreloadState(AtomicU8::new(s)).rank())
            .collect();
        assert_eq!(ranks, [2, 1, 2, 0]);
        // Only a sandbox at the low weight needs it given back by the taker.
        let taken: Vec<bool> = states
            .iter()
            .map(|&s| PreloadState(AtomicU8::new(s)).take())
            .collect();
        assert_eq!(taken, [false, true, false, false]);
        let state = PreloadState::new(true);
        assert!(state.moved(PreloadState::WAITING, PreloadState::LOWERING));
        assert!(
            !state.take(),
            "taken while lowering: the pool gives it back"
        );
        assert!(!state.moved(PreloadState::LOWERING, PreloadState::PRELOADING));
        assert_eq!(PreloadState::new(false).get(), PreloadState::DONE);
    }

    #[test]
    fn demand_memory_is_bounded() {
        let mut demand = Demand::default();
        let now = Instant::now();
        for _ in 0..DEMAND_MEMORY * 2 {
            demand.record(now);
        }
        assert_eq!(demand.takes.len(), DEMAND_MEMORY);
        assert_eq!(demand.peak(now), DEMAND_MEMORY);
    }
}
