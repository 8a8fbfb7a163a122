//! The egress forwarder: `127.0.0.1:3128` inside the container, where `HTTP_PROXY` and
//! `HTTPS_PROXY` point (the broker sets them in every container).
//!
//! The container has no network. With egress on, the broker bind-mounts its proxy's Unix
//! socket and names it in `CODEBROKER_EGRESS_SOCKET`; each connection accepted here is then
//! relayed byte for byte to a fresh connection to that socket, where the broker reads the
//! `CONNECT host:port` (or absolute-form) request, applies its allowlist and relays or
//! answers 403 itself. With egress off, the forwarder answers every request with a 403 whose
//! reason phrase says so, because pip and curl print the status line ("Tunnel connection
//! failed: 403 egress is off ..."), and closes. A socket that cannot be reached gets a 502.
//!
//! Threads: one accepts, started with the runner; each connection gets a thread of its own,
//! which relays the broker's bytes to the client, and a second one for the other direction,
//! each copying through a 64 KiB buffer. That measured faster than one thread moving both
//! directions with `splice(2)` through two pipes (100 MiB from a fake broker on a Unix
//! socket to a client on 127.0.0.1, see `bench_relay`: about 3.2 GB/s against 1.6 GB/s, and
//! 2.1 GB/s with 1 MiB pipes), at the price of two pids per connection instead of one. At
//! most [`MAX_CONNECTIONS`] are served at once; the accept thread answers the rest with a
//! 503 itself (as it does a connection whose thread cannot be started, when a fork bomb
//! filled the pids limit), so a flood cannot take the runner's threads. Nothing here may
//! stop the runner: a port that cannot be bound is one line on stderr.

use crate::egress_channel::Tunnel;
use crate::frame::Channel;
use sandbox_runner::{EGRESS_PROXY_PORT, EGRESS_SOCKET_ENV};
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Shutdown, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most connections relayed (or being answered) at once.
pub const MAX_CONNECTIONS: usize = 64;
/// The most of a request head read before an answer that is not a relay.
const HEAD_LIMIT: usize = 16 * 1024;
/// How long a request head is waited for before that answer goes out anyway.
const HEAD_TIMEOUT: Duration = Duration::from_secs(2);
/// How long, and how much, is read and dropped after such an answer, so that a request body
/// still coming does not turn the close into a reset that could cost the client the answer.
const LINGER: Duration = Duration::from_millis(500);
const LINGER_LIMIT: usize = 64 * 1024;
/// A connection thread's stack: its buffer is on the heap.
pub(crate) const THREAD_STACK: usize = 128 * 1024;
/// What one direction of a relay reads at a time (bigger ones were no faster).
const RELAY_BUFFER: usize = 64 * 1024;

/// Where the forwarder carries connections.
pub enum Upstream {
    /// The broker's proxy socket, mounted into the container (Docker).
    Socket(PathBuf),
    /// A tunnel over the runner channel, once the broker listens on it (Kubernetes, or a
    /// broker told to); until then egress is off.
    Channel(Arc<Tunnel>),
}

/// How the forwarder answers.
pub struct Settings {
    /// Where connections go.
    pub upstream: Upstream,
    /// Most connections served at once.
    pub max_connections: usize,
}

/// Starts the forwarder on `127.0.0.1:EGRESS_PROXY_PORT`, in a thread of its own. In a
/// container (`pid1`) always; on a host only when an egress socket is named, so a runner
/// tested on a host does not take the host's port 3128. Failures are logged, never fatal.
/// Returns the tunnel, for the frames the broker sends it, when there is no socket: a
/// broker that tunnels egress over the channel says so with its listen request, and until
/// then (or never, with egress off) the forwarder answers that egress is off.
pub fn start(pid1: bool, chan: &Arc<Channel>) -> Option<Arc<Tunnel>> {
    let socket = std::env::var_os(EGRESS_SOCKET_ENV).filter(|v| !v.is_empty());
    if !pid1 && socket.is_none() {
        return None;
    }
    let (upstream, tunnel) = match socket {
        Some(path) => (Upstream::Socket(PathBuf::from(path)), None),
        None => {
            let tunnel = Arc::new(Tunnel::new(chan.clone()));
            (Upstream::Channel(tunnel.clone()), Some(tunnel))
        }
    };
    let listener = match TcpListener::bind((Ipv4Addr::LOCALHOST, EGRESS_PROXY_PORT)) {
        Ok(l) => l,
        Err(e) => {
            eprintln!(
                "sandbox-runner: egress: cannot listen on 127.0.0.1:{EGRESS_PROXY_PORT}: {e}"
            );
            return tunnel;
        }
    };
    let settings = Settings {
        upstream,
        max_connections: MAX_CONNECTIONS,
    };
    if let Err(e) = std::thread::Builder::new()
        .name("egress".into())
        .spawn(move || serve(listener, settings))
    {
        eprintln!("sandbox-runner: egress: cannot start the forwarder: {e}");
    }
    tunnel
}

/// Accepts connections for ever, each served in a thread of its own.
pub fn serve(listener: TcpListener, settings: Settings) {
    let settings = Arc::new(settings);
    let active = Arc::new(AtomicUsize::new(0));
    loop {
        let conn = match listener.accept() {
            Ok((conn, _)) => conn,
            Err(e) => {
                // Out of descriptors or memory, or a connection gone before it was taken:
                // wait a little rather than spin, and go on.
                if e.kind() != io::ErrorKind::Interrupted {
                    std::thread::sleep(Duration::from_millis(10));
                }
                continue;
            }
        };
        let Some(slot) = Slot::take(&active, settings.max_connections) else {
            refuse(
                conn,
                &Answer::busy(&format!(
                    "too many connections at once (at most {})",
                    settings.max_connections
                )),
            );
            continue;
        };
        // A second handle, to answer on if the thread cannot be started.
        let spare = conn.try_clone();
        let settings = settings.clone();
        let started = std::thread::Builder::new()
            .name("egress-conn".into())
            .stack_size(THREAD_STACK)
            .spawn(move || {
                let _slot = slot;
                handle(conn, &settings);
            });
        if started.is_err() {
            if let Ok(conn) = spare {
                refuse(conn, &Answer::busy("the runner cannot start a thread"));
            }
        }
    }
}

/// One place among the connections served at once, given back when dropped.
struct Slot(Arc<AtomicUsize>);

impl Slot {
    fn take(active: &Arc<AtomicUsize>, max: usize) -> Option<Slot> {
        if active.fetch_add(1, Ordering::AcqRel) >= max {
            active.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(Slot(active.clone()))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Serves one connection: relays it, or answers it.
fn handle(mut conn: TcpStream, settings: &Settings) {
    // Small writes (a TLS handshake) go out at once rather than wait for an ACK.
    let _ = conn.set_nodelay(true);
    match &settings.upstream {
        Upstream::Socket(path) => match UnixStream::connect(path) {
            Ok(broker) => relay(conn, broker),
            Err(e) => answer(
                &mut conn,
                &Answer::unreachable(&format!("{}: {e}", path.display())),
            ),
        },
        Upstream::Channel(tunnel) => {
            if let Err(mut conn) = tunnel.relay(conn) {
                answer(&mut conn, &Answer::off());
            }
        }
    }
}

/// A response the forwarder gives itself, always followed by a close.
struct Answer {
    status: u16,
    /// The reason phrase: clients print the status line, so it says what happened.
    reason: &'static str,
    /// `X-Codebroker-Egress`.
    tag: &'static str,
    body: String,
}

impl Answer {
    /// Egress is off: the container was given no socket.
    fn off() -> Self {
        Answer {
            status: 403,
            reason: "egress is off (CODEBROKER_EGRESS is empty)",
            tag: "off",
            body: "egress: is off (CODEBROKER_EGRESS is empty)\n".into(),
        }
    }

    /// The broker's socket cannot be connected.
    fn unreachable(detail: &str) -> Self {
        Answer {
            status: 502,
            reason: "egress: the broker's proxy is not reachable",
            tag: "unreachable",
            body: format!("egress: the broker's proxy is not reachable ({detail})\n"),
        }
    }

    /// No room for one more connection.
    fn busy(detail: &str) -> Self {
        Answer {
            status: 503,
            reason: "egress: too many connections at once",
            tag: "busy",
            body: format!("egress: {detail}\n"),
        }
    }

    fn bytes(&self) -> Vec<u8> {
        format!(
            "HTTP/1.1 {} {}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\
             Connection: close\r\nX-Codebroker-Egress: {}\r\n\r\n{}",
            self.status,
            self.reason,
            self.body.len(),
            self.tag,
            self.body
        )
        .into_bytes()
    }
}

/// Reads the request head (up to [`HEAD_LIMIT`] bytes or [`HEAD_TIMEOUT`]), answers, and
/// closes after a short linger.
fn answer(conn: &mut TcpStream, answer: &Answer) {
    read_head(conn);
    let _ = conn.set_write_timeout(Some(HEAD_TIMEOUT));
    if conn.write_all(&answer.bytes()).is_err() {
        return;
    }
    let _ = conn.shutdown(Shutdown::Write);
    let deadline = Instant::now() + LINGER;
    let mut buf = [0u8; 4096];
    let mut drained = 0;
    while drained < LINGER_LIMIT {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || conn.set_read_timeout(Some(left)).is_err() {
            break;
        }
        match conn.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => drained += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
}

/// Reads until the blank line that ends a request head, [`HEAD_LIMIT`] bytes, end of file,
/// an error or [`HEAD_TIMEOUT`], whichever comes first.
fn read_head(conn: &mut TcpStream) {
    let deadline = Instant::now() + HEAD_TIMEOUT;
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 4096];
    while head.len() < HEAD_LIMIT {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || conn.set_read_timeout(Some(left)).is_err() {
            return;
        }
        let n = match conn.read(&mut buf[..(HEAD_LIMIT - head.len()).min(4096)]) {
            Ok(0) => return,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return,
        };
        let from = head.len().saturating_sub(3);
        head.extend_from_slice(&buf[..n]);
        if head[from..].windows(4).any(|w| w == b"\r\n\r\n")
            || head[from.saturating_sub(1)..]
                .windows(2)
                .any(|w| w == b"\n\n")
        {
            return;
        }
    }
}

/// Answers in the accept thread, without waiting for the request: the head already there
/// is read (so the close is not a reset), the answer written, the connection closed.
fn refuse(conn: TcpStream, answer: &Answer) {
    let mut conn = conn;
    if conn.set_nonblocking(true).is_err() {
        return;
    }
    let mut buf = [0u8; 4096];
    let _ = conn.read(&mut buf);
    let _ = conn.write_all(&answer.bytes());
    let _ = conn.shutdown(Shutdown::Write);
}

/// Relays both directions until both have ended, the broker's to the client in this
/// thread and the client's to the broker in a second one: each direction's end of file is
/// passed on as a half close (`shutdown(Write)`) of the other side; an error on either side
/// shuts both sockets down, which ends the other direction too.
fn relay(client: TcpStream, broker: UnixStream) {
    let (up_from, up_to) = match (client.try_clone(), broker.try_clone()) {
        (Ok(c), Ok(b)) => (c, b),
        _ => return,
    };
    let up = std::thread::Builder::new()
        .name("egress-up".into())
        .stack_size(THREAD_STACK)
        .spawn(move || pump(up_from, up_to));
    match up {
        Ok(up) => {
            pump(broker, client);
            let _ = up.join();
        }
        Err(_) => {
            drop(broker);
            let mut client = client;
            answer(
                &mut client,
                &Answer::busy("the runner cannot start a thread"),
            );
        }
    }
}

/// A socket of a relay.
trait Half: Read + Write {
    fn shut(&self, how: Shutdown);
}

impl Half for TcpStream {
    fn shut(&self, how: Shutdown) {
        let _ = self.shutdown(how);
    }
}

impl Half for UnixStream {
    fn shut(&self, how: Shutdown) {
        let _ = self.shutdown(how);
    }
}

/// Copies `from` to `to` until end of file (then half-closes `to`) or an error (then shuts
/// both down).
fn pump(mut from: impl Half, mut to: impl Half) {
    let mut buf = vec![0u8; RELAY_BUFFER];
    loop {
        match from.read(&mut buf) {
            Ok(0) => return to.shut(Shutdown::Write),
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    from.shut(Shutdown::Both);
    to.shut(Shutdown::Both);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;
    use std::path::Path;

    /// A fresh private directory for sockets.
    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "cb-egress-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir
    }

    /// A forwarder on an ephemeral port; returns its address.
    fn forwarder(upstream: Option<&Path>, max_connections: usize) -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let settings = Settings {
            // Without a socket: a tunnel no broker listens on, so egress is off.
            upstream: match upstream {
                Some(path) => Upstream::Socket(path.to_path_buf()),
                None => Upstream::Channel(Arc::new(Tunnel::new(Arc::new(Channel::stdout())))),
            },
            max_connections,
        };
        std::thread::spawn(move || serve(listener, settings));
        addr
    }

    /// A fake broker that echoes every connection, passing on its end of file.
    fn echo_broker(path: &Path) {
        let listener = UnixListener::bind(path).expect("bind unix");
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                std::thread::spawn(move || {
                    let mut out = conn.try_clone().expect("clone");
                    let _ = io::copy(&mut conn, &mut out);
                    let _ = out.shutdown(Shutdown::Write);
                });
            }
        });
    }

    fn read_all(conn: &mut TcpStream) -> Vec<u8> {
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let mut got = Vec::new();
        conn.read_to_end(&mut got).expect("read");
        got
    }

    #[test]
    fn a_connection_reaches_the_broker_and_its_answer_comes_back() {
        let dir = temp_dir("echo");
        let sock = dir.join("proxy.sock");
        echo_broker(&sock);
        let addr = forwarder(Some(&sock), 4);
        let mut conn = TcpStream::connect(addr).expect("connect");
        conn.write_all(b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: pypi.org:443\r\n\r\n")
            .expect("write");
        conn.shutdown(Shutdown::Write).expect("half close");
        assert_eq!(
            read_all(&mut conn),
            b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: pypi.org:443\r\n\r\n"
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn with_egress_off_the_answer_is_a_403_that_says_so() {
        let addr = forwarder(None, 4);
        let mut conn = TcpStream::connect(addr).expect("connect");
        conn.write_all(b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: pypi.org:443\r\n\r\n")
            .expect("write");
        // Not closed for writing: the head's blank line is what the answer waits for.
        let got = String::from_utf8(read_all(&mut conn)).expect("utf-8");
        let body = "egress: is off (CODEBROKER_EGRESS is empty)\n";
        assert_eq!(
            got,
            format!(
                "HTTP/1.1 403 egress is off (CODEBROKER_EGRESS is empty)\r\n\
                 Content-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\
                 X-Codebroker-Egress: off\r\n\r\n{body}",
                body.len()
            )
        );
    }

    #[test]
    fn with_egress_off_a_silent_client_is_answered_after_the_head_timeout() {
        let addr = forwarder(None, 4);
        let mut conn = TcpStream::connect(addr).expect("connect");
        let start = Instant::now();
        let got = read_all(&mut conn);
        assert!(got.starts_with(b"HTTP/1.1 403 egress is off"));
        let waited = start.elapsed();
        assert!(
            waited >= HEAD_TIMEOUT - Duration::from_millis(100) && waited < Duration::from_secs(5)
        );
    }

    #[test]
    fn a_socket_that_cannot_be_reached_gets_a_502() {
        let dir = temp_dir("gone");
        let addr = forwarder(Some(&dir.join("missing.sock")), 4);
        let mut conn = TcpStream::connect(addr).expect("connect");
        conn.write_all(b"GET http://example.com/ HTTP/1.1\r\nHost: example.com\r\n\r\n")
            .expect("write");
        let got = String::from_utf8(read_all(&mut conn)).expect("utf-8");
        assert!(
            got.starts_with("HTTP/1.1 502 egress: the broker's proxy is not reachable\r\n"),
            "{got}"
        );
        assert!(got.contains("missing.sock"), "{got}");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn connections_beyond_the_cap_get_a_503_and_the_slots_come_back() {
        let dir = temp_dir("cap");
        let sock = dir.join("proxy.sock");
        echo_broker(&sock);
        let addr = forwarder(Some(&sock), 2);
        // Two open relays (proved open by an echo each) take both slots.
        let mut held: Vec<TcpStream> = (0..2)
            .map(|i| {
                let mut c = TcpStream::connect(addr).expect("connect");
                c.write_all(&[i]).expect("write");
                let mut b = [0u8; 1];
                c.read_exact(&mut b).expect("echo");
                assert_eq!(b[0], i);
                c
            })
            .collect();
        let mut third = TcpStream::connect(addr).expect("connect");
        let got = String::from_utf8(read_all(&mut third)).expect("utf-8");
        assert!(
            got.starts_with("HTTP/1.1 503 egress: too many connections at once\r\n"),
            "{got}"
        );
        assert!(got.contains("at most 2"), "{got}");
        // Closing one gives its slot back (once its thread has seen the end).
        let closed = held.pop().expect("one");
        closed.shutdown(Shutdown::Write).expect("half close");
        let mut closed = closed;
        assert!(read_all(&mut closed).is_empty());
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let mut c = TcpStream::connect(addr).expect("connect");
            c.write_all(b"x").expect("write");
            c.set_read_timeout(Some(Duration::from_secs(5)))
                .expect("timeout");
            let mut b = [0u8; 1];
            if c.read_exact(&mut b).is_ok() && b[0] == b'x' {
                break;
            }
            assert!(Instant::now() < deadline, "the slot never came back");
            std::thread::sleep(Duration::from_millis(10));
        }
        drop(held);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A fake broker that answers each connection with `down` bytes of a pattern while it
    /// reads and checks what comes up, then reports how many bytes came up intact.
    fn pattern_broker(path: &Path, down: usize) -> std::sync::mpsc::Receiver<usize> {
        let listener = UnixListener::bind(path).expect("bind unix");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let Ok((conn, _)) = listener.accept() else {
                return;
            };
            let mut out = conn.try_clone().expect("clone");
            let writer = std::thread::spawn(move || {
                write_pattern(&mut out, down);
                out.shutdown(Shutdown::Write).expect("half close");
            });
            let got = check_pattern(conn);
            writer.join().expect("writer");
            let _ = tx.send(got);
        });
        rx
    }

    fn pattern_byte(i: usize) -> u8 {
        (i.wrapping_mul(31) ^ (i >> 13)) as u8
    }

    fn write_pattern(to: &mut impl Write, len: usize) {
        let mut buf = vec![0u8; 64 * 1024];
        let mut sent = 0;
        while sent < len {
            let n = buf.len().min(len - sent);
            for (k, b) in buf[..n].iter_mut().enumerate() {
                *b = pattern_byte(sent + k);
            }
            to.write_all(&buf[..n]).expect("write pattern");
            sent += n;
        }
    }

    /// Reads to end of file; the count of bytes read, or `usize::MAX` on a wrong byte.
    fn check_pattern(mut from: impl Read) -> usize {
        let mut buf = vec![0u8; 64 * 1024];
        let mut got = 0;
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => return got,
                Ok(n) => n,
            };
            if buf[..n]
                .iter()
                .enumerate()
                .any(|(k, &b)| b != pattern_byte(got + k))
            {
                return usize::MAX;
            }
            got += n;
        }
    }

    /// Sends `up` bytes through a forwarder while `down` come back; returns the time taken.
    fn transfer(
        addr: std::net::SocketAddr,
        rx: std::sync::mpsc::Receiver<usize>,
        up: usize,
        down: usize,
    ) -> Duration {
        let start = Instant::now();
        let conn = TcpStream::connect(addr).expect("connect");
        let mut out = conn.try_clone().expect("clone");
        let writer = std::thread::spawn(move || {
            write_pattern(&mut out, up);
            out.shutdown(Shutdown::Write).expect("half close");
        });
        assert_eq!(check_pattern(&conn), down, "the download");
        writer.join().expect("writer");
        let elapsed = start.elapsed();
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(30)).expect("broker"),
            up,
            "the upload"
        );
        elapsed
    }

    #[test]
    fn twenty_mib_each_way_arrive_intact() {
        let dir = temp_dir("big");
        let sock = dir.join("proxy.sock");
        let rx = pattern_broker(&sock, 20 << 20);
        let addr = forwarder(Some(&sock), 4);
        transfer(addr, rx, 20 << 20, 20 << 20);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// Writes `len` bytes of one buffer and counts what it reads: the cheap ends of the bench.
    fn blast(to: &mut impl Write, len: usize) {
        let buf = vec![7u8; 256 * 1024];
        let mut sent = 0;
        while sent < len {
            let n = buf.len().min(len - sent);
            to.write_all(&buf[..n]).expect("write");
            sent += n;
        }
    }

    fn count(mut from: impl Read) -> usize {
        let mut buf = vec![0u8; 256 * 1024];
        let mut got = 0;
        while let Ok(n) = from.read(&mut buf) {
            if n == 0 {
                break;
            }
            got += n;
        }
        got
    }

    /// The relay's speed on 100 MiB down (the broker to the client), then 100 MiB up, a real
    /// socket each side, five rounds:
    /// `cargo test -p sandbox-runner --release --bin sandbox-runner bench_relay -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn bench_relay() {
        let size: usize = 100 << 20;
        for round in 0..5 {
            for up in [false, true] {
                let dir = temp_dir(&format!("bench-{round}-{up}"));
                let sock = dir.join("proxy.sock");
                let broker = UnixListener::bind(&sock).expect("bind unix");
                let far = std::thread::spawn(move || {
                    let (mut conn, _) = broker.accept().expect("accept");
                    if !up {
                        blast(&mut conn, size);
                        conn.shutdown(Shutdown::Write).expect("half close");
                    }
                    count(&conn)
                });
                let addr = forwarder(Some(&sock), 4);
                let start = Instant::now();
                let mut conn = TcpStream::connect(addr).expect("connect");
                if up {
                    blast(&mut conn, size);
                }
                conn.shutdown(Shutdown::Write).expect("half close");
                let near = count(&conn);
                let far = far.join().expect("broker");
                let took = start.elapsed().as_secs_f64();
                assert_eq!(near + far, size);
                println!(
                    "{}: 100 MiB in {took:.3} s = {:.0} MiB/s",
                    if up { "up  " } else { "down" },
                    100.0 / took
                );
                let _ = std::fs::remove_dir_all(dir);
            }
        }
    }
}
