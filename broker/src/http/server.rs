//! The accept loop: HTTP/1.1 served by hyper with the limits `axum::serve` does not set.
//!
//! - A cap on open connections: over it the broker stops accepting, so further clients wait
//!   in the kernel's listen backlog (they cost the broker nothing) until one closes.
//! - A cap on connections per peer address: one client cannot take every slot. Its excess
//!   connections get a 503 and are closed at once, without taking a slot.
//! - A header-read timeout: a client must send a whole request head within
//!   `CODEBROKER_HEADER_READ_TIMEOUT_SECS` of the connection being ready for one. hyper
//!   starts the same timer when a keep-alive connection goes idle, so it is also the idle
//!   timeout.
//! - A write-progress timeout ([`WriteDeadline`]): a connection whose answer the client
//!   has not read a byte of for `CODEBROKER_WRITE_TIMEOUT_SECS` is reset. hyper's header
//!   timer is not armed while a write is pending, so without it a client that pipelines
//!   requests and never reads would hold its slot forever. A response that is merely slow
//!   to produce (a long exec, a quiet stream) has nothing pending and is never cut.
//! - `TCP_USER_TIMEOUT`, so a peer that vanished does not hold a slot for the kernel's
//!   15-minute retransmission limit.
//! - A bound on the buffered request head ([`MAX_HEAD_BYTES`]).
//! - A lingering close ([`LINGER`]): a connection closed with a body still arriving drops
//!   the rest for a moment, so the client reads the refusal instead of a reset.
//!
//! Pipelined requests are handled one at a time per connection (HTTP/1), with at most
//! [`MAX_HEAD_BYTES`] of them read ahead and as much of their answers buffered: a client
//! that does not read its answers stops having its requests read, and then is cut by the
//! write-progress timeout. An authentication failure also closes the connection
//! (`Connection: close`), so requests pipelined behind it are never read.
//!
//! HTTP/2 is not served: its streams would have no header-read timeout, and no client of
//! the broker speaks cleartext HTTP/2.

use crate::sync::LockExt as _;
use axum::extract::ConnectInfo;
use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt as _;

/// Largest request head (request line and headers) a connection may buffer. JWTs and keys
/// are a few KiB; hyper's default would let every open connection hold about 400 KiB.
pub(crate) const MAX_HEAD_BYTES: usize = 64 * 1024;

/// The answer a peer over its connection cap gets before its connection is closed: it
/// fits any socket's send buffer, so it is written without waiting.
const PEER_OVER_CAP: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\n\
Content-Type: application/json\r\nContent-Length: 95\r\nRetry-After: 1\r\n\
Connection: close\r\n\r\n\
{\"error\":\"unavailable\",\"message\":\"too many connections from this address; close one and retry\"}";

/// How long a closing connection keeps reading, and dropping, what its client still sends
/// after the answer and the write side's FIN. Closing a socket with unread bytes resets
/// it, and a reset makes the client's kernel drop the answer it has not read yet: a client
/// refused mid-body (a 401, a 503, a 413) would see "connection reset" instead of why.
/// This is the lingering close of Apache and nginx, bounded in time and bytes.
const LINGER: Duration = Duration::from_secs(2);

/// Most bytes a lingering close reads before it gives up and resets.
const LINGER_BYTES: usize = 16 * 1024 * 1024;

/// The limits of [`serve`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct ServeLimits {
    /// Connections open at once; more wait in the listen backlog.
    pub(crate) max_connections: usize,
    /// Connections one peer address may hold at once; more get a 503.
    pub(crate) max_connections_per_peer: usize,
    /// Time a client has to send a request head, and an idle keep-alive connection stays open.
    pub(crate) header_read_timeout: Duration,
    /// Time an answer may wait for the client to read any of it before the connection is
    /// reset; also the connection's `TCP_USER_TIMEOUT`.
    pub(crate) write_timeout: Duration,
}

/// Serves `app` on `listener` until `shutdown` resolves; then stops accepting (new
/// connections are refused), lets every open connection finish the request under way, and
/// returns once all have closed. Each request carries its peer's address as
/// `ConnectInfo<SocketAddr>`.
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ServeLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let peers = PeerCounts::new(limits.max_connections_per_peer.max(1));
    // Connections still serving HTTP, and the signal that asks them to finish: an
    // upgraded connection (a WebSocket) leaves this count, and its handler watches the
    // broker's own stop signal instead.
    let open = TaskTracker::new();
    let closing = CancellationToken::new();
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(MAX_HEAD_BYTES);
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
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    accept_error(err).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Some(peer_slot) = peers.enter(peer.ip()) else {
            // Over its share: told so and closed; the slot serves the next client.
            let _ = tcp.try_write(PEER_OVER_CAP);
            tracing::debug!(peer = %peer.ip(), "connection over the per-peer cap refused");
            continue;
        };
        configure(&tcp, limits.write_timeout);
        // The slots go with the socket, so a connection upgraded to a WebSocket keeps
        // counting against both caps until it closes.
        let io = TokioIo::new(WriteDeadline::new(tcp, limits.write_timeout).holding(
            ConnectionSlots {
                _peer: peer_slot,
                _slot: slot,
            },
        ));
        // The peer's address for the handlers (per-peer budgets), as axum's
        // `into_make_service_with_connect_info` would give it.
        let service =
            app.clone()
                .map_request(move |mut request: hyper::Request<hyper::body::Incoming>| {
                    request.extensions_mut().insert(ConnectInfo(peer));
                    request
                });
        let connection = builder
            .serve_connection(io, TowerToHyperService::new(service))
            .with_upgrades();
        let closing = closing.clone();
        open.spawn(async move {
            tokio::pin!(connection);
            let ended = tokio::select! {
                ended = connection.as_mut() => ended,
                () = closing.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(err) = ended {
                tracing::debug!(error = %err, "connection ended with an error");
            }
        });
    }
    // Closing the listener makes new connections fail at once.
    drop(listener);
    closing.cancel();
    open.close();
    open.wait().await;
    Ok(())
}

/// Socket options of an accepted connection.
fn configure(tcp: &TcpStream, write_timeout: Duration) {
    // Streamed output goes out in many small writes: without TCP_NODELAY, Nagle's
    // algorithm holds each one until the client's delayed ACK, about 40 ms.
    if let Err(err) = tcp.set_nodelay(true) {
        tracing::debug!(error = %err, "cannot set TCP_NODELAY");
    }
    // Data unacknowledged for this long ends the connection: a peer that is gone does not
    // keep its slot for the kernel's default of about 15 minutes of retransmissions.
    if let Err(err) = socket2::SockRef::from(tcp).set_tcp_user_timeout(Some(write_timeout)) {
        tracing::debug!(error = %err, "cannot set TCP_USER_TIMEOUT");
    }
}

/// Open connections per peer address, each at most `cap`.
#[derive(Clone)]
struct PeerCounts {
    /// Connections open per address; an address leaves the map with its last connection,
    /// so the map holds at most as many entries as there are open connections.
    open: Arc<Mutex<HashMap<IpAddr, usize>>>,
    /// Most connections one address may hold.
    cap: usize,
}

/// One connection counted against its peer; uncounted on drop.
struct PeerSlot {
    /// The counts it is in.
    counts: PeerCounts,
    /// Its peer, as counted (IPv4-mapped IPv6 addresses as IPv4).
    ip: IpAddr,
}

impl PeerCounts {
    fn new(cap: usize) -> PeerCounts {
        PeerCounts {
            open: Arc::default(),
            cap,
        }
    }

    /// Counts a new connection of `ip`; `None` when the address is at its cap.
    fn enter(&self, ip: IpAddr) -> Option<PeerSlot> {
        let ip = ip.to_canonical();
        let mut open = self.open.locked();
        let count = open.entry(ip).or_insert(0);
        if *count >= self.cap {
            return None;
        }
        *count += 1;
        Some(PeerSlot {
            counts: self.clone(),
            ip,
        })
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut open = self.counts.open.locked();
        if let Some(count) = open.get_mut(&self.ip) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

/// A connection that fails its writes once none has made progress for `timeout`: the
/// timer runs only while a write is pending (the client's receive window is shut), and
/// any byte written stops it. On expiry the socket is reset rather than closed, so the
/// kernel does not keep sending the unread answer to a client that does not read.
pub(crate) struct WriteDeadline {
    /// The client's connection.
    tcp: TcpStream,
    /// How long a write may make no progress.
    timeout: Duration,
    /// Running while a write is pending; `None` after any progress.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Set once the write side is shut: the end of the lingering close, and the bytes it
    /// has dropped so far.
    lingering: Option<(Pin<Box<tokio::time::Sleep>>, usize)>,
    /// The connection's places under the caps, given back when the socket closes.
    slots: Option<ConnectionSlots>,
}

/// A connection's place under the cap on open connections and under its peer's. The
/// fields drop in order: the peer's count goes first, so the accept loop, woken by the
/// freed slot, never counts the closed connection against the next one of the same peer
/// (which would refuse it with a 503 while the total has room).
struct ConnectionSlots {
    /// Its count against its peer address.
    _peer: PeerSlot,
    /// Its slot of [`ServeLimits::max_connections`].
    _slot: OwnedSemaphorePermit,
}

impl WriteDeadline {
    pub(crate) fn new(tcp: TcpStream, timeout: Duration) -> WriteDeadline {
        WriteDeadline {
            tcp,
            timeout,
            stalled: None,
            lingering: None,
            slots: None,
        }
    }

    /// The same connection, holding `slots` until it is dropped.
    fn holding(mut self, slots: ConnectionSlots) -> WriteDeadline {
        self.slots = Some(slots);
        self
    }

    /// Reads and drops what the client still sends until it closes, [`LINGER`] passes
    /// or [`LINGER_BYTES`] arrive; ready in every case, since the connection is done.
    fn poll_linger(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Some((until, dropped)) = self.lingering.as_mut() else {
            return Poll::Ready(());
        };
        let mut scratch = [0u8; 8192];
        loop {
            if *dropped >= LINGER_BYTES {
                return Poll::Ready(());
            }
            let mut buf = ReadBuf::new(&mut scratch);
            match Pin::new(&mut self.tcp).poll_read(cx, &mut buf) {
                Poll::Ready(Ok(())) if buf.filled().is_empty() => return Poll::Ready(()),
                Poll::Ready(Ok(())) => *dropped += buf.filled().len(),
                Poll::Ready(Err(_)) => return Poll::Ready(()),
                Poll::Pending => return until.as_mut().poll(cx),
            }
        }
    }

    /// What a write's outcome means under the deadline: progress stops the timer, a
    /// pending write starts it (or finds it expired).
    fn watch<T>(
        &mut self,
        cx: &mut Context<'_>,
        outcome: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if outcome.is_ready() {
            self.stalled = None;
            return outcome;
        }
        let timeout = self.timeout;
        let stalled = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        if stalled.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        // A linger of zero makes the close a reset: the unread answer is dropped.
        let _ = socket2::SockRef::from(&self.tcp).set_linger(Some(Duration::ZERO));
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "the client read nothing of the answer for {} s",
                timeout.as_secs()
            ),
        )))
    }
}

impl AsyncRead for WriteDeadline {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for WriteDeadline {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let outcome = Pin::new(&mut self.tcp).poll_write(cx, buf);
        self.watch(cx, outcome)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let outcome = Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs);
        self.watch(cx, outcome)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    // A TCP flush or shutdown writes nothing, so it is no progress: the timer is left as
    // the writes set it.
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    /// Sends the FIN, then lingers (see [`LINGER`]) so the answer is read before the
    /// socket closes.
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.lingering.is_none() {
            std::task::ready!(Pin::new(&mut self.tcp).poll_shutdown(cx))?;
            self.lingering = Some((Box::pin(tokio::time::sleep(LINGER)), 0));
        }
        self.poll_linger(cx).map(Ok)
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_are_capped_one_by_one_and_leave_the_map() {
        let peers = PeerCounts::new(2);
        let a: IpAddr = "127.0.0.1".parse().expect("ip");
        let mapped: IpAddr = "::ffff:127.0.0.1".parse().expect("ip");
        let b: IpAddr = "127.0.0.2".parse().expect("ip");
        let first = peers.enter(a).expect("first");
        let second = peers.enter(mapped).expect("second, the same peer");
        assert!(peers.enter(a).is_none(), "a third from the same peer");
        let other = peers.enter(b).expect("another peer is not held back");
        drop(first);
        let again = peers.enter(a).expect("room again after one closed");
        drop((second, again, other));
        assert!(peers.open.lock().expect("lock").is_empty());
    }

    #[tokio::test]
    async fn accepted_connections_give_up_on_an_unacknowledged_peer() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let _client = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let (accepted, _) = listener.accept().await.expect("accept");
        let before = socket2::SockRef::from(&accepted)
            .tcp_user_timeout()
            .expect("getsockopt");
        assert_eq!(before, None, "the kernel default is off");
        configure(&accepted, Duration::from_secs(30));
        let sock = socket2::SockRef::from(&accepted);
        assert_eq!(
            sock.tcp_user_timeout().expect("getsockopt"),
            Some(Duration::from_secs(30))
        );
        assert!(sock.tcp_nodelay().expect("getsockopt"));
    }

    /// A client refused before its body was read still gets the answer: the connection
    /// drops the rest of the body instead of resetting under the client's writes.
    #[tokio::test]
    async fn a_client_refused_mid_body_reads_the_refusal() {
        use std::io::{Read as _, Write as _};
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let app = Router::new().route(
            "/",
            axum::routing::post(|| async { (hyper::StatusCode::UNAUTHORIZED, "no key") }),
        );
        let limits = ServeLimits {
            max_connections: 4,
            max_connections_per_peer: 4,
            header_read_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(5),
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, app, limits, async {
            let _ = stopped.await;
        }));
        let answer = tokio::task::spawn_blocking(move || {
            let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
            s.set_read_timeout(Some(Duration::from_secs(10)))
                .expect("timeout");
            let body = vec![b'0'; 8 * 1024 * 1024];
            let head = format!(
                "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
                body.len()
            );
            s.write_all(head.as_bytes()).expect("head");
            // Sent in pieces with pauses, so the answer and the close come mid-body.
            for piece in body.chunks(256 * 1024) {
                s.write_all(piece)?;
                std::thread::sleep(Duration::from_millis(5));
            }
            let mut answer = String::new();
            s.read_to_string(&mut answer)?;
            Ok::<_, io::Error>(answer)
        })
        .await
        .expect("client");
        let answer = answer.expect("the body is sent and the answer read without a reset");
        assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
        let _ = stop.send(());
        server.await.expect("join").expect("serve");
    }

    #[test]
    fn the_over_cap_answer_is_well_formed() {
        let text = std::str::from_utf8(PEER_OVER_CAP).expect("ascii");
        let (head, body) = text.split_once("\r\n\r\n").expect("head and body");
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("Content-Length: "))
            .and_then(|v| v.parse().ok())
            .expect("length");
        assert_eq!(body.len(), length);
        let json: serde_json::Value = serde_json::from_str(body).expect("JSON");
        assert_eq!(json["error"], "unavailable");
    }
}
