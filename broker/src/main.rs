use clap::Parser;
use codebroker::cli::{Cli, Command};
use tracing_subscriber::EnvFilter;

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // Before the runtime starts its threads, which take this thread's capability sets.
    codebroker::settle_capabilities()?;
    tokio::runtime::Runtime::new()?.block_on(run(cli))
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        None | Some(Command::Serve) => serve(cli.config).await,
        Some(Command::Smoke(args)) => {
            if !codebroker::smoke::run(args).await? {
                std::process::exit(1);
            }
            Ok(())
        }
        Some(Command::Healthcheck { url }) => {
            codebroker::smoke::healthcheck(&Cli::health_url(&cli.config, url.as_deref())).await
        }
    }
}

async fn serve(config: codebroker::config::Config) -> anyhow::Result<()> {
    // Whatever the broker creates is its own alone unless it says otherwise (the data
    // directory's files are created with explicit modes too).
    // SAFETY: umask only changes this process's file creation mask.
    unsafe { libc::umask(0o077) };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    if config.log_format == codebroker::config::LogFormat::Json {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .json()
            .init();
    } else {
        tracing_subscriber::fmt().with_env_filter(filter).init();
    }
    let listener = tokio::net::TcpListener::bind(config.listen).await?;
    let broker = codebroker::build(config).await?;
    codebroker::run(listener, broker, shutdown_signal()).await
}

/// Resolves on SIGINT (ctrl-c) or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return ctrl_c.await.unwrap_or(()),
    };
    tokio::select! {
        _ = ctrl_c => tracing::info!("SIGINT"),
        _ = term.recv() => tracing::info!("SIGTERM"),
    }
}
