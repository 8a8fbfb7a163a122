// Over 600 lines: one test per API call and per answer, with the fixtures they share.
//! Request-level tests of every API call the backend makes, against a mocked API server
//! (`tower_test`): what is sent (the pod spec, selectors, deletes, watches) and how each
//! answer is taken (running, failed, evicted, 403, 404, 409, 410 Gone, an unreachable
//! server). The attach's WebSocket is not played here.

use super::*;
use crate::sandbox::SandboxEngine;
use axum::http::{Request, Response};
use http_body_util::BodyExt;
use kube::client::Body;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};

pub(super) const NS: &str = "sandboxes";

/// One request the mocked API server saw.
#[derive(Debug, Clone)]
pub(super) struct Seen {
    pub(super) method: String,
    /// Path and query, percent-decoded.
    pub(super) uri: String,
    pub(super) body: Value,
}

impl Seen {
    pub(super) fn is_watch(&self) -> bool {
        self.uri.contains("watch=true")
    }
}

/// How the mocked API server answers one request.
pub(super) enum Reply {
    /// A status and a JSON body.
    Json(u16, Value),
    /// 200 with these watch events, one per line, then the end of the watch.
    Events(Vec<Value>),
    /// No answer, ever (a server that hangs).
    Hang,
    /// The connection fails.
    Unreachable,
}

/// A client whose API server is `answer`, and what it was sent.
pub(super) fn mock_api(
    mut answer: impl FnMut(&Seen) -> Reply + Send + 'static,
) -> (kube::Client, Arc<Mutex<Vec<Seen>>>) {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    tokio::spawn(async move {
        let mut hung = Vec::new();
        while let Some((request, respond)) = handle.next_request().await {
            let (parts, body) = request.into_parts();
            let bytes = body.collect().await.expect("body").to_bytes();
            let seen = Seen {
                method: parts.method.to_string(),
                uri: percent_decode(&parts.uri.to_string()),
                body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
            };
            let reply = answer(&seen);
            log.lock().expect("log").push(seen);
            let (status, text) = match reply {
                Reply::Json(status, body) => (status, body.to_string()),
                Reply::Events(events) => (
                    200,
                    events.iter().map(|e| format!("{e}\n")).collect::<String>(),
                ),
                Reply::Hang => {
                    hung.push(respond);
                    continue;
                }
                Reply::Unreachable => {
                    respond.send_error(std::io::Error::new(
                        std::io::ErrorKind::ConnectionRefused,
                        "connection refused",
                    ));
                    continue;
                }
            };
            let response = Response::builder()
                .status(status)
                .header("content-type", "application/json")
                .body(Body::from(text.into_bytes()))
                .expect("response");
            respond.send_response(response);
        }
    });
    (kube::Client::new(service, NS), seen)
}

/// `%XX` escapes decoded, so assertions read selectors as written.
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let Ok(b) = u8::from_str_radix(&text[i + 1..i + 3], 16) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub(super) fn config() -> Config {
    let mut config = Config::for_tests("/data".into(), "t");
    config.kubernetes.k8s_ready_timeout_secs = 2;
    config
}

fn backend(client: kube::Client, config: &Config) -> KubernetesBackend {
    KubernetesBackend::with_client(client, NS, config)
}

/// Counts the failed calls a backend reports, by operation.
#[derive(Default)]
pub(super) struct Failures(pub(super) Mutex<Vec<String>>);

impl EngineObserver for Failures {
    fn api_error(&self, op: &str) {
        self.0.lock().expect("failures").push(op.to_string());
    }
}

pub(super) fn watched(backend: &KubernetesBackend) -> Arc<Failures> {
    let failures = Arc::new(Failures::default());
    backend.observe(failures.clone());
    failures
}

/// A pod named `name` in `phase`, its container in `state` (`{"running": {}}`, ...).
pub(super) fn pod(name: &str, phase: &str, state: Value) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "resourceVersion": "7",
            "labels": {"codebroker.instance": "t", "codebroker.session": "s-abc-s"},
        },
        "status": {
            "phase": phase,
            "containerStatuses": [{
                "name": "sandbox",
                "image": "codebroker-sandbox:latest",
                "imageID": "",
                "ready": phase == "Running",
                "restartCount": 0,
                "state": state,
            }],
        },
    })
}

pub(super) fn pending(name: &str) -> Value {
    pod(
        name,
        "Pending",
        json!({"waiting": {"reason": "ContainerCreating"}}),
    )
}

pub(super) fn running(name: &str) -> Value {
    pod(
        name,
        "Running",
        json!({"running": {"startedAt": "2026-01-01T00:00:00Z"}}),
    )
}

fn evicted(name: &str) -> Value {
    let mut pod = pod(
        name,
        "Failed",
        json!({"terminated": {"exitCode": 137, "reason": "Error"}}),
    );
    pod["status"]["reason"] = json!("Evicted");
    pod["status"]["message"] = json!("The node was low on resource: memory.");
    pod
}

pub(super) fn list_of(items: Vec<Value>, version: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "PodList",
        "metadata": {"resourceVersion": version},
        "items": items,
    })
}

pub(super) fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Status",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    })
}

pub(super) fn event(kind: &str, object: Value) -> Value {
    json!({"type": kind, "object": object})
}

pub(super) fn seen(log: &Arc<Mutex<Vec<Seen>>>) -> Vec<Seen> {
    log.lock().expect("log").clone()
}

/// The name in a pod's POSTed body.
fn posted_name(log: &Arc<Mutex<Vec<Seen>>>) -> String {
    seen(log)
        .iter()
        .find(|s| s.method == "POST")
        .and_then(|s| s.body["metadata"]["name"].as_str().map(str::to_string))
        .expect("a pod was posted")
}

pub(super) fn unavailable_reason(err: &anyhow::Error) -> Option<String> {
    err.chain()
        .find_map(|c| c.downcast_ref::<SandboxUnavailable>())
        .map(|u| u.0.clone())
}

/// The pod spec the backend POSTs: one pod in the namespace, locked down as the Docker
/// profile is, labelled for its session and broker. The attach is refused here, so the
/// create fails after the pod runs and the pod is deleted.
#[tokio::test]
async fn create_posts_the_locked_down_pod_then_deletes_it_when_attach_fails() {
    let mut config = config();
    config.kubernetes.k8s_runtime_class = " gvisor ".into();
    let (client, log) = mock_api(|seen| match (seen.method.as_str(), seen.uri.as_str()) {
        ("POST", _) => Reply::Json(201, seen.body.clone()),
        ("GET", uri) if uri.contains("/attach") => {
            Reply::Json(403, status(403, "Forbidden", "pods/attach is forbidden"))
        }
        ("GET", _) => {
            let name = seen.uri.split("metadata.name=").nth(1).unwrap_or("x");
            let name = name.split('&').next().unwrap_or(name);
            Reply::Json(200, list_of(vec![running(name)], "9"))
        }
        ("DELETE", _) => Reply::Json(200, running("x")),
        _ => Reply::Json(500, status(500, "InternalError", "unexpected")),
    });
    let backend = backend(client, &config);
    let err = backend
        .create_pod("abcdefghijklmnopqrstu", Warmup::Nothing)
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
    assert!(
        post.uri
            .starts_with(&format!("/api/v1/namespaces/{NS}/pods?")),
        "{}",
        post.uri
    );
    let pod = &post.body;
    let name = pod["metadata"]["name"].as_str().expect("a name");
    assert!(name.starts_with("cb-"), "{name}");
    let labels = &pod["metadata"]["labels"];
    assert_eq!(labels["codebroker.instance"], "t");
    assert_eq!(labels["codebroker.session"], "s-abcdefghijklmnopqrstu-s");
    assert!(labels["codebroker.created"]
        .as_str()
        .is_some_and(|c| c.parse::<u64>().is_ok()));

    let spec = &pod["spec"];
    assert_eq!(spec["restartPolicy"], "Never");
    assert_eq!(spec["automountServiceAccountToken"], false);
    assert_eq!(spec["enableServiceLinks"], false);
    assert_eq!(spec["hostNetwork"], false);
    assert_eq!(spec["hostPID"], false);
    assert_eq!(spec["hostIPC"], false);
    assert_eq!(spec["runtimeClassName"], "gvisor");
    assert_eq!(spec["terminationGracePeriodSeconds"], 1);
    let pod_security = &spec["securityContext"];
    assert_eq!(pod_security["runAsNonRoot"], true);
    assert_eq!(pod_security["runAsUser"], 10001);
    assert_eq!(pod_security["runAsGroup"], 10001);
    assert_eq!(pod_security["fsGroup"], 10001);
    assert_eq!(pod_security["seccompProfile"]["type"], "RuntimeDefault");

    let containers = spec["containers"].as_array().expect("containers");
    assert_eq!(containers.len(), 1);
    let c = &containers[0];
    assert_eq!(c["name"], "sandbox");
    assert_eq!(c["image"], "codebroker-sandbox:latest");
    assert!(c.get("command").is_none(), "the image's runner is PID 1");
    assert_eq!(c["stdin"], true);
    assert_eq!(c["stdinOnce"], false);
    assert_eq!(c["tty"], false);
    assert_eq!(c["workingDir"], "/mnt/data");
    let security = &c["securityContext"];
    assert_eq!(security["allowPrivilegeEscalation"], false);
    assert_eq!(security["privileged"], false);
    assert_eq!(security["readOnlyRootFilesystem"], true);
    assert_eq!(security["runAsNonRoot"], true);
    assert_eq!(security["runAsUser"], 10001);
    assert_eq!(security["capabilities"]["drop"], json!(["ALL"]));
    assert!(security["capabilities"].get("add").is_none());
    let limits = &c["resources"]["limits"];
    assert_eq!(limits["memory"], "1024Mi");
    assert_eq!(limits["cpu"], "1000m");
    // The 1 GiB quota and 128 MiB for the container's log.
    assert_eq!(limits["ephemeral-storage"], "1152Mi");
    let env: Vec<(String, String)> = c["env"]
        .as_array()
        .expect("env")
        .iter()
        .map(|e| {
            (
                e["name"].as_str().unwrap_or_default().to_string(),
                e["value"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    let env_of = |name: &str| env.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str());
    assert_eq!(env_of("HOME"), Some("/mnt/data"));
    assert_eq!(env_of("CODEBROKER_WORKSPACE_QUOTA"), Some("1073741824"));
    assert_eq!(env_of("CODEBROKER_WORKSPACE_MAX_FILES"), Some("100000"));
    assert_eq!(env_of(sandbox_runner::UNATTENDED_EXIT_ENV), Some("600000"));
    let mounts: Vec<(&str, &str)> = c["volumeMounts"]
        .as_array()
        .expect("mounts")
        .iter()
        .map(|m| {
            (
                m["name"].as_str().unwrap_or_default(),
                m["mountPath"].as_str().unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        mounts,
        [
            ("workspace", "/mnt/data"),
            ("tmp", "/tmp"),
            ("shm", "/dev/shm")
        ]
    );
    let volumes = spec["volumes"].as_array().expect("volumes");
    assert_eq!(volumes[0]["name"], "workspace");
    assert_eq!(volumes[0]["emptyDir"], json!({"sizeLimit": "1024Mi"}));
    assert_eq!(volumes[1]["name"], "tmp");
    assert_eq!(
        volumes[1]["emptyDir"],
        json!({"medium": "Memory", "sizeLimit": "512Mi"})
    );
    assert_eq!(volumes[2]["name"], "shm");
    assert_eq!(
        volumes[2]["emptyDir"],
        json!({"medium": "Memory", "sizeLimit": "64Mi"})
    );

    // Then: the readiness list by name, the attach (stdin and stdout only), the delete.
    let list = &requests[1];
    assert_eq!(list.method, "GET");
    assert!(
        list.uri
            .contains(&format!("fieldSelector=metadata.name={name}")),
        "{}",
        list.uri
    );
    let attach = &requests[2];
    assert!(
        attach
            .uri
            .starts_with(&format!("/api/v1/namespaces/{NS}/pods/{name}/attach?")),
        "{}",
        attach.uri
    );
    for part in ["stdin=true", "stdout=true", "container=sandbox"] {
        assert!(attach.uri.contains(part), "{}", attach.uri);
    }
    for part in ["stderr=true", "tty=true"] {
        assert!(!attach.uri.contains(part), "{}", attach.uri);
    }
    let delete = &requests[3];
    assert_eq!(delete.method, "DELETE");
    assert_eq!(delete.uri, format!("/api/v1/namespaces/{NS}/pods/{name}?"));
    assert_eq!(requests.len(), 4);
}

#[tokio::test]
async fn without_a_quota_or_a_runtime_class_the_spec_says_neither() {
    let mut config = config();
    config.sandbox.workspace_quota = 0;
    config.sandbox.cpus = 0.5;
    config.sandbox.memory_mb = 256;
    let pod = serde_json::to_value(pod_spec::sandbox_pod(
        &config.sandbox,
        &PodSettings {
            runtime_class: None,
            idle_ttl_secs: 0,
        },
        "cb-0",
        "abcdefghijklmnopqrstu",
    ))
    .expect("json");
    let spec = &pod["spec"];
    assert!(spec.get("runtimeClassName").is_none());
    let limits = &spec["containers"][0]["resources"]["limits"];
    assert_eq!(limits["cpu"], "500m");
    assert_eq!(limits["memory"], "256Mi");
    assert!(limits.get("ephemeral-storage").is_none());
    assert_eq!(spec["volumes"][0]["emptyDir"], json!({}));
}

#[tokio::test]
async fn a_forbidden_create_is_unavailable_with_the_rbac_reason_and_deletes_nothing() {
    let (client, log) = mock_api(|_| {
        Reply::Json(
            403,
            status(
                403,
                "Forbidden",
                "pods is forbidden: User \"system:serviceaccount:sandboxes:codebroker\" cannot create resource \"pods\"",
            ),
        )
    });
    let backend = backend(client, &config());
    let failures = watched(&backend);
    let err = backend
        .create_pod("abcdefghijklmnopqrstu", Warmup::Nothing)
        .await
        .err()
        .expect("refused");
    let reason = unavailable_reason(&err).expect("a reason for the client");
    assert!(reason.contains("RBAC"), "{reason}");
    assert!(reason.contains("forbidden"), "{reason}");
    assert!(reason.contains(NS), "{reason}");
    assert_eq!(seen(&log).len(), 1, "nothing to delete");
    assert_eq!(*failures.0.lock().expect("failures"), ["create"]);
}

#[tokio::test]
async fn an_unreachable_api_server_is_unavailable_with_the_reason() {
    let (client, _log) = mock_api(|_| Reply::Unreachable);
    let backend = backend(client, &config());
    let err = backend
        .create_pod("abcdefghijklmnopqrstu", Warmup::Nothing)
        .await
        .err()
        .expect("unreachable");
    let reason = unavailable_reason(&err).expect("a reason for the client");
    assert!(reason.contains("cannot be reached"), "{reason}");
    assert!(!backend.ping().await);
}

#[tokio::test]
async fn a_missing_namespace_is_named() {
    let (client, _log) = mock_api(|_| {
        Reply::Json(
            404,
            status(404, "NotFound", "namespaces \"sandboxes\" not found"),
        )
    });
    let backend = backend(client, &config());
    let err = backend
        .create_pod("abcdefghijklmnopqrstu", Warmup::Nothing)
        .await
        .err()
        .expect("no namespace");
    let reason = unavailable_reason(&err).expect("a reason for the client");
    assert!(
        reason.contains("namespace sandboxes does not exist"),
        "{reason}"
    );
}

#[tokio::test]
async fn a_name_taken_is_an_error_and_the_other_pod_is_left_alone() {
    let (client, log) = mock_api(|_| {
        Reply::Json(
            409,
            status(409, "AlreadyExists", "pods \"cb-0\" already exists"),
        )
    });
    let backend = backend(client, &config());
    let err = backend
        .create_pod("abcdefghijklmnopqrstu", Warmup::Nothing)
        .await
        .err()
        .expect("conflict");
    let text = format!("{err:#}");
    assert!(text.contains("409 AlreadyExists"), "{text}");
    assert!(
        unavailable_reason(&err).is_none(),
        "a fault, not the cluster's state"
    );
    let requests = seen(&log);
    assert!(
        requests.iter().all(|s| s.method != "DELETE"),
        "{requests:?}"
    );
}

#[tokio::test]
async fn the_wait_follows_a_pending_pod_until_it_runs() {
    let (client, log) = mock_api(|seen| {
        if seen.is_watch() {
            Reply::Events(vec![
                event("MODIFIED", pending("cb-1")),
                event(
                    "BOOKMARK",
                    json!({"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": "8"}}),
                ),
                event("MODIFIED", running("cb-1")),
            ])
        } else {
            Reply::Json(200, list_of(vec![pending("cb-1")], "5"))
        }
    });
    let pods: Api<Pod> = Api::namespaced(client, NS);
    let mut last = None;
    wait_running(&pods, "cb-1", Duration::from_secs(10), &mut last)
        .await
        .expect("running");
    assert_eq!(last.as_deref(), Some("ContainerCreating"));
    let requests = seen(&log);
    assert_eq!(requests.len(), 2);
    let watch = &requests[1];
    for part in [
        "watch=true",
        "resourceVersion=5",
        "fieldSelector=metadata.name=cb-1",
        "timeoutSeconds=10",
    ] {
        assert!(watch.uri.contains(part), "{}", watch.uri);
    }
}

#[tokio::test]
async fn a_watch_gone_410_lists_and_watches_again() {
    // Both ways a server says the version is too old: an ERROR event in the stream, and a
    // 410 answer to the watch request itself.
    for in_stream in [true, false] {
        let watches = Arc::new(AtomicUsize::new(0));
        let counter = watches.clone();
        let (client, log) = mock_api(move |seen| {
            if !seen.is_watch() {
                let version = if counter.load(Ordering::SeqCst) == 0 {
                    "5"
                } else {
                    "50"
                };
                return Reply::Json(200, list_of(vec![pending("cb-2")], version));
            }
            if counter.fetch_add(1, Ordering::SeqCst) == 0 {
                let gone = status(410, "Expired", "too old resource version: 5 (40)");
                if in_stream {
                    Reply::Events(vec![event("ERROR", gone)])
                } else {
                    Reply::Json(410, gone)
                }
            } else {
                Reply::Events(vec![event("MODIFIED", running("cb-2"))])
            }
        });
        let pods: Api<Pod> = Api::namespaced(client, NS);
        wait_running(&pods, "cb-2", Duration::from_secs(10), &mut None)
            .await
            .expect("running after the second watch");
        let requests = seen(&log);
        let kinds: Vec<bool> = requests.iter().map(Seen::is_watch).collect();
        assert_eq!(
            kinds,
            [false, true, false, true],
            "list, watch, list, watch"
        );
        assert!(
            requests[3].uri.contains("resourceVersion=50"),
            "{}",
            requests[3].uri
        );
    }
}

#[tokio::test]
async fn a_watch_that_ends_is_followed_by_a_new_list() {
    let lists = Arc::new(AtomicUsize::new(0));
    let counter = lists.clone();
    let (client, _log) = mock_api(move |seen| {
        if seen.is_watch() {
            return Reply::Events(Vec::new());
        }
        if counter.fetch_add(1, Ordering::SeqCst) == 0 {
            Reply::Json(200, list_of(vec![pending("cb-3")], "5"))
        } else {
            Reply::Json(200, list_of(vec![running("cb-3")], "6"))
        }
    });
    let pods: Api<Pod> = Api::namespaced(client, NS);
    wait_running(&pods, "cb-3", Duration::from_secs(10), &mut None)
        .await
        .expect("running at the second list");
    assert_eq!(lists.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_pod_that_fails_ends_the_wait_with_the_clusters_words() {
    let cases = [
        (
            pod(
                "cb-4",
                "Pending",
                json!({"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image \"codebroker-sandbox:latest\""}}),
            ),
            "ImagePullBackOff: Back-off pulling image",
        ),
        (
            pod(
                "cb-4",
                "Failed",
                json!({"terminated": {"exitCode": 1, "reason": "Error"}}),
            ),
            "the sandbox container ended (Error, exit code 1)",
        ),
        (
            evicted("cb-4"),
            "Evicted: The node was low on resource: memory.",
        ),
    ];
    for (pod, expected) in cases {
        let (client, _log) = mock_api(move |_| Reply::Json(200, list_of(vec![pod.clone()], "5")));
        let pods: Api<Pod> = Api::namespaced(client, NS);
        match wait_running(&pods, "cb-4", Duration::from_secs(10), &mut None).await {
            Err(WaitError::Ended(why)) => assert!(why.contains(expected), "{why}"),
            other => panic!("{other:?}"),
        }
    }
}

#[tokio::test]
async fn a_pod_deleted_while_starting_ends_the_wait() {
    let (client, _log) = mock_api(|seen| {
        if seen.is_watch() {
            Reply::Events(vec![event("DELETED", pending("cb-5"))])
        } else {
            Reply::Json(200, list_of(vec![pending("cb-5")], "5"))
        }
    });
    let pods: Api<Pod> = Api::namespaced(client, NS);
    match wait_running(&pods, "cb-5", Duration::from_secs(10), &mut None).await {
        Err(WaitError::Ended(why)) => assert!(why.contains("deleted"), "{why}"),
        other => panic!("{other:?}"),
    }
    let (client, _log) = mock_api(|_| Reply::Json(200, list_of(Vec::new(), "5")));
    let pods: Api<Pod> = Api::namespaced(client, NS);
    match wait_running(&pods, "cb-5", Duration::from_secs(10), &mut None).await {
        Err(WaitError::Ended(why)) => assert!(why.contains("gone"), "{why}"),
        other => panic!("{other:?}"),
    }
}

/// A pod that never runs within CODEBROKER_K8S_READY_TIMEOUT_SECS is deleted, and the
/// error says how long was waited and the last reason seen.
#[tokio::test]
async fn a_pod_not_running_in_time_is_deleted_and_reported() {
    let (client, log) = mock_api(|seen| match seen.method.as_str() {
        "POST" => Reply::Json(201, seen.body.clone()),
        "DELETE" => Reply::Json(200, pending("x")),
        _ if seen.is_watch() => Reply::Hang,
        _ => {
            let mut pod = pending("x");
            pod["status"]["containerStatuses"] = json!([]);
            pod["status"]["conditions"] = json!([{
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/3 nodes are available: 3 Insufficient memory.",
            }]);
            Reply::Json(200, list_of(vec![pod], "5"))
        }
    });
    let mut config = config();
    config.kubernetes.k8s_ready_timeout_secs = 1;
    let backend = backend(client, &config);
    let err = backend
        .create_pod("abcdefghijklmnopqrstu", Warmup::Nothing)
        .await
        .err()
        .expect("not running in time");
    let reason = unavailable_reason(&err).expect("a reason for the client");
    assert!(reason.contains("not running within 1 s"), "{reason}");
    assert!(
        reason.contains("Unschedulable: 0/3 nodes are available"),
        "{reason}"
    );
    let name = posted_name(&log);
    let requests = seen(&log);
    let delete = requests.last().expect("requests");
    assert_eq!(delete.method, "DELETE");
    assert!(delete.uri.contains(&name), "{}", delete.uri);
}

#[tokio::test]
async fn a_pod_that_cannot_start_is_deleted_and_reported() {
    let (client, log) = mock_api(|seen| match seen.method.as_str() {
        "POST" => Reply::Json(201, seen.body.clone()),
        "DELETE" => Reply::Json(200, pending("x")),
        _ => Reply::Json(
            200,
            list_of(
                vec![pod(
                    "x",
                    "Pending",
                    json!({"waiting": {"reason": "ErrImagePull", "message": "not found"}}),
                )],
                "5",
            ),
        ),
    });
    let backend = backend(client, &config());
    let err = backend
        .create_pod("abcdefghijklmnopqrstu", Warmup::Nothing)
        .await
        .err()
        .expect("cannot start");
    let reason = unavailable_reason(&err).expect("a reason for the client");
    assert!(reason.contains("ErrImagePull: not found"), "{reason}");
    assert_eq!(
        seen(&log).last().map(|s| s.method.clone()).as_deref(),
        Some("DELETE")
    );
}

#[tokio::test]
async fn remove_deletes_the_pod_and_a_missing_pod_is_fine() {
    let (client, log) = mock_api(|seen| {
        if seen.uri.contains("/cb-gone") {
            Reply::Json(404, status(404, "NotFound", "pods \"cb-gone\" not found"))
        } else if seen.uri.contains("/cb-stuck") {
            Reply::Json(500, status(500, "InternalError", "etcd is sad"))
        } else {
            Reply::Json(200, running("cb-6"))
        }
    });
    let backend = backend(client, &config());
    let failures = watched(&backend);
    backend.remove("cb-6").await;
    backend.remove("cb-gone").await;
    assert!(failures.0.lock().expect("failures").is_empty());
    backend.remove("cb-stuck").await;
    assert_eq!(*failures.0.lock().expect("failures"), ["remove"]);
    let requests = seen(&log);
    assert_eq!(requests[0].method, "DELETE");
    assert_eq!(
        requests[0].uri,
        format!("/api/v1/namespaces/{NS}/pods/cb-6?")
    );
}

#[tokio::test]
async fn list_own_selects_by_instance_and_reads_sessions_and_states() {
    let (client, log) = mock_api(|_| {
        let mut unlabelled = pending("cb-9");
        unlabelled["metadata"]["labels"] = json!({"codebroker.instance": "t"});
        Reply::Json(
            200,
            list_of(vec![running("cb-7"), evicted("cb-8"), unlabelled], "5"),
        )
    });
    let backend = backend(client, &config());
    let own = backend.list_own().await.expect("listed");
    let summary: Vec<(String, Option<String>, bool)> = own
        .into_iter()
        .map(|c| (c.id, c.session, c.running))
        .collect();
    assert_eq!(
        summary,
        [
            ("cb-7".to_string(), Some("abc".to_string()), true),
            // Evicted: ended, so the reconciler deletes it and the session gets a new pod.
            ("cb-8".to_string(), Some("abc".to_string()), false),
            ("cb-9".to_string(), None, false),
        ]
    );
    let list = &seen(&log)[0];
    assert_eq!(list.method, "GET");
    assert!(
        list.uri.contains("labelSelector=codebroker.instance=t"),
        "{}",
        list.uri
    );
}

#[tokio::test]
async fn list_own_refused_is_an_error_with_the_reason() {
    let (client, _log) =
        mock_api(|_| Reply::Json(403, status(403, "Forbidden", "pods is forbidden")));
    let backend = backend(client, &config());
    let err = backend.list_own().await.expect_err("refused");
    let reason = unavailable_reason(&err).expect("a reason");
    assert!(
        reason.contains("list the sandbox pods") && reason.contains("RBAC"),
        "{reason}"
    );
}

#[tokio::test]
async fn ping_is_one_small_list() {
    let (client, log) = mock_api(|seen| {
        if seen.uri.contains("limit=1") {
            Reply::Json(200, list_of(Vec::new(), "5"))
        } else {
            Reply::Json(400, status(400, "BadRequest", "no limit"))
        }
    });
    let backend = backend(client, &config());
    assert!(backend.ping().await);
    assert_eq!(seen(&log).len(), 1);
    let (client, _log) =
        mock_api(|_| Reply::Json(403, status(403, "Forbidden", "pods is forbidden")));
    assert!(!self::backend(client, &config()).ping().await);
}

#[tokio::test]
async fn an_oom_killed_container_is_told_from_other_ends() {
    let now = SystemTime::now();
    let stamp = |t: SystemTime| {
        let secs = t
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        // RFC 3339 in UTC, as the API server writes it.
        let dt = k8s_openapi::chrono::DateTime::from_timestamp(secs as i64, 0).expect("time");
        dt.to_rfc3339_opts(k8s_openapi::chrono::SecondsFormat::Secs, true)
    };
    let killed_at = |t: SystemTime| {
        pod(
            "cb-10",
            "Failed",
            json!({"terminated": {"exitCode": 137, "reason": "OOMKilled", "finishedAt": stamp(t)}}),
        )
    };
    let cases = [
        (killed_at(now), true),
        // Killed before the exec began: not this exec's end.
        (killed_at(now - Duration::from_secs(3600)), false),
        (
            pod(
                "cb-10",
                "Failed",
                json!({"terminated": {"exitCode": 1, "reason": "Error"}}),
            ),
            false,
        ),
        (evicted("cb-10"), false),
    ];
    for (pod, expected) in cases {
        let (client, log) = mock_api(move |_| Reply::Json(200, pod.clone()));
        let backend = backend(client, &config());
        assert_eq!(
            backend.ended_out_of_memory("cb-10", now, false).await,
            expected
        );
        let get = &seen(&log)[0];
        assert_eq!(get.method, "GET");
        assert_eq!(get.uri, format!("/api/v1/namespaces/{NS}/pods/cb-10"));
    }
    let (client, _log) =
        mock_api(|_| Reply::Json(404, status(404, "NotFound", "pods \"cb-10\" not found")));
    assert!(
        !backend(client, &config())
            .ended_out_of_memory("cb-10", now, false)
            .await
    );
    // OOMKilled is sticky: once the runner reported a process killed for memory, a
    // later end of the pod (killed, deleted, its node lost) is not memory's.
    let killed = killed_at(now);
    let (client, _log) = mock_api(move |_| Reply::Json(200, killed.clone()));
    assert!(
        !backend(client, &config())
            .ended_out_of_memory("cb-10", now, true)
            .await
    );
}

#[tokio::test]
async fn an_image_file_is_read_by_a_pod_that_cats_it() {
    let (client, log) = mock_api(|seen| match seen.method.as_str() {
        "POST" => Reply::Json(201, seen.body.clone()),
        "DELETE" => Reply::Json(200, running("x")),
        _ if seen.uri.contains("/log") => Reply::Json(200, json!({"python": ["numpy"]})),
        _ => Reply::Json(
            200,
            pod("x", "Succeeded", json!({"terminated": {"exitCode": 0}})),
        ),
    });
    let backend = backend(client, &config());
    let bytes = backend
        .read_image_file("/opt/codebroker/libraries.json")
        .await
        .expect("read");
    let value: Value = serde_json::from_slice(&bytes).expect("json");
    assert_eq!(value, json!({"python": ["numpy"]}));
    let requests = seen(&log);
    let container = &requests[0].body["spec"]["containers"][0];
    assert_eq!(
        container["command"],
        json!(["cat", "--", "/opt/codebroker/libraries.json"])
    );
    assert_eq!(container["securityContext"]["runAsNonRoot"], true);
    assert!(requests[0].body["spec"].get("volumes").is_none());
    let name = posted_name(&log);
    assert!(requests
        .iter()
        .any(|s| s.uri.contains(&format!("/pods/{name}/log"))));
    assert_eq!(requests.last().map(|s| s.method.as_str()), Some("DELETE"));
}

#[tokio::test]
async fn the_cpu_weight_is_never_set_and_the_image_is_the_kubelets_business() {
    let (client, log) = mock_api(|_| Reply::Json(500, status(500, "InternalError", "no")));
    let backend = backend(client, &config());
    assert!(!backend.set_cpu_weight("cb-11", CpuWeight::Low).await);
    assert!(backend.image_present().await);
    assert_eq!(backend.host_memory(), None);
    assert!(!backend.hands_over_pooled());
    assert!(seen(&log).is_empty(), "no API call");
}

#[tokio::test]
async fn a_pod_security_refusal_is_named_as_such_not_as_rbac() {
    let (client, _log) = mock_api(|_| {
        Reply::Json(
            403,
            status(
                403,
                "Forbidden",
                "pods \"cb-0\" is forbidden: violates PodSecurity \"restricted:latest\": \
                 allowPrivilegeEscalation != false",
            ),
        )
    });
    let backend = backend(client, &config());
    let err = backend
        .create_pod("abcdefghijklmnopqrstu", Warmup::Nothing)
        .await
        .err()
        .expect("refused");
    let reason = unavailable_reason(&err).expect("a reason for the client");
    assert!(reason.contains("Pod Security admission"), "{reason}");
    assert!(reason.contains("allowPrivilegeEscalation"), "{reason}");
    assert!(!reason.contains("RBAC"), "{reason}");
}

#[tokio::test(start_paused = true)]
async fn an_api_server_that_never_answers_is_given_up_on() {
    let (client, log) = mock_api(|_| Reply::Hang);
    let backend = backend(client, &config());
    let err = backend
        .create_pod("abcdefghijklmnopqrstu", Warmup::Nothing)
        .await
        .err()
        .expect("given up");
    let reason = unavailable_reason(&err).expect("a reason for the client");
    assert!(reason.contains("no answer within 30 s"), "{reason}");
    assert_eq!(seen(&log).len(), 1, "only the create was sent");
    // /health's probe gives up sooner, and the removal and the list give up too.
    assert!(!backend.ping().await);
    backend.remove_pod("cb-hung").await;
    assert!(backend.list_own().await.is_err());
}
