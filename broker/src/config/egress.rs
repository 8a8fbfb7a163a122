//! Egress: which hosts the sandboxes may reach through the broker's proxy (package
//! registries), and how much of it one exec and one session may use.

use super::units::parse_size;

/// What the sandboxes may reach through the broker (they never have a network of their own).
#[derive(Debug, Clone, clap::Args)]
pub struct EgressConfig {
    /// Hosts the sandboxes may reach, comma-separated `host[:port]` patterns; `*.example.com`
    /// matches its subdomains (not example.com itself); without a port, 443 and 80. Empty
    /// (the default): no egress at all, and pip or npm fail at once saying so. The container
    /// keeps no network: its HTTP(S)_PROXY is the runner on 127.0.0.1:3128, which carries
    /// each connection to the broker, which checks it against this list, resolves the name
    /// once and connects to the address it checked. Installs land in the session's
    /// workspace (README, "Package installs").
    #[arg(long = "egress", env = "CODEBROKER_EGRESS", default_value = "")]
    pub egress: String,

    /// `name=address` pins, comma-separated (as curl's `--resolve`, without a port): that
    /// name connects to that address unresolved, and a pinned address may be private or
    /// loopback, which is how an internal mirror (devpi, Artifactory, Nexus on 10.x) is
    /// reached. Every other name is refused when any address it resolves to is loopback,
    /// private, link-local, multicast or a cloud metadata address.
    #[arg(long, env = "CODEBROKER_EGRESS_RESOLVE", default_value = "")]
    pub egress_resolve: String,

    /// The package index pip uses in the sandboxes (PIP_INDEX_URL), when egress is on; its
    /// host must be allowed by CODEBROKER_EGRESS. An `http://` index's host is also trusted
    /// (pip ignores a plain-HTTP index otherwise). Empty: pip's own default (pypi.org).
    #[arg(long, env = "CODEBROKER_PIP_INDEX_URL", default_value = "")]
    pub pip_index_url: String,

    /// The npm registry the sandboxes use (npm_config_registry), when egress is on; its host
    /// must be allowed by CODEBROKER_EGRESS. Empty: npm's own default (registry.npmjs.org).
    #[arg(long, env = "CODEBROKER_NPM_REGISTRY", default_value = "")]
    pub npm_registry: String,

    /// Connections one exec may open through the proxy (a `pip install` of a package with
    /// its dependencies opens a few dozen); the next one gets a 403 saying so. 0: no cap.
    #[arg(
        long,
        env = "CODEBROKER_EGRESS_EXEC_CONNECTIONS",
        default_value_t = 256
    )]
    pub egress_exec_connections: u64,

    /// Bytes one exec may move through the proxy, both ways, e.g. `512MiB`; a transfer that
    /// reaches it is cut (pip reports the broken download). 0: no cap.
    #[arg(long, env = "CODEBROKER_EGRESS_EXEC_BYTES", default_value = "1GiB", value_parser = parse_size)]
    pub egress_exec_bytes: u64,

    /// How a sandbox's proxy connections reach the broker: `socket` (a Unix socket per
    /// sandbox, bind-mounted read-only; Docker only, and the fastest) or `runner` (tunnelled
    /// over the runner's attached stdio; the only one on Kubernetes). Empty: `socket` on
    /// Docker, `runner` on Kubernetes.
    #[arg(long, env = "CODEBROKER_EGRESS_TRANSPORT", default_value = "", value_parser = parse_transport)]
    pub egress_transport: TransportSetting,

    /// Bytes one session may move through the proxy over its life, both ways. 0: no cap.
    #[arg(long, env = "CODEBROKER_EGRESS_SESSION_BYTES", default_value = "4GiB", value_parser = parse_size)]
    pub egress_session_bytes: u64,
}

/// How a sandbox's proxy connections reach the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum EgressTransport {
    /// A Unix socket per sandbox, in a directory bind-mounted into it.
    Socket,
    /// Frames over the runner's attached stdio.
    Runner,
}

/// The transport asked for, `None` for the backend's own. An alias, so that clap takes the
/// empty value to the parser instead of refusing it as a missing one.
pub type TransportSetting = Option<EgressTransport>;

/// `socket`, `runner`, or empty (as `.env.example` leaves it) for the backend's own.
fn parse_transport(value: &str) -> Result<TransportSetting, String> {
    match value.trim() {
        "" => Ok(None),
        "socket" => Ok(Some(EgressTransport::Socket)),
        "runner" => Ok(Some(EgressTransport::Runner)),
        other => Err(format!("{other:?} is not socket, runner or empty")),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_empty_transport_is_the_backends_own() {
        use super::*;
        assert_eq!(parse_transport(""), Ok(None));
        assert_eq!(parse_transport("runner"), Ok(Some(EgressTransport::Runner)));
        assert_eq!(parse_transport("socket"), Ok(Some(EgressTransport::Socket)));
        assert!(parse_transport("tcp").is_err());
    }
}
