//! The broker's side of a sandbox's HTTP proxy: one connection from pip or npm (carried
//! from the container by any byte stream), its request head, the policy's verdict, a
//! connection out and the relay of its bytes within the exec's and the session's budget.
//!
//! `CONNECT host:port` opens a tunnel (HTTPS). A plain HTTP request in absolute form
//! (`GET http://host/path`) is sent on in origin form with `Connection: close`: one
//! request per connection, the client opens a new one for the next (which it does when
//! the answer says `Connection: close`).

use super::policy::{authority, EgressPolicy, Refusal};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

/// The longest request head read: pip's and npm's are well under 2 KiB.
const MAX_HEAD: usize = 16 * 1024;
/// How long the whole head may take to arrive: a connection that sends nothing holds a
/// task for no longer.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the connection out may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the proxy's own answer may take to be written: a client that does not read
/// it does not hold the task.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);
/// Header lines a head may carry.
const MAX_HEADERS: usize = 100;
/// One read of the relay.
const RELAY_CHUNK: usize = 16 * 1024;

/// What the connections of one exec may use: caps per exec, and one per session whose
/// counter the session's execs share. A cap of 0 is no cap. Bytes are counted in both
/// directions.
#[derive(Debug)]
pub(crate) struct Budget {
    /// Connections out one exec may open.
    max_exec_connections: u64,
    /// Bytes one exec may move.
    max_exec_bytes: u64,
    /// Bytes the session may move, all its execs together.
    max_session_bytes: u64,
    /// Connections this exec opened.
    exec_connections: AtomicU64,
    /// Bytes this exec moved.
    exec_bytes: AtomicU64,
    /// Bytes the session moved: shared with its other execs' budgets.
    session_bytes: Arc<AtomicU64>,
}

/// What a budget grants of a transfer.
struct Charge {
    /// Bytes that may be moved (all but what no longer fits).
    granted: u64,
    /// The cap that is spent, when not all was granted.
    spent: Option<Refusal>,
}

impl Budget {
    /// A fresh budget for one exec; `session_bytes_used` is the session's counter.
    pub(crate) fn new(
        max_exec_connections: u64,
        max_exec_bytes: u64,
        max_session_bytes: u64,
        session_bytes_used: Arc<AtomicU64>,
    ) -> Budget {
        Budget {
            max_exec_connections,
            max_exec_bytes,
            max_session_bytes,
            exec_connections: AtomicU64::new(0),
            exec_bytes: AtomicU64::new(0),
            session_bytes: session_bytes_used,
        }
    }

    /// Takes one connection of the exec's cap; refused too once a byte cap is spent.
    pub(crate) fn open_connection(&self) -> Result<(), Refusal> {
        if self.max_exec_bytes > 0 && self.exec_bytes.load(Ordering::Relaxed) >= self.max_exec_bytes
        {
            return Err(Refusal::ExecBytes {
                cap: self.max_exec_bytes,
            });
        }
        if self.max_session_bytes > 0
            && self.session_bytes.load(Ordering::Relaxed) >= self.max_session_bytes
        {
            return Err(Refusal::SessionBytes {
                cap: self.max_session_bytes,
            });
        }
        let cap = self.max_exec_connections;
        self.exec_connections
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (cap == 0 || n < cap).then_some(n + 1)
            })
            .map(|_| ())
            .map_err(|_| Refusal::ExecConnections { cap })
    }

    #[cfg(test)]
    /// Connections this exec opened.
    pub(crate) fn exec_connections(&self) -> u64 {
        self.exec_connections.load(Ordering::Relaxed)
    }

    #[cfg(test)]
    /// Bytes this exec moved.
    pub(crate) fn exec_bytes(&self) -> u64 {
        self.exec_bytes.load(Ordering::Relaxed)
    }

    /// Takes up to `want` bytes from both byte caps: what fits in both is granted.
    fn charge(&self, want: u64) -> Charge {
        let exec = take(&self.exec_bytes, self.max_exec_bytes, want);
        let both = take(&self.session_bytes, self.max_session_bytes, exec);
        if both < exec {
            // Given back: the session's cap granted less.
            self.exec_bytes.fetch_sub(exec - both, Ordering::Relaxed);
        }
        let spent = if exec < want {
            Some(Refusal::ExecBytes {
                cap: self.max_exec_bytes,
            })
        } else if both < want {
            Some(Refusal::SessionBytes {
                cap: self.max_session_bytes,
            })
        } else {
            None
        };
        Charge {
            granted: both,
            spent,
        }
    }
}

/// Adds up to `want` to `used` without passing `cap` (0: no cap); returns what it added.
fn take(used: &AtomicU64, cap: u64, want: u64) -> u64 {
    if cap == 0 {
        used.fetch_add(want, Ordering::Relaxed);
        return want;
    }
    let mut granted = 0;
    // The closure always returns Some: the update cannot fail.
    let _ = used.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
        granted = want.min(cap.saturating_sub(n));
        Some(n + granted)
    });
    granted
}

/// What one proxied connection was and what it moved: what the caller audits and counts.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct Outcome {
    /// The request's method (`CONNECT`, `GET`, ...); empty when no head was read.
    pub(crate) method: String,
    /// The host requested (lowercase); empty when none was read.
    pub(crate) host: String,
    /// The port requested; 0 when none was read.
    pub(crate) port: u16,
    /// `allowed`, or the reason label of the refusal, or of the cap that cut the
    /// transfer (`exec_bytes`, `session_bytes`).
    pub(crate) verdict: &'static str,
    /// The address connected to (or tried): set once the policy allowed the request.
    pub(crate) address: Option<SocketAddr>,
    /// The sentence the client was answered with, or the cap that cut the transfer.
    pub(crate) refusal: Option<String>,
    /// Bytes relayed from the client to the host (the rewritten head included).
    pub(crate) bytes_up: u64,
    /// Bytes relayed from the host to the client.
    pub(crate) bytes_down: u64,
}

impl Outcome {
    /// Whether the connection was made and not cut by a cap.
    #[cfg(test)]
    pub(crate) fn allowed(&self) -> bool {
        self.verdict == "allowed"
    }

    /// Records `refusal` as the verdict.
    fn refused(&mut self, refusal: &Refusal) {
        self.verdict = refusal.reason();
        self.refusal = Some(refusal.to_string());
    }
}

/// Serves one proxy connection from the sandbox to its end, and says what it was.
pub(crate) async fn serve<S>(client: S, policy: &EgressPolicy, budget: &Budget) -> Outcome
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    serve_within(client, policy, Some(budget)).await
}

/// [`serve`] for a connection no exec accounts for: its request is read and refused
/// ([`Refusal::NoExec`]) before anything is resolved or connected.
pub(crate) async fn refuse_without_exec<S>(client: S, policy: &EgressPolicy) -> Outcome
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    serve_within(client, policy, None).await
}

async fn serve_within<S>(mut client: S, policy: &EgressPolicy, budget: Option<&Budget>) -> Outcome
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let mut outcome = Outcome {
        method: String::new(),
        host: String::new(),
        port: 0,
        verdict: "allowed",
        address: None,
        refusal: None,
        bytes_up: 0,
        bytes_down: 0,
    };
    let head = match tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut client)).await {
        Ok(Ok(head)) => head,
        Ok(Err(HeadError::Closed)) => {
            // Nobody is left to answer.
            outcome.refused(&bad_request("the client closed before a full request head"));
            return outcome;
        }
        Ok(Err(HeadError::Bad(reason))) => {
            return refuse(client, outcome, bad_request(&reason)).await;
        }
        Err(_) => {
            let reason = format!("no full request head within {} s", HEAD_TIMEOUT.as_secs());
            return refuse(client, outcome, bad_request(&reason)).await;
        }
    };
    outcome.method = head.method.clone();
    let target = match parse_target(&head) {
        Ok(target) => target,
        Err(reason) => return refuse(client, outcome, bad_request(&reason)).await,
    };
    outcome.host = target.host.to_ascii_lowercase();
    outcome.port = target.port;
    let Some(budget) = budget else {
        return refuse(client, outcome, Refusal::NoExec).await;
    };
    let address = match policy.decide(&target.host, target.port).await {
        Ok(address) => address,
        Err(refusal) => return refuse(client, outcome, refusal).await,
    };
    outcome.address = Some(address);
    // Counted once allowed: refused requests open nothing.
    if let Err(refusal) = budget.open_connection() {
        return refuse(client, outcome, refusal).await;
    }
    let connected = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(address)).await;
    let upstream = match connected {
        Ok(Ok(upstream)) => upstream,
        Ok(Err(e)) => {
            let refusal = connect_failed(&target, address, e.to_string());
            return refuse(client, outcome, refusal).await;
        }
        Err(_) => {
            let error = format!("no connection within {} s", CONNECT_TIMEOUT.as_secs());
            let refusal = connect_failed(&target, address, error);
            return refuse(client, outcome, refusal).await;
        }
    };
    // Small writes (TLS handshakes) go at once.
    let _ = upstream.set_nodelay(true);
    let first_up = match &target.origin_form {
        None => {
            let established = b"HTTP/1.1 200 Connection established\r\n\r\n";
            if client.write_all(established).await.is_err() {
                return outcome;
            }
            head.rest
        }
        Some(origin) => {
            let mut first = rewrite_head(&head, origin);
            first.extend_from_slice(&head.rest);
            first
        }
    };
    let relayed = relay(client, upstream, first_up, budget).await;
    outcome.bytes_up = relayed.up;
    outcome.bytes_down = relayed.down;
    if let Some(spent) = relayed.spent {
        outcome.refused(&spent);
    }
    outcome
}

/// A `BadRequest` refusal.
fn bad_request(reason: &str) -> Refusal {
    Refusal::BadRequest {
        reason: reason.to_string(),
    }
}

/// A `ConnectFailed` refusal for `target`.
fn connect_failed(target: &Target, address: SocketAddr, error: String) -> Refusal {
    Refusal::ConnectFailed {
        target: authority(&target.host, target.port),
        address,
        error,
    }
}

/// Answers `refusal` (its sentence as a text body), closes, and records it.
async fn refuse<S>(mut client: S, mut outcome: Outcome, refusal: Refusal) -> Outcome
where
    S: AsyncWrite + Unpin,
{
    let code = match refusal {
        Refusal::BadRequest { .. } => 400,
        Refusal::ConnectFailed { .. } => 502,
        _ => 403,
    };
    let body = format!("{refusal}\n");
    // The sentence is also the reason phrase: pip, curl and npm print the status line of a
    // failed tunnel, not its body.
    let answer = format!(
        "HTTP/1.1 {code} {}\r\nContent-Type: text/plain\r\nConnection: close\r\n\
         Content-Length: {}\r\nX-Codebroker-Egress: {}\r\n\r\n{body}",
        reason_phrase(&refusal.to_string()),
        body.len(),
        refusal.reason()
    );
    // The client may be gone or not reading: the verdict stands either way.
    let _ = tokio::time::timeout(ANSWER_TIMEOUT, async {
        client.write_all(answer.as_bytes()).await?;
        client.shutdown().await
    })
    .await;
    outcome.refused(&refusal);
    outcome
}

/// `sentence` as an HTTP reason phrase: printable, on one line, at most 200 bytes.
fn reason_phrase(sentence: &str) -> String {
    let mut phrase: String = sentence
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if phrase.len() > 200 {
        let mut end = 200;
        while !phrase.is_char_boundary(end) {
            end -= 1;
        }
        phrase.truncate(end);
    }
    phrase
}

/// A request head, parsed, and what followed it in the same reads.
struct Head {
    /// The method, as sent.
    method: String,
    /// The request target, as sent.
    target: String,
    /// The minor HTTP version (1.0 or 1.1), kept in the rewritten request line.
    minor_version: u8,
    /// The header lines, names as sent.
    headers: Vec<(String, Vec<u8>)>,
    /// Bytes after the head (a body, or a TLS hello sent early): relayed first.
    rest: Vec<u8>,
}

/// Why no head was read.
enum HeadError {
    /// The client closed first (or its stream failed).
    Closed,
    /// Not a request head the proxy reads; the reason for the answer.
    Bad(String),
}

/// Reads the request head, at most `MAX_HEAD` bytes.
async fn read_head<R: AsyncRead + Unpin>(client: &mut R) -> Result<Head, HeadError> {
    let mut buf = vec![0u8; MAX_HEAD];
    let mut filled = 0;
    loop {
        let n = match client.read(&mut buf[filled..]).await {
            Ok(0) | Err(_) => return Err(HeadError::Closed),
            Ok(n) => n,
        };
        filled += n;
        // Only a new line can complete a head or show it is not one; parsing at each
        // line keeps a head sent byte by byte from costing more than a few parses.
        if memchr::memchr(b'\n', &buf[filled - n..filled]).is_some() {
            let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
            let mut request = httparse::Request::new(&mut headers);
            match request.parse(&buf[..filled]) {
                Ok(httparse::Status::Complete(len)) => {
                    let head = Head {
                        method: request.method.unwrap_or_default().to_string(),
                        target: request.path.unwrap_or_default().to_string(),
                        minor_version: request.version.unwrap_or(1),
                        headers: request
                            .headers
                            .iter()
                            .map(|h| (h.name.to_string(), h.value.to_vec()))
                            .collect(),
                        rest: buf[len..filled].to_vec(),
                    };
                    return Ok(head);
                }
                Ok(httparse::Status::Partial) => {}
                Err(e) => {
                    return Err(HeadError::Bad(format!("not an HTTP request head ({e})")));
                }
            }
        }
        if filled == MAX_HEAD {
            return Err(HeadError::Bad(format!(
                "the request head is longer than {} KiB",
                MAX_HEAD / 1024
            )));
        }
    }
}

/// Where a request goes.
struct Target {
    /// The host, as sent (IPv6 without brackets).
    host: String,
    /// The port (the request's, or 80 for `http://`).
    port: u16,
    /// For a plain HTTP request: the authority for `Host` and the origin-form target;
    /// `None` for a tunnel.
    origin_form: Option<OriginForm>,
}

/// A plain HTTP request as it is sent on.
struct OriginForm {
    /// `host[:port]` as the URL wrote it: the `Host` header.
    authority: String,
    /// The path and query (`/` when the URL has none).
    path: String,
}

/// The target of a `CONNECT` (`host:port`) or of an absolute-form `http://` request.
fn parse_target(head: &Head) -> Result<Target, String> {
    if head.method.eq_ignore_ascii_case("CONNECT") {
        let (host, port) = split_authority(&head.target, None)?;
        return Ok(Target {
            host,
            port,
            origin_form: None,
        });
    }
    let target = head.target.as_str();
    let scheme = |s: &str| {
        target
            .get(..s.len())
            .is_some_and(|t| t.eq_ignore_ascii_case(s))
    };
    if scheme("https://") {
        return Err("an https:// URL goes through CONNECT".into());
    }
    if !scheme("http://") {
        return Err(format!(
            "'{} {target}' names no host; a proxy is sent CONNECT host:port or an absolute \
             http:// URL",
            head.method
        ));
    }
    let rest = &target["http://".len()..];
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, path) = rest.split_at(end);
    if authority.contains('@') {
        return Err("credentials in the URL are not sent on".into());
    }
    let (host, port) = split_authority(authority, Some(80))?;
    // The fragment is the client's own.
    let path = path.split('#').next().unwrap_or_default();
    let path = match path.chars().next() {
        Some('/') => path.to_string(),
        _ => format!("/{path}"),
    };
    Ok(Target {
        host,
        port,
        origin_form: Some(OriginForm {
            authority: authority.to_string(),
            path,
        }),
    })
}

/// `host:port`, `[v6]:port`, or without the port when there is a default.
fn split_authority(authority: &str, default_port: Option<u16>) -> Result<(String, u16), String> {
    let (host, port) = if let Some(rest) = authority.strip_prefix('[') {
        let (host, after) = rest
            .split_once(']')
            .ok_or_else(|| format!("'{authority}': a '[' without its ']'"))?;
        match after.strip_prefix(':') {
            Some(port) => (host, Some(port)),
            None if after.is_empty() => (host, None),
            None => return Err(format!("'{authority}' is not host:port")),
        }
    } else {
        match authority.matches(':').count() {
            0 => (authority, None),
            1 => {
                let (host, port) = authority.split_once(':').unwrap_or((authority, ""));
                (host, Some(port))
            }
            _ => return Err(format!("'{authority}': an IPv6 address takes brackets")),
        }
    };
    if host.is_empty() {
        return Err(format!("'{authority}' names no host"));
    }
    let port = match (port, default_port) {
        (Some(port), _) => port
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0 && port.bytes().all(|b| b.is_ascii_digit()))
            .ok_or_else(|| format!("'{authority}': '{port}' is not a port"))?,
        (None, Some(default)) => default,
        (None, None) => return Err(format!("'{authority}' is not host:port")),
    };
    Ok((host.to_string(), port))
}

/// The head sent on for a plain HTTP request: origin form, `Host` from the URL (a proxy
/// ignores the client's, RFC 9112 3.2.2), without the proxy's own and hop-by-hop headers,
/// and `Connection: close` (one request per connection).
fn rewrite_head(head: &Head, origin: &OriginForm) -> Vec<u8> {
    // Headers a Connection header names are for this hop only.
    let mut hop: Vec<String> = Vec::new();
    for (name, value) in &head.headers {
        if name.eq_ignore_ascii_case("connection") || name.eq_ignore_ascii_case("proxy-connection")
        {
            hop.extend(
                String::from_utf8_lossy(value)
                    .split(',')
                    .map(|t| t.trim().to_ascii_lowercase())
                    .filter(|t| !t.is_empty()),
            );
        }
    }
    let mut out = format!(
        "{} {} HTTP/1.{}\r\nHost: {}\r\n",
        head.method, origin.path, head.minor_version, origin.authority
    )
    .into_bytes();
    for (name, value) in &head.headers {
        let lower = name.to_ascii_lowercase();
        let dropped = matches!(
            lower.as_str(),
            "host" | "connection" | "keep-alive" | "upgrade"
        ) || lower.starts_with("proxy-")
            || hop.contains(&lower);
        if !dropped {
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value);
            out.extend_from_slice(b"\r\n");
        }
    }
    out.extend_from_slice(b"Connection: close\r\n\r\n");
    out
}

/// What a relay moved, and the cap that cut it.
struct Relayed {
    /// Bytes from the client to the host.
    up: u64,
    /// Bytes from the host to the client.
    down: u64,
    /// The cap that stopped the relay, if one did.
    spent: Option<Refusal>,
}

/// How one direction of a relay ended.
enum PumpEnd {
    /// Its reader closed; the writer was shut down in turn.
    Closed,
    /// A read or write failed: the connection is over.
    Failed,
    /// A byte cap is spent: the connection is over.
    Spent(Refusal),
}

/// Relays both ways until both directions close, one fails, or a byte cap is spent; then
/// drops both streams, which closes them. `first_up` goes to the host first.
async fn relay<C>(client: C, mut upstream: TcpStream, first_up: Vec<u8>, budget: &Budget) -> Relayed
where
    C: AsyncRead + AsyncWrite + Unpin,
{
    let (client_read, client_write) = tokio::io::split(client);
    let (upstream_read, upstream_write) = upstream.split();
    let (up_bytes, down_bytes) = (AtomicU64::new(0), AtomicU64::new(0));
    let up = pump(client_read, upstream_write, first_up, budget, &up_bytes);
    let down = pump(upstream_read, client_write, Vec::new(), budget, &down_bytes);
    tokio::pin!(up, down);
    let (mut up_open, mut down_open) = (true, true);
    let mut spent = None;
    // A closed direction leaves the other running (a client may half-close after its
    // request); anything else ends both.
    while up_open || down_open {
        let end = tokio::select! {
            end = &mut up, if up_open => { up_open = false; end }
            end = &mut down, if down_open => { down_open = false; end }
        };
        match end {
            PumpEnd::Closed => {}
            PumpEnd::Failed => break,
            PumpEnd::Spent(refusal) => {
                spent = Some(refusal);
                break;
            }
        }
    }
    Relayed {
        up: up_bytes.load(Ordering::Relaxed),
        down: down_bytes.load(Ordering::Relaxed),
        spent,
    }
}

/// Copies `from` to `to` (after `first`), charging every byte to `budget` and counting it
/// in `moved`.
async fn pump<R, W>(
    mut from: R,
    mut to: W,
    first: Vec<u8>,
    budget: &Budget,
    moved: &AtomicU64,
) -> PumpEnd
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    if !first.is_empty() {
        if let Some(end) = forward(&mut to, &first, budget, moved).await {
            return end;
        }
    }
    let mut buf = vec![0u8; RELAY_CHUNK];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) => {
                let _ = to.shutdown().await;
                return PumpEnd::Closed;
            }
            Ok(n) => n,
            Err(_) => return PumpEnd::Failed,
        };
        if let Some(end) = forward(&mut to, &buf[..n], budget, moved).await {
            return end;
        }
    }
}

/// Writes what the budget grants of `bytes`; `Some` ends the pump.
async fn forward<W: AsyncWrite + Unpin>(
    to: &mut W,
    bytes: &[u8],
    budget: &Budget,
    moved: &AtomicU64,
) -> Option<PumpEnd> {
    let charge = budget.charge(bytes.len() as u64);
    let granted = usize::try_from(charge.granted).unwrap_or(bytes.len());
    let granted = &bytes[..granted.min(bytes.len())];
    if to.write_all(granted).await.is_err() {
        return Some(PumpEnd::Failed);
    }
    moved.fetch_add(granted.len() as u64, Ordering::Relaxed);
    charge.spent.map(PumpEnd::Spent)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::DuplexStream;
    use tokio::net::TcpListener;
    use tokio::task::JoinHandle;

    fn policy(egress: &str, resolve: &str) -> Arc<EgressPolicy> {
        Arc::new(EgressPolicy::from_settings(egress, resolve).expect("policy"))
    }

    fn no_caps() -> Arc<Budget> {
        Arc::new(Budget::new(0, 0, 0, Arc::new(AtomicU64::new(0))))
    }

    /// Serves one connection in a task; the test holds the client's end.
    fn start(
        policy: &Arc<EgressPolicy>,
        budget: &Arc<Budget>,
    ) -> (DuplexStream, JoinHandle<Outcome>) {
        let (client, server) = tokio::io::duplex(256 * 1024);
        let (policy, budget) = (policy.clone(), budget.clone());
        let task = tokio::spawn(async move { serve(server, &policy, &budget).await });
        (client, task)
    }

    /// Sends `request`, closes the client's write side, and reads everything back.
    async fn exchange(
        policy: &Arc<EgressPolicy>,
        budget: &Arc<Budget>,
        request: &[u8],
    ) -> (String, Outcome) {
        let (mut client, task) = start(policy, budget);
        client.write_all(request).await.expect("write");
        client.shutdown().await.expect("shutdown");
        let mut answer = Vec::new();
        client.read_to_end(&mut answer).await.expect("read");
        let outcome = task.await.expect("serve");
        (String::from_utf8_lossy(&answer).into_owned(), outcome)
    }

    /// The answer a refusal gets.
    fn refused(status: &str, reason: &str, sentence: &str) -> String {
        let body = format!("{sentence}\n");
        let code = &status[..3];
        format!(
            "HTTP/1.1 {code} {sentence}\r\nContent-Type: text/plain\r\nConnection: close\r\n\
             Content-Length: {}\r\nX-Codebroker-Egress: {reason}\r\n\r\n{body}",
            body.len()
        )
    }

    /// An upstream on 127.0.0.1 that answers each connection with `serve`.
    async fn upstream<F, Fut>(serve: F) -> u16
    where
        F: Fn(TcpStream) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve(stream));
            }
        });
        port
    }

    /// Reads until a blank line: a request head.
    async fn read_until_blank(stream: &mut TcpStream) -> String {
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            if stream.read(&mut byte).await.expect("read") == 0 {
                break;
            }
            head.push(byte[0]);
        }
        String::from_utf8_lossy(&head).into_owned()
    }

    const ESTABLISHED: &[u8] = b"HTTP/1.1 200 Connection established\r\n\r\n";

    #[tokio::test]
    async fn connect_relays_both_ways_and_counts() {
        let port = upstream(|mut s: TcpStream| async move {
            let mut hello = [0u8; 5];
            s.read_exact(&mut hello).await.expect("read");
            assert_eq!(&hello, b"hello");
            s.write_all(b"world!").await.expect("write");
        })
        .await;
        let policy = policy(&format!("pkg.test:{port}"), "pkg.test=127.0.0.1");
        let session = Arc::new(AtomicU64::new(0));
        let budget = Arc::new(Budget::new(0, 0, 0, session.clone()));
        let (mut client, task) = start(&policy, &budget);
        client
            .write_all(
                format!("CONNECT pkg.test:{port} HTTP/1.1\r\nHost: pkg.test:{port}\r\n\r\n")
                    .as_bytes(),
            )
            .await
            .expect("write");
        let mut established = vec![0u8; ESTABLISHED.len()];
        client.read_exact(&mut established).await.expect("read");
        assert_eq!(established, ESTABLISHED);
        client.write_all(b"hello").await.expect("write");
        let mut answer = Vec::new();
        client.read_to_end(&mut answer).await.expect("read");
        assert_eq!(answer, b"world!");
        drop(client);
        let outcome = task.await.expect("serve");
        assert_eq!(outcome.method, "CONNECT");
        assert_eq!((outcome.host.as_str(), outcome.port), ("pkg.test", port));
        assert_eq!(outcome.verdict, "allowed");
        assert!(outcome.allowed());
        assert_eq!(
            outcome.address,
            Some(SocketAddr::from(([127, 0, 0, 1], port)))
        );
        assert_eq!((outcome.bytes_up, outcome.bytes_down), (5, 6));
        assert_eq!(session.load(Ordering::Relaxed), 11);
        assert_eq!((budget.exec_bytes(), budget.exec_connections()), (11, 1));
    }

    #[tokio::test]
    async fn connect_to_an_unlisted_host_is_forbidden() {
        let (answer, outcome) = exchange(
            &policy("pkg.test", ""),
            &no_caps(),
            b"CONNECT other.test:443 HTTP/1.1\r\nHost: other.test:443\r\n\r\n",
        )
        .await;
        assert_eq!(
            answer,
            refused(
                "403",
                "not_listed",
                "egress: other.test is not in CODEBROKER_EGRESS"
            )
        );
        assert_eq!(outcome.verdict, "not_listed");
        assert_eq!((outcome.host.as_str(), outcome.port), ("other.test", 443));
        assert_eq!(outcome.address, None);
    }

    #[tokio::test]
    async fn addresses_and_loopback_names_are_forbidden() {
        let policy = policy("pkg.test,localhost", "");
        for (target, reason) in [
            ("127.0.0.1:443", "ip_literal"),
            ("[::1]:443", "ip_literal"),
            ("2130706433:443", "ip_literal"),
            ("0x7f.1:443", "ip_literal"),
            ("localhost:443", "not_public"),
        ] {
            let request = format!("CONNECT {target} HTTP/1.1\r\n\r\n");
            let (answer, outcome) = exchange(&policy, &no_caps(), request.as_bytes()).await;
            assert!(
                answer.starts_with("HTTP/1.1 403 egress: "),
                "{target}: {answer}"
            );
            assert!(
                answer.contains(&format!("\r\nX-Codebroker-Egress: {reason}\r\n")),
                "{target}: {answer}"
            );
            assert_eq!(outcome.verdict, reason, "{target}");
        }
        let (answer, _) = exchange(
            &policy,
            &no_caps(),
            b"CONNECT 127.0.0.1:443 HTTP/1.1\r\n\r\n",
        )
        .await;
        assert!(answer.ends_with(
            "\r\n\r\negress: 127.0.0.1 is an IP address; name a host listed in CODEBROKER_EGRESS\n"
        ));
    }

    #[tokio::test]
    async fn another_port_of_a_listed_host_is_forbidden() {
        let (answer, outcome) = exchange(
            &policy("pkg.test", "pkg.test=127.0.0.1"),
            &no_caps(),
            b"CONNECT pkg.test:8080 HTTP/1.1\r\n\r\n",
        )
        .await;
        assert_eq!(
            answer,
            refused(
                "403",
                "not_listed",
                "egress: pkg.test:8080 is not in CODEBROKER_EGRESS (only ports 80 and 443 of \
                 pkg.test are)"
            )
        );
        assert_eq!(outcome.port, 8080);
    }

    #[tokio::test]
    async fn plain_http_goes_on_in_origin_form() {
        let (seen_tx, mut seen_rx) = tokio::sync::mpsc::unbounded_channel();
        let port = upstream(move |mut s: TcpStream| {
            let seen = seen_tx.clone();
            async move {
                let head = read_until_blank(&mut s).await;
                let mut body = vec![0u8; if head.starts_with("POST") { 4 } else { 0 }];
                s.read_exact(&mut body).await.expect("body");
                let _ = seen.send((head, body));
                s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
                    .await
                    .expect("write");
            }
        })
        .await;
        let policy = policy(&format!("pkg.test:{port}"), "pkg.test=127.0.0.1");
        let request = format!(
            "GET http://PKG.test:{port}/simple/pip/?x=1#frag HTTP/1.1\r\nHost: elsewhere.test\r\n\
             Proxy-Connection: keep-alive\r\nProxy-Authorization: Basic eDp5\r\n\
             Connection: keep-alive, X-Hop\r\nX-Hop: 1\r\nKeep-Alive: 5\r\nAccept: */*\r\n\r\n"
        );
        let (answer, outcome) = exchange(&policy, &no_caps(), request.as_bytes()).await;
        assert_eq!(
            answer,
            "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
        );
        let (head, _) = seen_rx.recv().await.expect("upstream saw it");
        let sent = format!(
            "GET /simple/pip/?x=1 HTTP/1.1\r\nHost: PKG.test:{port}\r\nAccept: */*\r\n\
             Connection: close\r\n\r\n"
        );
        assert_eq!(head, sent);
        assert_eq!(outcome.method, "GET");
        assert_eq!((outcome.host.as_str(), outcome.port), ("pkg.test", port));
        assert_eq!(outcome.bytes_up, sent.len() as u64);
        assert_eq!(outcome.bytes_down, answer.len() as u64);

        // The body read with the head goes on after it; no path is `/`.
        let request =
            format!("POST http://pkg.test:{port}?q HTTP/1.0\r\nContent-Length: 4\r\n\r\nabcd");
        let (answer, outcome) = exchange(&policy, &no_caps(), request.as_bytes()).await;
        assert!(answer.ends_with("ok"), "{answer}");
        let (head, body) = seen_rx.recv().await.expect("upstream saw it");
        assert_eq!(
            head,
            format!(
                "POST /?q HTTP/1.0\r\nHost: pkg.test:{port}\r\nContent-Length: 4\r\n\
                 Connection: close\r\n\r\n"
            )
        );
        assert_eq!(body, b"abcd");
        assert_eq!(outcome.verdict, "allowed");
    }

    #[tokio::test]
    async fn a_byte_cap_cuts_the_transfer() {
        let port = upstream(|mut s: TcpStream| async move {
            let _ = s.write_all(&[7u8; 5000]).await;
        })
        .await;
        let policy = policy(&format!("pkg.test:{port}"), "pkg.test=127.0.0.1");
        let session = Arc::new(AtomicU64::new(0));
        let budget = Arc::new(Budget::new(0, 1000, 0, session.clone()));
        let request = format!("CONNECT pkg.test:{port} HTTP/1.1\r\n\r\n");
        let (answer, outcome) = exchange(&policy, &budget, request.as_bytes()).await;
        let relayed = answer.len() - ESTABLISHED.len();
        assert_eq!(relayed, 1000);
        assert_eq!(outcome.verdict, "exec_bytes");
        assert_eq!(outcome.bytes_down, 1000);
        assert_eq!(
            outcome.refusal.as_deref(),
            Some("egress: this exec's byte cap of 1000 bytes is spent")
        );
        assert_eq!(session.load(Ordering::Relaxed), 1000);
        // Spent: the next connection is refused before it is made.
        let (answer, outcome) = exchange(&policy, &budget, request.as_bytes()).await;
        assert!(answer.starts_with("HTTP/1.1 403 egress: "), "{answer}");
        assert_eq!(outcome.verdict, "exec_bytes");

        // The session's cap, shared with the session's other execs.
        let budget = Arc::new(Budget::new(0, 0, 1500, session.clone()));
        let (answer, outcome) = exchange(&policy, &budget, request.as_bytes()).await;
        assert_eq!(answer.len() - ESTABLISHED.len(), 500);
        assert_eq!(outcome.verdict, "session_bytes");
        assert_eq!(budget.exec_bytes(), 500);
        let (answer, _) = exchange(&policy, &budget, request.as_bytes()).await;
        assert_eq!(
            answer,
            refused(
                "403",
                "session_bytes",
                "egress: this session's byte cap of 1500 bytes is spent"
            )
        );
    }

    #[tokio::test]
    async fn a_connection_cap_refuses_the_next() {
        let port = upstream(|_s: TcpStream| async move {}).await;
        let policy = policy(&format!("pkg.test:{port}"), "pkg.test=127.0.0.1");
        let budget = Arc::new(Budget::new(2, 0, 0, Arc::new(AtomicU64::new(0))));
        let request = format!("CONNECT pkg.test:{port} HTTP/1.1\r\n\r\n");
        for _ in 0..2 {
            let (answer, outcome) = exchange(&policy, &budget, request.as_bytes()).await;
            assert_eq!(answer.as_bytes(), ESTABLISHED);
            assert!(outcome.allowed());
        }
        let (answer, outcome) = exchange(&policy, &budget, request.as_bytes()).await;
        assert_eq!(
            answer,
            refused(
                "403",
                "exec_connections",
                "egress: this exec's cap of 2 connections is spent"
            )
        );
        assert_eq!(outcome.verdict, "exec_connections");
        // A refused request does not count.
        let (_, outcome) =
            exchange(&policy, &no_caps(), b"CONNECT no.test:443 HTTP/1.1\r\n\r\n").await;
        assert_eq!(outcome.verdict, "not_listed");
        assert_eq!(budget.exec_connections(), 2);
    }

    #[tokio::test]
    async fn a_connection_no_exec_accounts_for_is_refused_before_it_resolves() {
        let policy = policy("pkg.test", "pkg.test=127.0.0.1");
        let (mut client, server) = tokio::io::duplex(64 * 1024);
        let task = tokio::spawn({
            let policy = policy.clone();
            async move { refuse_without_exec(server, &policy).await }
        });
        client
            .write_all(b"CONNECT pkg.test:443 HTTP/1.1\r\n\r\n")
            .await
            .expect("write");
        let mut answer = String::new();
        client.read_to_string(&mut answer).await.expect("read");
        assert_eq!(
            answer,
            refused(
                "403",
                "no_exec",
                "egress: only code of a running exec may connect"
            )
        );
        let outcome = task.await.expect("task");
        assert_eq!((outcome.verdict, outcome.address), ("no_exec", None));
    }

    #[tokio::test]
    async fn a_failed_connection_is_a_bad_gateway() {
        let closed = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = closed.local_addr().expect("addr").port();
        drop(closed);
        let policy = policy(&format!("pkg.test:{port}"), "pkg.test=127.0.0.1");
        let request = format!("CONNECT pkg.test:{port} HTTP/1.1\r\n\r\n");
        let (answer, outcome) = exchange(&policy, &no_caps(), request.as_bytes()).await;
        assert!(answer.starts_with("HTTP/1.1 502 egress: "), "{answer}");
        assert!(
            answer.contains("\r\nX-Codebroker-Egress: connect_failed\r\n"),
            "{answer}"
        );
        assert!(
            answer.contains(&format!(
                "\r\n\r\negress: cannot connect to pkg.test:{port} (127.0.0.1:{port}): "
            )),
            "{answer}"
        );
        assert_eq!(outcome.verdict, "connect_failed");
    }

    #[tokio::test]
    async fn bad_heads_get_400() {
        let policy = policy("pkg.test", "");
        let long = format!(
            "GET http://pkg.test/ HTTP/1.1\r\nX-Long: {}\r\n\r\n",
            "a".repeat(17 * 1024)
        );
        for (request, why) in [
            (long.as_str(), "longer than 16 KiB"),
            (
                "\x16\x03\x01\x02\x00garbage\r\n\r\n",
                "not an HTTP request head",
            ),
            (
                "GET /simple/ HTTP/1.1\r\nHost: pkg.test\r\n\r\n",
                "names no host",
            ),
            (
                "GET https://pkg.test/ HTTP/1.1\r\n\r\n",
                "goes through CONNECT",
            ),
            ("CONNECT pkg.test HTTP/1.1\r\n\r\n", "is not host:port"),
            ("CONNECT pkg.test:0 HTTP/1.1\r\n\r\n", "is not a port"),
            ("CONNECT pkg.test:+443 HTTP/1.1\r\n\r\n", "is not a port"),
            ("CONNECT :443 HTTP/1.1\r\n\r\n", "names no host"),
            ("CONNECT ::1:443 HTTP/1.1\r\n\r\n", "takes brackets"),
            (
                "GET http://user:pw@pkg.test/ HTTP/1.1\r\n\r\n",
                "credentials",
            ),
        ] {
            let (answer, outcome) = exchange(&policy, &no_caps(), request.as_bytes()).await;
            assert!(
                answer.starts_with("HTTP/1.1 400 egress: "),
                "{why}: {answer}"
            );
            assert!(
                answer.contains("\r\nX-Codebroker-Egress: bad_request\r\n"),
                "{answer}"
            );
            assert!(
                answer.contains("\r\n\r\negress: bad proxy request: "),
                "{answer}"
            );
            assert!(answer.contains(why), "{why}: {answer}");
            assert_eq!(outcome.verdict, "bad_request");
        }
        // Gone before a full head: nothing to answer.
        let (answer, outcome) = exchange(&policy, &no_caps(), b"CONNECT pkg.te").await;
        assert_eq!(answer, "");
        assert_eq!(outcome.verdict, "bad_request");
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_head_gets_400() {
        let policy = policy("pkg.test", "");
        let budget = no_caps();
        let (mut client, server) = tokio::io::duplex(1024);
        client
            .write_all(b"CONNECT pkg.test:443 HTTP/1.1\r\n")
            .await
            .expect("write");
        let started = tokio::time::Instant::now();
        let outcome = serve(server, &policy, &budget).await;
        assert_eq!(started.elapsed(), HEAD_TIMEOUT);
        assert_eq!(outcome.verdict, "bad_request");
        let mut answer = Vec::new();
        client.read_to_end(&mut answer).await.expect("read");
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 400 egress: "), "{answer}");
        assert!(answer.ends_with("egress: bad proxy request: no full request head within 10 s\n"));
    }

    #[test]
    fn budgets_grant_what_fits() {
        let session = Arc::new(AtomicU64::new(0));
        let budget = Budget::new(0, 100, 150, session.clone());
        let charge = budget.charge(60);
        assert_eq!((charge.granted, charge.spent), (60, None));
        let charge = budget.charge(60);
        assert_eq!(charge.granted, 40);
        assert_eq!(charge.spent, Some(Refusal::ExecBytes { cap: 100 }));
        assert_eq!(budget.exec_bytes(), 100);
        let other = Budget::new(0, 100, 150, session.clone());
        let charge = other.charge(80);
        assert_eq!(charge.granted, 50);
        assert_eq!(charge.spent, Some(Refusal::SessionBytes { cap: 150 }));
        assert_eq!(
            (other.exec_bytes(), session.load(Ordering::Relaxed)),
            (50, 150)
        );
        assert_eq!(
            other.open_connection(),
            Err(Refusal::SessionBytes { cap: 150 })
        );
    }
}
