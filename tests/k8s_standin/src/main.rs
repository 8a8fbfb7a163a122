//! **Test code only.** A stand-in for the Kubernetes API server that serves the pod calls
//! codebroker's Kubernetes backend makes — create, get, list, watch, delete, `pods/log`,
//! `pods/attach` — and runs each pod as a container on the local Docker engine, so the
//! end-to-end suites run through the backend's whole path, attach stream included,
//! without a cluster (`make test-k8s`). Not a Kubernetes: no scheduler, nodes,
//! controllers or authentication; one container per pod; `emptyDir` volumes only.
//!
//! It listens on loopback only, writes a kubeconfig that points at itself, and removes
//! its containers when a pod is deleted and when it exits (SIGINT, SIGTERM).

mod api;
mod attach;
mod cluster;
mod container;

use anyhow::Context;
use clap::Parser;
use std::future::IntoFuture;
use std::net::SocketAddr;
use std::path::PathBuf;

/// A stand-in for the Kubernetes API server, for codebroker's tests only.
#[derive(Parser)]
struct Args {
    /// Where to write a kubeconfig that points at this server (what KUBECONFIG names).
    #[arg(long)]
    kubeconfig: PathBuf,

    /// The namespaces that exist (comma-separated); pods elsewhere get 404.
    #[arg(long, default_value = "codebroker", value_delimiter = ',')]
    namespaces: Vec<String>,

    /// Where to listen: a loopback address (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,

    /// The pids limit of each pod's container, as a kubelet's podPidsLimit.
    #[arg(long, default_value_t = 1024)]
    pod_pids_limit: i64,
}

/// The kubeconfig of a client of the server at `url`, in `namespace`.
fn kubeconfig(url: &str, namespace: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: k8s-standin\n  cluster:\n    \
         server: {url}\nusers:\n- name: k8s-standin\n  user: {{}}\ncontexts:\n- name: \
         k8s-standin\n  context:\n    cluster: k8s-standin\n    user: k8s-standin\n    \
         namespace: {namespace}\ncurrent-context: k8s-standin\n"
    )
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.listen.ip().is_loopback(),
        "the stand-in serves loopback only, not {}",
        args.listen
    );
    let docker = bollard::Docker::connect_with_local_defaults()
        .context("cannot reach the Docker engine")?
        .negotiate_version()
        .await
        .context("cannot negotiate the Docker API version")?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let addr = listener.local_addr()?;
    let server = format!("{}-{}", std::process::id(), addr.port());
    let volumes_dir = std::env::temp_dir().join(format!("k8s-standin-{server}"));
    let cluster = cluster::Cluster::new(
        docker,
        server,
        args.namespaces.clone(),
        args.pod_pids_limit,
        volumes_dir,
    );
    let url = format!("http://{addr}");
    // Written whole, then renamed: whoever waits for the file never reads half of it.
    let partial = args.kubeconfig.with_extension("partial");
    let namespace = args.namespaces.first().map_or("default", String::as_str);
    std::fs::write(&partial, kubeconfig(&url, namespace))
        .and_then(|_| std::fs::rename(&partial, &args.kubeconfig))
        .with_context(|| format!("cannot write {}", args.kubeconfig.display()))?;
    println!("k8s-standin (test code only) serving {url}");

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("cannot handle SIGTERM")?;
    // Open watches and attaches do not hold the exit up: their pods' containers go.
    tokio::select! {
        served = axum::serve(listener, api::router(cluster.clone())).into_future() => {
            served.context("serving")?
        }
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    cluster.remove_all().await;
    let _ = std::fs::remove_file(&args.kubeconfig);
    Ok(())
}
