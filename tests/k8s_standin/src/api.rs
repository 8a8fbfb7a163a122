//! The HTTP side: the pod routes of the core v1 API as the API server answers them (JSON
//! objects and lists, `Status` objects for errors, watch events one JSON object a line,
//! label and field selectors), `pods/log`, and `pods/attach` (in `attach`).

use crate::attach;
use crate::cluster::{ApiError, Change, Cluster};
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use bollard::container::LogOutput;
use bollard::query_parameters::LogsOptions;
use futures::StreamExt;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::broadcast::error::RecvError;

/// The longest a watch stays open when the client names no timeout.
const MAX_WATCH: Duration = Duration::from_secs(1800);

pub(crate) fn router(cluster: Arc<Cluster>) -> Router {
    Router::new()
        .route(
            "/api/v1/namespaces/{ns}/pods",
            get(list_or_watch).post(create),
        )
        .route(
            "/api/v1/namespaces/{ns}/pods/{name}",
            get(get_pod).delete(delete_pod),
        )
        .route("/api/v1/namespaces/{ns}/pods/{name}/log", get(log))
        .route(
            "/api/v1/namespaces/{ns}/pods/{name}/attach",
            get(attach).post(attach),
        )
        .fallback(|| async {
            ApiError {
                code: 404,
                reason: "NotFound",
                message: "the server could not find the requested resource".to_string(),
                name: None,
            }
        })
        .with_state(cluster)
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let code = StatusCode::from_u16(self.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (code, axum::Json(self.status())).into_response()
    }
}

fn json_answer(code: StatusCode, body: &Value) -> Response {
    (code, axum::Json(body)).into_response()
}

async fn create(
    State(cluster): State<Arc<Cluster>>,
    Path(ns): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let pod: Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("the body is not a Pod: {e}")))?;
    let pod = cluster.create(&ns, pod)?;
    Ok(json_answer(StatusCode::CREATED, &pod))
}

async fn get_pod(
    State(cluster): State<Arc<Cluster>>,
    Path((ns, name)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    Ok(json_answer(StatusCode::OK, &cluster.get(&ns, &name)?))
}

async fn delete_pod(
    State(cluster): State<Arc<Cluster>>,
    Path((ns, name)): Path<(String, String)>,
    Query(query): Query<HashMap<String, String>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    // DeleteOptions come in the body (kube) or the query (kubectl).
    let options: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let grace = options["gracePeriodSeconds"]
        .as_i64()
        .or_else(|| query.get("gracePeriodSeconds").and_then(|g| g.parse().ok()));
    Ok(json_answer(
        StatusCode::OK,
        &cluster.delete(&ns, &name, grace)?,
    ))
}

/// One requirement of a label selector.
#[derive(Debug, PartialEq)]
enum LabelRequirement {
    Equals(String, String),
    NotEquals(String, String),
    Exists(String),
    Absent(String),
}

/// A label selector of equality and existence requirements (`a=b,c!=d,e,!f`); set-based
/// ones (`in`, `notin`) are refused, as the backend never sends them.
fn parse_label_selector(selector: &str) -> Result<Vec<LabelRequirement>, ApiError> {
    let mut requirements = Vec::new();
    for part in selector.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let requirement = if let Some((k, v)) = part.split_once("!=") {
            LabelRequirement::NotEquals(k.trim().into(), v.trim().into())
        } else if let Some((k, v)) = part.split_once("==").or_else(|| part.split_once('=')) {
            LabelRequirement::Equals(k.trim().into(), v.trim().into())
        } else if part.contains(' ') || part.contains('(') {
            return Err(ApiError::bad_request(format!(
                "unable to parse requirement: the stand-in takes no set-based selector: {part}"
            )));
        } else if let Some(k) = part.strip_prefix('!') {
            LabelRequirement::Absent(k.trim().into())
        } else {
            LabelRequirement::Exists(part.into())
        };
        requirements.push(requirement);
    }
    Ok(requirements)
}

fn labels_match(pod: &Value, requirements: &[LabelRequirement]) -> bool {
    let labels = &pod["metadata"]["labels"];
    requirements.iter().all(|r| match r {
        LabelRequirement::Equals(k, v) => labels[k] == v.as_str(),
        LabelRequirement::NotEquals(k, v) => labels[k] != v.as_str(),
        LabelRequirement::Exists(k) => !labels[k].is_null(),
        LabelRequirement::Absent(k) => labels[k].is_null(),
    })
}

/// A field selector: `metadata.name`, `metadata.namespace`, `status.phase` and
/// `spec.nodeName` with `=`, `==` or `!=`, as the API server allows for pods.
fn parse_field_selector(selector: &str) -> Result<Vec<(String, bool, String)>, ApiError> {
    let mut requirements = Vec::new();
    for part in selector.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (field, equal, value) = if let Some((f, v)) = part.split_once("!=") {
            (f, false, v)
        } else if let Some((f, v)) = part.split_once("==").or_else(|| part.split_once('=')) {
            (f, true, v)
        } else {
            return Err(ApiError::bad_request(format!(
                "invalid selector: '{selector}'; can't understand '{part}'"
            )));
        };
        let field = field.trim();
        if ![
            "metadata.name",
            "metadata.namespace",
            "status.phase",
            "spec.nodeName",
        ]
        .contains(&field)
        {
            return Err(ApiError::bad_request(format!(
                "field label not supported: {field}"
            )));
        }
        requirements.push((field.to_string(), equal, value.trim().to_string()));
    }
    Ok(requirements)
}

fn fields_match(pod: &Value, requirements: &[(String, bool, String)]) -> bool {
    requirements.iter().all(|(field, equal, value)| {
        let mut at = pod;
        for part in field.split('.') {
            at = &at[part];
        }
        (at.as_str().unwrap_or_default() == value) == *equal
    })
}

/// What a list or watch selects, from its query.
fn selection(
    query: &HashMap<String, String>,
) -> Result<impl Fn(&Value) -> bool + Send + Sync + 'static, ApiError> {
    let labels = parse_label_selector(query.get("labelSelector").map_or("", String::as_str))?;
    let fields = parse_field_selector(query.get("fieldSelector").map_or("", String::as_str))?;
    Ok(move |pod: &Value| labels_match(pod, &labels) && fields_match(pod, &fields))
}

async fn list_or_watch(
    State(cluster): State<Arc<Cluster>>,
    Path(ns): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let keep = selection(&query)?;
    if matches!(query.get("watch").map(String::as_str), Some("true" | "1")) {
        return watch(cluster, ns, query, keep);
    }
    let (version, mut pods) = cluster.list(&ns, keep)?;
    // `limit` and `continue` page through the list, the token the offset.
    let offset: usize = query
        .get("continue")
        .map(|c| {
            c.parse().map_err(|_| ApiError {
                code: 410,
                reason: "Expired",
                message: "the provided continue parameter is too old".to_string(),
                name: None,
            })
        })
        .transpose()?
        .unwrap_or(0);
    pods = pods.into_iter().skip(offset).collect();
    let mut meta = json!({"resourceVersion": version.to_string()});
    if let Some(limit) = query.get("limit").and_then(|l| l.parse::<usize>().ok()) {
        if limit > 0 && pods.len() > limit {
            meta["continue"] = json!((offset + limit).to_string());
            meta["remainingItemCount"] = json!(pods.len() - limit);
            pods.truncate(limit);
        }
    }
    // `list_metadata` asks for metadata only, in its own list kind.
    let accept = headers
        .get(header::ACCEPT)
        .and_then(|a| a.to_str().ok())
        .unwrap_or_default();
    let list = if accept.contains("as=PartialObjectMetadataList") {
        let items: Vec<Value> = pods
            .into_iter()
            .map(|p| {
                json!({"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                            "metadata": p["metadata"]})
            })
            .collect();
        json!({"kind": "PartialObjectMetadataList", "apiVersion": "meta.k8s.io/v1",
               "metadata": meta, "items": items})
    } else {
        json!({"kind": "PodList", "apiVersion": "v1", "metadata": meta, "items": pods})
    };
    Ok(json_answer(StatusCode::OK, &list))
}

/// One line of a watch.
fn event_line(kind: &str, object: &Value) -> Bytes {
    let mut line = serde_json::to_vec(&json!({"type": kind, "object": object})).unwrap_or_default();
    line.push(b'\n');
    Bytes::from(line)
}

/// The ERROR event of a version too old to watch from.
fn gone(version: u64) -> Bytes {
    let status = ApiError {
        code: 410,
        reason: "Expired",
        message: format!("too old resource version: {version}"),
        name: None,
    };
    event_line("ERROR", &status.status())
}

fn watch(
    cluster: Arc<Cluster>,
    ns: String,
    query: HashMap<String, String>,
    keep: impl Fn(&Value) -> bool + Send + Sync + 'static,
) -> Result<Response, ApiError> {
    let version: u64 = match query.get("resourceVersion").map(String::as_str) {
        None | Some("") | Some("0") => 0,
        Some(v) => v
            .parse()
            .map_err(|_| ApiError::bad_request(format!("invalid resource version: {v}")))?,
    };
    let lasts = query
        .get("timeoutSeconds")
        .and_then(|t| t.parse().ok())
        .map_or(MAX_WATCH, Duration::from_secs)
        .min(MAX_WATCH);
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    match cluster.watch(&ns, version)? {
        None => {
            let _ = tx.try_send(Ok(gone(version)));
        }
        Some((backlog, mut changes)) => {
            tokio::spawn(async move {
                let deadline = tokio::time::Instant::now() + lasts;
                let mut seen = version;
                let send = |change: &Change| {
                    (change.namespace == ns && keep(&change.pod))
                        .then(|| event_line(change.kind, &change.pod))
                };
                for change in &backlog {
                    seen = seen.max(change.version);
                    if let Some(line) = send(change) {
                        if tx.send(Ok(line)).await.is_err() {
                            return;
                        }
                    }
                }
                loop {
                    let change = tokio::select! {
                        change = changes.recv() => change,
                        _ = tokio::time::sleep_until(deadline) => return,
                        _ = tx.closed() => return,
                    };
                    match change {
                        // Already sent from the backlog.
                        Ok(change) if change.version <= seen => {}
                        Ok(change) => {
                            seen = change.version;
                            if let Some(line) = send(&change) {
                                if tx.send(Ok(line)).await.is_err() {
                                    return;
                                }
                            }
                        }
                        // Too slow a reader: its version is gone, as the API server says.
                        Err(RecvError::Lagged(_)) => {
                            let _ = tx.send(Ok(gone(seen))).await;
                            return;
                        }
                        Err(RecvError::Closed) => return,
                    }
                }
            });
        }
    }
    let body = Body::from_stream(tokio_stream_of(rx));
    Ok(Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(body)
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response()))
}

/// A stream of what comes through `rx`.
fn tokio_stream_of<T: Send + 'static>(
    rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures::Stream<Item = T> + Send {
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|t| (t, rx)) })
}

/// The pod's container name in `query` (`container=`), checked against the pod's.
fn check_container(pod: &Value, query: &HashMap<String, String>) -> Result<(), ApiError> {
    let own = pod["spec"]["containers"][0]["name"]
        .as_str()
        .unwrap_or_default();
    match query.get("container") {
        Some(asked) if asked != own => Err(ApiError::bad_request(format!(
            "container {asked} is not valid for pod {}",
            pod["metadata"]["name"].as_str().unwrap_or_default()
        ))),
        _ => Ok(()),
    }
}

async fn log(
    State(cluster): State<Arc<Cluster>>,
    Path((ns, name)): Path<(String, String)>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Response, ApiError> {
    let (pod, id) = cluster.container_of(&ns, &name)?;
    check_container(&pod, &query)?;
    let options = LogsOptions {
        stdout: true,
        stderr: true,
        tail: "all".to_string(),
        ..Default::default()
    };
    let mut logs = cluster.docker().logs(&id, Some(options));
    let mut text = Vec::new();
    while let Some(chunk) = logs.next().await {
        match chunk {
            Ok(LogOutput::StdOut { message } | LogOutput::StdErr { message })
            | Ok(LogOutput::Console { message }) => text.extend_from_slice(&message),
            Ok(LogOutput::StdIn { .. }) => {}
            Err(err) => {
                return Err(ApiError {
                    code: 500,
                    reason: "InternalError",
                    message: format!("cannot read the log of pod {name}: {err}"),
                    name: Some(name),
                })
            }
        }
    }
    Ok((StatusCode::OK, [(header::CONTENT_TYPE, "text/plain")], text).into_response())
}

async fn attach(
    State(cluster): State<Arc<Cluster>>,
    Path((ns, name)): Path<(String, String)>,
    Query(query): Query<HashMap<String, String>>,
    request: Request,
) -> Result<Response, ApiError> {
    let (pod, id) = cluster.container_of(&ns, &name)?;
    check_container(&pod, &query)?;
    if pod["status"]["phase"] != "Running" {
        return Err(ApiError::bad_request(format!(
            "cannot attach to a container in a completed pod; current phase is {}",
            pod["status"]["phase"].as_str().unwrap_or("Pending")
        )));
    }
    let flag = |name: &str| matches!(query.get(name).map(String::as_str), Some("true" | "1"));
    let streams = attach::Streams {
        stdin: flag("stdin"),
        stdout: flag("stdout"),
        stderr: flag("stderr"),
    };
    if !(streams.stdin || streams.stdout || streams.stderr) {
        return Err(ApiError::bad_request(
            "you must specify at least 1 of stdin, stdout, stderr",
        ));
    }
    attach::upgrade(cluster, id, streams, request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_selectors_select_as_the_api_server_does() {
        let pod = json!({"metadata": {"labels": {"a": "1", "b": "2"}}});
        let select = |s: &str| labels_match(&pod, &parse_label_selector(s).expect("parses"));
        assert!(select("a=1"));
        assert!(select("a==1,b"));
        assert!(select("a=1,!c"));
        assert!(select("b!=3"));
        assert!(!select("a=2"));
        assert!(!select("c"));
        assert!(select(""));
        assert_eq!(
            parse_label_selector("a in (1,2)").expect_err("set").code,
            400
        );
    }

    #[test]
    fn field_selectors_take_the_pod_fields_only() {
        let pod = json!({"metadata": {"name": "cb-1"}, "status": {"phase": "Running"}});
        let select = |s: &str| fields_match(&pod, &parse_field_selector(s).expect("parses"));
        assert!(select("metadata.name=cb-1"));
        assert!(select("status.phase!=Pending"));
        assert!(!select("metadata.name=cb-2"));
        assert_eq!(
            parse_field_selector("spec.image=x")
                .expect_err("field")
                .code,
            400
        );
    }

    #[test]
    fn errors_are_status_objects() {
        let status = ApiError::not_found("cb-1").status();
        assert_eq!(status["kind"], "Status");
        assert_eq!(status["code"], 404);
        assert_eq!(status["reason"], "NotFound");
        assert_eq!(status["message"], "pods \"cb-1\" not found");
        assert_eq!(status["details"]["name"], "cb-1");
    }
}
