//! What front ends may ask of the broker beyond an exec and the file operations: its
//! settings, its health, its load, and the refusals they answered. The fields of
//! [`Broker`] are private; this is how the front ends read them.

use crate::config::Config;
use crate::core::{Broker, Result};
use crate::session::Session;
use std::sync::Arc;

/// The pool as `/health` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PoolStatus {
    /// Containers ready to be taken.
    pub(crate) ready: usize,
    /// Of those, the ones still importing the preload.
    pub(crate) preloading: usize,
    /// Containers being started.
    pub(crate) starting: usize,
    /// How many it is filling towards.
    pub(crate) target: usize,
}

/// The container caps as resolved at start-up (`auto` turned into numbers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResolvedCaps {
    /// Most live sandboxes at once.
    pub max_containers: usize,
    /// Most sessions with a live sandbox per user.
    pub max_sessions_per_user: usize,
}

/// A refusal a front end answered, counted on `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// A 429: a rate or a capacity limit.
    RateLimited,
    /// A 401.
    Unauthenticated,
}

impl Broker {
    /// Every setting.
    pub(crate) fn config(&self) -> &Config {
        &self.config
    }

    /// The container caps this broker resolved.
    pub fn caps(&self) -> ResolvedCaps {
        ResolvedCaps {
            max_containers: self.limits.max_containers(),
            max_sessions_per_user: self.limits.max_sessions_per_user(),
        }
    }

    /// Whether the engine answers, and whether it has the sandbox image.
    pub(crate) async fn engine_status(&self) -> (bool, bool) {
        tokio::join!(
            self.backend.engine().ping(),
            self.backend.engine().image_present()
        )
    }

    /// Sessions known, with or without a sandbox.
    pub(crate) fn session_count(&self) -> usize {
        self.registry.len()
    }

    /// The pool's state.
    pub(crate) fn pool_status(&self) -> PoolStatus {
        PoolStatus {
            ready: self.pool.ready(),
            preloading: self.pool.preloading(),
            starting: self.pool.creating(),
            target: self.pool.target(),
        }
    }

    /// The `/metrics` text, with the session and container gauges read now.
    pub(crate) fn metrics_text(&self) -> String {
        let sessions = self.registry.all();
        let containers = sessions
            .iter()
            .filter(|s| s.sandbox().is_some_and(|sb| sb.is_alive()))
            .count();
        self.metrics
            .render(sessions.len(), containers, self.pool.ready())
    }

    /// Counts a refusal a front end answered.
    pub(crate) fn count_refusal(&self, refusal: Refusal) {
        match refusal {
            Refusal::RateLimited => self.metrics.rate_limited(),
            Refusal::Unauthenticated => self.metrics.auth_failed(),
        }
    }

    /// At most `cap` bytes of the file `name` of `session`'s sandbox, as it is now (the
    /// code may still be writing it): what a streamed display inlines. `None` when it is
    /// not there or cannot be read.
    pub(crate) async fn display_bytes(
        &self,
        session: &Session,
        name: &str,
        cap: u64,
    ) -> Option<Vec<u8>> {
        let (at, backend, name) = (session.files(), self.backend.clone(), name.to_string());
        tokio::task::spawn_blocking(move || backend.read_file(&at, &name, cap))
            .await
            .ok()?
            .ok()?
    }

    /// What a front end inlines for a display: the file it names read (at most `cap`
    /// bytes), as text for text types and SVG, else base64; or the display's own small
    /// text. `None` when the file cannot be read.
    pub(crate) async fn display_value(
        &self,
        session: &Session,
        display: &crate::core::Display,
        cap: u64,
    ) -> Option<String> {
        use base64::Engine as _;
        let Some(name) = &display.name else {
            return display.data.clone();
        };
        let bytes = self.display_bytes(session, name, cap).await?;
        Some(
            if display.mime.starts_with("text/") || display.mime == "image/svg+xml" {
                String::from_utf8_lossy(&bytes).into_owned()
            } else {
                base64::engine::general_purpose::STANDARD.encode(bytes)
            },
        )
    }

    /// The session an upload goes to: the one named by `session_id`, else the one of
    /// `entity_id`, when the caller may see it (the upload then takes a token of the exec
    /// rate, as a new session would); else a new one.
    pub(crate) async fn session_for_upload(
        &self,
        tenant: Option<&str>,
        user: Option<&str>,
        session_id: Option<&str>,
        entity_id: Option<&str>,
    ) -> Result<Arc<Session>> {
        let visible = |s: &Arc<Session>| s.visible_to(tenant, user);
        let found = session_id
            .and_then(|id| self.registry.get(id))
            .filter(visible)
            .or_else(|| {
                entity_id
                    .and_then(|e| self.registry.by_entity(tenant, user, e))
                    .filter(visible)
            });
        match found {
            Some(session) => self.charge_upload(tenant, user).map(|()| session),
            None => self.new_session(tenant, user, entity_id, false).await,
        }
    }

    /// Once the broker listens on `port`: the egress proxy never leads there.
    pub(crate) fn guard_egress_port(&self, port: u16) {
        self.egress.guard_broker_port(port);
    }

    /// Runs the pool's refiller until `stop`.
    pub(crate) async fn run_refiller(&self, stop: tokio_util::sync::CancellationToken) {
        self.pool
            .clone()
            .run_refiller(
                self.backend.clone(),
                self.config.data_dir.as_path().into(),
                self.config.workspace_uid(),
                stop,
            )
            .await;
    }
}
