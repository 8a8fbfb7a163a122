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
pub mod ids;
pub mod jwt;
pub mod mcp;
pub mod metrics;
pub mod ratelimit;
pub mod sandbox;
pub mod session;
pub mod smoke;
pub mod storage;
pub mod workspace;

use crate::broker::Broker;
use crate::config::Config;
use crate::sandbox::DockerBackend;
use anyhow::Context;
use std::future::{Future, IntoFuture};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

/// Connects to Docker, prepares the data directory and re-attaches to this instance's
/// containers: everything `run` needs, ready to serve.
pub async fn build(config: Config) -> anyhow::Result<Arc<Broker>> {
    config.validate().map_err(anyhow::Error::msg)?;
    let jwt = jwt::JwtKeys::from_config(&config).context("cannot load the JWT public keys")?;
    let mut config = config;
    std::fs::create_dir_all(config.data_dir.join("sessions"))
        .with_context(|| format!("cannot create {}", config.data_dir.display()))?;
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
    let mut broker = Broker::new(config, docker);
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
        broker.docker.clone(),
        broker.config.clone(),
        stop_rx.clone(),
    ));
    let reaper = tokio::spawn(reap_loop(broker.clone(), stop_rx.clone()));

    let state = http::AppState::new(broker.clone());
    let stopping = state.shutdown.clone();
    let app = http::router(state);
    tracing::info!(addr = %listener.local_addr()?, "listening");
    // Streamed output goes out in many small writes: without TCP_NODELAY, Nagle's algorithm
    // holds each one until the client's delayed ACK, about 40 ms.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        if let Err(err) = tcp.set_nodelay(true) {
            tracing::debug!(error = %err, "cannot set TCP_NODELAY");
        }
    });
    let signalled = stop_tx.clone();
    let served = axum::serve(listener, app).with_graceful_shutdown(async move {
        shutdown.await;
        tracing::info!("stopping: no new connections; waiting for the requests under way");
        // The pool stops refilling at once: containers started now would only be removed.
        let _ = signalled.send(true);
        stopping.cancel();
    });
    let grace = Duration::from_secs(broker.config.shutdown_grace);
    let mut grace_over = stop_rx.clone();
    let served = tokio::select! {
        served = served.into_future() => served.context("server failed"),
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
