//! The pods of the stand-in: stored as the JSON the API server would serve, each with a
//! resource version from one counter, every change kept in a bounded history that
//! watches replay from; and the kubelet's part, which runs each pod as a Docker
//! container and writes what becomes of it into the pod's status.

use crate::container::{container_body, disk_volumes, Unrunnable, SERVER_LABEL};
use bollard::query_parameters::{
    InspectContainerOptions, ListContainersOptions, RemoveContainerOptions, StopContainerOptions,
    WaitContainerOptions,
};
use bollard::Docker;
use futures::StreamExt;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::broadcast;

/// Changes kept for watches to start from; older versions get 410 Gone.
const HISTORY: usize = 4096;

/// How often an ended pod's container is looked for, to forget the pod once it is gone.
const GONE_POLL: std::time::Duration = std::time::Duration::from_secs(1);

/// The grace period of a pod that gives none (the API server's default).
const DEFAULT_GRACE_SECS: i64 = 30;

/// An error the API server answers with: the HTTP code, the `Status` reason, the message.
#[derive(Debug, Clone)]
pub(crate) struct ApiError {
    pub(crate) code: u16,
    pub(crate) reason: &'static str,
    pub(crate) message: String,
    /// The pod named, for the Status's `details`.
    pub(crate) name: Option<String>,
}

impl ApiError {
    pub(crate) fn not_found(name: &str) -> ApiError {
        ApiError {
            code: 404,
            reason: "NotFound",
            message: format!("pods \"{name}\" not found"),
            name: Some(name.to_string()),
        }
    }

    pub(crate) fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError {
            code: 400,
            reason: "BadRequest",
            message: message.into(),
            name: None,
        }
    }

    /// The `Status` object the API server sends for it.
    pub(crate) fn status(&self) -> Value {
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let Some(name) = &self.name {
            status["details"] = json!({"name": name, "kind": "pods"});
        }
        status
    }
}

/// One change to a pod, as a watch sends it.
#[derive(Debug, Clone)]
pub(crate) struct Change {
    /// The resource version the change made.
    pub(crate) version: u64,
    /// `ADDED`, `MODIFIED` or `DELETED`.
    pub(crate) kind: &'static str,
    /// The pod's namespace, which watches are scoped to.
    pub(crate) namespace: String,
    /// The pod after the change (before it, for `DELETED`).
    pub(crate) pod: Value,
}

/// Where a watch starts: the changes it must send first, and the receiver of the rest.
pub(crate) type WatchStart = (Vec<Change>, broadcast::Receiver<Change>);

/// A stored pod and the container that runs it.
struct StoredPod {
    /// The pod as it is served.
    pod: Value,
    /// Its Docker container, once created.
    container: Option<String>,
}

#[derive(Default)]
struct Store {
    /// The latest resource version handed out.
    version: u64,
    /// Pods by namespace and name.
    pods: BTreeMap<(String, String), StoredPod>,
    /// The latest changes, oldest first.
    history: VecDeque<Change>,
}

/// The pods, and the Docker engine that runs them.
pub(crate) struct Cluster {
    /// The engine the pods' containers run on.
    docker: Docker,
    /// This stand-in's id, the value of its containers' server label.
    pub(crate) server: String,
    /// The namespaces that exist: pods elsewhere get 404 as from a missing namespace.
    namespaces: Vec<String>,
    /// The pids limit the kubelet gives each pod (its `podPidsLimit`).
    pids_limit: i64,
    /// Where pods' disk `emptyDir`s are, one directory per pod uid; removed at exit.
    volumes_dir: PathBuf,
    /// Pods, versions and history; never held across an await.
    store: Mutex<Store>,
    /// Every change, to the watches that are open.
    changes: broadcast::Sender<Change>,
    /// Makes pod uids.
    next_uid: AtomicU64,
}

/// Now, as Kubernetes writes times (whole seconds, UTC).
pub(crate) fn now() -> String {
    let format =
        time::macros::format_description!("[year]-[month]-[day]T[hour]:[minute]:[second]Z");
    time::OffsetDateTime::now_utc()
        .format(&format)
        .unwrap_or_default()
}

/// A Docker time (RFC 3339 with nanoseconds) as Kubernetes writes it.
fn docker_time(t: Option<&str>) -> Value {
    match t {
        Some(t) if t.len() >= 19 && !t.starts_with("0001") => json!(format!("{}Z", &t[..19])),
        _ => Value::Null,
    }
}

impl Cluster {
    pub(crate) fn new(
        docker: Docker,
        server: String,
        namespaces: Vec<String>,
        pids_limit: i64,
        volumes_dir: PathBuf,
    ) -> Arc<Cluster> {
        Arc::new(Cluster {
            docker,
            server,
            namespaces,
            pids_limit,
            volumes_dir,
            store: Mutex::new(Store::default()),
            changes: broadcast::channel(HISTORY).0,
            next_uid: AtomicU64::new(1),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// 404 for a namespace that does not exist, as the API server says it.
    pub(crate) fn check_namespace(&self, namespace: &str) -> Result<(), ApiError> {
        if self.namespaces.iter().any(|n| n == namespace) {
            return Ok(());
        }
        Err(ApiError {
            code: 404,
            reason: "NotFound",
            message: format!("namespaces \"{namespace}\" not found"),
            name: None,
        })
    }

    /// Records a change to `pod` (stamping its new resource version) and tells watches.
    fn commit(&self, store: &mut Store, kind: &'static str, namespace: &str, pod: &mut Value) {
        store.version += 1;
        pod["metadata"]["resourceVersion"] = json!(store.version.to_string());
        let change = Change {
            version: store.version,
            kind,
            namespace: namespace.to_string(),
            pod: pod.clone(),
        };
        if store.history.len() == HISTORY {
            store.history.pop_front();
        }
        store.history.push_back(change.clone());
        // No receiver is fine: no watch is open.
        let _ = self.changes.send(change);
    }

    /// Changes `name`'s stored pod with `edit` (when it is still the pod of `uid`).
    fn update(&self, namespace: &str, name: &str, uid: &str, edit: impl FnOnce(&mut StoredPod)) {
        let mut store = self.lock();
        let key = (namespace.to_string(), name.to_string());
        let Some(mut stored) = store.pods.remove(&key) else {
            return;
        };
        if stored.pod["metadata"]["uid"] != uid {
            store.pods.insert(key, stored);
            return;
        }
        edit(&mut stored);
        self.commit(&mut store, "MODIFIED", namespace, &mut stored.pod);
        store.pods.insert(key, stored);
    }

    /// Forgets the pod of `uid` (its container is gone) and says it was deleted.
    fn forget(&self, namespace: &str, name: &str, uid: &str) {
        let mut store = self.lock();
        let key = (namespace.to_string(), name.to_string());
        if store
            .pods
            .get(&key)
            .is_some_and(|s| s.pod["metadata"]["uid"] == uid)
        {
            if let Some(mut stored) = store.pods.remove(&key) {
                self.commit(&mut store, "DELETED", namespace, &mut stored.pod);
            }
        }
        let _ = std::fs::remove_dir_all(self.volumes_dir.join(uid));
    }

    /// Makes the pod's disk `emptyDir`s: empty, world-writable, and with an fsGroup, of
    /// that group and setgid, as the kubelet makes them.
    fn make_volumes(&self, pod: &Value, uid: &str) -> std::io::Result<PathBuf> {
        use std::os::unix::fs::PermissionsExt;
        let dir = self.volumes_dir.join(uid);
        let fs_group = pod["spec"]["securityContext"]["fsGroup"]
            .as_u64()
            .and_then(|g| u32::try_from(g).ok());
        for name in disk_volumes(pod) {
            let volume = dir.join(&name);
            std::fs::create_dir_all(&volume)?;
            let mut mode = 0o777;
            // Only a stand-in run as root can give the directory away.
            if fs_group.is_some() && std::os::unix::fs::chown(&volume, None, fs_group).is_ok() {
                mode |= 0o2000;
            }
            std::fs::set_permissions(&volume, std::fs::Permissions::from_mode(mode))?;
        }
        Ok(dir)
    }

    /// POST: stores the pod as Pending and starts its container.
    pub(crate) fn create(
        self: &Arc<Self>,
        namespace: &str,
        mut pod: Value,
    ) -> Result<Value, ApiError> {
        self.check_namespace(namespace)?;
        if pod["kind"] != "Pod" && !pod["kind"].is_null() {
            return Err(ApiError::bad_request(format!(
                "the body is a {}, not a Pod",
                pod["kind"]
            )));
        }
        let Some(name) = pod["metadata"]["name"].as_str().map(str::to_string) else {
            return Err(ApiError {
                code: 422,
                reason: "Invalid",
                message: "Pod \"\" is invalid: metadata.name: Required value: name or \
                          generateName is required"
                    .to_string(),
                name: None,
            });
        };
        if pod["spec"]["containers"]
            .as_array()
            .is_none_or(|c| c.is_empty())
        {
            return Err(ApiError {
                code: 422,
                reason: "Invalid",
                message: format!("Pod \"{name}\" is invalid: spec.containers: Required value"),
                name: Some(name),
            });
        }
        let uid = format!(
            "{:08x}-0000-4000-8000-{:012x}",
            std::process::id(),
            self.next_uid.fetch_add(1, Ordering::SeqCst)
        );
        pod["kind"] = json!("Pod");
        pod["apiVersion"] = json!("v1");
        let meta = &mut pod["metadata"];
        meta["namespace"] = json!(namespace);
        meta["uid"] = json!(uid);
        meta["creationTimestamp"] = json!(now());
        pod["status"] = json!({
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "True",
                            "lastTransitionTime": now()}],
            "qosClass": "Guaranteed",
        });
        {
            let mut store = self.lock();
            let key = (namespace.to_string(), name.clone());
            if store.pods.contains_key(&key) {
                return Err(ApiError {
                    code: 409,
                    reason: "AlreadyExists",
                    message: format!("pods \"{name}\" already exists"),
                    name: Some(name),
                });
            }
            self.commit(&mut store, "ADDED", namespace, &mut pod);
            store.pods.insert(
                key,
                StoredPod {
                    pod: pod.clone(),
                    container: None,
                },
            );
        }
        let cluster = self.clone();
        let (ns, created) = (namespace.to_string(), pod.clone());
        tokio::spawn(async move { cluster.run(ns, created).await });
        Ok(pod)
    }

    /// The kubelet's part: creates and starts the pod's container, says it runs, and
    /// says how it ended.
    async fn run(self: Arc<Self>, namespace: String, pod: Value) {
        let name = pod["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let uid = pod["metadata"]["uid"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let image = pod["spec"]["containers"][0]["image"].clone();
        let cname = pod["spec"]["containers"][0]["name"].clone();
        let waiting = |reason: &str, message: &str| {
            json!([{"name": cname, "image": image, "imageID": "", "ready": false,
                    "restartCount": 0, "started": false,
                    "state": {"waiting": {"reason": reason, "message": message}}}])
        };
        let set_waiting = |reason: &str, message: &str| {
            let statuses = waiting(reason, message);
            self.update(&namespace, &name, &uid, |s| {
                s.pod["status"]["containerStatuses"] = statuses;
            });
        };
        set_waiting("ContainerCreating", "");
        let volumes = match self.make_volumes(&pod, &uid) {
            Ok(volumes) => volumes,
            Err(err) => return set_waiting("CreateContainerConfigError", &err.to_string()),
        };
        let body = match container_body(&pod, &self.server, self.pids_limit, &volumes) {
            Ok(body) => body,
            Err(Unrunnable { reason, message }) => return set_waiting(reason, &message),
        };
        // Named as the kubelet named its containers on Docker.
        let container_name = format!(
            "k8s_{}_{name}_{namespace}_{uid}_0",
            cname.as_str().unwrap_or("c")
        );
        let options = bollard::query_parameters::CreateContainerOptionsBuilder::default()
            .name(&container_name)
            .build();
        let id = match self.docker.create_container(Some(options), body).await {
            Ok(created) => created.id,
            Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 404,
                message,
            }) => {
                return set_waiting(
                    "ErrImageNeverPull",
                    &format!("Container image {image} is not present: {message}"),
                )
            }
            Err(err) => return set_waiting("CreateContainerError", &err.to_string()),
        };
        // Deleted while its container was being created: the container goes too.
        let mut deleting = true;
        self.update(&namespace, &name, &uid, |s| {
            s.container = Some(id.clone());
            deleting = !s.pod["metadata"]["deletionTimestamp"].is_null();
        });
        if deleting {
            self.remove_container(&id).await;
            return self.forget(&namespace, &name, &uid);
        }
        if let Err(err) = self
            .docker
            .start_container(
                &id,
                None::<bollard::query_parameters::StartContainerOptions>,
            )
            .await
        {
            return set_waiting("RunContainerError", &err.to_string());
        }
        self.record_state(&namespace, &name, &uid, &id).await;
        // Until the container ends (or is removed).
        let mut wait = self
            .docker
            .wait_container(&id, None::<WaitContainerOptions>);
        while let Some(Ok(_)) = wait.next().await {}
        self.record_state(&namespace, &name, &uid, &id).await;
        // A container removed from outside (the suites remove a dropped broker's that
        // way) takes its pod and the pod's volumes with it; a pod deleted through the
        // API is forgotten by the delete.
        while self
            .get(&namespace, &name)
            .is_ok_and(|p| p["metadata"]["uid"] == uid.as_str())
        {
            tokio::time::sleep(GONE_POLL).await;
            if self
                .docker
                .inspect_container(&id, None::<InspectContainerOptions>)
                .await
                .is_err()
            {
                return self.forget(&namespace, &name, &uid);
            }
        }
    }

    /// Writes the container's state into the pod's status; a container that is gone
    /// (removed from outside, or by a delete) takes its pod with it.
    async fn record_state(&self, namespace: &str, name: &str, uid: &str, id: &str) {
        let inspected = match self
            .docker
            .inspect_container(id, None::<InspectContainerOptions>)
            .await
        {
            Ok(inspected) => inspected,
            Err(_) => return self.forget(namespace, name, uid),
        };
        let state = inspected.state.unwrap_or_default();
        let running = state.running == Some(true);
        let started = docker_time(state.started_at.as_deref());
        let exit_code = state.exit_code.unwrap_or(0);
        let container_state = if running {
            json!({"running": {"startedAt": started}})
        } else {
            let reason = if state.oom_killed == Some(true) {
                "OOMKilled"
            } else if exit_code == 0 {
                "Completed"
            } else {
                "Error"
            };
            json!({"terminated": {"exitCode": exit_code, "reason": reason,
                                  "startedAt": started,
                                  "finishedAt": docker_time(state.finished_at.as_deref()),
                                  "containerID": format!("docker://{id}")}})
        };
        let phase = match (running, exit_code) {
            (true, _) => "Running",
            (false, 0) => "Succeeded",
            (false, _) => "Failed",
        };
        self.update(namespace, name, uid, |s| {
            let c = &s.pod["spec"]["containers"][0];
            let statuses = json!([{
                "name": c["name"], "image": c["image"],
                "imageID": format!("docker-pullable://{}", inspected.image.clone().unwrap_or_default()),
                "containerID": format!("docker://{id}"),
                "ready": running, "started": running, "restartCount": 0,
                "state": container_state, "lastState": {},
            }]);
            let status = &mut s.pod["status"];
            status["phase"] = json!(phase);
            status["containerStatuses"] = statuses;
            if status["startTime"].is_null() {
                status["startTime"] = started.clone();
            }
            status["hostIP"] = json!("127.0.0.1");
            let ready = if running { "True" } else { "False" };
            status["conditions"] = json!([
                {"type": "PodScheduled", "status": "True"},
                {"type": "Initialized", "status": "True"},
                {"type": "ContainersReady", "status": ready},
                {"type": "Ready", "status": ready},
            ]);
        });
    }

    /// GET one pod.
    pub(crate) fn get(&self, namespace: &str, name: &str) -> Result<Value, ApiError> {
        self.check_namespace(namespace)?;
        let store = self.lock();
        store
            .pods
            .get(&(namespace.to_string(), name.to_string()))
            .map(|s| s.pod.clone())
            .ok_or_else(|| ApiError::not_found(name))
    }

    /// The running container of a pod, for attach and log.
    pub(crate) fn container_of(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<(Value, String), ApiError> {
        self.check_namespace(namespace)?;
        let store = self.lock();
        let stored = store
            .pods
            .get(&(namespace.to_string(), name.to_string()))
            .ok_or_else(|| ApiError::not_found(name))?;
        match &stored.container {
            Some(id) => Ok((stored.pod.clone(), id.clone())),
            None => Err(ApiError::bad_request(format!(
                "container \"{}\" in pod \"{name}\" is waiting to start: ContainerCreating",
                stored.pod["spec"]["containers"][0]["name"]
                    .as_str()
                    .unwrap_or_default()
            ))),
        }
    }

    /// LIST: the namespace's pods that `keep` says yes to, at the current version.
    pub(crate) fn list(
        &self,
        namespace: &str,
        keep: impl Fn(&Value) -> bool,
    ) -> Result<(u64, Vec<Value>), ApiError> {
        self.check_namespace(namespace)?;
        let store = self.lock();
        let pods = store
            .pods
            .iter()
            .filter(|((ns, _), s)| ns == namespace && keep(&s.pod))
            .map(|(_, s)| s.pod.clone())
            .collect();
        Ok((store.version, pods))
    }

    /// WATCH from `version`: the changes after it that history still holds, and a
    /// receiver of the ones to come; `None` when the version is older than the history
    /// (410 Gone). Version 0 starts with the current pods, as ADDED.
    pub(crate) fn watch(
        &self,
        namespace: &str,
        version: u64,
    ) -> Result<Option<WatchStart>, ApiError> {
        self.check_namespace(namespace)?;
        let store = self.lock();
        let receiver = self.changes.subscribe();
        if version == 0 {
            let current = store
                .pods
                .iter()
                .filter(|((ns, _), _)| ns == namespace)
                .map(|((ns, _), s)| Change {
                    version: store.version,
                    kind: "ADDED",
                    namespace: ns.clone(),
                    pod: s.pod.clone(),
                })
                .collect();
            return Ok(Some((current, receiver)));
        }
        let oldest = store
            .history
            .front()
            .map(|c| c.version)
            .unwrap_or(store.version + 1);
        if version + 1 < oldest && version < store.version {
            return Ok(None);
        }
        let backlog = store
            .history
            .iter()
            .filter(|c| c.version > version && c.namespace == namespace)
            .cloned()
            .collect();
        Ok(Some((backlog, receiver)))
    }

    /// DELETE: marks the pod as being deleted, stops and removes its container within the
    /// grace period, then forgets it. The pod as marked.
    pub(crate) fn delete(
        self: &Arc<Self>,
        namespace: &str,
        name: &str,
        grace: Option<i64>,
    ) -> Result<Value, ApiError> {
        self.check_namespace(namespace)?;
        let (pod, container, uid, first) = {
            let mut store = self.lock();
            let key = (namespace.to_string(), name.to_string());
            let Some(mut stored) = store.pods.remove(&key) else {
                return Err(ApiError::not_found(name));
            };
            let first = stored.pod["metadata"]["deletionTimestamp"].is_null();
            if first {
                let grace = grace
                    .or_else(|| stored.pod["spec"]["terminationGracePeriodSeconds"].as_i64())
                    .unwrap_or(DEFAULT_GRACE_SECS);
                stored.pod["metadata"]["deletionTimestamp"] = json!(now());
                stored.pod["metadata"]["deletionGracePeriodSeconds"] = json!(grace);
                self.commit(&mut store, "MODIFIED", namespace, &mut stored.pod);
            }
            let answer = (
                stored.pod.clone(),
                stored.container.clone(),
                stored.pod["metadata"]["uid"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                first,
            );
            store.pods.insert(key, stored);
            answer
        };
        if first {
            let grace = pod["metadata"]["deletionGracePeriodSeconds"]
                .as_i64()
                .unwrap_or(0);
            let cluster = self.clone();
            let (ns, name) = (namespace.to_string(), name.to_string());
            tokio::spawn(async move {
                if let Some(id) = &container {
                    let stop = StopContainerOptions {
                        t: Some(grace.clamp(0, i64::from(i32::MAX)) as i32),
                        signal: None,
                    };
                    let _ = cluster.docker.stop_container(id, Some(stop)).await;
                    cluster.remove_container(id).await;
                }
                // A pod whose container was still being created is forgotten by `run`.
                if container.is_some() || cluster.container_of(&ns, &name).is_err() {
                    cluster.forget(&ns, &name, &uid);
                }
            });
        }
        Ok(pod)
    }

    async fn remove_container(&self, id: &str) {
        let options = RemoveContainerOptions {
            force: true,
            v: true,
            link: false,
        };
        let _ = self.docker.remove_container(id, Some(options)).await;
    }

    /// The Docker engine, for attach and log.
    pub(crate) fn docker(&self) -> &Docker {
        &self.docker
    }

    /// Removes every container of this stand-in and the pods' volumes (at exit).
    pub(crate) async fn remove_all(&self) {
        let filters = HashMap::from([(
            "label".to_string(),
            vec![format!("{SERVER_LABEL}={}", self.server)],
        )]);
        let options = ListContainersOptions {
            all: true,
            filters: Some(filters),
            ..Default::default()
        };
        let Ok(containers) = self.docker.list_containers(Some(options)).await else {
            return;
        };
        for c in containers {
            if let Some(id) = c.id {
                self.remove_container(&id).await;
            }
        }
        let _ = std::fs::remove_dir_all(&self.volumes_dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cluster whose engine is never called: these tests stay off the Docker paths.
    fn cluster() -> Arc<Cluster> {
        let docker = Docker::connect_with_local_defaults().expect("client");
        Cluster::new(
            docker,
            "t".into(),
            vec!["ns".into()],
            1,
            "/nonexistent".into(),
        )
    }

    /// Stores a pod as `create` would, without starting it.
    fn add(cluster: &Cluster, name: &str) {
        let mut pod = json!({"metadata": {"name": name, "uid": name}});
        let mut store = cluster.lock();
        cluster.commit(&mut store, "ADDED", "ns", &mut pod);
        let key = ("ns".to_string(), name.to_string());
        store.pods.insert(
            key,
            StoredPod {
                pod,
                container: None,
            },
        );
    }

    #[test]
    fn a_missing_namespace_or_pod_is_a_404_status() {
        let cluster = cluster();
        let err = cluster.get("other", "cb-1").expect_err("namespace");
        assert_eq!(
            (err.code, err.message.as_str()),
            (404, "namespaces \"other\" not found")
        );
        let err = cluster.get("ns", "cb-1").expect_err("pod");
        assert_eq!(
            (err.code, err.message.as_str()),
            (404, "pods \"cb-1\" not found")
        );
        assert_eq!(
            cluster.delete("ns", "cb-1", None).expect_err("delete").code,
            404
        );
        let err = cluster.container_of("ns", "cb-1").expect_err("attach");
        assert_eq!(err.code, 404);
    }

    #[tokio::test]
    async fn a_second_pod_of_one_name_is_a_409_and_a_nameless_one_a_422() {
        let cluster = cluster();
        add(&cluster, "cb-1");
        let pod = json!({"metadata": {"name": "cb-1"}, "spec": {"containers": [{}]}});
        let err = cluster.create("ns", pod).expect_err("exists");
        assert_eq!((err.code, err.reason), (409, "AlreadyExists"));
        let err = cluster
            .create("ns", json!({"metadata": {}, "spec": {"containers": [{}]}}))
            .expect_err("nameless");
        assert_eq!((err.code, err.reason), (422, "Invalid"));
    }

    #[test]
    fn a_pod_waiting_for_its_container_cannot_be_attached() {
        let cluster = cluster();
        add(&cluster, "cb-1");
        let err = cluster.container_of("ns", "cb-1").expect_err("waiting");
        assert_eq!(err.code, 400);
        assert!(err.message.contains("ContainerCreating"), "{}", err.message);
    }

    #[test]
    fn watches_start_from_a_version_until_it_leaves_the_history() {
        let cluster = cluster();
        add(&cluster, "cb-1");
        add(&cluster, "cb-2");
        // From 0: the pods there are, as ADDED.
        let (backlog, _) = cluster.watch("ns", 0).expect("ns").expect("watch");
        assert_eq!(backlog.len(), 2);
        // From a list's version: the changes after it only.
        let (backlog, _) = cluster.watch("ns", 1).expect("ns").expect("watch");
        assert_eq!(backlog.len(), 1);
        assert_eq!(backlog[0].pod["metadata"]["name"], "cb-2");
        assert_eq!(backlog[0].pod["metadata"]["resourceVersion"], "2");
        for i in 0..HISTORY {
            add(&cluster, &format!("cb-x{i}"));
        }
        // Version 1 is no longer in the history: 410 Gone.
        assert!(cluster.watch("ns", 1).expect("ns").is_none());
        assert!(cluster.watch("ns", 3).expect("ns").is_some());
    }
}
