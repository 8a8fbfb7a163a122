//! A pool of started sandboxes, each already bound to a fresh empty workspace, so that a
//! new session costs a pool take instead of a container start.
//!
//! A pooled sandbox is handed to exactly one session and never comes back.

use crate::config::Config;
use crate::ids::new_id;
use crate::sandbox::{DockerBackend, Sandbox};
use crate::workspace::Workspace;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

/// How long after a take the refill waits before starting a container: starting one costs
/// the engine and the new kernel over a second of CPU, which on a small host would slow
/// the very exec the taken sandbox was handed out for.
const REFILL_DELAY: Duration = Duration::from_millis(250);

/// A started sandbox waiting for its session.
pub struct Pooled {
    /// The id the session will have; the workspace directory is already named after it.
    pub session_id: String,
    /// The empty workspace the sandbox mounts.
    pub workspace: Workspace,
    /// The sandbox, its Python kernel already started.
    pub sandbox: Arc<Sandbox>,
}

/// The warm pool.
pub struct Pool {
    /// Sandboxes ready to be taken, oldest first.
    ready: Mutex<VecDeque<Pooled>>,
    /// How many the pool keeps ready.
    target: usize,
    /// How many it starts at once, so a burst does not stall the engine.
    concurrency: usize,
    /// Creations under way, so the refiller does not overshoot.
    creating: AtomicUsize,
    /// Wakes the refiller after a take.
    wake: Notify,
    /// When a sandbox was last taken, so the refill waits out [`REFILL_DELAY`].
    last_take: Mutex<Option<tokio::time::Instant>>,
    /// Set when draining: a creation that finishes later removes its sandbox instead of
    /// adding it, so nothing outlives the broker.
    closed: AtomicBool,
}

impl Pool {
    pub fn new(target: usize, concurrency: usize) -> Pool {
        Pool {
            ready: Mutex::new(VecDeque::new()),
            target,
            concurrency: concurrency.max(1),
            creating: AtomicUsize::new(0),
            wake: Notify::new(),
            last_take: Mutex::new(None),
            closed: AtomicBool::new(false),
        }
    }

    /// How many sandboxes are being started now.
    pub fn creating(&self) -> usize {
        self.creating.load(Ordering::SeqCst)
    }

    /// How many sandboxes are ready now.
    pub fn ready(&self) -> usize {
        self.lock().len()
    }

    /// How many the pool aims to keep.
    pub fn target(&self) -> usize {
        self.target
    }

    /// Takes a live pooled sandbox, if one is ready.
    pub fn take(&self) -> Option<Pooled> {
        let taken = loop {
            let Some(pooled) = self.lock().pop_front() else {
                break None;
            };
            if pooled.sandbox.is_alive() {
                break Some(pooled);
            }
            // A dead one is dropped; the refiller's sweep removes its container.
        };
        *self.last_take.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(tokio::time::Instant::now());
        self.wake.notify_one();
        taken
    }

    /// Keeps the pool full until `shutdown` resolves; then removes what it holds.
    pub async fn run_refiller(
        self: Arc<Self>,
        docker: Arc<DockerBackend>,
        config: Arc<Config>,
        mut shutdown: tokio::sync::watch::Receiver<bool>,
    ) {
        if self.target == 0 {
            return;
        }
        loop {
            let last_take = *self.last_take.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(taken) = last_take {
                tokio::select! {
                    _ = tokio::time::sleep_until(taken + REFILL_DELAY) => {}
                    _ = shutdown.wait_for(|s| *s) => break,
                }
            }
            while self.ready() + self.creating.load(Ordering::SeqCst) < self.target
                && self.creating.load(Ordering::SeqCst) < self.concurrency
            {
                self.creating.fetch_add(1, Ordering::SeqCst);
                let pool = self.clone();
                let docker = docker.clone();
                let config = config.clone();
                tokio::spawn(async move {
                    match create_pooled(&docker, &config).await {
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
                                remove(&docker, pooled).await;
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
                    self.lock().retain(|p| p.sandbox.is_alive());
                }
                _ = shutdown.wait_for(|s| *s) => break,
            }
        }
        // A container still being started would outlive the drain: wait for those first
        // (each start is bounded by the engine's own timeouts; this bound is a backstop).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while self.creating.load(Ordering::SeqCst) > 0 && tokio::time::Instant::now() < deadline {
            let _ = tokio::time::timeout(Duration::from_millis(100), self.wake.notified()).await;
        }
        self.drain(&docker).await;
    }

    /// Removes every pooled sandbox and its workspace, and those still being started
    /// once they are.
    pub async fn drain(&self, docker: &DockerBackend) {
        let drained: Vec<Pooled> = {
            let mut ready = self.lock();
            self.closed.store(true, Ordering::SeqCst);
            ready.drain(..).collect()
        };
        for pooled in drained {
            remove(docker, pooled).await;
        }
        // Starts under way remove their own sandbox; wait for them (each is bounded by the
        // runner's hello timeout) so a shut-down broker leaves nothing behind.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while self.creating() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Pooled>> {
        self.ready.lock().unwrap_or_else(|p| p.into_inner())
    }
}

async fn remove(docker: &DockerBackend, pooled: Pooled) {
    pooled.sandbox.close("the pool is draining");
    docker.remove(&pooled.sandbox.container_id).await;
    let _ = std::fs::remove_dir_all(pooled.workspace.root());
}

async fn create_pooled(docker: &DockerBackend, config: &Config) -> anyhow::Result<Pooled> {
    let session_id = new_id();
    let workspace = Workspace::new(&config.data_dir, &session_id);
    workspace.create(config.sandbox_uid)?;
    match docker
        .create(&session_id, &workspace.files_dir(), true)
        .await
    {
        Ok(sandbox) => Ok(Pooled {
            session_id,
            workspace,
            sandbox: Arc::new(sandbox),
        }),
        Err(err) => {
            let _ = std::fs::remove_dir_all(workspace.root());
            Err(err)
        }
    }
}
