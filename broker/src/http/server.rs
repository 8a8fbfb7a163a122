//! The accept loop: HTTP/1.1 served by hyper with the limits `axum::serve` does not set.
//!
//! - A cap on open connections: over it the broker stops accepting, so further clients wait
//!   in the kernel's listen backlog (they cost the broker nothing) until one closes.
//! - A header-read timeout: a client must send a whole request head within
//!   `CODEBROKER_HEADER_READ_TIMEOUT_SECS` of the connection being ready for one. hyper
//!   starts the same timer when a keep-alive connection goes idle, so it is also the idle
//!   timeout; a response being sent (a long exec, an SSE stream, an MCP stream) is never cut.
//! - A bound on the buffered request head ([`MAX_HEAD_BYTES`]).
//!
//! HTTP/2 is not served: its streams would have no header-read timeout, and no client of
//! the broker speaks cleartext HTTP/2.

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// Largest request head (request line and headers) a connection may buffer. JWTs and keys
/// are a few KiB; hyper's default would let every open connection hold about 400 KiB.
pub(crate) const MAX_HEAD_BYTES: usize = 64 * 1024;

/// The limits of [`serve`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct ServeLimits {
    /// Connections open at once; more wait in the listen backlog.
    pub(crate) max_connections: usize,
    /// Time a client has to send a request head, and an idle keep-alive connection stays open.
    pub(crate) header_read_timeout: Duration,
}

/// Serves `app` on `listener` until `shutdown` resolves; then stops accepting (new
/// connections are refused), lets every open connection finish the request under way, and
/// returns once all have closed.
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ServeLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(MAX_HEAD_BYTES);
    let service = TowerToHyperService::new(app);
    tokio::pin!(shutdown);
    loop {
        // A free slot first, then accept: over the cap nothing is read from new clients.
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
            () = &mut shutdown => break,
        };
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _peer)) => tcp,
                Err(err) => {
                    accept_error(err).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Streamed output goes out in many small writes: without TCP_NODELAY, Nagle's
        // algorithm holds each one until the client's delayed ACK, about 40 ms.
        if let Err(err) = tcp.set_nodelay(true) {
            tracing::debug!(error = %err, "cannot set TCP_NODELAY");
        }
        let connection = builder.serve_connection(TokioIo::new(tcp), service.clone());
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(err) = connection.await {
                tracing::debug!(error = %err, "connection ended with an error");
            }
            drop(slot);
        });
    }
    // Closing the listener makes new connections fail at once.
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// A failed accept: a client that gave up is skipped; anything else (out of file
/// descriptors) is logged and retried after a pause, as hyper 0.14's server did.
async fn accept_error(err: io::Error) {
    if matches!(
        err.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    ) {
        return;
    }
    tracing::error!(error = %err, "accept failed");
    tokio::time::sleep(Duration::from_secs(1)).await;
}
