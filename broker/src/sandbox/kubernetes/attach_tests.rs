//! The attach to a pod's runner through the API server's WebSocket, against a local server
//! on 127.0.0.1 that speaks the `v4.channel.k8s.io` subprotocol (channel 0 stdin, 1
//! stdout) and plays a runner that answers hellos.

use super::*;
use crate::sandbox::{ChannelError, SandboxEngine};
use futures::SinkExt;
use sandbox_runner::{CoordinatorMessage, HelloResponse, Multiplexed, WorkerMessage};
use std::sync::atomic::Ordering;
use tokio_tungstenite::tungstenite::handshake::server::{Request, Response};
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::Message;

/// What the played API server saw, and when it stops answering.
#[derive(Default)]
struct PlayedRunner {
    /// The URI of each attach.
    uris: Mutex<Vec<String>>,
    /// The subprotocols each attach offered.
    offered: Mutex<Vec<String>>,
    /// Hellos received.
    hellos: std::sync::atomic::AtomicUsize,
    /// At this hello the WebSocket closes unanswered, as when the pod is deleted.
    gone_at_hello: Option<usize>,
}

/// Serves attaches on 127.0.0.1; returns a client of it.
async fn attach_server(runner: Arc<PlayedRunner>) -> kube::Client {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            tokio::spawn(serve_one(tcp, runner.clone()));
        }
    });
    let config = kube::Config::new(format!("http://{addr}").parse().expect("url"));
    kube::Client::try_from(config).expect("client")
}

// The handshake callback's error type is tungstenite's, not ours.
#[allow(clippy::result_large_err)]
async fn serve_one(tcp: tokio::net::TcpStream, runner: Arc<PlayedRunner>) {
    let record = runner.clone();
    let answer = move |request: &Request, mut response: Response| {
        record
            .uris
            .lock()
            .expect("uris")
            .push(request.uri().to_string());
        if let Some(offered) = request.headers().get("Sec-WebSocket-Protocol") {
            let offered = offered.to_str().unwrap_or_default().to_string();
            record.offered.lock().expect("offered").push(offered);
        }
        response.headers_mut().insert(
            "Sec-WebSocket-Protocol",
            HeaderValue::from_static("v4.channel.k8s.io"),
        );
        Ok(response)
    };
    let Ok(ws) = tokio_tungstenite::accept_hdr_async(tcp, answer).await else {
        return;
    };
    let (mut to_client, mut from_client) = ws.split();
    let mut stdin = Vec::new();
    while let Some(Ok(message)) = from_client.next().await {
        let Message::Binary(data) = message else {
            continue;
        };
        if data.first() != Some(&0) {
            continue;
        }
        stdin.extend_from_slice(&data[1..]);
        while let Some(end) = stdin.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = stdin.drain(..=end).collect();
            let Ok(Multiplexed(job, CoordinatorMessage::Hello(_))) =
                serde_json::from_slice::<Multiplexed<CoordinatorMessage>>(&line)
            else {
                continue;
            };
            let n = runner.hellos.fetch_add(1, Ordering::SeqCst) + 1;
            if runner.gone_at_hello == Some(n) {
                let _ = to_client.send(Message::Close(None)).await;
                return;
            }
            let hello = WorkerMessage::Hello(HelloResponse {
                runner_version: "test".into(),
                kernel_running: false,
                running_job: None,
                preloading: false,
            });
            let mut frame = vec![1u8];
            frame.extend(serde_json::to_vec(&Multiplexed(job, hello)).expect("frame"));
            frame.push(b'\n');
            if to_client.send(Message::Binary(frame.into())).await.is_err() {
                return;
            }
        }
    }
}

#[tokio::test]
async fn adopt_attaches_stdin_and_stdout_and_the_runner_answers() {
    let runner = Arc::new(PlayedRunner::default());
    let client = attach_server(runner.clone()).await;
    let config = Config::for_tests("/data".into(), "t");
    let backend = KubernetesBackend::with_client(client, "sandboxes", &config);
    let sandbox = backend.adopt("cb-a").await.expect("adopted");
    assert!(sandbox.is_alive());
    let hello = sandbox
        .hello(Warmup::Nothing)
        .await
        .expect("a second hello");
    assert_eq!(hello.runner_version, "test");
    assert_eq!(runner.hellos.load(Ordering::SeqCst), 2);
    let uris = runner.uris.lock().expect("uris").clone();
    assert_eq!(uris.len(), 1, "one attach");
    assert!(
        uris[0].starts_with("/api/v1/namespaces/sandboxes/pods/cb-a/attach?"),
        "{}",
        uris[0]
    );
    for part in ["stdin=true", "stdout=true", "container=sandbox"] {
        assert!(uris[0].contains(part), "{}", uris[0]);
    }
    for part in ["stderr=true", "tty=true"] {
        assert!(!uris[0].contains(part), "{}", uris[0]);
    }
    let offered = runner.offered.lock().expect("offered").clone();
    assert!(offered[0].contains("v4.channel.k8s.io"), "{offered:?}");
}

/// A pod deleted while a request waits on its runner: the request ends with a message
/// that says so, and the sandbox is dead, so the session's next exec gets a new pod.
#[tokio::test]
async fn a_pod_gone_under_a_request_ends_it_with_a_clear_message() {
    let runner = Arc::new(PlayedRunner {
        gone_at_hello: Some(2),
        ..Default::default()
    });
    let client = attach_server(runner.clone()).await;
    let config = Config::for_tests("/data".into(), "t");
    let backend = KubernetesBackend::with_client(client, "sandboxes", &config);
    let sandbox = backend.adopt("cb-b").await.expect("adopted");
    let err = tokio::time::timeout(Duration::from_secs(10), sandbox.hello(Warmup::Nothing))
        .await
        .expect("ends at once")
        .expect_err("the pod is gone");
    match err {
        ChannelError::Closed(why) => {
            assert!(why.contains("attach stream ended"), "{why}");
            assert!(why.contains("deleted"), "{why}");
        }
        other => panic!("{other:?}"),
    }
    assert!(!sandbox.is_alive());
}
