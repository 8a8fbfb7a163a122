//! codebroker: a self-hosted code interpreter for chat assistants.
//!
//! [`run`] serves the HTTP API on a listener it is given, so tests bind port 0; the
//! binary in `main.rs` only parses the configuration and calls it.

#![warn(unreachable_pub)]

// What the binary, the tests and the bench use is public; the rest is the crate's own.
pub mod cli;
pub mod config;
pub mod ids;
pub mod smoke;

mod audit;
mod clock;
mod core;
mod e2b;
pub(crate) mod egress;
mod http;
mod identity;
mod jupyter;
pub use identity::settle as settle_capabilities;
mod mcp;
mod metrics;
pub(crate) mod net;
mod render;
mod sandbox;
mod session;
mod sync;
mod workspace;

pub use crate::core::capacity::{read_meminfo, sandboxes_that_fit};
pub use crate::core::{Broker, ResolvedCaps};
pub use mcp::codemode;

use crate::config::Config;
use anyhow::Context;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Connects to the sandbox backend (Docker or Kubernetes), prepares the data directory
/// and re-attaches to this instance's sandboxes: everything `run` needs, ready to serve.
pub async fn build(config: Config) -> anyhow::Result<Arc<Broker>> {
    config.validate()?;
    // Checked here, so a bad key stops the start; `run` loads them again for the routes.
    http::jwt::JwtKeys::load(&config.access).context("cannot load the JWT public keys")?;
    let identity = identity::check(config.sandbox_uids())?;
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
    let backend = Arc::new(sandbox::connect(&config).await?);
    // Only where the broker places files in the directory sandboxes mount does its uid
    // keep read-only uploads as placed.
    if identity == identity::Identity::SameAsSandbox && backend.files_on_host() {
        tracing::warn!(
            uid = config.workspace_uid(),
            "the broker runs as the sandbox uid: sandboxed code can change read-only uploads; \
             run it as another uid (the broker image does)"
        );
    }
    let broker = Arc::new(Broker::new(config, backend)?);
    broker
        .reconcile()
        .await
        .context("cannot reconcile sandboxes")?;
    Ok(broker)
}

/// Serves until `shutdown` resolves; then stops taking connections, gives the requests
/// under way `CODEBROKER_SHUTDOWN_GRACE` to finish, and stops the broker.
pub async fn run(
    listener: TcpListener,
    broker: Arc<Broker>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    // The one stop signal: the pool's refiller, the reaper and open MCP streams each hold
    // a child of it.
    let stop = CancellationToken::new();
    let refiller = tokio::spawn({
        let (broker, stop) = (broker.clone(), stop.child_token());
        async move { broker.run_refiller(stop).await }
    });
    let reaper = tokio::spawn(reap_loop(broker.clone(), stop.child_token()));

    let jwt = http::jwt::JwtKeys::load(&broker.config().access)
        .context("cannot load the JWT public keys")?;
    jwt.log_loaded();
    let mut state = http::AppState::new(broker.clone(), jwt);
    state.shutdown = stop.child_token();
    // The last burst of authentication failures is summed up even if none follows it.
    let failures = state.auth_failures.clone();
    let failures_stop = stop.child_token();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tokio::select! {
                _ = tick.tick() => failures.flush(),
                () = failures_stop.cancelled() => break,
            }
        }
    });
    let mcp = mcp::router(&state);
    // E2B's and Jupyter's front ends check credentials their own way.
    let own_auth = e2b::router(&state).merge(jupyter::router(&state));
    let app = http::router(state, mcp, own_auth);
    let e2b = &broker.config().e2b;
    let app = e2b::with_host_routing(app, if e2b.e2b { &e2b.e2b_domain } else { "" });
    let addr = listener.local_addr()?;
    tracing::info!(%addr, "listening");
    broker.guard_egress_port(addr.port());
    let limits = http::server::ServeLimits {
        max_connections: broker.config().caps.max_connections,
        max_connections_per_peer: broker.config().connections_per_peer(),
        header_read_timeout: Duration::from_secs(broker.config().header_read_timeout_secs.max(1)),
        write_timeout: Duration::from_secs(broker.config().write_timeout_secs.max(1)),
    };
    let signalled = stop.clone();
    let served = http::server::serve(listener, app, limits, async move {
        shutdown.await;
        tracing::info!("stopping: no new connections; waiting for the requests under way");
        // The pool stops refilling at once (containers started now would only be removed),
        // and open MCP streams end.
        signalled.cancel();
    });
    let grace = Duration::from_secs(broker.config().lifecycle.shutdown_grace);
    let served = tokio::select! {
        served = served => served.context("server failed"),
        _ = async {
            stop.cancelled().await;
            tokio::time::sleep(grace).await;
        } => {
            tracing::warn!(grace_secs = grace.as_secs(), "requests still under way after the grace period; stopping anyway");
            Ok(())
        }
    };

    stop.cancel();
    let _ = refiller.await;
    let _ = reaper.await;
    broker.shutdown().await;
    tracing::info!("stopped");
    served
}

async fn reap_loop(broker: Arc<Broker>, stop: CancellationToken) {
    let every = Duration::from_secs(broker.config().lifecycle.reap_interval_secs.max(1));
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {
                broker.reap_idle().await;
                broker.expire_files().await;
            }
            _ = stop.cancelled() => return,
        }
    }
}
