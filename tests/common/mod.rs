//! A broker on port 0 against the real Docker engine and the real sandbox image, for the
//! end-to-end tests. Each test broker has its own instance label and data directory, and
//! removes its containers when dropped.

#![allow(dead_code)]

use codebroker::config::Config;
use serde_json::{json, Value};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// The sandbox image under test: `CODEBROKER_IMAGE` (as the broker reads it), else the
/// image `make image` builds.
pub fn image() -> String {
    std::env::var("CODEBROKER_IMAGE").unwrap_or_else(|_| "codebroker-sandbox:latest".into())
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

pub struct TestBroker {
    pub base: String,
    pub client: reqwest::Client,
    pub instance: String,
    pub data: std::path::PathBuf,
    /// Keeps the data directory until the broker is dropped.
    _tmp: Option<tempfile::TempDir>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    /// Leave containers behind on drop (a test that restarts the broker on them).
    pub keep_containers: bool,
}

/// A fresh instance name, unique across test processes.
pub fn instance_name(tag: &str) -> String {
    format!(
        "test-{tag}-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::SeqCst)
    )
}

pub fn require_image() {
    let image = image();
    let ok = Command::new("docker")
        .args(["image", "inspect", &image])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    assert!(
        ok,
        "the sandbox image {image} is missing: run `make image` first"
    );
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
        config.pool_size = 0;
        adjust(&mut config);
        let data = config.data_dir.clone();
        let mut broker = Self::serve(config).await;
        broker._tmp = Some(tmp);
        broker.data = data;
        broker
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
        let instance = config.instance.clone();
        let data = config.data_dir.clone();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let broker = codebroker::build(config).await.expect("broker builds");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(codebroker::run(listener, broker, async move {
            let _ = stopped.await;
        }));
        TestBroker {
            base,
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(120))
                .build()
                .expect("client"),
            instance,
            data,
            _tmp: None,
            stop: Some(stop),
            server: Some(server),
            keep_containers: false,
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
        let resp = self
            .client
            .post(self.url("/exec"))
            .json(&body)
            .send()
            .await
            .expect("POST /exec");
        let status = resp.status().as_u16();
        let text = resp.text().await.expect("body");
        let json = serde_json::from_str(text.trim()).unwrap_or(Value::String(text));
        (status, json)
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

    /// Ids of this instance's containers.
    pub fn containers(&self) -> Vec<String> {
        containers_of(&self.instance)
    }
}

pub fn containers_of(instance: &str) -> Vec<String> {
    containers_matching(instance, &[])
}

/// Ids of this instance's containers that also carry every label in `labels` (`k=v`).
pub fn containers_matching(instance: &str, labels: &[&str]) -> Vec<String> {
    let mut args = vec![
        "ps".to_string(),
        "-aq".into(),
        "--no-trunc".into(),
        "--filter".into(),
        format!("label=codebroker.instance={instance}"),
    ];
    for label in labels {
        args.extend(["--filter".to_string(), format!("label={label}")]);
    }
    let out = Command::new("docker")
        .args(&args)
        .output()
        .expect("docker ps");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .filter(|l| !l.is_empty())
        .collect()
}

pub fn remove_containers_of(instance: &str) {
    let ids = containers_of(instance);
    if !ids.is_empty() {
        let _ = Command::new("docker")
            .arg("rm")
            .arg("-f")
            .args(&ids)
            .output();
    }
}

/// `docker inspect` of one container, as JSON.
pub fn inspect(id: &str) -> Value {
    let out = Command::new("docker")
        .args(["inspect", id])
        .output()
        .expect("docker inspect");
    let list: Value = serde_json::from_slice(&out.stdout).expect("inspect json");
    list[0].clone()
}

impl Drop for TestBroker {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if !self.keep_containers {
            remove_containers_of(&self.instance);
        }
    }
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
