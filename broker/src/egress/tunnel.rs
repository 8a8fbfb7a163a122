//! The broker's end of egress tunnelled over a runner channel (see `sandbox_runner::tunnel`),
//! for sandboxes that cannot mount the proxy socket (Kubernetes pods, or any sandbox when
//! `CODEBROKER_EGRESS_TRANSPORT=runner`). Each tunnelled connection becomes an in-memory
//! stream served by the same proxy as a socket's connection ([`Gateway::serve_one`]), with
//! the same policy, budget and records.
//!
//! One task reads the runner's frames and never waits on a connection: bytes go to the
//! connection's queue, which the runner's credit bounds to a window (a runner that sends
//! past it has its connection reset). Each connection's own task writes them to the proxy
//! and acknowledges them, and sends the proxy's bytes to the runner within the credit the
//! runner grants.

use super::gateway::{Gateway, SandboxEgress, MAX_OPEN_PER_SANDBOX};
use crate::sandbox::channel::{FrameSender, StandingJob};
use crate::sync::LockExt as _;
use sandbox_runner::{
    ConnId, CoordinatorMessage, JobId, TunnelFrame, WorkerMessage, TUNNEL_CHUNK, TUNNEL_WINDOW,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;

/// What the frame reader hands a connection's task.
enum Upstream {
    /// The client's bytes.
    Data(Vec<u8>),
    /// The client's end of file.
    End,
}

/// A connection under way, as the frame reader sees it.
struct Tunnelled {
    /// The client's bytes and end, to its task. Unbounded: the window bounds it.
    to_proxy: mpsc::UnboundedSender<Upstream>,
    /// The client's bytes received and not yet acknowledged (at most a window).
    unacked: Arc<AtomicUsize>,
    /// Bytes the runner may still take from the proxy's side.
    credit: Arc<Semaphore>,
    /// Ends the connection's task (a reset from the runner).
    stop: CancellationToken,
}

type Conns = Arc<Mutex<HashMap<ConnId, Tunnelled>>>;

/// Serves the tunnel of one sandbox until `stop`, the channel's end, or the runner
/// refusing to listen.
pub(crate) async fn serve(
    gateway: Arc<Gateway>,
    sandbox: Weak<SandboxEgress>,
    mut standing: StandingJob,
    stop: CancellationToken,
) {
    let conns: Conns = Arc::default();
    let (job, sender) = (standing.job, standing.sender.clone());
    loop {
        let msg = tokio::select! {
            _ = stop.cancelled() => break,
            msg = standing.messages.recv() => msg,
        };
        let frame = match msg {
            Some(WorkerMessage::Egress(frame)) => frame,
            Some(WorkerMessage::Error(err)) => {
                tracing::warn!(error = %err.message, "egress: the runner does not tunnel");
                break;
            }
            Some(_) => continue,
            None => break,
        };
        let conn = frame.conn();
        match frame {
            TunnelFrame::Open { .. } => {
                let full = conns.locked().len() >= MAX_OPEN_PER_SANDBOX;
                let taken = conns.locked().contains_key(&conn);
                let Some(sandbox) = sandbox.upgrade().filter(|_| !full && !taken) else {
                    reset(&sender, job, conn);
                    continue;
                };
                open(&gateway, &sandbox, &conns, &sender, job, conn, &stop);
            }
            TunnelFrame::Data { data, .. } => {
                let over = {
                    let conns = conns.locked();
                    match conns.get(&conn) {
                        Some(c) => {
                            let unacked = c.unacked.fetch_add(data.len(), Ordering::AcqRel);
                            if unacked + data.len() > TUNNEL_WINDOW {
                                true
                            } else {
                                let _ = c.to_proxy.send(Upstream::Data(data));
                                false
                            }
                        }
                        None => false,
                    }
                };
                if over {
                    tracing::warn!(conn, "egress: the runner sent past its window");
                    drop_conn(&conns, conn);
                    reset(&sender, job, conn);
                }
            }
            TunnelFrame::End { .. } => {
                if let Some(c) = conns.locked().get(&conn) {
                    let _ = c.to_proxy.send(Upstream::End);
                }
            }
            TunnelFrame::Ack { bytes, .. } => {
                if let Some(c) = conns.locked().get(&conn) {
                    let room = TUNNEL_WINDOW.saturating_sub(c.credit.available_permits());
                    c.credit
                        .add_permits(usize::try_from(bytes).unwrap_or(room).min(room));
                }
            }
            TunnelFrame::Reset { .. } => drop_conn(&conns, conn),
        }
    }
    for (_, c) in conns.locked().drain() {
        c.stop.cancel();
    }
}

/// Ends a connection's task, if it is still there.
fn drop_conn(conns: &Conns, conn: ConnId) {
    if let Some(c) = conns.locked().remove(&conn) {
        c.stop.cancel();
    }
}

/// Tells the runner a connection is over, without waiting: the frame reader must never wait
/// on a write to the runner, which may itself be waiting for the broker to read.
fn reset(sender: &FrameSender, job: JobId, conn: ConnId) {
    let sender = sender.clone();
    tokio::spawn(async move {
        let _ = sender
            .send(job, CoordinatorMessage::Egress(TunnelFrame::Reset { conn }))
            .await;
    });
}

/// Starts the task of a new connection: the proxy on one end of an in-memory stream, the
/// tunnel's two directions on the other.
fn open(
    gateway: &Arc<Gateway>,
    sandbox: &Arc<SandboxEgress>,
    conns: &Conns,
    sender: &FrameSender,
    job: JobId,
    conn: ConnId,
    stop: &CancellationToken,
) {
    let (proxy_side, tunnel_side) = tokio::io::duplex(TUNNEL_CHUNK);
    let (to_proxy, mut from_runner) = mpsc::unbounded_channel();
    let unacked = Arc::new(AtomicUsize::new(0));
    let credit = Arc::new(Semaphore::new(TUNNEL_WINDOW));
    let conn_stop = stop.child_token();
    conns.locked().insert(
        conn,
        Tunnelled {
            to_proxy,
            unacked: unacked.clone(),
            credit: credit.clone(),
            stop: conn_stop.clone(),
        },
    );
    let served = gateway.serve_one(sandbox, proxy_side, conn_stop.clone());
    let (conns, sender) = (conns.clone(), sender.clone());
    tokio::spawn(async move {
        let (mut tunnel_read, mut tunnel_write) = tokio::io::split(tunnel_side);
        // The client's bytes into the proxy, each piece acknowledged once written.
        let up = async {
            while let Some(piece) = from_runner.recv().await {
                match piece {
                    Upstream::Data(data) => {
                        if tunnel_write.write_all(&data).await.is_err() {
                            return false;
                        }
                        unacked.fetch_sub(data.len(), Ordering::AcqRel);
                        let ack = TunnelFrame::Ack {
                            conn,
                            bytes: data.len() as u64,
                        };
                        if sender
                            .send(job, CoordinatorMessage::Egress(ack))
                            .await
                            .is_err()
                        {
                            return false;
                        }
                    }
                    Upstream::End => {
                        let _ = tunnel_write.shutdown().await;
                        return true;
                    }
                }
            }
            false
        };
        // The proxy's bytes to the runner, within its credit.
        let down = async {
            let mut buf = vec![0u8; TUNNEL_CHUNK];
            loop {
                let Ok(permit) = credit.acquire().await else {
                    return false;
                };
                let room = (credit.available_permits() + 1).min(TUNNEL_CHUNK);
                let n = match tunnel_read.read(&mut buf[..room]).await {
                    Ok(n) => n,
                    Err(_) => return false,
                };
                if n == 0 {
                    // A connection stopped from here (a reset) ends its proxy too, whose end
                    // of file is not the server's: the runner gets the reset, not an end.
                    if conn_stop.is_cancelled() {
                        return false;
                    }
                    drop(permit);
                    let end = CoordinatorMessage::Egress(TunnelFrame::End { conn });
                    return sender.send(job, end).await.is_ok();
                }
                permit.forget();
                if let Ok(more) = credit.try_acquire_many((n - 1) as u32) {
                    more.forget();
                }
                let data = TunnelFrame::Data {
                    conn,
                    data: buf[..n].to_vec(),
                };
                if sender
                    .send(job, CoordinatorMessage::Egress(data))
                    .await
                    .is_err()
                {
                    return false;
                }
            }
        };
        let clean = tokio::select! {
            (_, up, down) = async { tokio::join!(served, up, down) } => up && down,
            _ = conn_stop.cancelled() => false,
        };
        if conns.locked().remove(&conn).is_some() && !clean {
            reset(&sender, job, conn);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::egress::gateway::{EgressObserver, ExecEgress};
    use crate::egress::proxy::Outcome;
    use crate::sandbox::channel::{AttachOutput, RunnerChannel};
    use sandbox_runner::{EgressListenRequest, Multiplexed};
    use std::sync::atomic::AtomicU64;
    use std::time::Duration;
    use tokio::io::{AsyncBufReadExt as _, BufReader};

    struct Quiet;
    impl EgressObserver for Quiet {
        fn connection(&self, _exec: Option<&ExecEgress>, _outcome: &Outcome) {}
    }

    /// A fake runner: frames to the broker go in, frames from it come out.
    struct FakeRunner {
        to_broker: mpsc::UnboundedSender<Result<AttachOutput, String>>,
        from_broker: BufReader<tokio::io::DuplexStream>,
        job: JobId,
    }

    impl FakeRunner {
        fn send(&self, frame: TunnelFrame) {
            let line = serde_json::to_string(&Multiplexed(self.job, WorkerMessage::Egress(frame)))
                .expect("encode");
            self.to_broker
                .send(Ok(AttachOutput::Stdout(format!("{line}\n").into())))
                .expect("send");
        }

        /// The broker's next frame, or `None` after `wait` without one.
        async fn next(&mut self, wait: Duration) -> Option<CoordinatorMessage> {
            let mut line = String::new();
            let read = tokio::time::timeout(wait, self.from_broker.read_line(&mut line)).await;
            match read {
                Ok(Ok(n)) if n > 0 => {
                    let Multiplexed(job, msg) =
                        serde_json::from_str::<Multiplexed<CoordinatorMessage>>(&line)
                            .expect("a frame");
                    assert_eq!(job, self.job);
                    Some(msg)
                }
                _ => None,
            }
        }
    }

    /// A gateway allowing `pkg.test:port` (pinned to loopback), a sandbox of it tunnelled
    /// over a fake runner's channel, with an exec under way.
    async fn tunnelled(port: u16) -> (FakeRunner, Arc<SandboxEgress>, RunnerChannel) {
        let mut config = crate::config::Config::for_tests("/tmp".into(), "tunnel-test").egress;
        config.egress = format!("pkg.test:{port}");
        config.egress_resolve = "pkg.test=127.0.0.1".into();
        let gateway = Arc::new(
            Gateway::new(
                &config,
                crate::config::EgressTransport::Runner,
                std::path::Path::new("/tmp"),
                Arc::new(Quiet),
            )
            .expect("gateway"),
        );
        let (to_broker, mut rx) = mpsc::unbounded_channel();
        let output = futures::stream::poll_fn(move |cx| rx.poll_recv(cx));
        let (input, sink) = tokio::io::duplex(4 << 20);
        let channel = RunnerChannel::new("t".into(), output, Box::pin(input));
        let standing = channel
            .standing_job(EgressListenRequest {})
            .await
            .expect("listen");
        let mut runner = FakeRunner {
            to_broker,
            from_broker: BufReader::new(sink),
            job: standing.job,
        };
        assert_eq!(
            runner.next(Duration::from_secs(5)).await,
            Some(CoordinatorMessage::EgressListen(EgressListenRequest {}))
        );
        let egress = gateway.open_tunnel("t", standing);
        let budget = gateway.exec_budget(Arc::new(AtomicU64::new(0)));
        std::mem::forget(egress.begin_exec(ExecEgress {
            session: "s".into(),
            user: None,
            tenant: None,
            budget,
        }));
        (runner, egress, channel)
    }

    /// A server on loopback that sends `first` bytes on each connection, then echoes.
    async fn server(first: usize) -> u16 {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    if s.write_all(&vec![b'x'; first]).await.is_err() {
                        return;
                    }
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                    let _ = w.shutdown().await;
                });
            }
        });
        port
    }

    fn connect(conn: ConnId, port: u16) -> TunnelFrame {
        TunnelFrame::Data {
            conn,
            data: format!("CONNECT pkg.test:{port} HTTP/1.1\r\n\r\n").into_bytes(),
        }
    }

    #[tokio::test]
    async fn a_tunnelled_connection_is_proxied_both_ways_and_acknowledged() {
        let port = server(0).await;
        let (mut runner, _egress, _channel) = tunnelled(port).await;
        runner.send(TunnelFrame::Open { conn: 1 });
        runner.send(connect(1, port));
        runner.send(TunnelFrame::Data {
            conn: 1,
            data: b"ping".to_vec(),
        });
        runner.send(TunnelFrame::End { conn: 1 });
        let sent = format!("CONNECT pkg.test:{port} HTTP/1.1\r\n\r\n").len() + 4;
        let (mut down, mut acked, mut ended) = (Vec::new(), 0, false);
        while !(ended && acked == sent) {
            match runner.next(Duration::from_secs(10)).await {
                Some(CoordinatorMessage::Egress(TunnelFrame::Data { conn: 1, data })) => {
                    down.extend_from_slice(&data);
                    runner.send(TunnelFrame::Ack {
                        conn: 1,
                        bytes: data.len() as u64,
                    });
                }
                Some(CoordinatorMessage::Egress(TunnelFrame::Ack { conn: 1, bytes })) => {
                    acked += bytes as usize
                }
                Some(CoordinatorMessage::Egress(TunnelFrame::End { conn: 1 })) => ended = true,
                other => panic!("unexpected {other:?} after {down:?}"),
            }
        }
        assert_eq!(
            String::from_utf8_lossy(&down),
            "HTTP/1.1 200 Connection established\r\n\r\nping"
        );
    }

    #[tokio::test]
    async fn the_broker_sends_no_more_than_the_runner_acknowledged() {
        let port = server(3 * TUNNEL_WINDOW).await;
        let (mut runner, _egress, _channel) = tunnelled(port).await;
        runner.send(TunnelFrame::Open { conn: 7 });
        runner.send(connect(7, port));
        let mut got = 0;
        while let Some(msg) = runner.next(Duration::from_millis(500)).await {
            if let CoordinatorMessage::Egress(TunnelFrame::Data { data, .. }) = msg {
                got += data.len();
            }
        }
        assert_eq!(got, TUNNEL_WINDOW, "a window, then nothing without an ack");
        runner.send(TunnelFrame::Ack {
            conn: 7,
            bytes: got as u64,
        });
        let mut more = 0;
        while let Some(msg) = runner.next(Duration::from_millis(500)).await {
            if let CoordinatorMessage::Egress(TunnelFrame::Data { data, .. }) = msg {
                more += data.len();
            }
        }
        assert_eq!(more, TUNNEL_WINDOW, "the ack opened one more window");
    }

    #[tokio::test]
    async fn a_runner_that_sends_past_its_window_has_its_connection_reset() {
        let port = server(0).await;
        let (mut runner, _egress, _channel) = tunnelled(port).await;
        runner.send(TunnelFrame::Open { conn: 2 });
        runner.send(TunnelFrame::Data {
            conn: 2,
            data: vec![b'a'; TUNNEL_WINDOW + 1],
        });
        loop {
            match runner.next(Duration::from_secs(10)).await {
                Some(CoordinatorMessage::Egress(TunnelFrame::Reset { conn: 2 })) => break,
                Some(CoordinatorMessage::Egress(TunnelFrame::Ack { .. })) => {}
                other => panic!("expected a reset, got {other:?}"),
            }
        }
        // The tunnel serves the next connection.
        runner.send(TunnelFrame::Open { conn: 3 });
        runner.send(connect(3, port));
        loop {
            match runner.next(Duration::from_secs(10)).await {
                Some(CoordinatorMessage::Egress(TunnelFrame::Data { conn: 3, data })) => {
                    assert!(data.starts_with(b"HTTP/1.1 200"), "{data:?}");
                    break;
                }
                Some(CoordinatorMessage::Egress(_)) => {}
                other => panic!("expected an answer, got {other:?}"),
            }
        }
    }
}
