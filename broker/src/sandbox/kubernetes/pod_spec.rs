//! What a sandbox pod is: the Docker profile's lockdown, said in a pod spec.
//!
//! Pure: the spec is built from the settings alone, so the tests read exactly what the
//! API server is sent.

use super::super::labels;
use super::super::{unattended_exit_ms, WORKDIR};
use crate::config::SandboxProfile;
use k8s_openapi::api::core::v1::{
    Capabilities, Container, EmptyDirVolumeSource, EnvVar, Pod, PodSecurityContext, PodSpec,
    ResourceRequirements, SeccompProfile, SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

/// The name of the one container of a sandbox pod, which attach names.
pub(super) const CONTAINER: &str = "sandbox";

/// Seconds the kubelet gives a deleted pod before it kills it: the runner keeps nothing
/// that needs a clean stop (the broker saved what it wanted before deleting).
const GRACE_SECS: i64 = 1;

/// Ephemeral storage a pod may use beyond its workspace quota: the runner's frames are
/// the container's stdout, which the kubelet keeps as its log (10 MiB × 5 files with the
/// kubelet's defaults), and the log counts against the limit.
const EPHEMERAL_HEADROOM: u64 = 128 << 20;

/// What a pod gets besides the profile: the parts of the settings only Kubernetes has.
#[derive(Debug, Clone)]
pub(crate) struct PodSettings {
    /// `runtimeClassName` (CODEBROKER_K8S_RUNTIME_CLASS); `None`: the cluster's default.
    pub(crate) runtime_class: Option<String>,
    /// The broker's idle TTL, from which the runner's unattended limit is made, as on
    /// Docker (a runner must outlive any idle session its broker keeps).
    pub(crate) idle_ttl_secs: u64,
}

/// The session label's value for `session_id`: a label value must begin and end with a
/// letter or digit, and session ids may begin or end with `-` or `_`, so the id goes
/// between `s-` and `-s`.
pub(crate) fn session_label(session_id: &str) -> String {
    format!("s-{session_id}-s")
}

/// The session id a session label holds (see [`session_label`]).
pub(crate) fn session_of_label(value: &str) -> Option<String> {
    value
        .strip_prefix("s-")
        .and_then(|v| v.strip_suffix("-s"))
        .map(str::to_string)
}

/// The labels of a sandbox of session `session_id`, on its pod or on its claim: the
/// broker instance (what `list_own` selects), the session (what reconcile gives back),
/// and when it was made.
pub(crate) fn sandbox_labels(
    profile: &SandboxProfile,
    session_id: &str,
) -> BTreeMap<String, String> {
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    BTreeMap::from([
        (labels::INSTANCE.to_string(), profile.instance.clone()),
        (labels::SESSION.to_string(), session_label(session_id)),
        (labels::CREATED.to_string(), created.to_string()),
    ])
}

/// A fresh pod name: `cb-` and 16 hex digits, so the 12 characters logs show (`short`)
/// still tell pods apart.
pub(crate) fn new_pod_name() -> String {
    format!("cb-{:016x}", rand::random::<u64>())
}

/// A quantity of `bytes` as Kubernetes writes it: in Mi when whole, else in bytes.
fn bytes_quantity(bytes: u64) -> Quantity {
    if bytes % (1 << 20) == 0 {
        Quantity(format!("{}Mi", bytes >> 20))
    } else {
        Quantity(bytes.to_string())
    }
}

/// CPUs as millicores, at least 1m.
fn cpu_quantity(cpus: f64) -> Quantity {
    Quantity(format!("{}m", ((cpus * 1000.0).round() as u64).max(1)))
}

/// The pod of session `session_id`, named `name`: the lockdown SECURITY.md describes
/// ("Layers"), as far as a pod spec says it. What the spec cannot say (a pids limit,
/// ulimits, our seccomp profile, no network) is left to the cluster: the kubelet's pod
/// pids limit, the runner's own watch of the workspace, RuntimeDefault seccomp, and a
/// NetworkPolicy denying all traffic to sandbox pods (deploy/kubernetes).
pub(crate) fn sandbox_pod(
    profile: &SandboxProfile,
    settings: &PodSettings,
    name: &str,
    session_id: &str,
) -> Pod {
    let labels = sandbox_labels(profile, session_id);
    let uid = i64::from(profile.pod_uid());
    let mut limits = BTreeMap::from([
        (
            "memory".to_string(),
            bytes_quantity(profile.memory_mb.saturating_mul(1 << 20)),
        ),
        ("cpu".to_string(), cpu_quantity(profile.cpus)),
    ]);
    // No quota, no bound on the disk either: the workspace may fill the node's.
    if profile.workspace_quota > 0 {
        limits.insert(
            "ephemeral-storage".to_string(),
            bytes_quantity(profile.workspace_quota.saturating_add(EPHEMERAL_HEADROOM)),
        );
    }
    let env = |name: &str, value: String| EnvVar {
        name: name.to_string(),
        value: Some(value),
        value_from: None,
    };
    let container = Container {
        name: CONTAINER.to_string(),
        image: Some(profile.image.clone()),
        // The image's entrypoint is the runner, PID 1, as on Docker.
        working_dir: Some(WORKDIR.to_string()),
        env: Some(vec![
            env("HOME", WORKDIR.to_string()),
            // The runner watches the workspace against these during each exec.
            env(
                "CODEBROKER_WORKSPACE_QUOTA",
                profile.workspace_quota.to_string(),
            ),
            env(
                "CODEBROKER_WORKSPACE_MAX_FILES",
                profile.workspace_max_files.to_string(),
            ),
            // A pod whose broker never comes back ends itself after the idle TTL, as the
            // reaper would have removed it.
            env(
                sandbox_runner::UNATTENDED_EXIT_ENV,
                unattended_exit_ms(settings.idle_ttl_secs).to_string(),
            ),
        ]),
        stdin: Some(true),
        stdin_once: Some(false),
        tty: Some(false),
        resources: Some(ResourceRequirements {
            // Requests default to the limits: each pod is scheduled for what it may use.
            limits: Some(limits),
            ..Default::default()
        }),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            privileged: Some(false),
            capabilities: profile.drop_capabilities.then(|| Capabilities {
                drop: Some(vec!["ALL".to_string()]),
                add: None,
            }),
            read_only_root_filesystem: Some(profile.readonly_rootfs),
            run_as_non_root: Some(true),
            run_as_user: Some(uid),
            run_as_group: Some(uid),
            ..Default::default()
        }),
        volume_mounts: Some(vec![
            mount("workspace", WORKDIR),
            mount("tmp", "/tmp"),
            mount("shm", "/dev/shm"),
        ]),
        ..Default::default()
    };
    let empty_dir = |name: &str, medium: Option<&str>, size: Option<u64>| Volume {
        name: name.to_string(),
        empty_dir: Some(EmptyDirVolumeSource {
            medium: medium.map(str::to_string),
            size_limit: size.map(bytes_quantity),
        }),
        ..Default::default()
    };
    let spec = PodSpec {
        containers: vec![container],
        restart_policy: Some("Never".to_string()),
        automount_service_account_token: Some(false),
        enable_service_links: Some(false),
        host_network: Some(false),
        host_pid: Some(false),
        host_ipc: Some(false),
        share_process_namespace: Some(false),
        termination_grace_period_seconds: Some(GRACE_SECS),
        runtime_class_name: settings.runtime_class.clone(),
        security_context: Some(PodSecurityContext {
            run_as_non_root: Some(true),
            run_as_user: Some(uid),
            run_as_group: Some(uid),
            // The workspace volume is the sandbox uid's group's, so its code can write it.
            fs_group: Some(uid),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".to_string(),
                localhost_profile: None,
            }),
            ..Default::default()
        }),
        volumes: Some(vec![
            // The workspace: on the node's disk, bounded by the quota (0: unbounded).
            empty_dir(
                "workspace",
                None,
                (profile.workspace_quota > 0).then_some(profile.workspace_quota),
            ),
            // Scratch in memory, charged to the pod's memory limit, as Docker's tmpfs.
            empty_dir(
                "tmp",
                Some("Memory"),
                Some(profile.tmp_mb.saturating_mul(1 << 20)),
            ),
            empty_dir(
                "shm",
                Some("Memory"),
                Some(profile.shm_mb.saturating_mul(1 << 20)),
            ),
        ]),
        ..Default::default()
    };
    Pod {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            labels: Some(labels),
            ..Default::default()
        },
        spec: Some(spec),
        status: None,
    }
}

fn mount(volume: &str, path: &str) -> VolumeMount {
    VolumeMount {
        name: volume.to_string(),
        mount_path: path.to_string(),
        ..Default::default()
    }
}

/// The pod that reads one file of the image (`/libraries`): the sandbox's lockdown, no
/// workspace, and `cat` instead of the runner; its log is the file.
pub(crate) fn reader_pod(
    profile: &SandboxProfile,
    settings: &PodSettings,
    name: &str,
    path: &str,
) -> Pod {
    let mut pod = sandbox_pod(profile, settings, name, "image-reader");
    if let Some(spec) = pod.spec.as_mut() {
        for container in &mut spec.containers {
            container.command = Some(vec!["cat".to_string(), "--".to_string(), path.to_string()]);
            container.stdin = Some(false);
            container.env = None;
            container.working_dir = None;
            container.volume_mounts = None;
        }
        spec.volumes = None;
    }
    pod
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_labels_are_label_values_and_give_the_id_back() {
        for id in [
            "-abcdefghijklmnopqrs_",
            "abcdefghijklmnopqrstu",
            "_____________________",
        ] {
            let label = session_label(id);
            assert!(crate::config::is_label_value(&label), "{label}");
            assert_eq!(session_of_label(&label).as_deref(), Some(id));
        }
        assert_eq!(session_of_label("abc"), None);
    }

    #[test]
    fn pod_names_are_dns_names_told_apart_in_twelve_characters() {
        let a = new_pod_name();
        let b = new_pod_name();
        assert_eq!(a.len(), 19);
        assert!(a
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'));
        assert_ne!(a[..12], b[..12]);
    }

    #[test]
    fn quantities_are_written_as_kubernetes_reads_them() {
        assert_eq!(bytes_quantity(1 << 30).0, "1024Mi");
        assert_eq!(bytes_quantity(1000).0, "1000");
        assert_eq!(cpu_quantity(1.0).0, "1000m");
        assert_eq!(cpu_quantity(0.25).0, "250m");
        assert_eq!(cpu_quantity(0.0001).0, "1m");
    }
}
