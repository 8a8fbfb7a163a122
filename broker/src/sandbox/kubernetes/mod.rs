//! Sandboxes as Kubernetes pods (CODEBROKER_BACKEND=kubernetes): one pod per session in
//! one namespace, from the sandbox image, its runner reached by attaching to the pod's
//! stdin and stdout through the API server (the same frames as over Docker's attach).
//!
//! The broker cannot see a pod's disk: files always move through the runner
//! (`super::runner_files`), and a new pod of a session that has files gets them back from
//! the broker's store at its first exec. The image is pulled by the kubelet, so the
//! broker never checks for it.

#[cfg(test)]
mod attach_tests;
#[cfg(test)]
mod claim_tests;
mod claims;
mod pod_spec;
mod pod_state;
#[cfg(test)]
pub(super) mod tests;

use super::channel::AttachOutput;
use super::engine::{EngineObserver, SandboxUnavailable};
use super::heartbeat_every;
use super::{labels, CpuWeight, Listed, RunnerChannel, Sandbox, Warmup};
use crate::config::{Config, KubernetesMode, SandboxProfile, SeccompChoice};
use crate::sync::LockExt as _;
use crate::workspace::Workspace;
use anyhow::{anyhow, Context};
use claims::Claims;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, AttachParams, DeleteParams, ListParams, LogParams, PostParams};
use pod_spec::{new_pod_name, reader_pod, sandbox_pod, session_of_label, PodSettings, CONTAINER};
use pod_state::{pod_state, wait_running, PodState, WaitError};
use std::collections::HashSet;
use std::io;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

/// Where a pod's service account names its namespace.
const NAMESPACE_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/namespace";

/// The namespace when none is set and the broker does not run in a pod.
const DEFAULT_NAMESPACE: &str = "codebroker";

/// How long a new runner may take to answer its first hello, once attached.
const HELLO_TIMEOUT: Duration = Duration::from_secs(20);

/// How long to wait for the cluster to record the end of a pod whose runner went away,
/// before asking how it ended.
const EXIT_WAIT: Duration = Duration::from_secs(5);

/// How often a pod (or a claim) is looked at while waiting for its end (or its pod).
const POLL_EVERY: Duration = Duration::from_millis(500);

/// How long one create, delete or list may wait for the API server: the client's own bound
/// (its read timeout) is nearly five minutes, for watches, and a request would wait as long.
const API_CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// How long `/health`'s one-item list may take: a probe must answer within seconds.
const PING_TIMEOUT: Duration = Duration::from_secs(5);

/// One of this instance's sandboxes (a pod, or a claim), by its name and session label.
fn own_sandbox(
    metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    running: bool,
) -> Option<Listed> {
    let session = metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(labels::SESSION))
        .and_then(|v| session_of_label(v));
    Some(Listed {
        id: metadata.name?,
        session,
        running,
    })
}

/// `call`, or the client's error for an API server that did not answer within `bound`.
async fn within<T>(
    bound: Duration,
    call: impl std::future::Future<Output = Result<T, kube::Error>>,
) -> Result<T, kube::Error> {
    tokio::time::timeout(bound, call).await.unwrap_or_else(|_| {
        Err(kube::Error::Service(Box::new(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("no answer within {} s", bound.as_secs()),
        ))))
    })
}

/// Creates, attaches to, and deletes sandbox pods.
pub(crate) struct KubernetesBackend {
    /// The pods of the sandbox namespace, through the broker's client.
    pods: Api<Pod>,
    /// The sandbox namespace, for messages that send an operator to its RBAC.
    namespace: String,
    /// Image, limits, lockdown and instance label: the sandbox group of the settings.
    profile: SandboxProfile,
    /// What only pods have: runtime class, and the idle TTL the runner's limit comes from.
    settings: PodSettings,
    /// How long a new pod may take to be running and attached.
    ready_timeout: Duration,
    /// Told of failed API calls (the broker's metrics); unset until the broker installs it.
    observer: OnceLock<Arc<dyn EngineObserver>>,
    /// What the egress gateway puts in a sandbox's environment: the proxy (the runner),
    /// which with egress off (the only way on this backend) answers every request with a
    /// 403 saying so, so pip fails at once instead of on the NetworkPolicy's time-outs.
    egress: OnceLock<Arc<crate::egress::gateway::Gateway>>,
    /// Pods whose workspace was brought up to date with their session's files; a pod's
    /// `emptyDir` starts empty, so each pod is filled once (see `settle_files`).
    settled: Mutex<HashSet<String>>,
    /// In agent-sandbox mode, the claims sandboxes come from (`claims.rs`); `None`: the
    /// broker creates bare pods.
    claims: Option<Claims>,
}

impl KubernetesBackend {
    /// Connects with the cluster's credentials (a pod's service account, else
    /// `KUBECONFIG` or `~/.kube/config`), in the namespace the settings name.
    pub(crate) async fn connect(config: &Config) -> anyhow::Result<KubernetesBackend> {
        let client = kube::Client::try_default().await.context(
            "cannot configure the Kubernetes client: run the broker in a pod with a service \
             account, or give it KUBECONFIG",
        )?;
        let namespace = config
            .kubernetes
            .k8s_namespace
            .clone()
            .filter(|n| !n.trim().is_empty())
            .or_else(|| {
                std::fs::read_to_string(NAMESPACE_FILE)
                    .ok()
                    .map(|n| n.trim().to_string())
                    .filter(|n| !n.is_empty())
            })
            .unwrap_or_else(|| DEFAULT_NAMESPACE.to_string());
        let backend = KubernetesBackend::with_client(client, &namespace, config);
        let p = &config.sandbox;
        if config.kubernetes.k8s_mode == KubernetesMode::AgentSandbox {
            tracing::info!(
                namespace = %namespace,
                template = %config.kubernetes.k8s_sandbox_template.trim(),
                "sandboxes are claimed from agent-sandbox (SandboxClaim, API v1alpha1): the \
                 SandboxTemplate says their pods (image, limits, lockdown, runtime class); \
                 CODEBROKER_IMAGE is used only to read the image's library list"
            );
            return Ok(backend);
        }
        // What the Docker profile says and a pod spec cannot: said once, so an operator
        // knows what the cluster must provide instead (docs/KUBERNETES.md).
        tracing::info!(
            namespace = %namespace,
            runtime_class = backend.settings.runtime_class.as_deref().unwrap_or("(cluster default)"),
            "sandboxes are Kubernetes pods; files move through the runner; pods get seccomp \
             RuntimeDefault and the kubelet's pids limit, not CODEBROKER_SECCOMP, \
             CODEBROKER_PIDS_LIMIT, CODEBROKER_NOFILE or CODEBROKER_FSIZE_MB; their network \
             is what the namespace's NetworkPolicy allows"
        );
        if p.seccomp != SeccompChoice::Builtin || !p.runtime.trim().is_empty() {
            tracing::warn!(
                "CODEBROKER_SECCOMP and CODEBROKER_RUNTIME apply to Docker only: use \
                 CODEBROKER_K8S_RUNTIME_CLASS"
            );
        }
        Ok(backend)
    }

    /// A backend on `client` (the tests give one that plays the API server).
    pub(crate) fn with_client(
        client: kube::Client,
        namespace: &str,
        config: &Config,
    ) -> KubernetesBackend {
        let claims = (config.kubernetes.k8s_mode == KubernetesMode::AgentSandbox).then(|| {
            Claims::new(
                client.clone(),
                namespace,
                config.kubernetes.k8s_sandbox_template.trim(),
            )
        });
        let runtime_class = Some(config.kubernetes.k8s_runtime_class.trim())
            .filter(|r| !r.is_empty())
            .map(str::to_string);
        KubernetesBackend {
            pods: Api::namespaced(client, namespace),
            namespace: namespace.to_string(),
            profile: config.sandbox.clone(),
            settings: PodSettings {
                runtime_class,
                idle_ttl_secs: config.lifecycle.idle_ttl_secs,
            },
            ready_timeout: Duration::from_secs(config.kubernetes.k8s_ready_timeout_secs),
            observer: OnceLock::new(),
            egress: OnceLock::new(),
            settled: Mutex::new(HashSet::new()),
            claims,
        }
    }

    /// Counts one failed API call of `op`.
    fn failed(&self, op: &str) {
        if let Some(observer) = self.observer.get() {
            observer.api_error(op);
        }
    }

    /// The error for a failed API call while trying `to` (`create the sandbox pod`): a
    /// [`SandboxUnavailable`] with the reason when the API server refused (RBAC), is
    /// unreachable or is in trouble, so the request that waited gets 503 with it.
    fn api_error(&self, err: kube::Error, to: &str) -> anyhow::Error {
        self.api_error_needing(err, to, "pods and pods/attach")
    }

    /// [`Self::api_error`], whose RBAC message says the Role must allow `needs`.
    fn api_error_needing(&self, err: kube::Error, to: &str, needs: &str) -> anyhow::Error {
        let ns = &self.namespace;
        let reason = match &err {
            // Admission, not RBAC: the pod spec breaks the namespace's Pod Security level.
            kube::Error::Api(e) if e.code == 403 && e.message.contains("violates PodSecurity") => {
                format!(
                    "the namespace {ns}'s Pod Security admission refused to {to}: {}",
                    e.message
                )
            }
            kube::Error::Api(e) if e.code == 401 || e.code == 403 => format!(
                "the Kubernetes API server refused to {to} ({} {}: {}); the broker's service \
                 account needs a Role allowing {needs} in namespace {ns} (RBAC)",
                e.code, e.reason, e.message
            ),
            kube::Error::Api(e) if e.code == 429 || e.code >= 500 => format!(
                "the Kubernetes API server could not {to} ({} {}: {})",
                e.code, e.reason, e.message
            ),
            // The namespace is missing (not the pod: a pod's 404 is its own answer).
            kube::Error::Api(e) if e.code == 404 && e.message.starts_with("namespaces ") => {
                format!("the Kubernetes API server could not {to}: namespace {ns} does not exist")
            }
            kube::Error::Api(e) => {
                return anyhow!(err.to_string()).context(format!(
                    "the Kubernetes API server would not {to} ({} {})",
                    e.code, e.reason
                ))
            }
            // An attach the API server answers with a status instead of a WebSocket.
            kube::Error::UpgradeConnection(
                kube::client::UpgradeConnectionError::ProtocolSwitch(status),
            ) if status.as_u16() == 401 || status.as_u16() == 403 => format!(
                "the Kubernetes API server refused to {to} ({status}); the broker's service \
                 account needs a Role allowing pods/attach in namespace {ns} (RBAC)"
            ),
            kube::Error::HyperError(_) | kube::Error::Service(_) => {
                format!("the Kubernetes API server cannot be reached to {to}: {err}")
            }
            _ => return anyhow!(err.to_string()).context(format!("cannot {to}")),
        };
        anyhow::Error::new(SandboxUnavailable(reason))
    }

    /// Creates the pod of `session_id`, waits until it runs, attaches and says hello;
    /// a pod that does not get there is deleted.
    async fn create_pod(&self, session_id: &str, warmup: Warmup) -> anyhow::Result<Sandbox> {
        let name = new_pod_name();
        let mut pod = sandbox_pod(&self.profile, &self.settings, &name, session_id);
        if let Some(gateway) = self.egress.get() {
            add_env(&mut pod, &gateway.sandbox_env());
        }
        let t0 = std::time::Instant::now();
        within(
            API_CALL_TIMEOUT,
            self.pods.create(&PostParams::default(), &pod),
        )
        .await
        .map_err(|e| {
            self.failed("create");
            self.api_error(e, "create the sandbox pod")
        })?;
        let t_create = t0.elapsed();
        let channel = match self.run_and_attach(&name).await {
            Ok(channel) => channel,
            Err(err) => {
                self.remove_pod(&name).await;
                return Err(err);
            }
        };
        tracing::debug!(
            pod = %name,
            create = ?t_create,
            running_and_attached = ?(t0.elapsed() - t_create),
            "sandbox pod attached"
        );
        self.say_hello(name, channel, warmup).await
    }

    /// Claims a sandbox for `session_id` (agent-sandbox mode), attaches to its pod and
    /// says hello; a claim that does not get there is deleted.
    async fn create_claimed(&self, session_id: &str, warmup: Warmup) -> anyhow::Result<Sandbox> {
        let t0 = std::time::Instant::now();
        let (name, channel) = self.claim_and_attach(session_id).await?;
        tracing::debug!(claim = %name, bound_and_attached = ?t0.elapsed(), "sandbox claimed");
        self.say_hello(name, channel, warmup).await
    }

    /// The first hello of a new sandbox `id` on `channel`; one that does not answer is
    /// removed.
    async fn say_hello(
        &self,
        id: String,
        channel: RunnerChannel,
        warmup: Warmup,
    ) -> anyhow::Result<Sandbox> {
        let sandbox = Sandbox::new(id.clone(), channel);
        let hello = tokio::time::timeout(HELLO_TIMEOUT, sandbox.hello(warmup))
            .await
            .map_err(|_| anyhow!("the runner did not answer within {HELLO_TIMEOUT:?}"))
            .and_then(|answer| answer.context("the runner did not answer"));
        let sandbox = match hello {
            Ok(_) => sandbox.tunnel_egress(self.egress.get()).await,
            Err(err) => {
                // The attach goes first, so the runner is not held while its pod goes.
                drop(sandbox);
                Err(err)
            }
        };
        match sandbox {
            Ok(sandbox) => Ok(sandbox),
            Err(err) => Err(err),
        }
    }

    /// Waits until the pod `name` runs and attaches to it, within the ready timeout.
    async fn run_and_attach(&self, name: &str) -> anyhow::Result<RunnerChannel> {
        let secs = self.ready_timeout.as_secs();
        let mut last = None;
        let ready = tokio::time::timeout(
            self.ready_timeout,
            self.running_then_attach(name, self.ready_timeout, &mut last),
        )
        .await;
        match ready {
            Ok(channel) => channel,
            Err(_) => Err(anyhow::Error::new(SandboxUnavailable(format!(
                "the sandbox pod was not running within {secs} s (CODEBROKER_K8S_READY_TIMEOUT_SECS){}",
                last.map(|why| format!("; last: {why}")).unwrap_or_default()
            )))),
        }
    }

    /// Waits until the pod `name` runs and attaches to it; `last` says why it does not
    /// run yet. Unbounded but for the watches' `timeout`: the caller bounds it.
    async fn running_then_attach(
        &self,
        name: &str,
        timeout: Duration,
        last: &mut Option<String>,
    ) -> anyhow::Result<RunnerChannel> {
        wait_running(&self.pods, name, timeout, last)
            .await
            .map_err(|e| match e {
                WaitError::Ended(why) => anyhow::Error::new(SandboxUnavailable(format!(
                    "the sandbox pod did not start: {why}"
                ))),
                WaitError::Api(e) => {
                    self.failed("watch");
                    self.api_error(e, "watch the sandbox pod")
                }
            })?;
        self.attach_channel(name).await
    }

    /// Attaches to the runner's stdin and stdout (its stderr goes to the pod's log).
    async fn attach_channel(&self, name: &str) -> anyhow::Result<RunnerChannel> {
        let params = AttachParams::default()
            .container(CONTAINER)
            .stdin(true)
            .stdout(true)
            .stderr(false)
            .tty(false);
        let mut attached = self.pods.attach(name, &params).await.map_err(|e| {
            self.failed("attach");
            self.api_error(e, "attach to the sandbox pod")
        })?;
        let (Some(input), Some(output)) = (attached.stdin(), attached.stdout()) else {
            return Err(anyhow!("the attach gave no stdin or stdout"));
        };
        // The attach's task ends with the channel: dropping the output stream (the
        // channel's reader) aborts it, so a forgotten channel holds no connection.
        let held = AbortOnDrop(attached);
        let output = tokio_util::io::ReaderStream::new(output)
            .map(move |chunk| {
                let _ = &held;
                chunk
                    .map(AttachOutput::Stdout)
                    .map_err(|e| format!("the pod's attach stream broke: {e}"))
            })
            // The stream ends when the pod does, is deleted, or loses its node: said so.
            .chain(futures::stream::once(async {
                Err(
                    "the pod's attach stream ended (the pod ended, was deleted, or lost \
                     its node)"
                        .to_string(),
                )
            }));
        let channel = RunnerChannel::new(name.to_string(), output, Box::pin(input));
        Ok(channel.with_heartbeat(heartbeat_every(self.settings.idle_ttl_secs)))
    }

    /// Deletes a pod; one already gone is fine, other failures are logged (the
    /// reconciler at the next start deletes what is left).
    async fn remove_pod(&self, name: &str) {
        self.lock_settled().remove(name);
        match within(
            API_CALL_TIMEOUT,
            self.pods.delete(name, &DeleteParams::default()),
        )
        .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(err) => {
                self.failed("remove");
                tracing::warn!(pod = %name, error = %err, "cannot delete sandbox pod");
            }
        }
    }

    fn lock_settled(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.settled.locked()
    }

    /// Reads one file of the image: a pod of the image runs `cat` on it, its log is the
    /// file. Needs `pods/log` besides what sandboxes need; used once, for `/libraries`.
    async fn read_image_file_by_pod(&self, path: &str) -> anyhow::Result<Vec<u8>> {
        let name = new_pod_name();
        let pod = reader_pod(&self.profile, &self.settings, &name, path);
        self.pods
            .create(&PostParams::default(), &pod)
            .await
            .map_err(|e| {
                self.failed("read_image");
                self.api_error(e, "create a pod that reads the image")
            })?;
        let read = async {
            let finished = tokio::time::timeout(self.ready_timeout, async {
                loop {
                    let pod = self.pods.get(&name).await?;
                    let phase = pod.status.and_then(|s| s.phase);
                    if matches!(phase.as_deref(), Some("Succeeded" | "Failed")) {
                        return Ok::<_, kube::Error>(phase);
                    }
                    tokio::time::sleep(POLL_EVERY).await;
                }
            })
            .await
            .map_err(|_| anyhow!("the pod reading {path} did not finish in time"))?
            .map_err(|e| self.api_error(e, "read the image"))?;
            if finished.as_deref() != Some("Succeeded") {
                anyhow::bail!("cannot read {path} from the image (the reading pod failed)");
            }
            let params = LogParams {
                container: Some(CONTAINER.to_string()),
                ..Default::default()
            };
            let text =
                self.pods.logs(&name, &params).await.map_err(|e| {
                    self.api_error(e, "read the log of the pod that reads the image")
                })?;
            anyhow::Ok(text.into_bytes())
        }
        .await;
        if read.is_err() {
            self.failed("read_image");
        }
        self.remove_pod(&name).await;
        read
    }
}

/// Aborts an attach's task when dropped.
struct AbortOnDrop(kube::api::AttachedProcess);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[async_trait::async_trait]
impl super::engine::SandboxEngine for KubernetesBackend {
    async fn create(
        &self,
        session_id: &str,
        _workspace: &Workspace,
        warmup: Warmup,
    ) -> anyhow::Result<Sandbox> {
        if self.claims.is_some() {
            self.create_claimed(session_id, warmup).await
        } else {
            self.create_pod(session_id, warmup).await
        }
    }

    /// Re-attaches to the pod `sandbox_id` names: in agent-sandbox mode a claim's, found
    /// through its Sandbox.
    async fn adopt(&self, sandbox_id: &str) -> anyhow::Result<Sandbox> {
        let pod = match self.claims {
            Some(_) => self.claimed_pod(sandbox_id).await?,
            None => sandbox_id.to_string(),
        };
        let channel = self.attach_channel(&pod).await?;
        Sandbox::adopted(sandbox_id.to_string(), channel, HELLO_TIMEOUT)
            .await?
            .tunnel_egress(self.egress.get())
            .await
    }

    /// A pod's CPU weight is its request, fixed when it is created: never set.
    async fn set_cpu_weight(&self, _sandbox_id: &str, _weight: CpuWeight) -> bool {
        false
    }

    /// Deletes the pod, or in agent-sandbox mode the claim (the controller deletes the
    /// Sandbox and its pod).
    async fn remove(&self, sandbox_id: &str) {
        if self.claims.is_some() {
            self.remove_claim(sandbox_id).await
        } else {
            self.remove_pod(sandbox_id).await
        }
    }

    /// This instance's pods, or in agent-sandbox mode its claims: never a warm pool's
    /// pods, which are the controller's.
    async fn list_own(&self) -> anyhow::Result<Vec<Listed>> {
        if self.claims.is_some() {
            return self.list_own_claims().await;
        }
        let selector = format!("{}={}", labels::INSTANCE, self.profile.instance);
        let list = within(
            API_CALL_TIMEOUT,
            self.pods.list(&ListParams::default().labels(&selector)),
        )
        .await
        .map_err(|e| {
            self.failed("list");
            self.api_error(e, "list the sandbox pods")
        })?;
        Ok(list
            .items
            .into_iter()
            .filter_map(|pod| {
                let running = pod_state(&pod) == PodState::Running;
                own_sandbox(pod.metadata, running)
            })
            .collect())
    }

    async fn ping(&self) -> bool {
        within(
            PING_TIMEOUT,
            self.pods.list_metadata(&ListParams::default().limit(1)),
        )
        .await
        .is_ok()
    }

    /// The kubelet pulls the image when a pod needs it; a missing image shows as a pod
    /// that cannot start (`ErrImagePull`), reported by `create`.
    async fn image_present(&self) -> bool {
        true
    }

    /// The container's `OOMKilled` reason, when it ended during the exec. The reason is
    /// sticky (containerd keeps the first OOM event of a container for its end): after
    /// an earlier exec's process was killed for memory while the runner lived on, it says
    /// nothing about this end, which is then not reported as memory's.
    async fn ended_out_of_memory(
        &self,
        sandbox_id: &str,
        since: SystemTime,
        oom_before: bool,
    ) -> bool {
        if oom_before {
            return false;
        }
        let pod = match self.claims {
            Some(_) => match self.claimed_pod(sandbox_id).await {
                Ok(pod) => pod,
                Err(_) => return false,
            },
            None => sandbox_id.to_string(),
        };
        let sandbox_id = pod.as_str();
        // The runner's stream may break before the cluster records the end: wait a little.
        let deadline = tokio::time::Instant::now() + EXIT_WAIT;
        loop {
            let pod = match self.pods.get(sandbox_id).await {
                Ok(pod) => pod,
                Err(kube::Error::Api(e)) if e.code == 404 => return false,
                Err(err) => {
                    self.failed("inspect");
                    tracing::warn!(pod = %sandbox_id, error = %err, "cannot read sandbox pod");
                    return false;
                }
            };
            if pod_state::ended_out_of_memory(&pod, since) {
                return true;
            }
            if pod_state(&pod) != PodState::Running || tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(POLL_EVERY).await;
        }
    }

    async fn read_image_file(&self, path: &str) -> anyhow::Result<Vec<u8>> {
        self.read_image_file_by_pod(path).await
    }

    /// Pods run on nodes the broker does not know: CODEBROKER_MAX_CONTAINERS `auto` takes
    /// its minimum; set a number.
    fn host_memory(&self) -> Option<u64> {
        None
    }

    fn observe(&self, observer: Arc<dyn EngineObserver>) {
        // Only the first observer counts: the broker installs it once, at start.
        let _ = self.observer.set(observer);
    }

    fn carry_egress(&self, gateway: Arc<crate::egress::gateway::Gateway>) {
        let _ = self.egress.set(gateway);
    }

    /// Pods run on nodes the broker cannot see: files move through the runner.
    fn file_transport(&self) -> super::files::FileTransport {
        super::files::FileTransport::Runner
    }

    /// A new pod (after the idle TTL, an eviction, a lost node) starts with an empty
    /// workspace, and the broker's store has the session's files: once per pod.
    fn disk_outlives_sandbox(&self) -> bool {
        false // an emptyDir goes with its pod
    }

    fn first_settle(&self, sandbox_id: &str) -> bool {
        !self.lock_settled().contains(sandbox_id)
    }

    fn settled(&self, sandbox_id: &str) {
        self.lock_settled().insert(sandbox_id.to_string());
    }
}

/// Appends `NAME=value` entries to the environment of the pod's containers.
fn add_env(pod: &mut k8s_openapi::api::core::v1::Pod, entries: &[String]) {
    let Some(spec) = pod.spec.as_mut() else {
        return;
    };
    for container in &mut spec.containers {
        let env = container.env.get_or_insert_with(Vec::new);
        for entry in entries {
            if let Some((name, value)) = entry.split_once('=') {
                env.push(k8s_openapi::api::core::v1::EnvVar {
                    name: name.to_string(),
                    value: Some(value.to_string()),
                    value_from: None,
                });
            }
        }
    }
}
