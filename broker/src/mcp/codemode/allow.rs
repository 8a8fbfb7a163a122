//! The allow-list of `http.fetch`: which hosts and ports a URL may name, and which
//! addresses a name may resolve to.

use crate::net::is_public;
use std::net::{IpAddr, SocketAddr};

/// One allowed HTTP host: a name, and a port unless the web's own ports are meant.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct HostRule {
    /// Lowercase host name or IP address (IPv6 without brackets).
    pub(super) host: String,
    /// The one port allowed; `None` allows 80 and 443 (a bare name is a web site, not
    /// every service its host runs).
    port: Option<u16>,
}

impl HostRule {
    /// `name`, `name:port`, `[v6]`, `[v6]:port` or a bare IPv6 address.
    pub(super) fn parse(entry: &str) -> Option<HostRule> {
        let entry = entry.trim().to_ascii_lowercase();
        if entry.is_empty() {
            return None;
        }
        if let Some(rest) = entry.strip_prefix('[') {
            let (host, after) = rest.split_once(']')?;
            let port = match after.strip_prefix(':') {
                Some(p) => Some(p.parse().ok()?),
                None if after.is_empty() => None,
                None => return None,
            };
            return Some(HostRule {
                host: host.to_string(),
                port,
            });
        }
        match entry.matches(':').count() {
            0 => Some(HostRule {
                host: entry,
                port: None,
            }),
            1 => {
                let (host, port) = entry.split_once(':')?;
                Some(HostRule {
                    host: host.to_string(),
                    port: Some(port.parse().ok()?),
                })
            }
            _ => Some(HostRule {
                host: entry,
                port: None,
            }),
        }
    }
}

/// The host of `url` as the denial names it, and whether `rules` allow it.
pub(super) fn host_allowed(rules: &[HostRule], url: &reqwest::Url) -> (String, bool) {
    let host = url
        .host_str()
        .unwrap_or_default()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_ascii_lowercase();
    let port = url.port_or_known_default();
    let port_ok = |rule: &HostRule| match rule.port {
        Some(allowed) => port == Some(allowed),
        None => matches!(port, Some(80 | 443)),
    };
    let ok = matches!(url.scheme(), "http" | "https")
        && rules.iter().any(|r| r.host == host && port_ok(r));
    let shown = match url.port() {
        Some(p) => format!("{host}:{p}"),
        None => host,
    };
    (shown, ok)
}

/// `http.fetch`'s name resolution: the addresses a name resolves to, less those that are not
/// public (unless listed literally, or allowed by the operator). reqwest connects to the
/// addresses given here, so the address checked is the address used: a name that
/// re-binds between a check and the connection cannot exist.
pub(super) struct CheckedResolver {
    /// Addresses the allowlist names literally: reachable even when not public.
    pub(super) listed: Vec<IpAddr>,
    /// `CODEBROKER_CODEMODE_HTTP_ALLOW_PRIVATE`: every address is reachable.
    pub(super) allow_private: bool,
}

impl reqwest::dns::Resolve for CheckedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let name = name.as_str().to_string();
        let listed = self.listed.clone();
        let allow_private = self.allow_private;
        Box::pin(async move {
            let resolved: Vec<SocketAddr> =
                tokio::net::lookup_host((name.as_str(), 0)).await?.collect();
            let (usable, refused): (Vec<SocketAddr>, Vec<SocketAddr>) = resolved
                .into_iter()
                .partition(|a| allow_private || is_public(a.ip()) || listed.contains(&a.ip()));
            if usable.is_empty() {
                if let Some(first) = refused.first() {
                    let denied = Denied(format!(
                        "Host '{name}' resolves to a non-public address ({}), which is not \
                         allowed unless the address itself is listed",
                        first.ip()
                    ));
                    return Err(Box::new(denied) as Box<dyn std::error::Error + Send + Sync>);
                }
            }
            Ok(Box::new(usable.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// A request refused by the allowlist or the address policy (found again in reqwest's
/// error chain).
#[derive(Debug)]
pub(super) struct Denied(pub(super) String);

impl std::fmt::Display for Denied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Denied {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_rules() {
        let rules: Vec<HostRule> = ["Example.com", "127.0.0.1:8080", "[::1]:9", "::2"]
            .iter()
            .filter_map(|e| HostRule::parse(e))
            .collect();
        let check = |u: &str| host_allowed(&rules, &reqwest::Url::parse(u).expect("url"));
        assert_eq!(check("https://example.com/x"), ("example.com".into(), true));
        assert!(check("https://EXAMPLE.com:443/").1);
        assert!(
            !check("http://EXAMPLE.com:81/").1,
            "a bare name: 80 and 443 only"
        );
        assert!(check("http://127.0.0.1:8080/").1);
        assert_eq!(
            check("http://127.0.0.1:8081/"),
            ("127.0.0.1:8081".into(), false)
        );
        assert!(check("http://[::1]:9/").1);
        assert!(check("http://[::2]/").1);
        assert!(!check("http://[::2]:1/").1);
        assert!(!check("ftp://example.com/").1);
        assert!(!check("http://evil.com/").1);
        assert!(HostRule::parse("").is_none());
    }
}
