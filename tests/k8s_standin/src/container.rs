//! A pod spec said as a Docker container, as far as a kubelet with Docker's runtime would
//! run it: one container, its command, env, user and security context, its limits, and
//! its `emptyDir` volumes (memory-backed ones as tmpfs, the others as host directories
//! the cluster makes for the pod, empty as the kubelet makes them). Pure, so the mapping
//! is tested on its own.

use bollard::models::{ContainerCreateBody, HostConfig, Mount, MountTypeEnum};
use serde_json::Value;
use std::collections::HashMap;

/// The label on every container of one stand-in; its value tells stand-ins apart.
pub(crate) const SERVER_LABEL: &str = "k8s-standin.server";

/// The prefix under which a pod's labels are copied onto its container: not the labels
/// themselves, so that nothing looking for Docker-backend containers takes these.
pub(crate) const POD_LABEL_PREFIX: &str = "k8s-standin.pod-label.";

/// Why a pod spec cannot be run, as the kubelet's waiting reason and message.
#[derive(Debug, PartialEq)]
pub(crate) struct Unrunnable {
    /// `CreateContainerConfigError` and the like.
    pub(crate) reason: &'static str,
    /// The kubelet's words.
    pub(crate) message: String,
}

fn config_error(message: impl Into<String>) -> Unrunnable {
    Unrunnable {
        reason: "CreateContainerConfigError",
        message: message.into(),
    }
}

/// Bytes in a Kubernetes quantity (`1024Mi`, `1Gi`, `500M`, `1000`, `1e3`).
pub(crate) fn quantity_bytes(q: &str) -> Option<u64> {
    let q = q.trim();
    let units: [(&str, u64); 12] = [
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("Pi", 1 << 50),
        ("Ei", 1 << 60),
        ("k", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
        ("P", 1_000_000_000_000_000),
        ("E", 1_000_000_000_000_000_000),
    ];
    for (suffix, factor) in units {
        if let Some(n) = q.strip_suffix(suffix) {
            return n.parse::<u64>().ok()?.checked_mul(factor);
        }
    }
    if let Ok(n) = q.parse::<u64>() {
        return Some(n);
    }
    q.parse::<f64>()
        .ok()
        .filter(|n| *n >= 0.0)
        .map(|n| n as u64)
}

/// Millicores in a CPU quantity (`1000m`, `1`, `0.5`).
pub(crate) fn quantity_millicores(q: &str) -> Option<u64> {
    let q = q.trim();
    if let Some(m) = q.strip_suffix('m') {
        return m.parse().ok();
    }
    q.parse::<f64>()
        .ok()
        .filter(|n| *n >= 0.0)
        .map(|n| (n * 1000.0).round() as u64)
}

/// The names of the pod's `emptyDir` volumes on the node's disk (not in memory), each a
/// directory the cluster makes before the container starts.
pub(crate) fn disk_volumes(pod: &Value) -> Vec<String> {
    pod["spec"]["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|v| v["emptyDir"].is_object() && v["emptyDir"]["medium"] != "Memory")
        .filter_map(|v| v["name"].as_str().map(str::to_string))
        .collect()
}

/// The Docker container of `pod`, labelled as the stand-in `server`'s, its disk volumes
/// the directories `volumes/<name>`; pods get the kubelet's `pids_limit`.
pub(crate) fn container_body(
    pod: &Value,
    server: &str,
    pids_limit: i64,
    volumes_dir: &std::path::Path,
) -> Result<ContainerCreateBody, Unrunnable> {
    let spec = &pod["spec"];
    let containers = spec["containers"].as_array().cloned().unwrap_or_default();
    let [c] = containers.as_slice() else {
        return Err(config_error(
            "the stand-in runs pods of exactly one container",
        ));
    };
    if spec["initContainers"]
        .as_array()
        .is_some_and(|a| !a.is_empty())
    {
        return Err(config_error("the stand-in runs no init containers"));
    }
    if spec["hostNetwork"] == true || spec["hostPID"] == true || spec["hostIPC"] == true {
        return Err(config_error("the stand-in runs no host namespaces"));
    }
    let image = c["image"]
        .as_str()
        .filter(|i| !i.is_empty())
        .ok_or_else(|| config_error("the container has no image"))?;
    let strings = |v: &Value| -> Option<Vec<String>> {
        v.as_array().map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect()
        })
    };

    let mut env = Vec::new();
    for e in c["env"].as_array().into_iter().flatten() {
        if !e["valueFrom"].is_null() {
            return Err(config_error("the stand-in does not resolve env valueFrom"));
        }
        let name = e["name"].as_str().unwrap_or_default();
        env.push(format!(
            "{name}={}",
            e["value"].as_str().unwrap_or_default()
        ));
    }

    // The container's security context wins over the pod's, field by field.
    let pod_sc = &spec["securityContext"];
    let sc = &c["securityContext"];
    let pick = |field: &str| -> &Value {
        if sc[field].is_null() {
            &pod_sc[field]
        } else {
            &sc[field]
        }
    };
    let uid = pick("runAsUser").as_i64();
    let gid = pick("runAsGroup").as_i64();
    if pick("runAsNonRoot") == true && uid.is_none_or(|u| u == 0) {
        return Err(config_error(
            "container has runAsNonRoot and image will run as root",
        ));
    }
    let user = match (uid, gid) {
        (Some(u), Some(g)) => Some(format!("{u}:{g}")),
        (Some(u), None) => Some(u.to_string()),
        _ => None,
    };
    let mut groups: Vec<String> = pod_sc["supplementalGroups"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_i64)
        .map(|g| g.to_string())
        .collect();
    if let Some(fs_group) = pod_sc["fsGroup"].as_i64() {
        groups.push(fs_group.to_string());
    }
    let mut security_opt = Vec::new();
    if sc["allowPrivilegeEscalation"] == false {
        security_opt.push("no-new-privileges".to_string());
    }
    match pick("seccompProfile")["type"].as_str() {
        None | Some("RuntimeDefault") => {}
        Some("Unconfined") => security_opt.push("seccomp=unconfined".to_string()),
        Some(other) => {
            return Err(config_error(format!(
                "the stand-in cannot apply seccomp profile type {other}"
            )))
        }
    }

    let limits = &c["resources"]["limits"];
    let requests = &c["resources"]["requests"];
    let memory = limits["memory"]
        .as_str()
        .and_then(quantity_bytes)
        .and_then(|b| i64::try_from(b).ok());
    let cpu_limit = limits["cpu"].as_str().and_then(quantity_millicores);
    // Requests default to limits, and a CPU request is the container's CPU weight.
    let cpu_request = requests["cpu"]
        .as_str()
        .and_then(quantity_millicores)
        .or(cpu_limit);

    let volumes = spec["volumes"].as_array().cloned().unwrap_or_default();
    let mut tmpfs = HashMap::new();
    let mut mounts = Vec::new();
    for m in c["volumeMounts"].as_array().into_iter().flatten() {
        let (Some(name), Some(path)) = (m["name"].as_str(), m["mountPath"].as_str()) else {
            return Err(config_error("a volume mount lacks its name or path"));
        };
        let Some(volume) = volumes.iter().find(|v| v["name"] == name) else {
            return Err(config_error(format!("volume {name} is not in the pod")));
        };
        let empty_dir = &volume["emptyDir"];
        if !empty_dir.is_object() {
            return Err(config_error(format!(
                "volume {name}: the stand-in has emptyDir volumes only"
            )));
        }
        let read_only = m["readOnly"] == true;
        if empty_dir["medium"] == "Memory" {
            // A memory-backed emptyDir is a tmpfs, as the kubelet mounts it, world-writable.
            // Docker makes a tmpfs noexec unless told; the kubelet's is not.
            let mut options = vec![
                if read_only { "ro" } else { "rw" }.to_string(),
                "exec".to_string(),
            ];
            if let Some(size) = empty_dir["sizeLimit"].as_str().and_then(quantity_bytes) {
                options.push(format!("size={size}"));
            }
            options.push("mode=0777".to_string());
            tmpfs.insert(path.to_string(), options.join(","));
        } else {
            // On the node's disk: the pod's directory for it. Its size limit is what the
            // kubelet enforces by eviction, not by the file system: not here.
            mounts.push(Mount {
                target: Some(path.to_string()),
                source: Some(volumes_dir.join(name).to_string_lossy().into_owned()),
                typ: Some(MountTypeEnum::BIND),
                read_only: Some(read_only),
                ..Default::default()
            });
        }
    }

    let mut labels = HashMap::from([(SERVER_LABEL.to_string(), server.to_string())]);
    for (key, value) in pod["metadata"]["labels"].as_object().into_iter().flatten() {
        if let Some(value) = value.as_str() {
            labels.insert(format!("{POD_LABEL_PREFIX}{key}"), value.to_string());
        }
    }
    for (key, field) in [
        ("k8s-standin.namespace", "namespace"),
        ("k8s-standin.pod", "name"),
        ("k8s-standin.uid", "uid"),
    ] {
        if let Some(value) = pod["metadata"][field].as_str() {
            labels.insert(key.to_string(), value.to_string());
        }
    }

    let host_config = HostConfig {
        // No network at all: what the NetworkPolicy denying all traffic gives a sandbox pod.
        network_mode: Some("none".to_string()),
        cap_drop: sc["capabilities"]["drop"]
            .as_array()
            .map(|_| strings(&sc["capabilities"]["drop"]).unwrap_or_default()),
        cap_add: strings(&sc["capabilities"]["add"]),
        privileged: Some(sc["privileged"] == true),
        security_opt: Some(security_opt),
        readonly_rootfs: Some(sc["readOnlyRootFilesystem"] == true),
        group_add: (!groups.is_empty()).then_some(groups),
        memory,
        // No swap on a node (the kubelet's default).
        memory_swap: memory,
        nano_cpus: cpu_limit.map(|m| (m * 1_000_000) as i64),
        cpu_shares: cpu_request.map(|m| (m * 1024 / 1000).max(2) as i64),
        pids_limit: Some(pids_limit),
        tmpfs: Some(tmpfs),
        mounts: Some(mounts),
        ipc_mode: Some("private".to_string()),
        init: Some(false),
        ..Default::default()
    };
    let stdin = c["stdin"] == true;
    Ok(ContainerCreateBody {
        image: Some(image.to_string()),
        // `command` replaces the image's entrypoint, `args` its command, as Kubernetes says.
        entrypoint: strings(&c["command"]),
        cmd: strings(&c["args"]),
        working_dir: c["workingDir"].as_str().map(str::to_string),
        env: Some(env),
        user,
        open_stdin: Some(stdin),
        stdin_once: Some(c["stdinOnce"] == true),
        attach_stdin: Some(stdin),
        attach_stdout: Some(true),
        attach_stderr: Some(true),
        tty: Some(c["tty"] == true),
        network_disabled: Some(true),
        labels: Some(labels),
        host_config: Some(host_config),
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod() -> Value {
        json!({
            "metadata": {"name": "cb-1", "namespace": "ns", "uid": "u-1",
                         "labels": {"codebroker.instance": "i"}},
            "spec": {
                "securityContext": {"runAsNonRoot": true, "runAsUser": 10001,
                                    "runAsGroup": 10001, "fsGroup": 10001,
                                    "seccompProfile": {"type": "RuntimeDefault"}},
                "containers": [{
                    "name": "sandbox", "image": "img:1", "stdin": true,
                    "env": [{"name": "A", "value": "1"}],
                    "resources": {"limits": {"memory": "1024Mi", "cpu": "500m"}},
                    "securityContext": {"allowPrivilegeEscalation": false,
                                        "readOnlyRootFilesystem": true,
                                        "capabilities": {"drop": ["ALL"]}},
                    "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"},
                                     {"name": "ws", "mountPath": "/mnt/data"}]
                }],
                "volumes": [{"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}},
                            {"name": "ws", "emptyDir": {"sizeLimit": "1Gi"}}]
            }
        })
    }

    #[test]
    fn quantities_read_as_kubernetes_writes_them() {
        assert_eq!(quantity_bytes("1024Mi"), Some(1 << 30));
        assert_eq!(quantity_bytes("500M"), Some(500_000_000));
        assert_eq!(quantity_bytes("1000"), Some(1000));
        assert_eq!(quantity_bytes("lots"), None);
        assert_eq!(quantity_millicores("250m"), Some(250));
        assert_eq!(quantity_millicores("1.5"), Some(1500));
    }

    #[test]
    fn the_lockdown_of_the_spec_becomes_the_containers() {
        let body = container_body(&pod(), "s1", 1024, std::path::Path::new("/v")).expect("runs");
        assert_eq!(body.user.as_deref(), Some("10001:10001"));
        assert_eq!(body.open_stdin, Some(true));
        assert_eq!(body.env, Some(vec!["A=1".to_string()]));
        let host = body.host_config.expect("host config");
        assert_eq!(host.network_mode.as_deref(), Some("none"));
        assert_eq!(host.cap_drop, Some(vec!["ALL".to_string()]));
        assert_eq!(
            host.security_opt,
            Some(vec!["no-new-privileges".to_string()])
        );
        assert_eq!(host.readonly_rootfs, Some(true));
        assert_eq!(host.memory, Some(1 << 30));
        assert_eq!(host.nano_cpus, Some(500_000_000));
        assert_eq!(host.cpu_shares, Some(512));
        assert_eq!(host.group_add, Some(vec!["10001".to_string()]));
        let tmpfs = host.tmpfs.expect("tmpfs");
        assert_eq!(
            tmpfs["/tmp"],
            format!("rw,exec,size={},mode=0777", 64 << 20)
        );
        let mounts = host.mounts.expect("mounts");
        assert_eq!(mounts[0].target.as_deref(), Some("/mnt/data"));
        assert_eq!(mounts[0].source.as_deref(), Some("/v/ws"));
        assert_eq!(disk_volumes(&pod()), vec!["ws".to_string()]);
        let labels = body.labels.expect("labels");
        assert_eq!(labels[SERVER_LABEL], "s1");
        assert_eq!(labels["k8s-standin.pod-label.codebroker.instance"], "i");
        assert!(!labels.contains_key("codebroker.instance"));
    }

    #[test]
    fn what_the_stand_in_cannot_run_is_a_config_error() {
        let mut root = pod();
        root["spec"]["securityContext"]["runAsUser"] = json!(0);
        let err = container_body(&root, "s", 1, std::path::Path::new("/v")).expect_err("root");
        assert_eq!(err.reason, "CreateContainerConfigError");
        assert!(err.message.contains("runAsNonRoot"), "{}", err.message);

        let mut host_path = pod();
        host_path["spec"]["volumes"][1] = json!({"name": "ws", "hostPath": {"path": "/"}});
        let err =
            container_body(&host_path, "s", 1, std::path::Path::new("/v")).expect_err("hostPath");
        assert!(err.message.contains("emptyDir"), "{}", err.message);

        let mut two = pod();
        let c = two["spec"]["containers"][0].clone();
        two["spec"]["containers"] = json!([c.clone(), c]);
        assert!(container_body(&two, "s", 1, std::path::Path::new("/v")).is_err());
    }
}
