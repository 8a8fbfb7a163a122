//! codebroker: a self-hosted code interpreter for chat assistants.
//!
//! [`run`] serves the HTTP API on a listener it is given, so tests bind port 0; the
//! binary in `main.rs` only parses the configuration and calls it.

pub mod audit;
pub mod auth;
pub mod broker;
pub mod cli;
pub mod codemode;
pub mod config;
mod diskspace;
pub mod error;
pub mod http;
pub mod identity;
pub mod ids;
pub mod jwt;
pub mod mcp;
pub mod metrics;
pub mod ratelimit;
pub mod sandbox;
mod server;
pub mod session;
pub mod smoke;
pub mod storage;
pub mod workspace;

use crate::broker::Broker;
use crate::config::Config;
use crate::sandbox::DockerBackend;
use anyhow::Context;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

/// Connects to Docker, prepares the data directory and re-attaches to this instance's
/// containers: everything `run` needs, ready to serve.
pub async fn build(config: Config) -> anyhow::Result<Arc<Broker>> {
    config.validate().map_err(anyhow::Error::msg)?;
    let jwt = jwt::JwtKeys::from_config(&config).context("cannot load the JWT public keys")?;
    if identity::check(config.sandbox_uid)? == identity::Identity::SameAsSandbox {
        tracing::warn!(
            uid = config.sandbox_uid,
            "the broker runs as the sandbox uid: sandboxed code can change read-only uploads; \
             run it as another uid (the broker image does)"
        );
    }
    let mut config = config;
    // Only the broker reads its data: sessions/ and staging/ are 0700 from the start.
    for dir in ["sessions", "staging"] {
        let dir = config.data_dir.join(dir);
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .and_then(|()| std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)))
            .with_context(|| format!("cannot create {}", dir.display()))?;
    }
    // Bind mounts are resolved by the engine, which needs an absolute path.
    config.data_dir = config
        .data_dir
        .canonicalize()
        .with_context(|| format!("cannot resolve {}", config.data_dir.display()))?;
    let config = Arc::new(config);
    let docker = DockerBackend::connect(config.clone()).await?;
    if !docker.image_present().await {
        tracing::warn!(image = %config.image, "the sandbox image is missing; build it with `make image`");
    }
    let mut broker = Broker::new(config, Arc::new(docker));
    broker.jwt = jwt;
    let broker = Arc::new(broker);
    broker
        .reconcile()
        .await
        .context("cannot reconcile containers")?;
    Ok(broker)
}

/// Serves until `shutdown` resolves; then stops taking connections, gives the requests
/// under way `CODEBROKER_SHUTDOWN_GRACE` to finish, and stops the broker.
pub async fn run(
    listener: TcpListener,
    broker: Arc<Broker>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stop_tx = Arc::new(stop_tx);
    let refiller = tokio::spawn(broker.pool.clone().run_refiller(
        broker.backend.clone(),
        broker.config.clone(),
        stop_rx.clone(),
    ));
    let reaper = tokio::spawn(reap_loop(broker.clone(), stop_rx.clone()));

    let state = http::AppState::new(broker.clone());
    let stopping = state.shutdown.clone();
    let app = http::router(state);
    tracing::info!(addr = %listener.local_addr()?, "listening");
    let limits = server::ServeLimits {
        max_connections: broker.config.max_connections,
        header_read_timeout: Duration::from_secs(broker.config.header_read_timeout_secs.max(1)),
    };
    let signalled = stop_tx.clone();
    let served = server::serve(listener, app, limits, async move {
        shutdown.await;
        tracing::info!("stopping: no new connections; waiting for the requests under way");
        // The pool stops refilling at once: containers started now would only be removed.
        let _ = signalled.send(true);
        stopping.cancel();
    });
    let grace = Duration::from_secs(broker.config.shutdown_grace);
    let mut grace_over = stop_rx.clone();
    let served = tokio::select! {
        served = served => served.context("server failed"),
        _ = async {
            let _ = grace_over.wait_for(|s| *s).await;
            tokio::time::sleep(grace).await;
        } => {
            tracing::warn!(grace_secs = grace.as_secs(), "requests still under way after the grace period; stopping anyway");
            Ok(())
        }
    };

    let _ = stop_tx.send(true);
    let _ = refiller.await;
    let _ = reaper.await;
    broker.shutdown().await;
    tracing::info!("stopped");
    served
}

async fn reap_loop(broker: Arc<Broker>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let every = Duration::from_secs(broker.config.reap_interval_secs.max(1));
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {
                broker.reap_idle().await;
                broker.expire_files().await;
            }
            _ = async { stop.wait_for(|s| *s).await.map(|_| ()) } => return,
        }
    }
}
