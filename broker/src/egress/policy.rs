//! Which hosts and ports sandboxed code may reach through the egress proxy, and at which
//! address: `CODEBROKER_EGRESS` lists the hosts, `CODEBROKER_EGRESS_RESOLVE` pins names
//! to addresses (an internal mirror). A name that is not pinned must resolve to public
//! addresses only; the address checked is the address connected to.

use crate::net::is_public;
use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::time::Duration;

/// How long one name may take to resolve: a stalled resolver must not hold a
/// connection for ever.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(10);

/// The ports a pattern without one allows: a bare name is a web site, not every service
/// its host runs.
const WEB_PORTS: [u16; 2] = [80, 443];

/// Why a connection is not made (or was cut). Its Display is what the model reads, in
/// the proxy's answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Refusal {
    /// No pattern is configured.
    #[error("egress: is off (CODEBROKER_EGRESS is empty)")]
    Off,
    /// The host, or the port of a listed host, is not in the list.
    #[error("egress: {}", not_listed(.host, .port, .listed_ports))]
    NotListed {
        /// The host as requested (lowercase).
        host: String,
        /// The port requested.
        port: u16,
        /// The ports the patterns naming `host` allow (empty: none names it), so the
        /// sentence can say which would do.
        listed_ports: Vec<u16>,
    },
    /// The request names an address: the policy is about names, and an address is
    /// reachable only when listed as it is.
    #[error("egress: {host} is an IP address; name a host listed in CODEBROKER_EGRESS")]
    IpLiteral {
        /// The host as requested.
        host: String,
    },
    /// A listed name resolves (also) to an address that is not public: a name that points
    /// inside the operator's network does not open it.
    #[error(
        "egress: {host} resolves to {address}, which is not a public address \
         (pin a private mirror with CODEBROKER_EGRESS_RESOLVE)"
    )]
    NotPublic {
        /// The name requested.
        host: String,
        /// The first address found that is not public.
        address: IpAddr,
    },
    /// The name does not resolve (or not in time).
    #[error("egress: cannot resolve {host} ({error})")]
    Unresolvable {
        /// The name requested.
        host: String,
        /// The resolver's error.
        error: String,
    },
    /// Not a proxy request the broker serves.
    #[error("egress: bad proxy request: {reason}")]
    BadRequest {
        /// What is wrong with it.
        reason: String,
    },
    /// Allowed, but the connection out failed.
    #[error("egress: cannot connect to {target} ({address}): {error}")]
    ConnectFailed {
        /// `host:port` as requested.
        target: String,
        /// The address tried.
        address: SocketAddr,
        /// Why it failed.
        error: String,
    },
    /// A listed literal or a pinned name leads to the broker's own port on an address
    /// that is not public: the proxy never opens the broker's API to sandboxed code.
    #[error("egress: {target} ({address}) is the broker's own port")]
    BrokerPort {
        /// `host:port` as requested.
        target: String,
        /// The address it leads to.
        address: SocketAddr,
    },
    /// No exec of the sandbox's session is running: what outlives an exec (a background
    /// process) gets no egress, as nothing would account for it.
    #[error("egress: only code of a running exec may connect")]
    NoExec,
    /// The exec opened as many connections as it may.
    #[error("egress: this exec's cap of {cap} connections is spent")]
    ExecConnections {
        /// The cap, for the sentence.
        cap: u64,
    },
    /// The exec moved as many bytes as it may.
    #[error("egress: this exec's byte cap of {} is spent", size(.cap))]
    ExecBytes {
        /// The cap in bytes, for the sentence.
        cap: u64,
    },
    /// The session moved as many bytes as it may.
    #[error("egress: this session's byte cap of {} is spent", size(.cap))]
    SessionBytes {
        /// The cap in bytes, for the sentence.
        cap: u64,
    },
}

impl Refusal {
    /// The label of metrics and audit records.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            Refusal::Off => "off",
            Refusal::NotListed { .. } => "not_listed",
            Refusal::IpLiteral { .. } => "ip_literal",
            Refusal::NotPublic { .. } => "not_public",
            Refusal::Unresolvable { .. } => "unresolvable",
            Refusal::BadRequest { .. } => "bad_request",
            Refusal::ConnectFailed { .. } => "connect_failed",
            Refusal::BrokerPort { .. } => "broker_port",
            Refusal::NoExec => "no_exec",
            Refusal::ExecConnections { .. } => "exec_connections",
            Refusal::ExecBytes { .. } => "exec_bytes",
            Refusal::SessionBytes { .. } => "session_bytes",
        }
    }
}

/// `NotListed`'s sentence: with the ports that would do when the host itself is listed.
fn not_listed(host: &str, port: &u16, listed_ports: &[u16]) -> String {
    let Some((last, rest)) = listed_ports.split_last() else {
        return format!("{host} is not in CODEBROKER_EGRESS");
    };
    let ports = if rest.is_empty() {
        format!("only port {last} of {host} is")
    } else {
        let rest: Vec<String> = rest.iter().map(u16::to_string).collect();
        format!("only ports {} and {last} of {host} are", rest.join(", "))
    };
    format!(
        "{} is not in CODEBROKER_EGRESS ({ports})",
        authority(host, *port)
    )
}

/// A byte cap as the sentences write it.
fn size(bytes: &u64) -> String {
    const MIB: u64 = 1024 * 1024;
    if *bytes % MIB == 0 {
        format!("{} MiB", bytes / MIB)
    } else {
        format!("{bytes} bytes")
    }
}

/// `host:port`, with an IPv6 address in brackets.
pub(crate) fn authority(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// What one pattern names.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    /// One address, listed as it is: reachable without an address check.
    Literal(IpAddr),
    /// One name (lowercase, no trailing dot).
    Name(String),
    /// Every name under this one (`*.example.com` → `example.com`), not the name itself.
    Subdomains(String),
}

/// One entry of `CODEBROKER_EGRESS`: `host[:port]`, `*.domain[:port]`, an IPv4 address or
/// a bracketed IPv6 address (a bare one without a port).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HostPattern {
    /// The hosts the entry covers.
    target: Target,
    /// The one port allowed; `None` allows 80 and 443 (a bare name is a web site, not
    /// every service its host runs).
    port: Option<u16>,
}

impl HostPattern {
    /// Parses one entry; the error names the entry and what is wrong with it.
    pub(crate) fn parse(entry: &str) -> Result<HostPattern, String> {
        let why = |reason: String| format!("CODEBROKER_EGRESS entry '{}': {reason}", entry.trim());
        let lower = entry.trim().to_ascii_lowercase();
        if lower.is_empty() {
            return Err(why("empty".into()));
        }
        if lower.contains("://") {
            return Err(why("a host (host[:port]), not a URL".into()));
        }
        let (host, port, bracketed) = split_host_port(&lower).map_err(why)?;
        let port = port.map(parse_port).transpose().map_err(why)?;
        let target = if bracketed {
            let v6: Ipv6Addr = host
                .parse()
                .map_err(|_| why(format!("[{host}] is not an IPv6 address")))?;
            Target::Literal(IpAddr::V6(v6))
        } else if let Ok(ip) = host.parse::<IpAddr>() {
            Target::Literal(ip)
        } else {
            let host = host.strip_suffix('.').unwrap_or(host);
            if host == "*" {
                return Err(why("a bare * would allow every host".into()));
            }
            match host.strip_prefix("*.") {
                Some(domain) => {
                    check_pattern_name(domain).map_err(why)?;
                    Target::Subdomains(domain.to_string())
                }
                None => {
                    check_pattern_name(host).map_err(why)?;
                    Target::Name(host.to_string())
                }
            }
        };
        Ok(HostPattern { target, port })
    }

    /// Whether the pattern covers the name `host` (normalized, not an address).
    fn covers_name(&self, host: &str) -> bool {
        match &self.target {
            Target::Name(name) => name == host,
            Target::Subdomains(domain) => host
                .strip_suffix(domain.as_str())
                .and_then(|sub| sub.strip_suffix('.'))
                .is_some_and(|sub| !sub.is_empty()),
            Target::Literal(_) => false,
        }
    }

    /// Whether the pattern is the address `ip`.
    fn covers_literal(&self, ip: IpAddr) -> bool {
        self.target == Target::Literal(ip)
    }

    /// The ports the pattern allows.
    fn ports(&self) -> Vec<u16> {
        match self.port {
            Some(port) => vec![port],
            None => WEB_PORTS.to_vec(),
        }
    }
}

/// `host`, `host:port`, `[v6]`, `[v6]:port` or a bare IPv6 address: the host, the port's
/// text, and whether the host was bracketed.
fn split_host_port(entry: &str) -> Result<(&str, Option<&str>, bool), String> {
    if let Some(rest) = entry.strip_prefix('[') {
        let (host, after) = rest
            .split_once(']')
            .ok_or_else(|| "a '[' without its ']'".to_string())?;
        return match after.strip_prefix(':') {
            Some(port) => Ok((host, Some(port), true)),
            None if after.is_empty() => Ok((host, None, true)),
            None => Err(format!("'{after}' after the bracketed address")),
        };
    }
    match entry.matches(':').count() {
        0 => Ok((entry, None, false)),
        1 => {
            let (host, port) = entry.split_once(':').unwrap_or((entry, ""));
            Ok((host, Some(port), false))
        }
        _ if entry.parse::<Ipv6Addr>().is_ok() => Ok((entry, None, false)),
        _ => Err("an IPv6 address with a port takes brackets ([v6]:port)".into()),
    }
}

/// A port of a pattern: 1 to 65535.
fn parse_port(text: &str) -> Result<u16, String> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("port '{text}' is not a number"));
    }
    match text.parse::<u64>() {
        Ok(0) => Err("port 0 is not a port".into()),
        Ok(port) => u16::try_from(port).map_err(|_| format!("port {text} is above 65535")),
        Err(_) => Err(format!("port {text} is above 65535")),
    }
}

/// Checks the name of a pattern: a host name, and not an address in an unusual spelling
/// (a request naming it is refused as an address).
fn check_pattern_name(name: &str) -> Result<(), String> {
    check_name(name)?;
    if is_ip_literal(name) {
        return Err("an IP address is written a.b.c.d (or [v6]), and has no subdomains".into());
    }
    Ok(())
}

/// Checks a host name (lowercase, no trailing dot): labels of letters, digits, `-` and
/// `_`, none empty.
fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("no host name".into());
    }
    if name.len() > 253 {
        return Err("a host name is at most 253 characters".into());
    }
    for label in name.split('.') {
        if label.is_empty() {
            return Err("an empty label".into());
        }
        if label.len() > 63 {
            return Err(format!("label '{label}' is longer than 63 characters"));
        }
        if let Some(bad) = label
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_'))
        {
            return Err(if bad == '*' {
                "a * only as the whole first label (*.example.com)".into()
            } else {
                format!("'{bad}' is not allowed in a host name")
            });
        }
    }
    Ok(())
}

/// The host of a request as the policy compares it: lowercase, without IPv6 brackets and
/// without one trailing dot (`example.com.` is `example.com`).
fn normalize(host: &str) -> String {
    let host = host.trim().to_ascii_lowercase();
    if let Some(inner) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        return inner.to_string();
    }
    match host.strip_suffix('.') {
        Some(stripped) => stripped.to_string(),
        None => host,
    }
}

/// Whether a normalized host is an address rather than a name, in any spelling a resolver
/// accepts: IPv6 (anything with a `:`), or a last label that is a number (decimal, octal or
/// `0x` hex), which covers `127.0.0.1`, `127.1`, `0x7f.1` and `2130706433`. No top-level
/// domain is a number, so no name is lost.
fn is_ip_literal(host: &str) -> bool {
    if host.contains(':') || host.parse::<IpAddr>().is_ok() {
        return true;
    }
    let last = host.rsplit('.').next().unwrap_or(host);
    match last.strip_prefix("0x") {
        Some(hex) => hex.bytes().all(|b| b.is_ascii_hexdigit()),
        None => !last.is_empty() && last.bytes().all(|b| b.is_ascii_digit()),
    }
}

/// `CODEBROKER_EGRESS_RESOLVE`: names pinned to an address, as curl's `--resolve` without
/// the port. A pinned name is connected to at its address whatever the address is: how an
/// operator points a registry's name at an internal mirror.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Pins {
    /// The address of each pinned name (lowercase, no trailing dot).
    by_name: HashMap<String, IpAddr>,
}

impl Pins {
    /// Parses `name=address,...`; the error names the entry and what is wrong with it.
    pub(crate) fn parse(list: &str) -> Result<Pins, String> {
        let mut by_name = HashMap::new();
        for entry in list.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let why =
                |reason: String| format!("CODEBROKER_EGRESS_RESOLVE entry '{entry}': {reason}");
            let (name, address) = entry
                .split_once('=')
                .ok_or_else(|| why("expected name=address".into()))?;
            let name = normalize(name);
            if name.contains('*') {
                return Err(why("a pin names one host (no *)".into()));
            }
            if is_ip_literal(&name) {
                return Err(why("a pin names a host, not an address".into()));
            }
            check_name(&name).map_err(why)?;
            let address = address.trim();
            let bare = address
                .strip_prefix('[')
                .and_then(|a| a.strip_suffix(']'))
                .unwrap_or(address);
            let ip: IpAddr = bare.parse().map_err(|_| {
                why(format!(
                    "'{address}' is not an IPv4 or IPv6 address (and takes no port: the \
                     request's is used)"
                ))
            })?;
            if by_name
                .insert(name.clone(), ip)
                .is_some_and(|old| old != ip)
            {
                return Err(why(format!(
                    "{name} is pinned twice, to different addresses"
                )));
            }
        }
        Ok(Pins { by_name })
    }

    /// The address `name` (normalized) is pinned to.
    pub(crate) fn get(&self, name: &str) -> Option<IpAddr> {
        self.by_name.get(name).copied()
    }
}

/// Where package installs may connect: the hosts listed, at their pinned or public
/// addresses.
#[derive(Debug, Clone, Default)]
pub(crate) struct EgressPolicy {
    /// `CODEBROKER_EGRESS`: what may be reached; empty turns egress off.
    patterns: Vec<HostPattern>,
    /// `CODEBROKER_EGRESS_RESOLVE`: names connected to at a fixed address.
    pins: Pins,
    /// The broker's own listening port (set once it listens): never reached on an address
    /// that is not public (loopback, the host's private addresses), whatever a pin or a
    /// listed literal says.
    broker_port: std::sync::OnceLock<u16>,
}

impl EgressPolicy {
    /// Reads the two settings (comma-separated; empty entries are skipped). A pin for a
    /// name no pattern covers is an error: it would never be used, so it is a typo.
    pub(crate) fn from_settings(egress: &str, resolve: &str) -> Result<Self, String> {
        let patterns = egress
            .split(',')
            .filter(|e| !e.trim().is_empty())
            .map(HostPattern::parse)
            .collect::<Result<Vec<_>, _>>()?;
        let pins = Pins::parse(resolve)?;
        let mut names: Vec<(&String, &IpAddr)> = pins.by_name.iter().collect();
        names.sort();
        for (name, ip) in names {
            if !patterns.iter().any(|p| p.covers_name(name)) {
                return Err(format!(
                    "CODEBROKER_EGRESS_RESOLVE entry '{name}={ip}': {name} is not in \
                     CODEBROKER_EGRESS, so the pin would never be used"
                ));
            }
        }
        Ok(EgressPolicy {
            patterns,
            pins,
            broker_port: std::sync::OnceLock::new(),
        })
    }

    /// Whether any host is listed.
    pub(crate) fn is_on(&self) -> bool {
        !self.patterns.is_empty()
    }

    /// Where a request for `host:port` connects, or why it does not. Names resolve once,
    /// here: the address returned is the address checked.
    /// Guards the broker's own listening `port` (see [`Refusal::BrokerPort`]).
    pub(crate) fn guard_broker_port(&self, port: u16) {
        let _ = self.broker_port.set(port);
    }

    /// `address`, unless it is the broker's own port on an address that is not public.
    fn unless_broker(&self, host: &str, address: SocketAddr) -> Result<SocketAddr, Refusal> {
        if self.broker_port.get() == Some(&address.port()) && !is_public(address.ip()) {
            return Err(Refusal::BrokerPort {
                target: authority(host, address.port()),
                address,
            });
        }
        Ok(address)
    }

    pub(crate) async fn decide(&self, host: &str, port: u16) -> Result<SocketAddr, Refusal> {
        if !self.is_on() {
            return Err(Refusal::Off);
        }
        let host = normalize(host);
        if is_ip_literal(&host) {
            // Only an address the operator listed as it is, in its usual spelling.
            if let Ok(ip) = host.parse::<IpAddr>() {
                let listed: Vec<&HostPattern> = self
                    .patterns
                    .iter()
                    .filter(|p| p.covers_literal(ip))
                    .collect();
                if listed.iter().any(|p| p.ports().contains(&port)) {
                    return self.unless_broker(&host, SocketAddr::new(ip, port));
                }
                if !listed.is_empty() {
                    return Err(not_listed_refusal(host, port, &listed));
                }
            }
            return Err(Refusal::IpLiteral { host });
        }
        // Not a host name (`a/b.example.com`): no pattern covers it.
        if check_name(&host).is_err() {
            return Err(not_listed_refusal(host, port, &[]));
        }
        let listed: Vec<&HostPattern> = self
            .patterns
            .iter()
            .filter(|p| p.covers_name(&host))
            .collect();
        if !listed.iter().any(|p| p.ports().contains(&port)) {
            return Err(not_listed_refusal(host, port, &listed));
        }
        if let Some(ip) = self.pins.get(&host) {
            return self.unless_broker(&host, SocketAddr::new(ip, port));
        }
        let lookup = tokio::net::lookup_host((host.as_str(), port));
        let resolved = match tokio::time::timeout(RESOLVE_TIMEOUT, lookup).await {
            Ok(Ok(addrs)) => Ok(addrs.collect::<Vec<SocketAddr>>()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within {} s", RESOLVE_TIMEOUT.as_secs())),
        };
        let resolved = resolved.map_err(|error| Refusal::Unresolvable {
            host: host.clone(),
            error,
        })?;
        // Any private address refuses the name: which address a client would use is
        // not the name's to choose.
        if let Some(private) = resolved.iter().find(|a| !is_public(a.ip())) {
            return Err(Refusal::NotPublic {
                host,
                address: private.ip(),
            });
        }
        match resolved.first() {
            Some(first) => Ok(*first),
            None => Err(Refusal::Unresolvable {
                host,
                error: "no addresses".into(),
            }),
        }
    }
}

/// `NotListed` for `host:port`, with the ports the patterns that cover the host allow.
fn not_listed_refusal(host: String, port: u16, listed: &[&HostPattern]) -> Refusal {
    let mut listed_ports: Vec<u16> = listed.iter().flat_map(|p| p.ports()).collect();
    listed_ports.sort_unstable();
    listed_ports.dedup();
    Refusal::NotListed {
        host,
        port,
        listed_ports,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(egress: &str, resolve: &str) -> EgressPolicy {
        EgressPolicy::from_settings(egress, resolve).expect("policy")
    }

    fn refusal(result: Result<SocketAddr, Refusal>) -> Refusal {
        result.expect_err("refused")
    }

    #[test]
    fn patterns_parse() {
        let p = |e: &str| HostPattern::parse(e).expect(e);
        assert_eq!(
            p(" PyPI.org "),
            HostPattern {
                target: Target::Name("pypi.org".into()),
                port: None
            }
        );
        assert_eq!(p("pypi.org.").target, Target::Name("pypi.org".into()));
        assert_eq!(
            p("*.example.com:8443"),
            HostPattern {
                target: Target::Subdomains("example.com".into()),
                port: Some(8443)
            }
        );
        assert_eq!(
            p("10.0.0.5:8080"),
            HostPattern {
                target: Target::Literal("10.0.0.5".parse().expect("ip")),
                port: Some(8080)
            }
        );
        assert_eq!(
            p("[fd00::1]:443"),
            HostPattern {
                target: Target::Literal("fd00::1".parse().expect("ip")),
                port: Some(443)
            }
        );
        assert_eq!(p("fd00::1").port, None);
        assert_eq!(p("[fd00::1]").port, None);
        assert_eq!(p("my_host.internal:65535").port, Some(65535));
    }

    #[test]
    fn bad_patterns_are_named() {
        for (entry, why) in [
            ("", "empty"),
            ("*", "bare *"),
            ("*:443", "bare *"),
            ("a.*.com", "first label"),
            ("*a.com", "first label"),
            ("foo*", "first label"),
            ("**.a.com", "first label"),
            ("a..com", "empty label"),
            (".a.com", "empty label"),
            ("*.", "bare *"),
            ("a.com:0", "port 0"),
            ("a.com:65536", "above 65535"),
            ("a.com:99999999999999999999999", "above 65535"),
            ("a.com:", "not a number"),
            ("a.com:+1", "not a number"),
            ("https://a.com", "not a URL"),
            ("a.com:https", "not a number"),
            ("a.com/simple", "'/' is not allowed"),
            ("fd00::1:443:x", "takes brackets"),
            ("[a.com]:443", "not an IPv6 address"),
            ("[::1]x", "after the bracketed"),
            ("127.1", "a.b.c.d"),
            ("2130706433", "a.b.c.d"),
            ("0x7f.1", "a.b.c.d"),
            ("*.10.0.0", "a.b.c.d"),
        ] {
            let err = HostPattern::parse(entry).expect_err(entry);
            assert!(
                err.starts_with(&format!("CODEBROKER_EGRESS entry '{entry}'")),
                "{err}"
            );
            assert!(err.contains(why), "{entry}: {err}");
        }
        let err = EgressPolicy::from_settings("pypi.org, *", "").expect_err("bare *");
        assert!(err.contains("entry '*'"), "{err}");
    }

    #[test]
    fn matching() {
        let star = HostPattern::parse("*.example.com").expect("pattern");
        assert!(star.covers_name("a.example.com"));
        assert!(star.covers_name("a.b.example.com"));
        assert!(!star.covers_name("example.com"));
        assert!(!star.covers_name("badexample.com"));
        assert!(!star.covers_name("example.com.evil"));
        let name = HostPattern::parse("Example.com").expect("pattern");
        assert!(name.covers_name("example.com"));
        assert!(!name.covers_name("a.example.com"));
        assert_eq!(name.ports(), vec![80, 443]);
        assert_eq!(normalize("EXAMPLE.com."), "example.com");
        assert_eq!(normalize("[::1]"), "::1");
    }

    #[test]
    fn literals() {
        for literal in [
            "127.0.0.1",
            "127.1",
            "0x7f.1",
            "0x7f000001",
            "2130706433",
            "0177.0.0.1",
            "::1",
            "::ffff:127.0.0.1",
            "fe80::1%eth0",
            "foo.123",
        ] {
            assert!(is_ip_literal(literal), "{literal}");
        }
        for name in ["cafe.be", "1e100.net", "localhost", "0x.example", "123.com"] {
            assert!(!is_ip_literal(name), "{name}");
        }
    }

    #[test]
    fn pins_parse() {
        let pins =
            Pins::parse("Mirror.Internal.=10.0.0.5, v6.internal=[fd00::1], b=::2,,").expect("pins");
        assert_eq!(pins.get("mirror.internal"), "10.0.0.5".parse().ok());
        assert_eq!(pins.get("v6.internal"), "fd00::1".parse().ok());
        assert_eq!(pins.get("b"), "::2".parse().ok());
        for (list, entry, why) in [
            ("a.com", "a.com", "name=address"),
            ("a.com=1.2.3.4:443", "a.com=1.2.3.4:443", "no port"),
            ("a.com=mirror", "a.com=mirror", "not an IPv4"),
            ("=1.2.3.4", "=1.2.3.4", "no host name"),
            ("*.a.com=1.2.3.4", "*.a.com=1.2.3.4", "no *"),
            ("1.2.3.4=1.2.3.5", "1.2.3.4=1.2.3.5", "not an address"),
            ("a..b=1.2.3.5", "a..b=1.2.3.5", "empty label"),
            (
                "a.com=1.1.1.1,a.com=1.1.1.2",
                "a.com=1.1.1.2",
                "pinned twice",
            ),
        ] {
            let err = Pins::parse(list).expect_err(list);
            assert!(
                err.starts_with(&format!("CODEBROKER_EGRESS_RESOLVE entry '{entry}'")),
                "{err}"
            );
            assert!(err.contains(why), "{list}: {err}");
        }
        assert!(Pins::parse("a.com=1.1.1.1,A.com.=1.1.1.1").is_ok());
    }

    #[test]
    fn settings() {
        assert!(!policy("", "").is_on());
        assert!(!policy(" , ", "").is_on());
        assert!(policy("pypi.org,files.pythonhosted.org,", "").is_on());
        let err = EgressPolicy::from_settings("pypi.org", "mirror.internal=10.0.0.5")
            .expect_err("unused pin");
        assert!(
            err.starts_with("CODEBROKER_EGRESS_RESOLVE entry 'mirror.internal=10.0.0.5'"),
            "{err}"
        );
        assert!(EgressPolicy::from_settings("*.internal", "mirror.internal=10.0.0.5").is_ok());
    }

    #[tokio::test]
    async fn off() {
        let refused = refusal(policy("", "").decide("pypi.org", 443).await);
        assert_eq!(refused, Refusal::Off);
        assert_eq!(
            refused.to_string(),
            "egress: is off (CODEBROKER_EGRESS is empty)"
        );
        assert_eq!(refused.reason(), "off");
    }

    #[tokio::test]
    async fn ip_literals_are_refused_unless_listed() {
        let p = policy("example.com", "");
        for host in [
            "127.0.0.1",
            "[::1]",
            "::1",
            "2130706433",
            "0x7f.1",
            "127.1",
            "0177.0.0.1",
            "127.0.0.1.",
            "[::ffff:127.0.0.1]",
            "169.254.169.254",
        ] {
            let refused = refusal(p.decide(host, 443).await);
            assert_eq!(refused.reason(), "ip_literal", "{host}: {refused}");
        }
        let refused = refusal(p.decide("127.0.0.1", 80).await);
        assert_eq!(
            refused.to_string(),
            "egress: 127.0.0.1 is an IP address; name a host listed in CODEBROKER_EGRESS"
        );
        // Listed as it is: reachable on its port, and only in its usual spelling.
        let p = policy("example.com,127.0.0.1:9000,[fd00::1]:443", "");
        assert_eq!(
            refusal(p.decide("127.1", 9000).await).reason(),
            "ip_literal"
        );
        assert_eq!(
            p.decide("127.0.0.1", 9000).await,
            Ok("127.0.0.1:9000".parse().expect("addr"))
        );
        assert_eq!(
            p.decide("[fd00::1]", 443).await,
            Ok("[fd00::1]:443".parse().expect("addr"))
        );
        let refused = refusal(p.decide("127.0.0.1", 9001).await);
        assert_eq!(
            refused.to_string(),
            "egress: 127.0.0.1:9001 is not in CODEBROKER_EGRESS (only port 9000 of 127.0.0.1 is)"
        );
        let refused = refusal(p.decide("fd00::1", 80).await);
        assert_eq!(
            refused.to_string(),
            "egress: [fd00::1]:80 is not in CODEBROKER_EGRESS (only port 443 of fd00::1 is)"
        );
    }

    #[tokio::test]
    async fn not_listed() {
        let p = policy("example.com,*.example.org,example.org:8443", "");
        let refused = refusal(p.decide("evil.test", 443).await);
        assert_eq!(
            refused.to_string(),
            "egress: evil.test is not in CODEBROKER_EGRESS"
        );
        assert_eq!(refused.reason(), "not_listed");
        assert_eq!(
            refusal(p.decide("Example.COM", 8080).await).to_string(),
            "egress: example.com:8080 is not in CODEBROKER_EGRESS (only ports 80 and 443 of \
             example.com are)"
        );
        assert_eq!(
            refusal(p.decide("example.org", 443).await).to_string(),
            "egress: example.org:443 is not in CODEBROKER_EGRESS (only port 8443 of \
             example.org is)"
        );
        assert_eq!(
            refusal(p.decide("a.example.com", 443).await).reason(),
            "not_listed"
        );
        // Not a name: never matches a wildcard.
        assert_eq!(
            refusal(p.decide("a/b.example.org", 443).await).reason(),
            "not_listed"
        );
    }

    #[tokio::test]
    async fn pinned_names_connect_anywhere() {
        let p = policy(
            "mirror.internal:3141,*.corp.test",
            "mirror.internal=127.0.0.1,pkg.corp.test=[fd00::5]",
        );
        assert_eq!(
            p.decide("MIRROR.internal.", 3141).await,
            Ok("127.0.0.1:3141".parse().expect("addr"))
        );
        assert_eq!(
            p.decide("pkg.corp.test", 443).await,
            Ok("[fd00::5]:443".parse().expect("addr"))
        );
        assert_eq!(
            refusal(p.decide("mirror.internal", 443).await).reason(),
            "not_listed"
        );
    }

    #[tokio::test]
    async fn the_broker_port_is_never_reached_on_a_private_address() {
        let p = policy(
            "broker.test:8000,mirror.test:3141,127.0.0.1:8000,[::1]:8000",
            "broker.test=127.0.0.1,mirror.test=10.0.0.7",
        );
        p.guard_broker_port(8000);
        for (host, port) in [("broker.test", 8000), ("127.0.0.1", 8000), ("[::1]", 8000)] {
            let refused = refusal(p.decide(host, port).await);
            assert_eq!(refused.reason(), "broker_port", "{host}: {refused}");
            assert!(
                refused.to_string().contains("the broker's own port"),
                "{refused}"
            );
        }
        // Another port of a pinned private mirror is the mirror's.
        assert_eq!(
            p.decide("mirror.test", 3141).await,
            Ok("10.0.0.7:3141".parse().expect("addr"))
        );
    }

    #[tokio::test]
    async fn private_resolutions_are_refused() {
        let p = policy("localhost,nosuch.invalid", "");
        let refused = refusal(p.decide("localhost", 443).await);
        assert_eq!(refused.reason(), "not_public", "{refused}");
        let Refusal::NotPublic { address, .. } = &refused else {
            panic!("{refused:?}");
        };
        assert_eq!(
            refused.to_string(),
            format!(
                "egress: localhost resolves to {address}, which is not a public address (pin a \
                 private mirror with CODEBROKER_EGRESS_RESOLVE)"
            )
        );
        let refused = refusal(p.decide("nosuch.invalid", 443).await);
        assert_eq!(refused.reason(), "unresolvable", "{refused}");
        assert!(
            refused
                .to_string()
                .starts_with("egress: cannot resolve nosuch.invalid ("),
            "{refused}"
        );
    }

    #[test]
    fn cap_sentences() {
        assert_eq!(
            Refusal::ExecBytes {
                cap: 64 * 1024 * 1024
            }
            .to_string(),
            "egress: this exec's byte cap of 64 MiB is spent"
        );
        assert_eq!(
            Refusal::SessionBytes { cap: 1000 }.to_string(),
            "egress: this session's byte cap of 1000 bytes is spent"
        );
        assert_eq!(
            Refusal::ExecConnections { cap: 3 }.to_string(),
            "egress: this exec's cap of 3 connections is spent"
        );
    }
}
