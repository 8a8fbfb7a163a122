//! The broker's end of each sandbox's egress: a Unix socket per sandbox, in a directory the
//! sandbox mounts read-only, which the runner's forwarder connects to for every connection
//! pip or npm open to their proxy. Each connection is served by [`proxy::serve`] under the
//! policy, counted against the exec running in that sandbox (none running: refused), and
//! recorded: an audit record and metrics per connection.

use super::policy::EgressPolicy;
use super::proxy::{self, Budget, Outcome};
use crate::config::{EgressConfig, EgressTransport};
use crate::sync::LockExt as _;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use tokio::net::UnixListener;
use tokio_util::sync::{CancellationToken, DropGuard};

/// Where the sandbox sees its socket's directory.
pub(crate) const SANDBOX_DIR: &str = sandbox_runner::EGRESS_SOCKET_DIR;
/// The socket's name in that directory (the runner connects to the path this ends).
const SOCKET_NAME: &str = "proxy.sock";
/// Connections one sandbox may have open through the proxy at once; more wait in the
/// socket's backlog (the runner caps its own side as well).
pub(super) const MAX_OPEN_PER_SANDBOX: usize = 64;

/// Who hears of each connection: metrics and the audit log.
pub(crate) trait EgressObserver: Send + Sync {
    /// One connection, served or refused, of `exec`'s (`None`: no exec was running).
    fn connection(&self, exec: Option<&ExecEgress>, outcome: &Outcome);
}

/// The exec a sandbox's connections are counted against while it runs.
#[derive(Clone)]
pub(crate) struct ExecEgress {
    /// The session, for the audit record.
    pub(crate) session: String,
    /// The caller, for the audit record.
    pub(crate) user: Option<String>,
    /// The caller's tenant, for the audit record.
    pub(crate) tenant: Option<String>,
    /// The exec's caps and what it has used (and its session's bytes).
    pub(crate) budget: Arc<Budget>,
}

/// The policy, the caps and the sockets' directory, shared by every sandbox.
pub(crate) struct Gateway {
    /// `CODEBROKER_EGRESS` and `CODEBROKER_EGRESS_RESOLVE`, with the broker's port guarded.
    policy: Arc<EgressPolicy>,
    /// The caps per exec and per session, and the registries the sandboxes are told of.
    config: EgressConfig,
    /// `DATA_DIR/egress`: one directory per sandbox, each holding its socket.
    dir: PathBuf,
    /// Metrics and audit.
    observer: Arc<dyn EgressObserver>,
    /// How the sandboxes' connections come: a socket each, or a tunnel over the channel.
    transport: EgressTransport,
}

impl Gateway {
    /// The gateway of `config` (checked by `Config::validate`).
    pub(crate) fn new(
        config: &EgressConfig,
        transport: EgressTransport,
        data_dir: &Path,
        observer: Arc<dyn EgressObserver>,
    ) -> Result<Gateway, String> {
        let policy = EgressPolicy::from_settings(&config.egress, &config.egress_resolve)?;
        Ok(Gateway {
            policy: Arc::new(policy),
            config: config.clone(),
            dir: data_dir.join("egress"),
            observer,
            transport,
        })
    }

    /// Once the broker listens: its port is never reached through the proxy on an address
    /// that is not public.
    pub(crate) fn guard_broker_port(&self, port: u16) {
        self.policy.guard_broker_port(port);
    }

    /// Whether any host is allowed (else sandboxes get no socket, and their proxy, the
    /// runner, answers every request with "egress is off").
    pub(crate) fn is_on(&self) -> bool {
        self.policy.is_on()
    }

    /// Whether egress is on and each sandbox gets a socket (else, when on, a tunnel).
    pub(crate) fn uses_sockets(&self) -> bool {
        self.is_on() && self.transport == EgressTransport::Socket
    }

    /// Whether egress is on and goes over the runner channel.
    pub(crate) fn uses_tunnels(&self) -> bool {
        self.is_on() && self.transport == EgressTransport::Runner
    }

    /// The variables every sandbox gets: its proxy (the runner's forwarder) always, so
    /// that pip and npm fail at once with the proxy's reason when egress is off; the
    /// socket and the registries when it is on.
    pub(crate) fn sandbox_env(&self) -> Vec<String> {
        let proxy = sandbox_runner::EGRESS_PROXY_URL;
        let mut env = Vec::new();
        for name in ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"] {
            env.push(format!("{name}={proxy}"));
        }
        // Servers the code starts itself, inside the sandbox, are reached directly.
        for name in ["NO_PROXY", "no_proxy"] {
            env.push(format!("{name}={}", sandbox_runner::EGRESS_NO_PROXY));
        }
        if !self.is_on() {
            // The proxy's refusal does not change on a retry. pip prints the refusal only
            // in the warning of a retry, so it gets one (at once: its first backoff is 0).
            env.push("PIP_RETRIES=1".to_string());
            env.push("npm_config_fetch_retries=0".to_string());
            return env;
        }
        // Over the runner channel, the runner learns of egress from the broker's listen
        // request instead.
        if self.transport == EgressTransport::Socket {
            env.push(format!(
                "{}={}",
                sandbox_runner::EGRESS_SOCKET_ENV,
                sandbox_runner::EGRESS_SOCKET_PATH
            ));
        }
        let index = self.config.pip_index_url.trim();
        if !index.is_empty() {
            env.push(format!("PIP_INDEX_URL={index}"));
            // pip ignores a plain-HTTP index unless its host is trusted.
            if let Some(host) = plain_http_host(index) {
                env.push(format!("PIP_TRUSTED_HOST={host}"));
            }
        }
        let registry = self.config.npm_registry.trim();
        if !registry.is_empty() {
            env.push(format!("npm_config_registry={registry}"));
        }
        env
    }

    /// Opens the socket of the sandbox `name` (new, or re-opened for a sandbox adopted
    /// after a restart) and serves it until the returned handle is dropped. Returns the
    /// directory to mount at [`SANDBOX_DIR`] with the handle.
    pub(crate) fn open(self: &Arc<Self>, name: &str) -> io::Result<Arc<SandboxEgress>> {
        use std::os::unix::fs::{DirBuilderExt as _, PermissionsExt as _};
        if !crate::ids::is_valid_id(name) {
            return Err(io::Error::other(format!("bad egress socket name {name:?}")));
        }
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)?;
        let dir = self.dir.join(name);
        match std::fs::DirBuilder::new().mode(0o755).create(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        // The sandbox's uid traverses the directory and connects to the socket.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))?;
        let path = dir.join(SOCKET_NAME);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let listener = UnixListener::bind(&path)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666))?;
        let stop = CancellationToken::new();
        let egress = Arc::new(SandboxEgress {
            name: name.to_string(),
            dir: Some(dir),
            exec: Mutex::new(None),
            _stop: stop.clone().drop_guard(),
        });
        tokio::spawn(self.clone().accept(listener, Arc::downgrade(&egress), stop));
        Ok(egress)
    }

    /// Serves one sandbox's socket until `stop`.
    async fn accept(
        self: Arc<Self>,
        listener: UnixListener,
        sandbox: std::sync::Weak<SandboxEgress>,
        stop: CancellationToken,
    ) {
        let open = Arc::new(tokio::sync::Semaphore::new(MAX_OPEN_PER_SANDBOX));
        loop {
            let permit = tokio::select! {
                _ = stop.cancelled() => return,
                permit = open.clone().acquire_owned() => match permit {
                    Ok(permit) => permit,
                    Err(_) => return,
                },
            };
            let stream = tokio::select! {
                _ = stop.cancelled() => return,
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => stream,
                    Err(err) => {
                        tracing::warn!(error = %err, "egress: accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                        continue;
                    }
                },
            };
            let Some(sandbox) = sandbox.upgrade() else {
                return;
            };
            let served = self.serve_one(&sandbox, stream, stop.clone());
            tokio::spawn(async move {
                let _permit = permit;
                served.await;
            });
        }
    }

    /// Serves one connection of `sandbox`'s (from its socket or its tunnel) under the
    /// policy, counted against the exec running there now (none: refused), and records
    /// it; a removed sandbox's connections end with it (`stop`).
    pub(super) fn serve_one<S>(
        self: &Arc<Self>,
        sandbox: &SandboxEgress,
        stream: S,
        stop: CancellationToken,
    ) -> impl std::future::Future<Output = ()> + Send + 'static
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let exec = sandbox.exec.locked().clone();
        let gateway = self.clone();
        async move {
            let served = async {
                match &exec {
                    Some(exec) => proxy::serve(stream, &gateway.policy, &exec.budget).await,
                    None => proxy::refuse_without_exec(stream, &gateway.policy).await,
                }
            };
            tokio::select! {
                outcome = served => gateway.observer.connection(exec.as_ref(), &outcome),
                _ = stop.cancelled() => {}
            }
        }
    }

    /// Serves the egress of the sandbox `name` over its runner channel (`standing`: the
    /// runner's tunnel job) until the returned handle is dropped.
    pub(crate) fn open_tunnel(
        self: &Arc<Self>,
        name: &str,
        standing: crate::sandbox::channel::StandingJob,
    ) -> Arc<SandboxEgress> {
        let stop = CancellationToken::new();
        let egress = Arc::new(SandboxEgress {
            name: name.to_string(),
            dir: None,
            exec: Mutex::new(None),
            _stop: stop.clone().drop_guard(),
        });
        tokio::spawn(super::tunnel::serve(
            self.clone(),
            Arc::downgrade(&egress),
            standing,
            stop,
        ));
        egress
    }

    /// The budget of one exec of a session that has moved `session_bytes` so far.
    pub(crate) fn exec_budget(&self, session_bytes: Arc<AtomicU64>) -> Arc<Budget> {
        Arc::new(Budget::new(
            self.config.egress_exec_connections,
            self.config.egress_exec_bytes,
            self.config.egress_session_bytes,
            session_bytes,
        ))
    }

    /// Removes the socket directory `name` of a sandbox that is gone.
    pub(crate) fn remove(&self, name: &str) {
        if crate::ids::is_valid_id(name) {
            let _ = std::fs::remove_dir_all(self.dir.join(name));
        }
    }

    /// Removes the socket directories of sandboxes that are gone (a broker that died
    /// left them), keeping those of `live`.
    pub(crate) fn sweep(&self, live: &[String]) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !live.contains(&name) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
}

/// One sandbox's socket: served while this lives, and the exec it counts against.
pub(crate) struct SandboxEgress {
    /// The socket's name (a container label keeps it for a restarted broker).
    name: String,
    /// The directory the sandbox mounts at [`SANDBOX_DIR`]; it outlives the handle (a kept
    /// container mounts it) until [`Gateway::remove`]. `None`: the egress is tunnelled
    /// over the runner channel.
    dir: Option<PathBuf>,
    /// The exec running in the sandbox now; `None` between execs.
    exec: Mutex<Option<ExecEgress>>,
    /// Stops the socket's service (and the connections under way) when dropped.
    _stop: DropGuard,
}

impl SandboxEgress {
    /// The socket's name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// The directory to mount, when the egress goes through a socket.
    pub(crate) fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// Counts the sandbox's connections against `exec` until the guard is dropped.
    pub(crate) fn begin_exec(self: &Arc<Self>, exec: ExecEgress) -> ExecEgressGuard {
        *self.exec.locked() = Some(exec);
        ExecEgressGuard(self.clone())
    }
}

/// While held, the sandbox's connections count against an exec.
pub(crate) struct ExecEgressGuard(Arc<SandboxEgress>);

impl Drop for ExecEgressGuard {
    fn drop(&mut self) {
        *self.0.exec.locked() = None;
    }
}

/// The host of an `http://` URL, for pip's trusted hosts.
fn plain_http_host(url: &str) -> Option<String> {
    let url = reqwest::Url::parse(url).ok()?;
    (url.scheme() == "http")
        .then(|| url.host_str().map(str::to_string))
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    /// Remembers every connection.
    #[derive(Default)]
    struct Seen(Mutex<Vec<(Option<String>, Outcome)>>);

    impl EgressObserver for Seen {
        fn connection(&self, exec: Option<&ExecEgress>, outcome: &Outcome) {
            self.0
                .locked()
                .push((exec.map(|e| e.session.clone()), outcome.clone()));
        }
    }

    fn config(egress: &str, resolve: &str) -> EgressConfig {
        let mut config = crate::config::Config::for_tests("/tmp".into(), "gateway-test").egress;
        config.egress = egress.to_string();
        config.egress_resolve = resolve.to_string();
        config
    }

    async fn ask(path: &Path, request: &str) -> String {
        let mut stream = tokio::net::UnixStream::connect(path)
            .await
            .expect("connect");
        stream.write_all(request.as_bytes()).await.expect("write");
        let mut answer = vec![0; 4096];
        let n = stream.read(&mut answer).await.expect("read");
        String::from_utf8_lossy(&answer[..n]).into_owned()
    }

    async fn wait_for(seen: &Seen, n: usize) {
        for _ in 0..200 {
            if seen.0.locked().len() >= n {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        panic!("no record of the connection");
    }

    #[tokio::test]
    async fn a_sandbox_socket_serves_only_during_an_exec_and_reports_each_connection() {
        let upstream = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = upstream.local_addr().expect("addr").port();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = upstream.accept().await {
                let _ = s.write_all(b"hello").await;
            }
        });
        let data = tempfile::tempdir().expect("tempdir");
        let seen = Arc::new(Seen::default());
        let gateway = Arc::new(
            Gateway::new(
                &config(&format!("pkg.test:{port}"), "pkg.test=127.0.0.1"),
                EgressTransport::Socket,
                data.path(),
                seen.clone(),
            )
            .expect("gateway"),
        );
        let egress = gateway.open(&crate::ids::new_id()).expect("open");
        let socket = egress.dir().expect("a socket").join(SOCKET_NAME);
        let request = format!("CONNECT pkg.test:{port} HTTP/1.1\r\n\r\n");

        let answer = ask(&socket, &request).await;
        assert!(
            answer.starts_with("HTTP/1.1 403 egress: only code of a running exec"),
            "{answer}"
        );
        wait_for(&seen, 1).await;

        let budget = gateway.exec_budget(Arc::new(AtomicU64::new(0)));
        let guard = egress.begin_exec(ExecEgress {
            session: "s1".into(),
            user: Some("u".into()),
            tenant: None,
            budget,
        });
        let mut stream = tokio::net::UnixStream::connect(&socket)
            .await
            .expect("connect");
        stream.write_all(request.as_bytes()).await.expect("write");
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await.expect("read");
        assert_eq!(
            String::from_utf8_lossy(&answer),
            "HTTP/1.1 200 Connection established\r\n\r\nhello"
        );
        drop(stream);
        wait_for(&seen, 2).await;
        let (session, outcome) = seen.0.locked()[1].clone();
        assert_eq!(session.as_deref(), Some("s1"));
        assert_eq!((outcome.verdict, outcome.bytes_down), ("allowed", 5));

        drop(guard);
        let answer = ask(&socket, &request).await;
        assert!(answer.contains("only code of a running exec"), "{answer}");

        // The service ends with the handle; the directory (which a kept container mounts)
        // stays until the sandbox is removed.
        let dir = egress.dir().expect("a socket").to_path_buf();
        let name = egress.name().to_string();
        drop(egress);
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(tokio::net::UnixStream::connect(&socket).await.is_err());
        assert!(dir.exists());
        gateway.remove(&name);
        assert!(!dir.exists());
    }

    #[test]
    fn the_sandbox_is_told_of_its_proxy_and_registries() {
        let seen: Arc<dyn EgressObserver> = Arc::new(Seen::default());
        let off = Gateway::new(
            &config("", ""),
            EgressTransport::Socket,
            Path::new("/tmp"),
            seen.clone(),
        )
        .expect("gateway");
        let env = off.sandbox_env();
        assert!(
            env.contains(&"HTTPS_PROXY=http://127.0.0.1:3128".to_string()),
            "{env:?}"
        );
        assert!(env.contains(&"PIP_RETRIES=1".to_string()));
        assert!(!env
            .iter()
            .any(|e| e.starts_with("CODEBROKER_EGRESS_SOCKET=")));

        let mut on = config("pypi.test:8080,npm.test", "pypi.test=10.0.0.5");
        on.pip_index_url = "http://pypi.test:8080/simple/".into();
        on.npm_registry = "https://npm.test/".into();
        let on =
            Gateway::new(&on, EgressTransport::Socket, Path::new("/tmp"), seen).expect("gateway");
        let env = on.sandbox_env();
        for expected in [
            "CODEBROKER_EGRESS_SOCKET=/run/codebroker/egress/proxy.sock",
            "PIP_INDEX_URL=http://pypi.test:8080/simple/",
            "PIP_TRUSTED_HOST=pypi.test",
            "npm_config_registry=https://npm.test/",
        ] {
            assert!(env.contains(&expected.to_string()), "{expected} in {env:?}");
        }
        assert!(!env.iter().any(|e| e.starts_with("PIP_RETRIES=")));
    }
}
