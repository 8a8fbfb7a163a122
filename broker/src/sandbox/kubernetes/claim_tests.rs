//! Request-level tests of agent-sandbox mode against the mocked API server of `tests.rs`:
//! the claim POSTed (template, labels, namespace), the wait from claim to Sandbox to a
//! running pod, the delete of a claim that is not bound in time, RBAC and a cluster
//! without agent-sandbox, remove, list and adopt. The attach is refused here (its
//! WebSocket is `attach_tests.rs`'s), which ends each create after the pod is found.

use super::tests::{
    config, mock_api, pending, running, seen, status, unavailable_reason, watched, Reply, NS,
};
use super::*;
use crate::sandbox::SandboxEngine;
use serde_json::{json, Value};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

const CLAIMS: &str = "/apis/extensions.agents.x-k8s.io/v1alpha1/namespaces/sandboxes/sandboxclaims";
const SANDBOXES: &str = "/apis/agents.x-k8s.io/v1alpha1/namespaces/sandboxes/sandboxes";
const PODS: &str = "/api/v1/namespaces/sandboxes/pods";

fn claims_config() -> Config {
    let mut config = config();
    config.kubernetes.k8s_mode = KubernetesMode::AgentSandbox;
    config.kubernetes.k8s_sandbox_template = " my-template ".into();
    config
}

fn backend(client: kube::Client) -> KubernetesBackend {
    KubernetesBackend::with_client(client, NS, &claims_config())
}

/// A claim named `name` with `status`, labelled for session `abc` of instance `t`.
fn claim(name: &str, status: Value) -> Value {
    json!({
        "apiVersion": "extensions.agents.x-k8s.io/v1alpha1",
        "kind": "SandboxClaim",
        "metadata": {
            "name": name,
            "namespace": NS,
            "resourceVersion": "3",
            "labels": {"codebroker.instance": "t", "codebroker.session": "s-abc-s"},
        },
        "spec": {"sandboxTemplateRef": {"name": "my-template"}},
        "status": status,
    })
}

/// A Sandbox named `name`, its pod named by the warm-pool annotation when `pod` is set.
fn sandbox(name: &str, pod: Option<&str>) -> Value {
    let annotations = match pod {
        Some(pod) => json!({"agents.x-k8s.io/pod-name": pod}),
        None => json!({}),
    };
    json!({
        "apiVersion": "agents.x-k8s.io/v1alpha1",
        "kind": "Sandbox",
        "metadata": {"name": name, "namespace": NS, "annotations": annotations},
        "spec": {"podTemplate": {"spec": {"containers": []}}},
        "status": {"replicas": 1},
    })
}

fn not_found(what: &str) -> Reply {
    Reply::Json(404, status(404, "NotFound", &format!("{what} not found")))
}

/// The name in the claim's POSTed body.
fn posted_claim(log: &Arc<Mutex<Vec<tests::Seen>>>) -> String {
    seen(log)
        .iter()
        .find(|s| s.method == "POST")
        .and_then(|s| s.body["metadata"]["name"].as_str().map(str::to_string))
        .expect("a claim was posted")
}

/// The claim POSTed names the template and carries the session's labels; once bound (the
/// early spelling `status.sandbox.Name`), its Sandbox names the warm-pool pod, which is
/// attached to. The attach is refused, so the claim, not the pod, is deleted.
#[tokio::test]
async fn a_claim_names_the_template_and_is_deleted_when_its_pod_cannot_be_attached() {
    let (client, log) = mock_api(|seen| match (seen.method.as_str(), seen.uri.as_str()) {
        ("POST", _) => Reply::Json(201, seen.body.clone()),
        ("GET", uri) if uri.starts_with(CLAIMS) => {
            let name = uri.trim_start_matches(CLAIMS).trim_start_matches('/');
            let name = name.split('?').next().unwrap_or(name);
            Reply::Json(200, claim(name, json!({"sandbox": {"Name": name}})))
        }
        ("GET", uri) if uri.starts_with(SANDBOXES) => {
            Reply::Json(200, sandbox("cb-x", Some("pool-pod-1")))
        }
        ("GET", uri) if uri.contains("/attach") => {
            Reply::Json(403, status(403, "Forbidden", "pods/attach is forbidden"))
        }
        ("GET", uri) if uri.starts_with(&format!("{PODS}/pool-pod-1")) => {
            Reply::Json(200, running("pool-pod-1"))
        }
        ("GET", _) => Reply::Json(200, tests::list_of(vec![running("pool-pod-1")], "9")),
        ("DELETE", _) => Reply::Json(200, claim("x", json!({}))),
        _ => Reply::Json(500, status(500, "InternalError", "unexpected")),
    });
    let backend = backend(client);
    let workspace = crate::workspace::Workspace::new(Path::new("/nonexistent"), "abc");
    let err = backend
        .create("abcdefghijklmnopqrstu", &workspace, Warmup::Nothing)
        .await
        .err()
        .expect("the attach is refused");
    let reason = unavailable_reason(&err).expect("a reason for the client");
    assert!(
        reason.contains("pods/attach") && reason.contains("RBAC"),
        "{reason}"
    );

    let requests = seen(&log);
    let post = &requests[0];
    assert_eq!(post.method, "POST");
    assert!(post.uri.starts_with(&format!("{CLAIMS}?")), "{}", post.uri);
    let body = &post.body;
    assert_eq!(body["apiVersion"], "extensions.agents.x-k8s.io/v1alpha1");
    assert_eq!(body["kind"], "SandboxClaim");
    let name = body["metadata"]["name"].as_str().expect("a name");
    assert!(name.starts_with("cb-"), "{name}");
    assert_eq!(body["metadata"]["namespace"], NS);
    let labels = &body["metadata"]["labels"];
    assert_eq!(labels["codebroker.instance"], "t");
    assert_eq!(labels["codebroker.session"], "s-abcdefghijklmnopqrstu-s");
    assert!(labels["codebroker.created"]
        .as_str()
        .is_some_and(|c| c.parse::<u64>().is_ok()));
    assert_eq!(
        body["spec"],
        json!({"sandboxTemplateRef": {"name": "my-template"}})
    );

    // The claim, its Sandbox (named by the claim's status), the pod the annotation names.
    assert_eq!(requests[1].uri, format!("{CLAIMS}/{name}"));
    assert_eq!(requests[2].uri, format!("{SANDBOXES}/{name}"));
    assert_eq!(requests[3].uri, format!("{PODS}/pool-pod-1"));
    assert!(
        requests[4]
            .uri
            .contains("fieldSelector=metadata.name=pool-pod-1"),
        "{}",
        requests[4].uri
    );
    assert!(
        requests[5]
            .uri
            .starts_with(&format!("{PODS}/pool-pod-1/attach?")),
        "{}",
        requests[5].uri
    );
    let delete = &requests[6];
    assert_eq!(delete.method, "DELETE");
    assert_eq!(delete.uri, format!("{CLAIMS}/{name}?"));
    assert_eq!(
        requests.len(),
        7,
        "the pod itself is the controller's to delete"
    );
}

/// The wait follows the claim while it is unbound (looking for a Sandbox of its name,
/// as the v1alpha1 client does), then the Sandbox its status names (the later spelling
/// `status.sandbox.name`), then that Sandbox's pod until it exists and runs.
#[tokio::test]
async fn the_wait_follows_the_claim_to_its_sandbox_and_pod_until_it_runs() {
    let claim_gets = Arc::new(AtomicUsize::new(0));
    let pod_gets = Arc::new(AtomicUsize::new(0));
    let (c, p) = (claim_gets.clone(), pod_gets.clone());
    let (client, log) = mock_api(
        move |seen| match (seen.method.as_str(), seen.uri.as_str()) {
            ("POST", _) => Reply::Json(201, seen.body.clone()),
            ("GET", uri) if uri.starts_with(CLAIMS) => {
                let name = uri.trim_start_matches(CLAIMS).trim_start_matches('/');
                if c.fetch_add(1, Ordering::SeqCst) == 0 {
                    Reply::Json(
                        200,
                        claim(
                            name,
                            json!({"conditions": [{
                                "type": "Ready", "status": "False",
                                "reason": "SandboxNotReady", "message": "waiting for a sandbox",
                                "lastTransitionTime": "2026-01-01T00:00:00Z",
                            }]}),
                        ),
                    )
                } else {
                    Reply::Json(200, claim(name, json!({"sandbox": {"name": "pool-x"}})))
                }
            }
            ("GET", uri) if uri == format!("{SANDBOXES}/pool-x") => {
                Reply::Json(200, sandbox("pool-x", None))
            }
            ("GET", uri) if uri.starts_with(SANDBOXES) => not_found("sandboxes"),
            ("GET", uri) if uri.contains("/attach") => {
                Reply::Json(403, status(403, "Forbidden", "pods/attach is forbidden"))
            }
            ("GET", uri) if uri == format!("{PODS}/pool-x") => {
                if p.fetch_add(1, Ordering::SeqCst) == 0 {
                    not_found("pods \"pool-x\"")
                } else {
                    Reply::Json(200, pending("pool-x"))
                }
            }
            ("GET", _) if seen.is_watch() => Reply::Json(
                200,
                json!({"type": "MODIFIED", "object": running("pool-x")}),
            ),
            ("GET", _) => Reply::Json(200, tests::list_of(vec![pending("pool-x")], "9")),
            ("DELETE", _) => Reply::Json(200, claim("x", json!({}))),
            _ => Reply::Json(500, status(500, "InternalError", "unexpected")),
        },
    );
    let mut config = claims_config();
    config.kubernetes.k8s_ready_timeout_secs = 10;
    let backend = KubernetesBackend::with_client(client, NS, &config);
    let err = backend
        .claim_and_attach("abc")
        .await
        .err()
        .expect("the attach is refused");
    assert!(
        unavailable_reason(&err).is_some_and(|r| r.contains("pods/attach")),
        "{err:?}"
    );
    let name = posted_claim(&log);
    let gets: Vec<String> = seen(&log)
        .into_iter()
        .filter(|s| s.method == "GET")
        .map(|s| s.uri)
        .collect();
    assert_eq!(gets[0], format!("{CLAIMS}/{name}"));
    // Unbound: a Sandbox of the claim's name, not made yet.
    assert_eq!(gets[1], format!("{SANDBOXES}/{name}"));
    // Bound: the Sandbox the status names, its pod not created yet.
    assert_eq!(gets[2], format!("{CLAIMS}/{name}"));
    assert_eq!(gets[3], format!("{SANDBOXES}/pool-x"));
    assert_eq!(gets[4], format!("{PODS}/pool-x"));
    // The pod exists: then the pods wait (list, watch to Running) and the attach.
    assert_eq!(gets[5], format!("{CLAIMS}/{name}"));
    assert_eq!(gets[6], format!("{SANDBOXES}/pool-x"));
    assert_eq!(gets[7], format!("{PODS}/pool-x"));
    assert!(
        gets[8].contains("fieldSelector=metadata.name=pool-x"),
        "{}",
        gets[8]
    );
    assert!(gets[9].contains("watch=true"), "{}", gets[9]);
    assert!(
        gets[10].starts_with(&format!("{PODS}/pool-x/attach?")),
        "{}",
        gets[10]
    );
}

/// A claim the controller does not bind within CODEBROKER_K8S_READY_TIMEOUT_SECS is
/// deleted, and the error says how long was waited and what the claim said last.
#[tokio::test]
async fn a_claim_not_bound_in_time_is_deleted_and_reported() {
    let (client, log) = mock_api(|seen| match (seen.method.as_str(), seen.uri.as_str()) {
        ("POST", _) => Reply::Json(201, seen.body.clone()),
        ("GET", uri) if uri.starts_with(CLAIMS) => Reply::Json(
            200,
            claim(
                "x",
                json!({"conditions": [{
                    "type": "Ready", "status": "False",
                    "reason": "TemplateNotFound",
                    "message": "sandboxtemplate \"my-template\" not found",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                }]}),
            ),
        ),
        ("GET", _) => not_found("sandboxes"),
        ("DELETE", _) => Reply::Json(200, claim("x", json!({}))),
        _ => Reply::Json(500, status(500, "InternalError", "unexpected")),
    });
    let mut config = claims_config();
    config.kubernetes.k8s_ready_timeout_secs = 1;
    let backend = KubernetesBackend::with_client(client, NS, &config);
    let err = backend
        .claim_and_attach("abc")
        .await
        .err()
        .expect("not bound in time");
    let reason = unavailable_reason(&err).expect("a reason for the client");
    assert!(
        reason.contains("was not bound to a running pod within 1 s"),
        "{reason}"
    );
    assert!(reason.contains("template my-template"), "{reason}");
    assert!(
        reason.contains("TemplateNotFound: sandboxtemplate \"my-template\" not found"),
        "{reason}"
    );
    let name = posted_claim(&log);
    let requests = seen(&log);
    let delete = requests.last().expect("requests");
    assert_eq!(delete.method, "DELETE");
    assert_eq!(delete.uri, format!("{CLAIMS}/{name}?"));
    assert!(
        !requests.iter().any(|s| s.uri.starts_with(PODS)),
        "no pod was looked for"
    );
}

/// A claim deleted while it is waited for (by an operator, or an expiry) ends the wait.
#[tokio::test]
async fn a_claim_deleted_while_waiting_ends_the_wait() {
    let (client, _log) = mock_api(|seen| match seen.method.as_str() {
        "POST" => Reply::Json(201, seen.body.clone()),
        _ => not_found("sandboxclaims.extensions.agents.x-k8s.io \"x\""),
    });
    let err = backend(client)
        .claim_and_attach("abc")
        .await
        .err()
        .expect("deleted");
    let reason = unavailable_reason(&err).expect("a reason");
    assert!(reason.contains("was deleted"), "{reason}");
}

#[tokio::test]
async fn a_forbidden_claim_is_unavailable_with_the_rbac_reason_and_deletes_nothing() {
    let (client, log) = mock_api(|_| {
        Reply::Json(
            403,
            status(
                403,
                "Forbidden",
                "sandboxclaims.extensions.agents.x-k8s.io is forbidden: User \
                 \"system:serviceaccount:sandboxes:codebroker\" cannot create resource \
                 \"sandboxclaims\"",
            ),
        )
    });
    let backend = backend(client);
    let failures = watched(&backend);
    let err = backend
        .claim_and_attach("abc")
        .await
        .err()
        .expect("refused");
    let reason = unavailable_reason(&err).expect("a reason for the client");
    assert!(reason.contains("RBAC"), "{reason}");
    assert!(reason.contains("create the sandbox claim"), "{reason}");
    assert!(
        reason.contains("allowing sandboxclaims (extensions.agents.x-k8s.io)"),
        "{reason}"
    );
    assert!(reason.contains(NS), "{reason}");
    assert_eq!(seen(&log).len(), 1, "nothing to delete");
    assert_eq!(*failures.0.lock().expect("failures"), ["create"]);
}

/// Without agent-sandbox's CRDs the API server answers 404 on the claims' path: said so,
/// on create and on the list at start.
#[tokio::test]
async fn a_cluster_without_agent_sandbox_is_named() {
    let (client, log) = mock_api(|_| {
        Reply::Json(
            404,
            status(
                404,
                "NotFound",
                "the server could not find the requested resource",
            ),
        )
    });
    let backend = backend(client);
    let err = backend
        .claim_and_attach("abc")
        .await
        .err()
        .expect("not installed");
    let reason = unavailable_reason(&err).expect("a reason for the client");
    assert!(
        reason.contains("agent-sandbox is not installed in the cluster"),
        "{reason}"
    );
    assert!(reason.contains("CODEBROKER_K8S_MODE=pods"), "{reason}");
    assert_eq!(seen(&log).len(), 1, "nothing to delete");
    let err = backend.list_own().await.expect_err("not installed");
    let reason = unavailable_reason(&err).expect("a reason");
    assert!(
        reason.contains("list the sandbox claims")
            && reason.contains("agent-sandbox is not installed"),
        "{reason}"
    );
}

/// A missing namespace is still a missing namespace, not a missing agent-sandbox.
#[tokio::test]
async fn a_missing_namespace_is_not_taken_for_a_missing_agent_sandbox() {
    let (client, _log) = mock_api(|_| not_found("namespaces \"sandboxes\""));
    let err = backend(client)
        .claim_and_attach("abc")
        .await
        .err()
        .expect("no namespace");
    let reason = unavailable_reason(&err).expect("a reason");
    assert!(
        reason.contains("namespace sandboxes does not exist"),
        "{reason}"
    );
}

#[tokio::test]
async fn remove_deletes_the_claim_and_a_missing_claim_is_fine() {
    let (client, log) = mock_api(|seen| {
        if seen.uri.contains("/cb-gone") {
            not_found("sandboxclaims.extensions.agents.x-k8s.io \"cb-gone\"")
        } else if seen.uri.contains("/cb-stuck") {
            Reply::Json(500, status(500, "InternalError", "etcd is sad"))
        } else {
            Reply::Json(200, claim("cb-6", json!({})))
        }
    });
    let backend = backend(client);
    let failures = watched(&backend);
    backend.remove("cb-6").await;
    backend.remove("cb-gone").await;
    assert!(failures.0.lock().expect("failures").is_empty());
    backend.remove("cb-stuck").await;
    assert_eq!(*failures.0.lock().expect("failures"), ["remove"]);
    let requests = seen(&log);
    assert_eq!(requests[0].method, "DELETE");
    assert_eq!(requests[0].uri, format!("{CLAIMS}/cb-6?"));
    assert!(
        requests.iter().all(|s| s.uri.starts_with(CLAIMS)),
        "only claims are deleted"
    );
}

/// list_own lists this instance's claims, never pods (a warm pool's are the
/// controller's): bound ones are running, unbound and deleting ones are not.
#[tokio::test]
async fn list_own_selects_claims_by_instance_and_never_lists_pods() {
    let (client, log) = mock_api(|_| {
        let mut deleting = claim("cb-9", json!({"sandbox": {"name": "cb-9"}}));
        deleting["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        let mut unlabelled = claim("cb-10", json!({}));
        unlabelled["metadata"]["labels"] = json!({"codebroker.instance": "t"});
        Reply::Json(
            200,
            json!({
                "apiVersion": "extensions.agents.x-k8s.io/v1alpha1",
                "kind": "SandboxClaimList",
                "metadata": {"resourceVersion": "5"},
                "items": [
                    claim("cb-7", json!({"sandbox": {"Name": "cb-7"}})),
                    claim("cb-8", json!({})),
                    deleting,
                    unlabelled,
                ],
            }),
        )
    });
    let own = backend(client).list_own().await.expect("listed");
    let summary: Vec<(String, Option<String>, bool)> = own
        .into_iter()
        .map(|c| (c.id, c.session, c.running))
        .collect();
    let abc = || Some("abc".to_string());
    assert_eq!(
        summary,
        [
            ("cb-7".to_string(), abc(), true),
            ("cb-8".to_string(), abc(), false),
            ("cb-9".to_string(), abc(), false),
            ("cb-10".to_string(), None, false),
        ]
    );
    let requests = seen(&log);
    assert_eq!(requests.len(), 1);
    assert!(
        requests[0].uri.starts_with(&format!("{CLAIMS}?"))
            && requests[0]
                .uri
                .contains("labelSelector=codebroker.instance=t"),
        "{}",
        requests[0].uri
    );
}

/// Adopting a claim after a restart finds its pod through its Sandbox and attaches there;
/// a claim gone since is an error, and the reconciler then deletes what is left.
#[tokio::test]
async fn adopt_attaches_to_the_claims_pod_through_its_sandbox() {
    let (client, log) = mock_api(|seen| match seen.uri.as_str() {
        uri if uri == format!("{CLAIMS}/cb-7") => {
            Reply::Json(200, claim("cb-7", json!({"sandbox": {"Name": "cb-7"}})))
        }
        uri if uri.starts_with(CLAIMS) => not_found("sandboxclaims"),
        uri if uri.starts_with(SANDBOXES) => Reply::Json(200, sandbox("cb-7", Some("pool-abc"))),
        uri if uri.contains("/attach") => {
            Reply::Json(403, status(403, "Forbidden", "pods/attach is forbidden"))
        }
        _ => Reply::Json(200, running("pool-abc")),
    });
    let backend = backend(client);
    let err = backend.adopt("cb-7").await.err().expect("attach refused");
    assert!(
        unavailable_reason(&err).is_some_and(|r| r.contains("pods/attach")),
        "{err:?}"
    );
    let uris: Vec<String> = seen(&log).into_iter().map(|s| s.uri).collect();
    assert_eq!(uris[0], format!("{CLAIMS}/cb-7"));
    assert_eq!(uris[1], format!("{SANDBOXES}/cb-7"));
    assert_eq!(uris[2], format!("{PODS}/pool-abc"));
    assert!(
        uris[3].starts_with(&format!("{PODS}/pool-abc/attach?")),
        "{}",
        uris[3]
    );

    let err = backend.adopt("cb-gone").await.err().expect("gone");
    let reason = unavailable_reason(&err).expect("a reason");
    assert!(reason.contains("cb-gone was deleted"), "{reason}");
}

/// An out-of-memory end is looked for on the claim's pod, not on a pod of the claim's name.
#[tokio::test]
async fn an_oom_is_looked_for_on_the_claims_pod() {
    let (client, log) = mock_api(|seen| match seen.uri.as_str() {
        uri if uri.starts_with(CLAIMS) => {
            Reply::Json(200, claim("cb-7", json!({"sandbox": {"name": "cb-7"}})))
        }
        uri if uri.starts_with(SANDBOXES) => Reply::Json(200, sandbox("cb-7", Some("pool-abc"))),
        _ => Reply::Json(
            200,
            tests::pod(
                "pool-abc",
                "Failed",
                json!({"terminated": {
                    "exitCode": 137, "reason": "OOMKilled",
                    "finishedAt": "2099-01-01T00:00:00Z",
                }}),
            ),
        ),
    });
    let backend = backend(client);
    assert!(
        backend
            .ended_out_of_memory("cb-7", std::time::SystemTime::now(), false)
            .await
    );
    let uris: Vec<String> = seen(&log).into_iter().map(|s| s.uri).collect();
    assert!(
        uris.iter().any(|u| u == &format!("{PODS}/pool-abc")),
        "{uris:?}"
    );
    assert!(
        !uris.iter().any(|u| u == &format!("{PODS}/cb-7")),
        "{uris:?}"
    );
}
