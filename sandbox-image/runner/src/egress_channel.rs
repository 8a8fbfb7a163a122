//! The runner's end of egress tunnelled over the channel (see `sandbox_runner::tunnel`):
//! used when the broker names no socket and asks for it (`EgressListen`).
//!
//! Each connection the forwarder accepts gets a number and two threads, as a socket relay
//! does: its own thread writes the broker's bytes to the client (acknowledging each piece
//! once written), and a second one reads the client and sends its bytes while the broker
//! has granted credit. The main thread, which reads the channel, only queues the broker's
//! frames here and never blocks on a connection.

use crate::frame::Channel;
use sandbox_runner::sync::LockExt as _;
use sandbox_runner::{ConnId, JobId, TunnelFrame, WorkerMessage, TUNNEL_CHUNK, TUNNEL_WINDOW};
use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// The tunnel of one runner: where its connections' frames go, and their state.
pub struct Tunnel {
    /// The channel to the broker.
    chan: Arc<Channel>,
    /// The broker's listening job; `None` until it asked (connections before that are
    /// answered "egress is off" by the forwarder).
    job: Mutex<Option<JobId>>,
    /// The connections under way, for the frames the broker sends them.
    conns: Mutex<HashMap<ConnId, Arc<Conn>>>,
    /// Source of connection numbers.
    next: AtomicU64,
}

/// One connection's state, shared by its two threads and the channel reader.
struct Conn {
    state: Mutex<ConnState>,
    /// Signalled on every change of `state`.
    changed: Condvar,
}

#[derive(Default)]
struct ConnState {
    /// The broker's bytes not yet written to the client.
    down: VecDeque<Vec<u8>>,
    /// The broker sent its end of file.
    down_ended: bool,
    /// The client's bytes the broker may still take.
    credit: usize,
    /// The connection is over (either side reset it).
    reset: bool,
}

impl Tunnel {
    /// A tunnel over `chan`, idle until the broker listens.
    pub fn new(chan: Arc<Channel>) -> Tunnel {
        Tunnel {
            chan,
            job: Mutex::new(None),
            conns: Mutex::default(),
            next: AtomicU64::new(1),
        }
    }

    /// The broker listens under `job` (a broker that attaches again listens anew; the
    /// connections of the one before are over).
    pub fn listen(&self, job: JobId) {
        *self.job.locked() = Some(job);
        for (_, conn) in self.conns.locked().drain() {
            conn.update(|s| s.reset = true);
        }
    }

    /// A frame the broker sent; frames of connections that are over are dropped.
    pub fn on_frame(&self, job: JobId, frame: TunnelFrame) {
        if *self.job.locked() != Some(job) {
            return;
        }
        let Some(conn) = self.conns.locked().get(&frame.conn()).cloned() else {
            return;
        };
        match frame {
            TunnelFrame::Data { data, .. } => conn.update(|s| s.down.push_back(data)),
            TunnelFrame::End { .. } => conn.update(|s| s.down_ended = true),
            TunnelFrame::Ack { bytes, .. } => conn.update(|s| {
                s.credit = s
                    .credit
                    .saturating_add(usize::try_from(bytes).unwrap_or(usize::MAX))
                    .min(TUNNEL_WINDOW);
            }),
            TunnelFrame::Reset { .. } => conn.update(|s| s.reset = true),
            // Connections are opened by this side only.
            TunnelFrame::Open { .. } => {}
        }
    }

    /// Relays `client` through the tunnel until both directions have ended. Returns the
    /// client back when the broker is not listening, for the caller to answer.
    pub fn relay(&self, client: TcpStream) -> Result<(), TcpStream> {
        let Some(job) = *self.job.locked() else {
            return Err(client);
        };
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(Conn {
            state: Mutex::new(ConnState {
                credit: TUNNEL_WINDOW,
                ..ConnState::default()
            }),
            changed: Condvar::new(),
        });
        let Ok(reader) = client.try_clone() else {
            return Err(client);
        };
        self.conns.locked().insert(id, conn.clone());
        self.send(job, TunnelFrame::Open { conn: id });
        let up = {
            let (conn, chan) = (conn.clone(), self.chan.clone());
            std::thread::Builder::new()
                .name("egress-up".into())
                .stack_size(crate::egress::THREAD_STACK)
                .spawn(move || send_client_bytes(reader, &conn, &chan, job, id))
        };
        match up {
            Ok(up) => {
                self.write_broker_bytes(&client, &conn, job, id);
                let _ = up.join();
            }
            Err(_) => {
                self.send(job, TunnelFrame::Reset { conn: id });
                let _ = client.shutdown(Shutdown::Both);
            }
        }
        self.conns.locked().remove(&id);
        Ok(())
    }

    /// Writes the broker's bytes to the client until the broker's end of file (then half
    /// closes the client) or a reset (then shuts it down, which ends the other thread).
    fn write_broker_bytes(&self, client: &TcpStream, conn: &Conn, job: JobId, id: ConnId) {
        let mut client = client;
        loop {
            let step = {
                let mut s = conn.wait(|s| s.reset || s.down_ended || !s.down.is_empty());
                if s.reset {
                    None
                } else {
                    Some(s.down.pop_front())
                }
            };
            let piece = match step {
                Some(Some(piece)) => piece,
                Some(None) => {
                    let _ = client.shutdown(Shutdown::Write);
                    return;
                }
                None => {
                    let _ = client.shutdown(Shutdown::Both);
                    return;
                }
            };
            if client.write_all(&piece).is_err() {
                conn.update(|s| s.reset = true);
                self.send(job, TunnelFrame::Reset { conn: id });
                let _ = client.shutdown(Shutdown::Both);
                return;
            }
            self.send(
                job,
                TunnelFrame::Ack {
                    conn: id,
                    bytes: piece.len() as u64,
                },
            );
        }
    }

    fn send(&self, job: JobId, frame: TunnelFrame) {
        self.chan.send(job, &WorkerMessage::Egress(frame));
    }
}

/// Reads the client and sends its bytes, within the broker's credit, until end of file
/// (sent as `End`), an error (`Reset`) or a reset from either side.
fn send_client_bytes(mut client: TcpStream, conn: &Conn, chan: &Channel, job: JobId, id: ConnId) {
    let mut buf = vec![0u8; TUNNEL_CHUNK];
    loop {
        let room = {
            let s = conn.wait(|s| s.reset || s.credit > 0);
            if s.reset {
                return;
            }
            s.credit.min(TUNNEL_CHUNK)
        };
        let frame = match client.read(&mut buf[..room]) {
            Ok(0) => TunnelFrame::End { conn: id },
            Ok(n) => {
                conn.update(|s| s.credit -= n.min(s.credit));
                TunnelFrame::Data {
                    conn: id,
                    data: buf[..n].to_vec(),
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => TunnelFrame::Reset { conn: id },
        };
        let last = !matches!(frame, TunnelFrame::Data { .. });
        if matches!(frame, TunnelFrame::Reset { .. }) {
            conn.update(|s| s.reset = true);
        }
        // A connection reset meanwhile (the client shut down by the other thread) says
        // nothing more.
        if conn.state.locked().reset && !matches!(frame, TunnelFrame::Reset { .. }) {
            return;
        }
        chan.send(job, &WorkerMessage::Egress(frame));
        if last {
            return;
        }
    }
}

impl Conn {
    /// Changes the state and wakes the connection's threads.
    fn update(&self, change: impl FnOnce(&mut ConnState)) {
        change(&mut self.state.locked());
        self.changed.notify_all();
    }

    /// Waits until `ready` holds.
    fn wait(&self, ready: impl Fn(&ConnState) -> bool) -> std::sync::MutexGuard<'_, ConnState> {
        let mut s = self.state.locked();
        while !ready(&s) {
            s = sandbox_runner::sync::unpoisoned(self.changed.wait(s));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandbox_runner::Multiplexed;
    use std::io::BufRead as _;
    use std::net::TcpListener;
    use std::os::fd::AsRawFd as _;
    use std::sync::mpsc;
    use std::time::Duration;

    /// A listening tunnel whose frames are read back, and a client connection relayed
    /// through it.
    struct Harness {
        tunnel: Arc<Tunnel>,
        frames: mpsc::Receiver<(JobId, TunnelFrame)>,
        client: TcpStream,
        conn: ConnId,
    }

    const JOB: JobId = 5;

    fn harness() -> Harness {
        let (read, write) = crate::sys::pipe().expect("pipe");
        let chan = Arc::new(Channel::to_fd(write.as_raw_fd()));
        // The channel writes to the raw descriptor for as long as any thread holds it.
        std::mem::forget(write);
        let tunnel = Arc::new(Tunnel::new(chan));
        tunnel.listen(JOB);
        let (tx, frames) = mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(std::fs::File::from(read)).lines() {
                let Ok(line) = line else { return };
                if let Ok(Multiplexed(job, WorkerMessage::Egress(frame))) =
                    serde_json::from_str(&line)
                {
                    if tx.send((job, frame)).is_err() {
                        return;
                    }
                }
            }
        });
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let client = TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let (served, _) = listener.accept().expect("accept");
        let relayed = tunnel.clone();
        std::thread::spawn(move || {
            let _ = relayed.relay(served);
        });
        client
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let mut h = Harness {
            tunnel,
            frames,
            client,
            conn: 0,
        };
        match h.next(Duration::from_secs(10)) {
            Some(TunnelFrame::Open { conn }) => h.conn = conn,
            other => panic!("expected an open, got {other:?}"),
        }
        h
    }

    impl Harness {
        fn next(&self, wait: Duration) -> Option<TunnelFrame> {
            let (job, frame) = self.frames.recv_timeout(wait).ok()?;
            assert_eq!(job, JOB);
            Some(frame)
        }

        /// The client's bytes the tunnel sent within `wait` of quiet.
        fn data_until_quiet(&self, wait: Duration) -> usize {
            let mut got = 0;
            while let Some(frame) = self.next(wait) {
                if let TunnelFrame::Data { data, .. } = frame {
                    got += data.len();
                }
            }
            got
        }
    }

    #[test]
    fn a_connection_goes_both_ways_with_acks_and_half_closes() {
        let mut h = harness();
        let conn = h.conn;
        h.client.write_all(b"hello").expect("write");
        assert_eq!(
            h.next(Duration::from_secs(10)),
            Some(TunnelFrame::Data {
                conn,
                data: b"hello".to_vec()
            })
        );
        h.tunnel.on_frame(
            JOB,
            TunnelFrame::Data {
                conn,
                data: b"world".to_vec(),
            },
        );
        let mut buf = [0u8; 5];
        h.client.read_exact(&mut buf).expect("read");
        assert_eq!(&buf, b"world");
        assert_eq!(
            h.next(Duration::from_secs(10)),
            Some(TunnelFrame::Ack { conn, bytes: 5 })
        );
        // A frame under another job is not the broker's: dropped.
        h.tunnel.on_frame(JOB + 1, TunnelFrame::End { conn });
        h.tunnel.on_frame(JOB, TunnelFrame::End { conn });
        let mut rest = Vec::new();
        h.client.read_to_end(&mut rest).expect("end of file");
        assert!(rest.is_empty());
        h.client.shutdown(Shutdown::Write).expect("half close");
        assert_eq!(
            h.next(Duration::from_secs(10)),
            Some(TunnelFrame::End { conn })
        );
    }

    #[test]
    fn the_client_is_read_no_further_than_the_broker_granted() {
        let h = harness();
        let conn = h.conn;
        let mut writer = h.client.try_clone().expect("clone");
        std::thread::spawn(move || {
            let _ = writer.write_all(&vec![b'a'; 3 * TUNNEL_WINDOW]);
        });
        let quiet = Duration::from_millis(500);
        assert_eq!(h.data_until_quiet(quiet), TUNNEL_WINDOW, "one window");
        h.tunnel.on_frame(
            JOB,
            TunnelFrame::Ack {
                conn,
                bytes: TUNNEL_WINDOW as u64,
            },
        );
        assert_eq!(h.data_until_quiet(quiet), TUNNEL_WINDOW, "one more");
    }

    #[test]
    fn a_reset_from_the_broker_ends_the_client_connection() {
        let mut h = harness();
        h.tunnel.on_frame(JOB, TunnelFrame::Reset { conn: h.conn });
        let mut rest = Vec::new();
        // End of file or a reset, not a hang.
        let _ = h.client.read_to_end(&mut rest);
        assert!(rest.is_empty());
    }

    #[test]
    fn without_a_listening_broker_the_connection_is_given_back() {
        let tunnel = Tunnel::new(Arc::new(Channel::stdout()));
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let _client = TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let (served, _) = listener.accept().expect("accept");
        assert!(tunnel.relay(served).is_err());
    }
}
