//! Sessions: one per chat session, each with its workspace and (while in use) its sandbox.
//!
//! Execs of one session run one at a time, in arrival order; sessions run in parallel.

pub(crate) mod evict;
pub(crate) mod pool;
pub(crate) mod registry;

pub(crate) use pool::Pool;
pub(crate) use registry::Registry;

use crate::clock::now_ms;
use crate::sandbox::{Sandbox, SandboxFiles};
use crate::sync::LockExt as _;
use crate::workspace::{FileIndex, Workspace};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::DropGuard;

/// Who a session belongs to, persisted as `session.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct SessionMeta {
    /// The session id (also the workspace's directory name).
    pub(crate) id: String,
    /// The end user it belongs to, when the caller named one; other users never see it.
    pub(crate) user: Option<String>,
    /// The `entity_id` it was created for, so later calls with that entity find it.
    pub(crate) entity_id: Option<String>,
    /// The `runtime_session_hint` it was created for (an opaque key of the client, such
    /// as a conversation id), so later calls with that hint find it.
    #[serde(default)]
    pub(crate) runtime_hint: Option<String>,
    /// Milliseconds since the epoch at creation.
    pub(crate) created_ms: u64,
    /// Set for a session of shared files (a `kind=skill` or `kind=agent` upload, or a
    /// classic one with `entity_id`): the tenant all of whose callers may read them. `user`
    /// is then only who uploaded them (and whose storage budget they count in). Nobody
    /// changes such a session: no exec runs in it, no upload adds to it, no client deletes
    /// from it; its files expire.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) shared_in: Option<String>,
    /// The tenant of the caller that made it (a key's, a named group of keys', a JWT's):
    /// callers of any other tenant never find it, whatever user they name. `None` on a
    /// session made before tenants were recorded: the registry gives it to a broker's only
    /// tenant when it has one; otherwise nobody finds it again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) tenant: Option<String>,
}

/// Who a session, a budget or a cap belongs to: the tenant, and the user in it (`None`:
/// the callers of the tenant that name no user).
pub(crate) type OwnerKey = (Option<String>, Option<String>);

/// One chat session.
pub(crate) struct Session {
    /// Identity and owner.
    pub(crate) meta: SessionMeta,
    /// Its files on the host.
    pub(crate) workspace: Workspace,
    /// One permit: holding it is the right to run an exec (or to touch the sandbox).
    queue: Arc<Semaphore>,
    /// The running sandbox, if any. Swapped only by the holder of the queue permit.
    sandbox: Mutex<Option<Arc<Sandbox>>>,
    /// File ids of the workspace; read by downloads, written after each exec.
    index: Mutex<FileIndex>,
    /// Milliseconds since the epoch of the last exec's end, for the idle reaper.
    last_used_ms: AtomicU64,
    /// Bumped at every use, so that a removal decided on a snapshot can tell exactly
    /// whether the session was used since (timestamps may tie within a millisecond).
    uses: AtomicU64,
    /// Execs run since the broker loaded the session: a session used once is likely
    /// never used again, and its container goes sooner (see `evict`).
    execs: AtomicU64,
    /// Background work held back while this session's exec runs, so that it does not take
    /// CPU from it: the removal of containers evicted to make room for it
    /// (`Broker::make_room`). Dropping a guard lets its work go; each also has its own
    /// deadline.
    after_exec: Mutex<Vec<DropGuard>>,
    /// Bytes its execs moved through the egress proxy, against the per-session cap (kept
    /// across its containers; a restarted broker starts it again at 0).
    egress_bytes: Arc<AtomicU64>,
}

impl Session {
    pub(crate) fn new(meta: SessionMeta, workspace: Workspace, index: FileIndex) -> Session {
        // After a restart, the newest file tells when the session was last used.
        let last_used = index
            .files
            .iter()
            .map(|r| r.created_ms)
            .max()
            .unwrap_or(0)
            .max(meta.created_ms);
        Session {
            meta,
            workspace,
            queue: Arc::new(Semaphore::new(1)),
            sandbox: Mutex::new(None),
            index: Mutex::new(index),
            last_used_ms: AtomicU64::new(last_used),
            uses: AtomicU64::new(0),
            execs: AtomicU64::new(0),
            after_exec: Mutex::new(Vec::new()),
            egress_bytes: Arc::default(),
        }
    }

    /// What its execs moved through the egress proxy so far (shared with their budgets).
    pub(crate) fn egress_bytes(&self) -> Arc<AtomicU64> {
        self.egress_bytes.clone()
    }

    /// The session id.
    pub(crate) fn id(&self) -> &str {
        &self.meta.id
    }

    /// Whether a caller in `tenant` naming `user` may see this session (see [`visible`]):
    /// use it, run code in it, add to it. Only in its own tenant; never a session of
    /// shared files.
    pub(crate) fn visible_to(&self, tenant: Option<&str>, user: Option<&str>) -> bool {
        !self.is_shared()
            && same_tenant(tenant, self.meta.tenant.as_deref())
            && visible(user, self.meta.user.as_deref())
    }

    /// Its owner, as budgets and caps count it.
    pub(crate) fn owner_key(&self) -> OwnerKey {
        (self.meta.tenant.clone(), self.meta.user.clone())
    }

    /// Whether this session holds shared files (see [`SessionMeta::shared_in`]).
    pub(crate) fn is_shared(&self) -> bool {
        self.meta.shared_in.is_some()
    }

    /// Whether a caller naming `user` in `tenant` may read this session's files: a
    /// session it may see, or one shared in its tenant.
    pub(crate) fn readable_by(&self, user: Option<&str>, tenant: Option<&str>) -> bool {
        match self.meta.shared_in.as_deref() {
            Some(shared_in) => tenant == Some(shared_in),
            None => self.visible_to(tenant, user),
        }
    }

    /// Waits for this session's turn to run.
    pub(crate) async fn acquire(&self) -> OwnedSemaphorePermit {
        // The semaphore is never closed, so acquiring cannot fail.
        loop {
            if let Ok(permit) = self.queue.clone().acquire_owned().await {
                return permit;
            }
        }
    }

    /// Takes the turn only if nobody holds it (for the reaper).
    pub(crate) fn try_acquire(&self) -> Option<OwnedSemaphorePermit> {
        self.queue.clone().try_acquire_owned().ok()
    }

    /// The current sandbox.
    pub(crate) fn sandbox(&self) -> Option<Arc<Sandbox>> {
        self.sandbox.locked().clone()
    }

    /// Where the session's files are now: its workspace, and its sandbox while the runner
    /// can be reached.
    pub(crate) fn files(&self) -> SandboxFiles {
        SandboxFiles {
            workspace: self.workspace.clone(),
            sandbox: self.sandbox().filter(|s| s.is_alive()),
        }
    }

    /// Replaces the sandbox, returning the old one.
    pub(crate) fn set_sandbox(&self, sandbox: Option<Arc<Sandbox>>) -> Option<Arc<Sandbox>> {
        std::mem::replace(&mut *self.sandbox.locked(), sandbox)
    }

    /// The file index, briefly.
    pub(crate) fn index(&self) -> MutexGuard<'_, FileIndex> {
        self.index.locked()
    }

    /// Records that the session was just used.
    pub(crate) fn touch(&self) {
        self.last_used_ms.store(now_ms(), Ordering::Relaxed);
        self.uses.fetch_add(1, Ordering::SeqCst);
    }

    /// Records that an exec ran to its end.
    pub(crate) fn exec_done(&self) {
        self.execs.fetch_add(1, Ordering::Relaxed);
        self.touch();
    }

    /// Holds back background work (see `after_exec`) until the exec that holds an
    /// [`Session::exec_running`] ends.
    pub(crate) fn hold_until_exec_ends(&self, work: DropGuard) {
        self.after_exec.locked().push(work);
    }

    /// For an exec, however it ends: dropped, lets the work held back for this session go,
    /// that held back during the exec included.
    pub(crate) fn exec_running(&self) -> ExecRunning<'_> {
        ExecRunning(self)
    }

    /// Execs run since the session was loaded.
    pub(crate) fn exec_count(&self) -> u64 {
        self.execs.load(Ordering::Relaxed)
    }

    /// Whether an exec holds or waits for the session's turn.
    pub(crate) fn is_busy(&self) -> bool {
        self.queue.available_permits() == 0
    }

    /// Milliseconds since the epoch of the last use.
    pub(crate) fn last_used_ms(&self) -> u64 {
        self.last_used_ms.load(Ordering::Relaxed)
    }

    /// Uses so far (see [`Session::claim_unused_since`]).
    pub(crate) fn uses(&self) -> u64 {
        self.uses.load(Ordering::SeqCst)
    }

    /// The turn, for removing the session's sandbox, when the session was not used since a
    /// snapshot that saw `uses` uses. The uses are looked at again once the turn is held:
    /// an exec that took the turn in between marked the session used, so its sandbox stays.
    pub(crate) fn claim_unused_since(&self, uses: u64) -> Option<OwnedSemaphorePermit> {
        if self.uses() != uses {
            return None;
        }
        let turn = self.try_acquire()?;
        (self.uses() == uses).then_some(turn)
    }
}

/// Held by an exec: lets the work held back for its session go when the exec ends.
pub(crate) struct ExecRunning<'a>(&'a Session);

impl Drop for ExecRunning<'_> {
    fn drop(&mut self) {
        let held = std::mem::take(&mut *self.0.after_exec.locked());
        drop(held);
    }
}

/// Whether a caller naming `user` may see what `owner` owns (a session, a programmatic
/// run), within one tenant (see [`same_tenant`]). A caller that names no user acts with the
/// scope of its tenant's keys and sees everything of the tenant; a named user sees only
/// what is theirs: not another user's, and not what an unnamed
/// caller made (MCP clients, LobeChat and the playground name no user, and their session
/// ids travel in transcripts and shared chats).
pub(crate) fn visible(user: Option<&str>, owner: Option<&str>) -> bool {
    match (user, owner) {
        (Some(caller), Some(owner)) => caller == owner,
        (Some(_), None) => false,
        (None, _) => true,
    }
}

/// Whether a caller in tenant `caller` may see what was made in tenant `owner`: only the
/// same one. A caller outside every tenant (a route without authentication) sees nothing.
pub(crate) fn same_tenant(caller: Option<&str>, owner: Option<&str>) -> bool {
    caller.is_some() && caller == owner
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idle_session() -> Session {
        let meta = SessionMeta {
            id: crate::ids::new_id(),
            user: None,
            entity_id: None,
            runtime_hint: None,
            created_ms: 0,
            shared_in: None,
            tenant: Some("t1".into()),
        };
        let workspace = Workspace::new(std::path::Path::new("/nonexistent"), &meta.id);
        Session::new(meta, workspace, FileIndex::default())
    }

    #[test]
    fn named_users_see_only_their_own() {
        assert!(visible(Some("a"), Some("a")));
        assert!(!visible(Some("a"), Some("b")));
        assert!(!visible(Some("a"), None), "an unnamed caller's session");
        assert!(visible(None, Some("a")), "the key's scope");
        assert!(visible(None, None));
    }

    #[test]
    fn sessions_are_seen_in_their_tenant_only() {
        let mut session = idle_session();
        session.meta.user = Some("alice".into());
        assert!(session.visible_to(Some("t1"), Some("alice")));
        assert!(session.visible_to(Some("t1"), None), "the tenant's scope");
        assert!(!session.visible_to(Some("t1"), Some("bob")));
        for user in [Some("alice"), None] {
            assert!(!session.visible_to(Some("t2"), user), "{user:?}");
            assert!(!session.readable_by(user, Some("t2")), "{user:?}");
            assert!(!session.visible_to(None, user), "outside every tenant");
        }
        session.meta.tenant = None;
        assert!(
            !session.visible_to(None, None),
            "an untenanted session is nobody's"
        );
        assert!(!session.visible_to(Some("t1"), None));
    }

    #[test]
    fn shared_sessions_are_read_by_their_tenant_only_and_seen_by_nobody() {
        let mut session = idle_session();
        session.meta.user = Some("alice".into());
        assert!(session.readable_by(Some("alice"), Some("t1")));
        assert!(session.readable_by(None, Some("t1")), "the tenant's scope");
        assert!(!session.readable_by(None, None), "outside every tenant");
        session.meta.shared_in = Some("t1".into());
        assert!(session.is_shared());
        for user in [Some("alice"), Some("bob"), None] {
            assert!(session.readable_by(user, Some("t1")), "{user:?}");
            assert!(!session.readable_by(user, Some("t2")), "{user:?}");
            assert!(!session.readable_by(user, None), "{user:?}");
            assert!(
                !session.visible_to(Some("t1"), user),
                "{user:?}: never written to"
            );
        }
    }

    #[test]
    fn an_idle_session_can_be_claimed() {
        let session = idle_session();
        assert!(session.claim_unused_since(session.uses()).is_some());
    }

    #[tokio::test]
    async fn an_exec_holding_the_turn_keeps_its_session() {
        let session = idle_session();
        let seen = session.uses();
        let exec_turn = session.acquire().await;
        // The reaper looked before the exec marked the session used: the turn is taken.
        assert!(session.claim_unused_since(seen).is_none());
        session.touch();
        drop(exec_turn);
        // After the exec: used since the look, so it stays.
        assert!(session.claim_unused_since(seen).is_none());
        assert!(
            session.claim_unused_since(session.uses()).is_some(),
            "a new look may remove it"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reaper_and_exec_racing_never_overlap() {
        // An exec takes the turn and marks the session used; the reaper claims in a loop.
        // Whoever wins, the reaper never holds the turn while an exec runs, and never
        // claims a session an exec used after its snapshot.
        for _ in 0..200 {
            let session = Arc::new(idle_session());
            let running = Arc::new(std::sync::atomic::AtomicBool::new(false));
            // The reaper's snapshot, taken before the exec comes.
            let seen = session.uses();
            let exec = {
                let (session, running) = (session.clone(), running.clone());
                tokio::spawn(async move {
                    let _turn = session.acquire().await;
                    session.touch();
                    running.store(true, Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    running.store(false, Ordering::SeqCst);
                    session.touch();
                })
            };
            let reaper = {
                let (session, running) = (session.clone(), running.clone());
                tokio::spawn(async move {
                    let mut claims = 0;
                    for _ in 0..50 {
                        if let Some(_turn) = session.claim_unused_since(seen) {
                            assert!(!running.load(Ordering::SeqCst), "reaped during an exec");
                            claims += 1;
                        }
                        tokio::task::yield_now().await;
                    }
                    claims
                })
            };
            exec.await.unwrap();
            let claims = reaper.await.unwrap();
            assert!(claims <= 50);
            assert!(
                session.claim_unused_since(seen).is_none(),
                "used since the look: kept"
            );
        }
    }
}
