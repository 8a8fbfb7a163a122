//! The sandboxes behind the sessions: one for an exec (from the pool or new), discarding
//! broken ones, re-attaching after a restart, evicting idle ones (their Python state saved
//! first, `state.rs`), and the shutdown.

use crate::clock::now_ms;
use crate::core::error::{Error, Result};
use crate::core::limits::ContainerSlot;
use crate::core::{state, Broker};
use crate::ids::is_valid_id;
use crate::sandbox::{short, CpuWeight, Sandbox, SandboxUnavailable, Warmup};
use crate::session::evict::{self, Reason};
use crate::session::pool::Pooled;
use crate::session::registry::META_FILE;
use crate::session::{OwnerKey, Session};
use crate::workspace::Workspace;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::{CancellationToken, DropGuard};

/// How long the removal of a container evicted to make room for an exec waits for that
/// exec to end (see [`Broker::make_room`]). A session's first exec typically ends well
/// within it; a longer one lets the removal go meanwhile.
const REMOVAL_WAITS_FOR_EXEC: Duration = Duration::from_secs(2);

/// Where a session records the pooled container it was handed (see
/// [`Broker::sandbox_from_pool`]).
const POOLED_SANDBOX_FILE: &str = "pooled-sandbox.json";

/// The container a session was handed from the pool.
#[derive(serde::Serialize, serde::Deserialize)]
struct PooledSandbox {
    /// Docker's id of the container, whose session label is the pooled id.
    container_id: String,
}

impl Broker {
    /// The session's live sandbox, or a new one on its workspace. `reserved`: the start
    /// admission already reserved for a session it made (its caps checked and its
    /// workspace just created); otherwise both happen here.
    pub(crate) async fn sandbox_for(
        &self,
        session: &Arc<Session>,
        reserved: Option<ContainerSlot>,
    ) -> Result<Arc<Sandbox>> {
        if let Some(sandbox) = session.sandbox() {
            if sandbox.is_alive() {
                return Ok(sandbox);
            }
            self.discard_sandbox(session, &sandbox).await;
        }
        let _slot = match reserved {
            Some(slot) => slot,
            None => self.reserve_start(session)?,
        };
        if let Some(sandbox) = self.sandbox_from_pool(session).await {
            return Ok(sandbox);
        }
        let cold = self.pool.cold_start();
        let created = self
            .backend
            .engine()
            .create(session.id(), &session.workspace, Warmup::Nothing)
            .await;
        drop(cold);
        let sandbox = created.map_err(|e| {
            tracing::error!(session = session.id(), error = ?e, "cannot start a sandbox");
            start_failure(&e)
        })?;
        let sandbox = Arc::new(sandbox);
        session.set_sandbox(Some(sandbox.clone()));
        Ok(sandbox)
    }

    /// Admission of a container start for a session that has none: the caller's room,
    /// idle sandboxes removed to make room, the caps; then its workspace brought to
    /// today's owners and modes (a workspace of an older version).
    fn reserve_start(&self, session: &Arc<Session>) -> Result<ContainerSlot> {
        let owner = session.owner_key();
        // Refused anyway: no other user's idle container is taken for it.
        self.limits.check_user_room(&self.registry, &owner)?;
        let removals = self.make_room(&owner);
        let room_made = removals.is_some();
        if let Some(removals) = removals {
            session.hold_until_exec_ends(removals);
        }
        let slot = self
            .limits
            .container_slot(&self.registry, &owner, room_made)?;
        session
            .workspace
            .create(self.config.workspace_uid())
            .map_err(|e| Error::internal(format!("cannot recreate workspace: {e}")))?;
        Ok(slot)
    }

    /// A pooled sandbox for a session that has files but no live sandbox (made by an
    /// upload, or whose container went idle): the pooled workspace's mounted directory
    /// takes the place of the session's, with the session's files moved into it. `None`
    /// when the pool is empty or the move fails (the caller then starts a container).
    pub(crate) async fn sandbox_from_pool(&self, session: &Arc<Session>) -> Option<Arc<Sandbox>> {
        if !self.backend.hands_over_pooled() {
            return None;
        }
        let pooled = self.pool.take()?;
        let ours = session.workspace.clone();
        let theirs = pooled.workspace.clone();
        let backend = self.backend.clone();
        let moved =
            tokio::task::spawn_blocking(move || backend.take_pooled_workspace(&ours, &theirs))
                .await;
        match moved {
            Ok(Ok(())) => {}
            failed => {
                tracing::warn!(session = session.id(), result = ?failed, "cannot hand a pooled sandbox to a session");
                self.pool.discard(pooled);
                return None;
            }
        }
        // The container's session label names the pooled id; this record lets a restarted
        // broker re-attach the container to this session.
        let record = PooledSandbox {
            container_id: pooled.sandbox.container_id.clone(),
        };
        if let Err(err) = session.workspace.save_meta(POOLED_SANDBOX_FILE, &record) {
            tracing::warn!(session = session.id(), error = %err, "cannot record the pooled sandbox");
        }
        self.audit.record(
            "sandbox_from_pool",
            serde_json::json!({
                "user": session.meta.user,
                "session": session.id(),
                "container": short(&record.container_id),
            }),
        );
        self.take_pooled(&pooled);
        session.set_sandbox(Some(pooled.sandbox.clone()));
        Some(pooled.sandbox)
    }

    /// Marks a pooled sandbox taken. One taken while it preloaded at the lowest CPU weight
    /// gets the usual weight back, in the background (the exec need not wait for the
    /// engine; until the update lands it competes at the low weight only with busy
    /// containers), and its kernel stops preloading at the first exec. The others are at
    /// the usual weight already, or get it back from the pool (`session::pool`).
    pub(crate) fn take_pooled(&self, pooled: &Pooled) {
        if !pooled.preload.take() {
            return;
        }
        let backend = self.backend.clone();
        let id = pooled.sandbox.container_id.clone();
        tokio::spawn(async move { backend.engine().set_cpu_weight(&id, CpuWeight::Usual).await });
    }

    /// Drops a broken sandbox and removes its container.
    pub(crate) async fn discard_sandbox(&self, session: &Session, sandbox: &Arc<Sandbox>) {
        sandbox.close("discarded");
        if let Some(current) = session.sandbox() {
            if Arc::ptr_eq(&current, sandbox) {
                session.set_sandbox(None);
            }
        }
        self.backend.engine().remove(&sandbox.container_id).await;
    }

    /// At start-up: re-attach to this instance's running session containers, remove the
    /// rest (stopped ones, pool leftovers, sessions that no longer exist).
    pub(crate) async fn reconcile(&self) -> anyhow::Result<()> {
        let loaded = self.registry.load_all()?;
        // Pooled containers handed to an existing session carry the pooled id as label.
        let handed: HashMap<String, Arc<Session>> = self
            .registry
            .all()
            .into_iter()
            .filter_map(|s| {
                let record: PooledSandbox = s.workspace.load_meta(POOLED_SANDBOX_FILE).ok()?;
                Some((record.container_id, s))
            })
            .collect();
        let mut adopted = 0;
        let mut removed = 0;
        for container in self.backend.engine().list_own().await? {
            let session = container
                .session
                .as_deref()
                .and_then(|id| self.registry.get(id))
                .or_else(|| handed.get(&container.id).cloned());
            match session {
                Some(session) if container.running && session.sandbox().is_none() => {
                    match self.backend.engine().adopt(&container.id).await {
                        Ok(sandbox) => {
                            session.set_sandbox(Some(Arc::new(sandbox)));
                            adopted += 1;
                            continue;
                        }
                        Err(err) => {
                            tracing::warn!(container = %short(&container.id), error = ?err, "cannot re-attach; removing")
                        }
                    }
                }
                Some(_) => {}
                None => {
                    // A pooled sandbox never handed out: its workspace has no session file.
                    if let Some(id) = container.session.as_deref().filter(|id| is_valid_id(id)) {
                        let ws = Workspace::new(&self.config.data_dir, id);
                        if !ws.root().join(META_FILE).exists() {
                            let _ = std::fs::remove_dir_all(ws.root());
                        }
                    }
                }
            }
            self.backend.engine().remove(&container.id).await;
            removed += 1;
        }
        // The sockets of containers that are gone (the pool's included) go with them.
        let live: Vec<String> = self
            .registry
            .all()
            .iter()
            .filter_map(|s| s.sandbox())
            .filter_map(|s| s.egress().map(|e| e.name().to_string()))
            .collect();
        self.egress.sweep(&live);
        tracing::info!(sessions = loaded, adopted, removed, "reconciled containers");
        Ok(())
    }

    /// The eviction rules of the configuration. Idle containers go before a cap that
    /// refuses (CODEBROKER_MAX_CONTAINERS, the per-user cap) is reached, so that only
    /// running code is ever refused room.
    pub(crate) fn evict_policy(&self) -> evict::Policy {
        let lowest = |a: usize, b: usize| match (a, b) {
            (0, n) | (n, 0) => n,
            (a, b) => a.min(b),
        };
        evict::Policy {
            idle_ttl_ms: self.config.lifecycle.idle_ttl_secs.saturating_mul(1000),
            single_use_ttl_ms: self
                .config
                .lifecycle
                .single_use_ttl_secs
                .saturating_mul(1000),
            max_live: lowest(
                self.config.caps.max_live_sandboxes,
                self.limits.max_containers(),
            ),
            max_per_user: self.limits.max_sessions_per_user(),
        }
    }

    /// Sessions holding a live sandbox, with what the eviction rules look at.
    pub(crate) fn live_sessions(&self) -> (Vec<Arc<Session>>, Vec<evict::Live>) {
        let sessions: Vec<Arc<Session>> = self
            .registry
            .all()
            .into_iter()
            .filter(|s| s.sandbox().is_some_and(|sb| sb.is_alive()))
            .collect();
        let live = sessions
            .iter()
            .map(|s| evict::Live {
                last_used_ms: s.last_used_ms(),
                execs: s.exec_count(),
                busy: s.is_busy(),
                uses: s.uses(),
                user: s.owner_key(),
            })
            .collect();
        (sessions, live)
    }

    /// How many session sandboxes are alive now (the pool not counted).
    pub(crate) fn live_sandboxes(&self) -> usize {
        self.live_sessions().0.len()
    }

    /// Before one more session sandbox starts for `user`: takes the sandbox away from the
    /// least recently used idle sessions over the caps (and any past a TTL), so the caps
    /// hold at once. Their state saves and container removals run
    /// in the background once the exec that needed the room has ended (at most
    /// [`REMOVAL_WAITS_FOR_EXEC`] later): on a small host they would otherwise take CPU
    /// from that exec, which is a session's first and which a user waits for. The
    /// returned guard, dropped, lets them go; [`Session::hold_until_exec_ends`] keeps
    /// it for the exec under way.
    pub(crate) fn make_room(&self, owner: &OwnerKey) -> Option<DropGuard> {
        let (sessions, live) = self.live_sessions();
        // Containers still starting for other requests hold no session sandbox yet, but
        // will: counted, so concurrent starts do not overshoot the cap.
        let room = evict::Room {
            total: 1 + self.pool.cold_starts(),
            user: Some(owner),
        };
        let mut policy = self.evict_policy();
        if self.limits.memory_is_short() {
            // The host's memory holds no more sandboxes: as at the ceiling, the least
            // recently used idle ones make room.
            policy.max_live = match policy.max_live {
                0 => live.len(),
                cap => cap.min(live.len()),
            };
        }
        let victims = evict::victims(&policy, &live, now_ms(), room);
        if victims.is_empty() {
            return None;
        }
        let exec_ended = CancellationToken::new();
        for (i, reason) in victims {
            self.evict_detached(&sessions[i], reason, live[i].uses, &exec_ended);
        }
        Some(exec_ended.drop_guard())
    }

    /// Takes the sandbox away from an idle session and removes its container in the
    /// background, once `exec_ended` is cancelled or [`REMOVAL_WAITS_FOR_EXEC`] has
    /// passed; a session that became busy meanwhile keeps it.
    fn evict_detached(
        &self,
        session: &Arc<Session>,
        reason: Reason,
        seen_uses: u64,
        exec_ended: &CancellationToken,
    ) -> bool {
        // Used since the snapshot that chose it: no longer the least recently used.
        let Some(turn) = session.claim_unused_since(seen_uses) else {
            return false;
        };
        let Some(sandbox) = session.set_sandbox(None) else {
            return false;
        };
        self.record_eviction(session, reason);
        let (rules, backend, session) = (
            self.state_rules_for(session),
            self.backend.clone(),
            session.clone(),
        );
        let exec_ended = exec_ended.clone();
        tokio::spawn(async move {
            let _ = tokio::time::timeout(REMOVAL_WAITS_FOR_EXEC, exec_ended.cancelled()).await;
            // The session's next exec waits for the save, so that it finds the state.
            state::save_before_removal(rules, &session, &sandbox).await;
            drop(turn);
            sandbox.close("evicted");
            backend.engine().remove(&sandbox.container_id).await
        });
        true
    }

    pub(crate) fn record_eviction(&self, session: &Session, reason: Reason) {
        tracing::debug!(
            session = session.id(),
            reason = reason.as_str(),
            "removing a session sandbox"
        );
        self.metrics.sandbox_removed(reason.as_str());
        let expired = serde_json::json!({
            "user": session.meta.user,
            "session": session.id(),
            "idle": matches!(reason, Reason::Idle | Reason::SingleUse),
            "reason": reason.as_str(),
        });
        self.audit.record("session_expire", expired);
    }

    /// Removes containers past a TTL or over the cap (their files stay), and dead ones.
    pub(crate) async fn reap_idle(&self) {
        for session in self.registry.all() {
            let Some(sandbox) = session.sandbox() else {
                continue;
            };
            if sandbox.is_alive() {
                continue;
            }
            // An exec in progress finds out by itself.
            let Some(_turn) = session.try_acquire() else {
                continue;
            };
            tracing::debug!(session = session.id(), "removing a dead sandbox");
            self.discard_sandbox(&session, &sandbox).await;
        }
        let (sessions, live) = self.live_sessions();
        let room = evict::Room::default();
        let mut removals = Vec::new();
        for (i, reason) in evict::victims(&self.evict_policy(), &live, now_ms(), room) {
            let session = &sessions[i];
            // An exec that took the turn since the snapshot marked the session used: its
            // sandbox stays.
            let Some(turn) = session.claim_unused_since(live[i].uses) else {
                continue;
            };
            let Some(sandbox) = session.sandbox() else {
                continue;
            };
            self.record_eviction(session, reason);
            // Side by side: each save has its own time bound, and none waits for another.
            removals.push(async move {
                self.retire_sandbox(session, &sandbox).await;
                drop(turn);
            });
        }
        futures::future::join_all(removals).await;
    }

    /// On shutdown: drain the pool; leave session containers for the next start to
    /// re-attach, or remove them (`CODEBROKER_SHUTDOWN_CONTAINERS`).
    pub(crate) async fn shutdown(&self) {
        self.pool.drain(&self.backend).await;
        let remove =
            self.config.lifecycle.shutdown_containers == crate::config::ShutdownContainers::Remove;
        let mut count = 0;
        let mut removals = Vec::new();
        for session in self.registry.all() {
            if !remove {
                count += usize::from(session.sandbox().is_some());
                continue;
            }
            // An exec abandoned at the end of the grace still runs: no save behind it.
            let turn = session.try_acquire();
            if let Some(sandbox) = session.set_sandbox(None) {
                count += 1;
                let rules = self.state_rules_for(&session);
                removals.push(async move {
                    if turn.is_some() {
                        state::save_before_removal(rules, &session, &sandbox).await;
                    }
                    sandbox.close("shutdown");
                    self.backend.engine().remove(&sandbox.container_id).await;
                });
            }
        }
        futures::future::join_all(removals).await;
        if remove {
            self.await_no_containers().await;
            tracing::info!(removed = count, "removed session containers");
        } else {
            tracing::info!(kept = count, "session containers left for the next start");
        }
    }

    /// Waits (a few seconds at most) until the engine lists none of this instance's
    /// containers: an exec abandoned at the end of the shutdown grace may be removing its
    /// own sandbox at the same moment, and the engine answers the second removal with a
    /// 409 while the first is still under way.
    async fn await_no_containers(&self) {
        for round in 0..50 {
            match self.backend.engine().list_own().await {
                Ok(left) if left.is_empty() => return,
                Ok(left) if round % 10 == 9 => {
                    for container in left {
                        self.backend.engine().remove(&container.id).await;
                    }
                }
                Ok(_) => {}
                Err(err) => {
                    tracing::warn!(error = %err, "cannot list containers");
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        tracing::warn!("session containers are still being removed");
    }
}

/// What a client reads when no sandbox could be started: 503, with the reason when the
/// backend gave one meant for clients (an orchestrator refusing or down, a pod that did
/// not start); anything else stays in the log.
fn start_failure(err: &anyhow::Error) -> Error {
    match err
        .chain()
        .find_map(|c| c.downcast_ref::<SandboxUnavailable>())
    {
        Some(why) => Error::Unavailable(format!(
            "cannot start a sandbox right now: {why}; try again"
        )),
        None => Error::Unavailable("cannot start a sandbox right now; try again".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    #[test]
    fn a_start_failure_says_the_backends_reason_for_clients_only() {
        let refused = anyhow::Error::new(SandboxUnavailable(
            "the Kubernetes API server refused to create the sandbox pod (403 Forbidden)".into(),
        ))
        .context("creating");
        let Error::Unavailable(message) = start_failure(&refused) else {
            panic!("not a 503");
        };
        assert_eq!(
            message,
            "cannot start a sandbox right now: the Kubernetes API server refused to create \
             the sandbox pod (403 Forbidden); try again"
        );
        let fault = Err::<(), _>(anyhow::anyhow!(
            "docker create failed: /var/run/docker.sock"
        ))
        .context("more")
        .expect_err("an error");
        let Error::Unavailable(message) = start_failure(&fault) else {
            panic!("not a 503");
        };
        assert_eq!(message, "cannot start a sandbox right now; try again");
    }
}
