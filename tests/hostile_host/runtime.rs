//! Runtime: a container runtime the Docker daemon lacks.

use super::*;
use serde_json::json;

#[tokio::test]
async fn a_runtime_the_daemon_lacks_is_a_clean_refusal() {
    // CODEBROKER_RUNTIME names e.g. gVisor's runsc; on a daemon without it, execs are
    // refused with a 503 that says so, promptly, and nothing is left behind.
    let broker = TestBroker::start_with("hh-runtime", |c| {
        c.sandbox.runtime = "codebroker-no-such-runtime".into();
    })
    .await;
    let started = Instant::now();
    let (status, body) = broker
        .exec(json!({ "lang": "bash", "code": "echo never" }))
        .await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"], "unavailable", "{body}");
    assert!(started.elapsed() < Duration::from_secs(30));
    assert!(broker.containers().is_empty(), "{:?}", broker.containers());
}
