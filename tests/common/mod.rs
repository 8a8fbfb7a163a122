//! The one harness of the end-to-end suites and the bench: a broker on port 0 against the
//! real Docker engine and the real sandbox image (`TestBroker`), the broker binary as a
//! child process (`child`), Docker from outside (`docker`) and LibreChat's JWTs (`jwt`).
//! Each test broker has its own instance label and data directory, and removes its
//! containers when dropped. The bench includes this module by path.

#![allow(dead_code)]

pub mod child;
pub mod docker;
pub mod jwt;
pub mod registries;

// Re-exported where the suites have always found them; not every suite uses each.
#[allow(unused_imports)]
pub use docker::{
    containers_matching, containers_of, image, inspect, remove_containers_of, require_image,
};

use codebroker::config::Config;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A listener `start_knowing_port` bound, for the next broker this thread serves.
static NEXT_LISTENER: std::sync::Mutex<Option<tokio::net::TcpListener>> =
    std::sync::Mutex::new(None);

/// A broker served in the test process on a port of its own.
pub struct TestBroker {
    /// `http://127.0.0.1:<port>`.
    pub base: String,
    /// The client the helpers send with (a long timeout: execs may take minutes).
    pub client: reqwest::Client,
    /// The label of its containers.
    pub instance: String,
    /// Its data directory.
    pub data: std::path::PathBuf,
    /// Keeps the data directory until the broker is dropped.
    _tmp: Option<tempfile::TempDir>,
    /// Ends the server's accept loop.
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    /// The server, awaited by `stop`.
    server: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    /// Leave containers behind on drop (a test that restarts the broker on them).
    pub keep_containers: bool,
    /// It runs a pool: a refill may be creating a container when the test ends, after
    /// the drop's first removal, so the drop removes until none is left.
    pooled: bool,
}

/// A fresh instance name, unique across test processes.
pub fn instance_name(tag: &str) -> String {
    format!(
        "test-{tag}-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::SeqCst)
    )
}

impl TestBroker {
    /// A broker with auth off and no pool.
    pub async fn start(tag: &str) -> TestBroker {
        Self::start_with(tag, |_| {}).await
    }

    /// A broker whose configuration `adjust` may change.
    pub async fn start_with(tag: &str, adjust: impl FnOnce(&mut Config)) -> TestBroker {
        require_image();
        let tmp = tempfile::tempdir().expect("tempdir");
        let instance = instance_name(tag);
        let mut config = Config::for_tests(tmp.path().to_path_buf(), &instance);
        config.pool.pool_size = 0;
        adjust(&mut config);
        let data = config.data_dir.clone();
        let mut broker = Self::serve(config).await;
        broker._tmp = Some(tmp);
        broker.data = data;
        broker
    }

    /// A broker whose configuration `adjust` may change knowing the port it will listen
    /// on (a setting that names the broker's own port).
    pub async fn start_knowing_port(
        tag: &str,
        adjust: impl FnOnce(&mut Config, u16),
    ) -> TestBroker {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        *NEXT_LISTENER.lock().expect("listener slot") = Some(listener);
        Self::start_with(tag, |c| adjust(c, port)).await
    }

    /// A broker on exactly this configuration (for restarts on the same data).
    pub async fn serve(config: Config) -> TestBroker {
        // Broker logs show with a failing test's output (RUST_LOG to change the level).
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| "codebroker=info".into()),
            )
            .with_test_writer()
            .try_init();
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(120))
            .build()
            .expect("client");
        Self::serve_with_client(config, client).await
    }

    /// A broker on this configuration, driven through `client`, with no log subscriber
    /// set up (the bench prints its own table on stdout).
    pub async fn serve_with_client(config: Config, client: reqwest::Client) -> TestBroker {
        let instance = config.sandbox.instance.clone();
        let data = config.data_dir.clone();
        let pooled = config.pool.pool_size > 0;
        let bound = NEXT_LISTENER.lock().expect("listener slot").take();
        let listener = match bound {
            Some(listener) => listener,
            None => tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind"),
        };
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let broker = codebroker::build(config).await.expect("broker builds");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(codebroker::run(listener, broker, async move {
            let _ = stopped.await;
        }));
        TestBroker {
            base,
            client,
            instance,
            data,
            _tmp: None,
            stop: Some(stop),
            server: Some(server),
            keep_containers: false,
            pooled,
        }
    }

    /// Stops serving (containers stay, as after a broker restart) and hands back the
    /// data directory's owner so a new broker can start on it.
    pub async fn stop(mut self) -> Option<tempfile::TempDir> {
        self.keep_containers = true;
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(server) = self.server.take() {
            let _ = server.await;
        }
        self._tmp.take()
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// POST /exec; returns status and JSON body.
    pub async fn exec(&self, body: Value) -> (u16, Value) {
        self.exec_with(&[], body).await
    }

    /// POST /exec with extra request headers (a user, a bearer token); returns status
    /// and JSON body.
    pub async fn exec_with(&self, headers: &[(&str, &str)], body: Value) -> (u16, Value) {
        let mut request = self.client.post(self.url("/exec")).json(&body);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        answer(request.send().await.expect("POST /exec")).await
    }

    /// POST /exec that must succeed with 200.
    pub async fn run(&self, lang: &str, code: &str, session_id: Option<&str>) -> Value {
        let mut body = json!({ "lang": lang, "code": code });
        if let Some(s) = session_id {
            body["session_id"] = json!(s);
        }
        let (status, json) = self.exec(body).await;
        assert_eq!(status, 200, "{json}");
        json
    }

    pub async fn get(&self, path: &str) -> reqwest::Response {
        self.client.get(self.url(path)).send().await.expect("GET")
    }

    /// Waits until the pool holds at least `n` ready sandboxes; returns `/health`.
    pub async fn wait_for_pool(&self, n: u64) -> Value {
        let deadline = std::time::Instant::now() + Duration::from_secs(90);
        loop {
            let health: Value = self.get("/health").await.json().await.expect("health");
            if health["pool"]["ready"].as_u64().unwrap_or(0) >= n {
                return health;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "pool never filled: {health}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until `n` pooled sandboxes are ready and none of them still preloads.
    pub async fn wait_for_preloaded_pool(&self, n: u64) -> Value {
        let deadline = std::time::Instant::now() + Duration::from_secs(90);
        loop {
            let health: Value = self.get("/health").await.json().await.expect("health");
            let pool = &health["pool"];
            if pool["ready"].as_u64().unwrap_or(0) >= n && pool["preloading"] == 0 {
                return health;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "pool never preloaded: {health}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Ids of this instance's containers.
    pub fn containers(&self) -> Vec<String> {
        containers_of(&self.instance)
    }
}

impl Drop for TestBroker {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if !self.keep_containers {
            remove_containers_of(&self.instance);
            if self.pooled {
                // A create the engine had already received completes after the removal
                // above (the runtime that would wait for it is ending): remove until two
                // looks a moment apart find nothing.
                let deadline = std::time::Instant::now() + Duration::from_secs(5);
                let mut empty_looks = 0;
                while empty_looks < 2 && std::time::Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(300));
                    if docker::containers_of(&self.instance).is_empty() {
                        empty_looks += 1;
                    } else {
                        empty_looks = 0;
                        remove_containers_of(&self.instance);
                    }
                }
            }
        }
    }
}

/// This test process's resident memory, in bytes (`VmRSS`): the in-process broker's
/// footprint, so tests that read it take turns within their binary.
pub fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    kib * 1024
}

pub fn stdout(v: &Value) -> &str {
    v["stdout"].as_str().unwrap_or("")
}

pub fn stderr(v: &Value) -> &str {
    v["stderr"].as_str().unwrap_or("")
}

pub fn session(v: &Value) -> String {
    v["session_id"].as_str().expect("session_id").to_string()
}

/// A response's status and its body as JSON (after any keep-alive whitespace), or as a
/// JSON string when it is not JSON.
pub async fn answer(resp: reqwest::Response) -> (u16, Value) {
    let status = resp.status().as_u16();
    let text = resp.text().await.expect("body");
    let json = serde_json::from_str(text.trim()).unwrap_or(Value::String(text));
    (status, json)
}

/// A multipart body written byte by byte, so that any bytes can go in a field or the file
/// name: the `fields` text parts, then one part `file` named `file_name` (with a
/// `Content-Type` when `file_type` gives one). The content type to send, and the body.
pub fn raw_multipart(
    fields: &[(&str, &[u8])],
    file_name: &[u8],
    file_type: Option<&str>,
    content: &[u8],
) -> (String, Vec<u8>) {
    let boundary = "codebroker-test-boundary-7d1f";
    let mut body = Vec::new();
    for (name, value) in fields {
        body.extend_from_slice(
            format!("--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n")
                .as_bytes(),
        );
        body.extend_from_slice(value);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(
        format!("--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"")
            .as_bytes(),
    );
    body.extend_from_slice(file_name);
    body.extend_from_slice(b"\"\r\n");
    if let Some(file_type) = file_type {
        body.extend_from_slice(format!("Content-Type: {file_type}\r\n").as_bytes());
    }
    body.extend_from_slice(b"\r\n");
    body.extend_from_slice(content);
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}
