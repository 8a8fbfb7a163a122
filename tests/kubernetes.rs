//! The Kubernetes backend's faults end to end, against the stand-in API server
//! (tests/k8s_standin, test code only) that `make test-k8s` starts: a pod deleted under a
//! running exec, a pod that cannot start, an API server that goes down. Each test returns
//! at once unless the suites run on the Kubernetes backend (`CODEBROKER_BACKEND` and
//! `KUBECONFIG` set, as `make test-k8s` sets them).

mod common;

use common::child::{Launch, Ready};
use common::{session, stderr, stdout, TestBroker};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams};
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Whether these tests apply; says so when they do not.
fn on_kubernetes() -> bool {
    let on = common::docker::kubernetes() && std::env::var_os("KUBECONFIG").is_some();
    if !on {
        eprintln!("not on the Kubernetes backend (make test-k8s runs these): skipped");
    }
    on
}

/// The sandbox namespace's pods, through the same kubeconfig as the broker's.
async fn pods() -> Api<Pod> {
    let client = kube::Client::try_default().await.expect("kube client");
    let namespace = std::env::var("CODEBROKER_K8S_NAMESPACE").unwrap_or("codebroker".into());
    Api::namespaced(client, &namespace)
}

/// Names of the pods of broker `instance`.
async fn pods_of(pods: &Api<Pod>, instance: &str) -> Vec<String> {
    let selector = format!("codebroker.instance={instance}");
    let list = pods
        .list(&ListParams::default().labels(&selector))
        .await
        .expect("list pods");
    list.items
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .collect()
}

#[tokio::test]
async fn a_pod_deleted_under_an_exec_ends_it_clearly_and_the_next_exec_gets_a_new_pod() {
    if !on_kubernetes() {
        return;
    }
    let broker = TestBroker::start("k8s-deleted").await;
    let pods = pods().await;
    let first = broker
        .run("bash", "echo kept > kept.txt; echo one", None)
        .await;
    let s = session(&first);
    let before = pods_of(&pods, &broker.instance).await;
    assert_eq!(before.len(), 1, "{before:?}");
    let deleter = {
        let (pods, name) = (pods.clone(), before[0].clone());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(2)).await;
            pods.delete(&name, &DeleteParams::default())
                .await
                .expect("delete the pod");
        })
    };
    let started = Instant::now();
    let (status, resp) = broker
        .exec(json!({"lang": "bash", "code": "sleep 60", "session_id": s}))
        .await;
    deleter.await.expect("deleter");
    assert_eq!(status, 200, "{resp}");
    assert!(started.elapsed() < Duration::from_secs(30), "{resp}");
    assert!(stderr(&resp).contains("stopped unexpectedly"), "{resp}");
    assert_eq!(resp["limits"], json!([]), "{resp}");
    // The next exec gets a new pod, with the session's files put back from the store.
    let next = broker.run("bash", "cat kept.txt", Some(&s)).await;
    assert_eq!(stdout(&next), "kept\n", "{next}");
    let after = pods_of(&pods, &broker.instance).await;
    assert!(!after.contains(&before[0]), "{after:?}");
    assert_eq!(after.len(), 1, "{after:?}");
}

#[tokio::test]
async fn a_pod_that_cannot_start_is_deleted_and_the_request_gets_503_with_why() {
    if !on_kubernetes() {
        return;
    }
    let broker = TestBroker::start_with("k8s-noimage", |c| {
        c.sandbox.image = "codebroker-sandbox:no-such-tag".to_string();
    })
    .await;
    let (status, resp) = broker
        .exec(json!({"lang": "bash", "code": "echo never"}))
        .await;
    assert_eq!(status, 503, "{resp}");
    let text = resp.to_string();
    assert!(text.contains("did not start"), "{text}");
    assert!(text.contains("no-such-tag"), "{text}");
    // The pod is deleted, not left to fail again.
    let pods = pods().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !pods_of(&pods, &broker.instance).await.is_empty() {
        assert!(Instant::now() < deadline, "the pod was not deleted");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A TCP relay on loopback to the API server of `KUBECONFIG`, which `down` cuts (the
/// listener and every connection), as an API server that goes away.
struct Relay {
    /// `http://127.0.0.1:<port>`.
    url: String,
    /// The accept loop and the connections it carries.
    tasks: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

impl Relay {
    async fn to_api_server() -> Relay {
        let kubeconfig = std::fs::read_to_string(std::env::var("KUBECONFIG").expect("KUBECONFIG"))
            .expect("kubeconfig");
        let server = kubeconfig
            .lines()
            .find_map(|l| l.trim().strip_prefix("server: http://"))
            .expect("an http server in the kubeconfig")
            .to_string();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let tasks = Arc::new(Mutex::new(Vec::new()));
        let carried = tasks.clone();
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let server = server.clone();
                let relay = tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(&server).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                carried.lock().expect("tasks").push(relay);
            }
        });
        tasks.lock().expect("tasks").push(accept);
        Relay { url, tasks }
    }

    fn down(&self) {
        for task in self.tasks.lock().expect("tasks").drain(..) {
            task.abort();
        }
    }
}

#[tokio::test]
async fn an_api_server_that_goes_down_gives_503_with_the_reason() {
    if !on_kubernetes() {
        return;
    }
    let relay = Relay::to_api_server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: relay\n  cluster:\n    server: \
             {}\nusers:\n- name: relay\n  user: {{}}\ncontexts:\n- name: relay\n  context:\n    \
             cluster: relay\n    user: relay\ncurrent-context: relay\n",
            relay.url
        ),
    )
    .expect("kubeconfig");
    let data = tempfile::tempdir().expect("data");
    let broker = Launch::binary(&common::instance_name("k8s-down"), data.path())
        .env("KUBECONFIG", &kubeconfig)
        .env("CODEBROKER_AUTH", "none")
        .quiet()
        .ready(Ready::Healthy)
        .spawn()
        .await;
    relay.down();
    let client = reqwest::Client::new();
    let resp = client
        .post(broker.url("/exec"))
        .json(&json!({"lang": "bash", "code": "echo never"}))
        .send()
        .await
        .expect("exec");
    let status = resp.status().as_u16();
    let text = resp.text().await.expect("body");
    assert_eq!(status, 503, "{text}");
    assert!(text.contains("cannot be reached"), "{text}");
    // Health is cached for a second: it says so at the next look.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let health = client
            .get(broker.url("/health"))
            .send()
            .await
            .expect("health");
        if health.status().as_u16() == 503 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "/health never said the API server is down"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}
