//! The command line: `codebroker` (or `codebroker serve`) serves; `smoke` checks a running
//! broker end to end; `healthcheck` is the container's health probe.

use crate::config::Config;
use crate::smoke::SmokeArgs;
use clap::{Parser, Subcommand};

/// codebroker: a self-hosted code interpreter for chat assistants.
#[derive(Debug, Parser)]
#[command(name = "codebroker", version, about)]
pub struct Cli {
    /// What to do; serving when none is named.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// The broker's settings (flags and `CODEBROKER_*` variables).
    #[command(flatten)]
    pub config: Config,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the API (the default).
    Serve,
    /// Check a running broker end to end: health, a hello world per language, a file round
    /// trip, a plot, a time limit. One line per check; exit status 1 when one failed.
    Smoke(SmokeArgs),
    /// Exit 0 when the broker at CODEBROKER_LISTEN (or --url) answers `GET /health` with
    /// 200: the container's health probe.
    Healthcheck {
        /// Base URL to probe instead of the listen address.
        #[arg(long)]
        url: Option<String>,
    },
}

impl Cli {
    /// The URL `healthcheck` probes: `--url`, else the listen address, with a wildcard
    /// address replaced by loopback.
    pub fn health_url(config: &Config, url: Option<&str>) -> String {
        if let Some(url) = url {
            return url.to_string();
        }
        let mut addr = config.listen;
        if addr.ip().is_unspecified() {
            addr.set_ip(if addr.is_ipv4() {
                std::net::Ipv4Addr::LOCALHOST.into()
            } else {
                std::net::Ipv6Addr::LOCALHOST.into()
            });
        }
        format!("http://{addr}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serving_is_the_default() {
        let cli = Cli::parse_from(["codebroker", "--listen", "0.0.0.0:9000"]);
        assert!(cli.command.is_none());
        assert_eq!(Cli::health_url(&cli.config, None), "http://127.0.0.1:9000");
        let cli = Cli::parse_from(["codebroker", "serve"]);
        assert!(matches!(cli.command, Some(Command::Serve)));
        let cli = Cli::parse_from(["codebroker", "smoke", "--url", "http://h:1", "--key", "k"]);
        match cli.command {
            Some(Command::Smoke(args)) => {
                assert_eq!(args.url, "http://h:1");
                assert_eq!(args.key.as_deref(), Some("k"));
            }
            other => panic!("parsed {other:?}"),
        }
        assert!(
            Cli::try_parse_from(["codebroker", "smoke"]).is_err(),
            "--url is required"
        );
    }
}
