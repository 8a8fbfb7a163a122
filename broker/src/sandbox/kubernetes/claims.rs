//! Sandboxes claimed from kubernetes-sigs/agent-sandbox (CODEBROKER_K8S_MODE=agent-sandbox):
//! the broker creates a `SandboxClaim` against a `SandboxTemplate`, the agent-sandbox
//! controller binds it to a `Sandbox` (from a `SandboxWarmPool` when one is warm) whose pod
//! runs the runner, and the broker attaches to that pod as in `pods` mode. The claim is
//! the broker's handle: its name is the sandbox id, deleting it lets the controller delete
//! the sandbox and its pod, and its labels say whose it is.
//!
//! The API targeted is agent-sandbox's v1alpha1 (releases v0.1.x), as read in
//! github.com/kubernetes-sigs/agent-sandbox (the commits are of the stored copies read;
//! they were not tied to release tags here):
//! - `extensions/api/v1alpha1/groupversion_info.go` (5bf1aad): group
//!   `extensions.agents.x-k8s.io`, version `v1alpha1`; `Sandbox` is in `agents.x-k8s.io`.
//! - `extensions/api/v1alpha1/sandboxclaim_types.go` (0e79538) and
//!   `k8s/crds/extensions.agents.x-k8s.io_sandboxclaims.yaml` (1203be6):
//!   `spec.sandboxTemplateRef.name` names the template; `status.sandbox` names the Sandbox
//!   the claim got, and `status.conditions` says why not yet. The CRD of the releases that
//!   served v1alpha1 alone spells that field `Name` (`status.sandbox.Name`); the later
//!   v1alpha1 types spell it `name`: both are read.
//! - `clients/python/agentic-sandbox-client/agentic_sandbox/sandbox_client.py` (0897b96,
//!   the v1alpha1 client): the Sandbox a claim makes carries the claim's name, and its pod
//!   is named by the Sandbox's `agents.x-k8s.io/pod-name` annotation when it was adopted
//!   from a warm pool, else by the Sandbox's own name (`api/v1alpha1/annotations.go`,
//!   75153eb: `SandboxPodNameAnnotation`).
//!
//! The controller makes the pod from the template, so the pod does not carry the broker's
//! labels: only claims are listed and deleted, never pods, and a warm pool's pods are
//! left to the controller.

use super::pod_spec::{new_pod_name, sandbox_labels};
use super::pod_state::{pod_state, PodState};
use super::{KubernetesBackend, Listed, POLL_EVERY};
use crate::config::SandboxProfile;
use crate::sandbox::engine::SandboxUnavailable;
use crate::sandbox::{labels, RunnerChannel};
use crate::sync::LockExt as _;
use anyhow::anyhow;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, PostParams,
};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Mutex;

/// The group of `SandboxClaim`, `SandboxTemplate` and `SandboxWarmPool`.
pub(crate) const CLAIM_GROUP: &str = "extensions.agents.x-k8s.io";
/// The group of `Sandbox`.
pub(crate) const SANDBOX_GROUP: &str = "agents.x-k8s.io";
/// The version of both groups the broker speaks.
pub(crate) const VERSION: &str = "v1alpha1";
/// The annotation on a Sandbox naming its pod when that pod came from a warm pool.
pub(crate) const POD_NAME_ANNOTATION: &str = "agents.x-k8s.io/pod-name";

/// What the broker's Role must allow in this mode, for RBAC messages.
const CLAIM_RBAC: &str = "sandboxclaims (extensions.agents.x-k8s.io), get on sandboxes \
                          (agents.x-k8s.io), and pods and pods/attach";

/// The claims side of the backend: present in agent-sandbox mode only.
pub(crate) struct Claims {
    /// `sandboxclaims` of the sandbox namespace.
    claims: Api<DynamicObject>,
    /// `sandboxes` of the sandbox namespace, read to find a claim's pod.
    sandboxes: Api<DynamicObject>,
    /// The `SandboxTemplate` claimed against (CODEBROKER_K8S_SANDBOX_TEMPLATE).
    template: String,
    /// The pod each live claim was bound to, so that a broken runner's pod is looked at
    /// without asking the claim and its Sandbox again.
    pods_of: Mutex<HashMap<String, String>>,
}

impl Claims {
    pub(crate) fn new(client: kube::Client, namespace: &str, template: &str) -> Claims {
        Claims {
            claims: Api::namespaced_with(client.clone(), namespace, &claim_resource()),
            sandboxes: Api::namespaced_with(client, namespace, &sandbox_resource()),
            template: template.to_string(),
            pods_of: Mutex::new(HashMap::new()),
        }
    }

    fn lock_pods(&self) -> std::sync::MutexGuard<'_, HashMap<String, String>> {
        self.pods_of.locked()
    }
}

/// `sandboxclaims.extensions.agents.x-k8s.io/v1alpha1`.
pub(crate) fn claim_resource() -> ApiResource {
    let gvk = GroupVersionKind::gvk(CLAIM_GROUP, VERSION, "SandboxClaim");
    ApiResource::from_gvk_with_plural(&gvk, "sandboxclaims")
}

/// `sandboxes.agents.x-k8s.io/v1alpha1`.
pub(crate) fn sandbox_resource() -> ApiResource {
    let gvk = GroupVersionKind::gvk(SANDBOX_GROUP, VERSION, "Sandbox");
    ApiResource::from_gvk_with_plural(&gvk, "sandboxes")
}

/// The claim of session `session_id`, named `name`, against `template`: labelled as a
/// sandbox pod is, so that `list_own` finds it and gives the session back.
pub(crate) fn sandbox_claim(
    profile: &SandboxProfile,
    template: &str,
    namespace: &str,
    name: &str,
    session_id: &str,
) -> DynamicObject {
    let mut claim = DynamicObject::new(name, &claim_resource())
        .within(namespace)
        .data(json!({"spec": {"sandboxTemplateRef": {"name": template}}}));
    claim.metadata = ObjectMeta {
        labels: Some(sandbox_labels(profile, session_id)),
        ..claim.metadata
    };
    claim
}

/// Where a claim stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ClaimState {
    /// Not bound to a Sandbox yet; what its Ready condition says, if anything.
    Unbound(Option<String>),
    /// Bound to the Sandbox of this name.
    Bound(String),
    /// Being deleted, or expired: it will not give a pod.
    Ended(String),
}

/// `reason: message` of the claim's Ready condition, with its status.
fn ready_condition(claim: &DynamicObject) -> Option<(String, String)> {
    let conditions = claim.data.pointer("/status/conditions")?.as_array()?;
    let ready = conditions
        .iter()
        .find(|c| c.get("type").and_then(Value::as_str) == Some("Ready"))?;
    let field = |k: &str| ready.get(k).and_then(Value::as_str).unwrap_or_default();
    let words = match (field("reason"), field("message")) {
        ("", "") => String::new(),
        (r, "") | ("", r) => format!(": {r}"),
        (r, m) => format!(": {r}: {m}"),
    };
    Some((
        field("reason").to_string(),
        format!("Ready {}{words}", field("status")),
    ))
}

/// Where `claim` stands.
pub(crate) fn claim_state(claim: &DynamicObject) -> ClaimState {
    if claim.metadata.deletion_timestamp.is_some() {
        return ClaimState::Ended("the claim is being deleted".to_string());
    }
    let condition = ready_condition(claim);
    if let Some((reason, words)) = &condition {
        if reason == "ClaimExpired" || reason == "SandboxExpired" {
            return ClaimState::Ended(format!("the claim expired ({words})"));
        }
    }
    // `Name` in the early CRD, `name` later (see the module's sources).
    let bound = ["/status/sandbox/name", "/status/sandbox/Name"]
        .iter()
        .find_map(|at| claim.data.pointer(at).and_then(Value::as_str))
        .filter(|n| !n.is_empty());
    match bound {
        Some(name) => ClaimState::Bound(name.to_string()),
        None => ClaimState::Unbound(condition.map(|(_, words)| words)),
    }
}

/// The pod of `sandbox`: the warm-pool pod its annotation names, else its own name.
pub(crate) fn pod_of_sandbox(sandbox: &DynamicObject) -> Option<String> {
    sandbox
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(POD_NAME_ANNOTATION))
        .filter(|n| !n.is_empty())
        .cloned()
        .or_else(|| sandbox.metadata.name.clone())
}

/// Whether a 404 on a collection (a create, a list) means the resource is not served:
/// the namespace missing is said otherwise (`namespaces "x" not found`).
fn resource_not_served(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(e) if e.code == 404 && !e.message.starts_with("namespaces "))
}

impl KubernetesBackend {
    fn claims(&self) -> anyhow::Result<&Claims> {
        self.claims
            .as_ref()
            .ok_or_else(|| anyhow!("not in agent-sandbox mode"))
    }

    /// The error for a failed call on claims or sandboxes; a collection that is not served
    /// means agent-sandbox (or its extensions) is not installed.
    fn claim_api_error(&self, err: kube::Error, to: &str, collection: bool) -> anyhow::Error {
        if collection && resource_not_served(&err) {
            let detail = match &err {
                kube::Error::Api(e) => format!("{} {}: {}", e.code, e.reason, e.message),
                other => other.to_string(),
            };
            return anyhow::Error::new(SandboxUnavailable(format!(
                "cannot {to}: agent-sandbox is not installed in the cluster (the API server \
                 does not serve {}/{VERSION} sandboxclaims: {detail}); install the \
                 agent-sandbox controller with its extensions (v0.1.x, API v1alpha1), or \
                 set CODEBROKER_K8S_MODE=pods",
                CLAIM_GROUP
            )));
        }
        self.api_error_needing(err, to, CLAIM_RBAC)
    }

    /// Claims a sandbox for `session_id`, waits until the claim is bound to a Sandbox whose
    /// pod runs, and attaches to that pod; a claim that does not get there is deleted.
    /// Returns the claim's name and the channel.
    pub(crate) async fn claim_and_attach(
        &self,
        session_id: &str,
    ) -> anyhow::Result<(String, RunnerChannel)> {
        let claims = self.claims()?;
        let name = new_pod_name();
        let claim = sandbox_claim(
            &self.profile,
            &claims.template,
            &self.namespace,
            &name,
            session_id,
        );
        claims
            .claims
            .create(&PostParams::default(), &claim)
            .await
            .map_err(|e| {
                self.failed("create");
                self.claim_api_error(e, "create the sandbox claim", true)
            })?;
        let secs = self.ready_timeout.as_secs();
        let mut last = None;
        let t0 = tokio::time::Instant::now();
        let attached = tokio::time::timeout(self.ready_timeout, async {
            let pod = self.wait_bound(claims, &name, &mut last).await?;
            let left = self.ready_timeout.saturating_sub(t0.elapsed());
            let channel = self.running_then_attach(&pod, left, &mut last).await?;
            claims.lock_pods().insert(name.clone(), pod);
            anyhow::Ok(channel)
        })
        .await
        .unwrap_or_else(|_| {
            Err(anyhow::Error::new(SandboxUnavailable(format!(
                "the sandbox claim {name} (template {}) was not bound to a running pod within \
                 {secs} s (CODEBROKER_K8S_READY_TIMEOUT_SECS); last: {}",
                claims.template,
                last.as_deref()
                    .unwrap_or("the claim was not bound to a sandbox")
            ))))
        });
        match attached {
            Ok(channel) => Ok((name, channel)),
            Err(err) => {
                self.remove_claim(&name).await;
                Err(err)
            }
        }
    }

    /// Waits until the claim `name` is bound to a Sandbox whose pod exists, and names the
    /// pod; `last` says what was seen meanwhile. Unbounded: the caller bounds it.
    async fn wait_bound(
        &self,
        claims: &Claims,
        name: &str,
        last: &mut Option<String>,
    ) -> anyhow::Result<String> {
        loop {
            if let Some(pod) = self.pod_of_claim(claims, name, last).await? {
                return Ok(pod);
            }
            tokio::time::sleep(POLL_EVERY).await;
        }
    }

    /// The pod of the claim `name` once it exists; `None` (and `last` updated) while the
    /// claim is unbound, its Sandbox not made, or the pod not created yet.
    async fn pod_of_claim(
        &self,
        claims: &Claims,
        name: &str,
        last: &mut Option<String>,
    ) -> anyhow::Result<Option<String>> {
        let unavailable = |why: String| anyhow::Error::new(SandboxUnavailable(why));
        let claim = match claims.claims.get(name).await {
            Ok(claim) => claim,
            Err(kube::Error::Api(e)) if e.code == 404 => {
                return Err(unavailable(format!("the sandbox claim {name} was deleted")))
            }
            Err(e) => {
                self.failed("watch");
                return Err(self.claim_api_error(e, "read the sandbox claim", false));
            }
        };
        // Unbound: a Sandbox of the claim's own name, as the v1alpha1 client looks for.
        let sandbox_name = match claim_state(&claim) {
            ClaimState::Ended(why) => {
                return Err(unavailable(format!("the sandbox claim {name}: {why}")))
            }
            ClaimState::Bound(sandbox) => sandbox,
            ClaimState::Unbound(why) => {
                *last = Some(match why {
                    Some(why) => format!("the claim is not bound to a sandbox ({why})"),
                    None => "the claim is not bound to a sandbox".to_string(),
                });
                name.to_string()
            }
        };
        let sandbox = match claims.sandboxes.get(&sandbox_name).await {
            Ok(sandbox) => sandbox,
            Err(kube::Error::Api(e)) if e.code == 404 => return Ok(None),
            Err(e) => {
                self.failed("watch");
                return Err(self.claim_api_error(e, "read the claim's sandbox", false));
            }
        };
        let Some(pod_name) = pod_of_sandbox(&sandbox) else {
            return Ok(None);
        };
        match self.pods.get(&pod_name).await {
            Ok(pod) => {
                if let PodState::Starting(why) = pod_state(&pod) {
                    *last = why.or(last.take());
                }
                Ok(Some(pod_name))
            }
            Err(kube::Error::Api(e)) if e.code == 404 => {
                *last = Some(format!("sandbox {sandbox_name} has no pod {pod_name} yet"));
                Ok(None)
            }
            Err(e) => {
                self.failed("watch");
                Err(self.api_error_needing(e, "read the sandbox pod", CLAIM_RBAC))
            }
        }
    }

    /// The pod the live claim `name` is bound to, asking the cluster when not known.
    pub(crate) async fn claimed_pod(&self, name: &str) -> anyhow::Result<String> {
        let claims = self.claims()?;
        if let Some(pod) = claims.lock_pods().get(name) {
            return Ok(pod.clone());
        }
        let mut last = None;
        let pod = self
            .pod_of_claim(claims, name, &mut last)
            .await?
            .ok_or_else(|| {
                anyhow::Error::new(SandboxUnavailable(format!(
                    "the sandbox claim {name} has no pod{}",
                    last.map(|l| format!(": {l}")).unwrap_or_default()
                )))
            })?;
        claims.lock_pods().insert(name.to_string(), pod.clone());
        Ok(pod)
    }

    /// Deletes a claim (the controller deletes its Sandbox and pod); one already gone is
    /// fine, other failures are logged (the reconciler at the next start deletes it).
    pub(crate) async fn remove_claim(&self, name: &str) {
        let Ok(claims) = self.claims() else { return };
        claims.lock_pods().remove(name);
        self.lock_settled().remove(name);
        match claims.claims.delete(name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(err) => {
                self.failed("remove");
                tracing::warn!(claim = %name, error = %err, "cannot delete sandbox claim");
            }
        }
    }

    /// This instance's claims: bound ones count as running (adopting one checks its pod).
    pub(crate) async fn list_own_claims(&self) -> anyhow::Result<Vec<Listed>> {
        let claims = self.claims()?;
        let selector = format!("{}={}", labels::INSTANCE, self.profile.instance);
        let list = claims
            .claims
            .list(&ListParams::default().labels(&selector))
            .await
            .map_err(|e| {
                self.failed("list");
                self.claim_api_error(e, "list the sandbox claims", true)
            })?;
        Ok(list
            .items
            .into_iter()
            .filter_map(|claim| {
                let running = matches!(claim_state(&claim), ClaimState::Bound(_));
                super::own_sandbox(claim.metadata, running)
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(data: Value) -> DynamicObject {
        DynamicObject::new("cb-1", &claim_resource()).data(data)
    }

    #[test]
    fn a_claim_is_bound_by_either_spelling_of_its_status() {
        assert_eq!(
            claim_state(&claim(json!({"status": {"sandbox": {"Name": "cb-1"}}}))),
            ClaimState::Bound("cb-1".into())
        );
        assert_eq!(
            claim_state(&claim(json!({"status": {"sandbox": {"name": "pool-x"}}}))),
            ClaimState::Bound("pool-x".into())
        );
        assert_eq!(
            claim_state(&claim(json!({"status": {"sandbox": {"name": ""}}}))),
            ClaimState::Unbound(None)
        );
        assert_eq!(claim_state(&claim(json!({}))), ClaimState::Unbound(None));
    }

    #[test]
    fn an_unbound_claim_says_what_its_ready_condition_says() {
        let c = claim(json!({"status": {"conditions": [{
            "type": "Ready", "status": "False",
            "reason": "TemplateNotFound", "message": "no template codebroker-sandbox",
        }]}}));
        assert_eq!(
            claim_state(&c),
            ClaimState::Unbound(Some(
                "Ready False: TemplateNotFound: no template codebroker-sandbox".into()
            ))
        );
        let expired = claim(json!({"status": {
            "conditions": [{"type": "Ready", "status": "False", "reason": "ClaimExpired"}],
            "sandbox": {"name": "cb-1"},
        }}));
        assert!(matches!(claim_state(&expired), ClaimState::Ended(why) if why.contains("expired")));
        let deleting: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "extensions.agents.x-k8s.io/v1alpha1",
            "kind": "SandboxClaim",
            "metadata": {"name": "cb-1", "deletionTimestamp": "2026-01-01T00:00:00Z"},
            "status": {"sandbox": {"name": "cb-1"}},
        }))
        .expect("a claim");
        assert!(matches!(claim_state(&deleting), ClaimState::Ended(_)));
    }

    #[test]
    fn the_pod_is_the_annotated_one_else_the_sandboxes_name() {
        let mut sandbox = DynamicObject::new("cb-1", &sandbox_resource());
        assert_eq!(pod_of_sandbox(&sandbox).as_deref(), Some("cb-1"));
        sandbox.metadata.annotations = Some(
            [(POD_NAME_ANNOTATION.to_string(), String::new())]
                .into_iter()
                .collect(),
        );
        assert_eq!(pod_of_sandbox(&sandbox).as_deref(), Some("cb-1"));
        sandbox.metadata.annotations = Some(
            [(POD_NAME_ANNOTATION.to_string(), "pool-abc12".to_string())]
                .into_iter()
                .collect(),
        );
        assert_eq!(pod_of_sandbox(&sandbox).as_deref(), Some("pool-abc12"));
    }
}
