//! E2B's protocol, so E2B's SDKs run in codebroker's sandboxes (docs/E2B.md): the control
//! plane at `/e2b` (`control.rs`), and a sandbox's envd (files, commands, filesystem) and
//! code interpreter at `/e2b/sandbox` (`data.rs`), told apart by the `E2b-Sandbox-Port`
//! header as E2B's own proxy does.
//!
//! An E2B sandbox is a codebroker session with a record here: its E2B id (a DNS label,
//! unlike session ids), its owner, its lifetime and its access tokens. Code runs only
//! through the core's exec, so rate limits, caps, metrics and the audit log apply.

mod control;
mod data;
mod files;
mod host;
mod interpreter;
mod paths;
mod process;

pub(crate) use host::with_host_routing;

use crate::clock::now_ms;
use crate::core::Broker;
use crate::http::AppState;
use crate::session::Session;
use crate::sync::LockExt as _;
use axum::Router;
use rand::Rng as _;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The E2B routes (empty when `CODEBROKER_E2B=false`), with the task that ends sandboxes
/// at their timeout. They sit outside `/v1` and outside the API-key layer: the control
/// plane checks keys itself (to answer in E2B's error shape), the data plane checks each
/// sandbox's own tokens.
pub(crate) fn router(state: &AppState) -> Router<AppState> {
    if !state.broker.config().e2b.e2b {
        return Router::new();
    }
    let e2b = Arc::new(E2b {
        broker: state.broker.clone(),
        sandboxes: Mutex::default(),
    });
    tokio::spawn(e2b.clone().run_reaper(state.shutdown.child_token()));
    Router::new().nest(
        "/e2b",
        control::router(state)
            .merge(data::router())
            .layer(axum::Extension(e2b)),
    )
}

/// The E2B sandboxes this broker serves.
pub(crate) struct E2b {
    /// The core every operation goes through.
    broker: Arc<Broker>,
    /// Sandboxes by their E2B id.
    sandboxes: Mutex<HashMap<String, Arc<E2bSandbox>>>,
}

/// Whether a sandbox runs or waits paused (its container released, its files and Python
/// state kept).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SandboxState {
    Running,
    Paused,
}

impl SandboxState {
    fn as_str(self) -> &'static str {
        match self {
            SandboxState::Running => "running",
            SandboxState::Paused => "paused",
        }
    }
}

/// One E2B sandbox: a codebroker session and what E2B's API says about it.
pub(crate) struct E2bSandbox {
    /// Its E2B id: 20 characters of `[a-z0-9]`, so it can be a DNS label
    /// (`49983-<id>.<domain>`).
    id: String,
    /// The session it runs in.
    session: Arc<Session>,
    /// The tenant of the key that made it: only that tenant sees it.
    tenant: Option<String>,
    /// The template it was made from (one image serves all).
    template: String,
    /// The caller's metadata, which `list` filters on.
    metadata: BTreeMap<String, String>,
    /// Environment variables every command and execution gets.
    env_vars: BTreeMap<String, String>,
    /// When it was made (ms since the epoch).
    started_ms: u64,
    /// Its place in the order of creation (`list` sorts by it: several are made in one ms).
    created: u64,
    /// When it ends (ms since the epoch): set by create, connect and set-timeout.
    end_ms: AtomicU64,
    /// Paused (true) or running.
    paused: AtomicBool,
    /// Pause instead of kill at the end of its timeout.
    auto_pause: bool,
    /// envd's `X-Access-Token`: the one credential of the data plane.
    envd_token: String,
    /// The interpreter's `E2B-Traffic-Access-Token`.
    traffic_token: String,
    /// Executions run by the interpreter (its `execution_count`).
    executions: AtomicU64,
    /// Commands started through envd's process service, by pid.
    commands: Mutex<process::Commands>,
}

impl E2bSandbox {
    fn state(&self) -> SandboxState {
        if self.paused.load(Ordering::SeqCst) {
            SandboxState::Paused
        } else {
            SandboxState::Running
        }
    }
}

/// The next sandbox's place in the order of creation.
fn next_created() -> u64 {
    static CREATED: AtomicU64 = AtomicU64::new(0);
    CREATED.fetch_add(1, Ordering::SeqCst)
}

/// A new E2B sandbox id: 20 characters of `[a-z0-9]` (103 bits).
fn new_sandbox_id() -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..20)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect()
}

/// A new access token: 32 random bytes, base64url.
fn new_token() -> String {
    use base64::Engine as _;
    let bytes: [u8; 32] = rand::rng().random();
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

impl E2b {
    /// The sandbox `id` as `tenant` may see it; `None` when it is unknown, another
    /// tenant's, or its session is gone.
    fn sandbox(&self, tenant: Option<&str>, id: &str) -> Option<Arc<E2bSandbox>> {
        let found = self.sandboxes.locked().get(id).cloned()?;
        if !crate::session::same_tenant(tenant, found.tenant.as_deref()) {
            return None;
        }
        self.live(found)
    }

    /// The sandbox `id` whatever its tenant (the data plane: its tokens are the check).
    fn sandbox_by_id(&self, id: &str) -> Option<Arc<E2bSandbox>> {
        let found = self.sandboxes.locked().get(id).cloned()?;
        self.live(found)
    }

    /// `sandbox` while its session lives; a session the core removed ends the sandbox.
    fn live(&self, sandbox: Arc<E2bSandbox>) -> Option<Arc<E2bSandbox>> {
        let tenant = sandbox.tenant.as_deref();
        if self
            .broker
            .tenant_session(tenant, sandbox.session.id())
            .is_some()
        {
            return Some(sandbox);
        }
        self.sandboxes.locked().remove(&sandbox.id);
        None
    }

    /// Every sandbox of `tenant`.
    fn of_tenant(&self, tenant: Option<&str>) -> Vec<Arc<E2bSandbox>> {
        let all: Vec<_> = self.sandboxes.locked().values().cloned().collect();
        all.into_iter()
            .filter(|s| crate::session::same_tenant(tenant, s.tenant.as_deref()))
            .filter_map(|s| self.live(s))
            .collect()
    }

    /// Kills a sandbox: its commands stop, then its session ends (container, files).
    async fn kill(&self, sandbox: &E2bSandbox) -> bool {
        let known = self.sandboxes.locked().remove(&sandbox.id).is_some();
        sandbox.commands.locked().stop_all();
        let deleted = self.broker.delete_session(&sandbox.session).await;
        known && deleted
    }

    /// Pauses a running sandbox: its commands stop, the Python state is saved and the
    /// container released; files stay. `false` when it was paused already.
    async fn pause(&self, sandbox: &E2bSandbox) -> bool {
        if sandbox.paused.swap(true, Ordering::SeqCst) {
            return false;
        }
        sandbox.commands.locked().stop_all();
        self.broker.release_sandbox(&sandbox.session).await;
        true
    }

    /// Ends sandboxes whose timeout passed (pausing those made with `autoPause`), once a
    /// second, until `stop`.
    async fn run_reaper(self: Arc<Self>, stop: CancellationToken) {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = stop.cancelled() => return,
            }
            let now = now_ms();
            let due: Vec<Arc<E2bSandbox>> = self
                .sandboxes
                .locked()
                .values()
                .filter(|s| s.end_ms.load(Ordering::SeqCst) <= now)
                .cloned()
                .collect();
            for sandbox in due {
                if sandbox.auto_pause && sandbox.state() == SandboxState::Running {
                    // Paused, it waits for a connect as long as its files are kept.
                    sandbox.end_ms.store(u64::MAX, Ordering::SeqCst);
                    self.pause(&sandbox).await;
                    tracing::debug!(sandbox = %sandbox.id, "e2b sandbox paused at its timeout");
                } else if sandbox.state() == SandboxState::Running || !sandbox.auto_pause {
                    self.kill(&sandbox).await;
                    tracing::debug!(sandbox = %sandbox.id, "e2b sandbox ended at its timeout");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_ids_are_dns_labels() {
        for _ in 0..100 {
            let id = new_sandbox_id();
            assert_eq!(id.len(), 20);
            assert!(id
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()));
        }
        assert_ne!(new_sandbox_id(), new_sandbox_id());
        assert_ne!(new_token(), new_token());
    }
}
