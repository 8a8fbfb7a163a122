//! What a pod's status says about its sandbox, and the wait for a new pod to run.
//!
//! The wait lists the pod, then watches it from the list's resource version until it runs
//! or fails; a watch that ends (the server's timeout) or is refused as too old (410 Gone)
//! is followed by a new list and a new watch.

use super::pod_spec::CONTAINER;
use futures::TryStreamExt;
use k8s_openapi::api::core::v1::{ContainerState, ContainerStatus, Pod};
use kube::api::{Api, ListParams, WatchEvent, WatchParams};
use std::time::{Duration, SystemTime};

/// Container waiting reasons from which a pod does not recover by itself: waiting
/// longer only delays the error.
const HOPELESS_WAITS: &[&str] = &[
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
    "CrashLoopBackOff",
];

/// Longest one watch request is held open; the API server refuses longer (kube checks
/// below 295 s).
const MAX_WATCH_SECS: u64 = 290;

/// Where a pod stands, for a sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PodState {
    /// Not running yet; the reason, when the status gives one (`ContainerCreating`,
    /// `Unschedulable: 0/3 nodes are available: ...`).
    Starting(Option<String>),
    /// Its container runs: the runner can be attached.
    Running,
    /// It ended, or will never run: why, in the cluster's words.
    Ended(String),
}

/// The status of the sandbox container of `pod`.
fn sandbox_status(pod: &Pod) -> Option<&ContainerStatus> {
    pod.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find(|s| s.name == CONTAINER)
}

/// `reason: message`, or whichever of them there is.
fn reason_message(reason: Option<&str>, message: Option<&str>) -> Option<String> {
    match (
        reason.filter(|r| !r.is_empty()),
        message.filter(|m| !m.is_empty()),
    ) {
        (Some(r), Some(m)) => Some(format!("{r}: {m}")),
        (Some(one), None) | (None, Some(one)) => Some(one.to_string()),
        (None, None) => None,
    }
}

/// How the container of `state` ended, if it did.
fn terminated(state: Option<&ContainerState>) -> Option<String> {
    let t = state?.terminated.as_ref()?;
    let why = reason_message(t.reason.as_deref(), t.message.as_deref())
        .unwrap_or_else(|| "terminated".to_string());
    Some(format!(
        "the sandbox container ended ({why}, exit code {})",
        t.exit_code
    ))
}

/// Where `pod` stands.
pub(crate) fn pod_state(pod: &Pod) -> PodState {
    if pod.metadata.deletion_timestamp.is_some() {
        return PodState::Ended("the pod is being deleted".to_string());
    }
    let Some(status) = pod.status.as_ref() else {
        return PodState::Starting(None);
    };
    let container = sandbox_status(pod);
    // An evicted pod is Failed with the reason `Evicted` and the kubelet's words.
    if let Some(phase @ ("Failed" | "Succeeded")) = status.phase.as_deref() {
        let why = reason_message(status.reason.as_deref(), status.message.as_deref())
            .or_else(|| container.and_then(|c| terminated(c.state.as_ref())))
            .unwrap_or_else(|| format!("phase {phase}"));
        return PodState::Ended(format!("the pod ended: {why}"));
    }
    if let Some(c) = container {
        if let Some(ended) = terminated(c.state.as_ref()) {
            return PodState::Ended(ended);
        }
        if let Some(waiting) = c.state.as_ref().and_then(|s| s.waiting.as_ref()) {
            let reason = waiting.reason.as_deref().unwrap_or_default();
            let why = reason_message(waiting.reason.as_deref(), waiting.message.as_deref());
            if HOPELESS_WAITS.contains(&reason) {
                return PodState::Ended(format!(
                    "the sandbox container cannot start: {}",
                    why.unwrap_or_default()
                ));
            }
            return PodState::Starting(why);
        }
        if status.phase.as_deref() == Some("Running")
            && c.state.as_ref().is_some_and(|s| s.running.is_some())
        {
            return PodState::Running;
        }
    }
    // Unscheduled: the scheduler's words. Not an end: a cluster autoscaler may be adding
    // the node it needs, and the ready timeout bounds the wait.
    let unscheduled = status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False");
    PodState::Starting(
        unscheduled.and_then(|c| reason_message(c.reason.as_deref(), c.message.as_deref())),
    )
}

/// Whether the sandbox container of `pod` was killed for memory (`OOMKilled`) at or after
/// `since`. Kubernetes writes times in whole seconds, so a second before counts too.
pub(crate) fn ended_out_of_memory(pod: &Pod, since: SystemTime) -> bool {
    let Some(container) = sandbox_status(pod) else {
        return false;
    };
    let since = since
        .checked_sub(Duration::from_secs(1))
        .unwrap_or(SystemTime::UNIX_EPOCH);
    [&container.state, &container.last_state]
        .into_iter()
        .flatten()
        .filter_map(|s| s.terminated.as_ref())
        .any(|t| {
            t.reason.as_deref() == Some("OOMKilled")
                && t.finished_at
                    .as_ref()
                    .is_none_or(|at| SystemTime::from(at.0) >= since)
        })
}

/// Why a wait for a pod failed.
#[derive(Debug)]
pub(crate) enum WaitError {
    /// The pod ended or will never run, in the cluster's words.
    Ended(String),
    /// An API call failed.
    Api(kube::Error),
}

/// Waits until the pod `name` runs; `last` is kept up to date with the latest reason it
/// is not running yet, so that a caller that gives up can say why.
pub(crate) async fn wait_running(
    pods: &Api<Pod>,
    name: &str,
    timeout: Duration,
    last: &mut Option<String>,
) -> Result<(), WaitError> {
    let by_name = format!("metadata.name={name}");
    let watch_secs = timeout.as_secs().clamp(1, MAX_WATCH_SECS) as u32;
    loop {
        let list = pods
            .list(&ListParams::default().fields(&by_name))
            .await
            .map_err(WaitError::Api)?;
        let Some(pod) = list.items.first() else {
            return Err(WaitError::Ended("the pod is gone".to_string()));
        };
        match pod_state(pod) {
            PodState::Running => return Ok(()),
            PodState::Ended(why) => return Err(WaitError::Ended(why)),
            PodState::Starting(why) => *last = why.or(last.take()),
        }
        let version = list.metadata.resource_version.unwrap_or_default();
        let params = WatchParams::default().fields(&by_name).timeout(watch_secs);
        let mut events = match pods.watch(&params, &version).await {
            Ok(events) => Box::pin(events),
            Err(kube::Error::Api(e)) if e.code == 410 => continue,
            Err(e) => return Err(WaitError::Api(e)),
        };
        loop {
            match events.try_next().await {
                Ok(Some(WatchEvent::Added(pod) | WatchEvent::Modified(pod))) => {
                    match pod_state(&pod) {
                        PodState::Running => return Ok(()),
                        PodState::Ended(why) => return Err(WaitError::Ended(why)),
                        PodState::Starting(why) => *last = why.or(last.take()),
                    }
                }
                Ok(Some(WatchEvent::Deleted(_))) => {
                    return Err(WaitError::Ended("the pod was deleted".to_string()))
                }
                Ok(Some(WatchEvent::Bookmark(_))) => {}
                // The version is too old to watch from (410 Gone): list again.
                Ok(Some(WatchEvent::Error(e))) if e.code == 410 => break,
                Ok(Some(WatchEvent::Error(e))) => return Err(WaitError::Api(kube::Error::Api(e))),
                Err(kube::Error::Api(e)) if e.code == 410 => break,
                Err(e) => return Err(WaitError::Api(e)),
                // The server ended the watch (its timeout): list again.
                Ok(None) => break,
            }
        }
    }
}
