//! The Docker engine as the suites and the bench see it from outside the broker: the
//! sandbox image, an instance's containers by label, `docker inspect`, and cleanup.

use serde_json::Value;
use std::process::{Command, Output};

/// The sandbox image under test: `CODEBROKER_IMAGE` (as the broker reads it), else the
/// image `make image` builds.
pub fn image() -> String {
    std::env::var("CODEBROKER_IMAGE").unwrap_or_else(|_| "codebroker-sandbox:latest".into())
}

/// Fails the test at once, with the fix, when the sandbox image is missing.
pub fn require_image() {
    let image = image();
    let ok = Command::new("docker")
        .args(["image", "inspect", &image])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    assert!(
        ok,
        "the sandbox image {image} is missing: run `make image` first"
    );
}

/// `docker <args>`, its output; panics only when the CLI cannot be started.
pub fn docker(args: &[&str]) -> Output {
    Command::new("docker")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("docker {args:?}: {e}"))
}

/// Whether the suites run on the Kubernetes backend (`CODEBROKER_BACKEND=kubernetes`, as
/// `make test-k8s` sets it): then an instance's sandboxes are pods, which the stand-in
/// API server (tests/k8s_standin) runs as containers with the pod's labels copied under
/// a prefix of its own.
pub fn kubernetes() -> bool {
    std::env::var("CODEBROKER_BACKEND").is_ok_and(|b| b.eq_ignore_ascii_case("kubernetes"))
}

/// A Docker label filter (`key=value`) for a sandbox label: on the Kubernetes backend,
/// the stand-in's copy of the pod label (a session label's value is `s-<id>-s` there).
fn label_filter(label: &str) -> String {
    if !kubernetes() {
        return label.to_string();
    }
    match label.split_once('=') {
        Some(("codebroker.session", id)) => {
            format!("k8s-standin.pod-label.codebroker.session=s-{id}-s")
        }
        _ => format!("k8s-standin.pod-label.{label}"),
    }
}

/// Ids of this instance's containers, stopped ones included.
pub fn containers_of(instance: &str) -> Vec<String> {
    containers_matching(instance, &[])
}

/// Ids of this instance's containers that also carry every label in `labels` (`k=v`).
pub fn containers_matching(instance: &str, labels: &[&str]) -> Vec<String> {
    list_containers(instance, labels, true)
}

/// Ids of this instance's running containers.
pub fn running_containers_of(instance: &str) -> Vec<String> {
    list_containers(instance, &[], false)
}

/// `docker ps` on the instance label and `labels`; with `all`, stopped containers too.
fn list_containers(instance: &str, labels: &[&str], all: bool) -> Vec<String> {
    let mut args = vec!["ps".to_string(), "-q".into(), "--no-trunc".into()];
    if all {
        args.push("-a".into());
    }
    let instance = format!("codebroker.instance={instance}");
    for label in std::iter::once(instance.as_str()).chain(labels.iter().copied()) {
        args.extend([
            "--filter".to_string(),
            format!("label={}", label_filter(label)),
        ]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    // The daemon may fail a listing that races a removal ("No such container") while
    // other tests tear down; an empty answer from a failed call would read as "none".
    let mut out = docker(&args);
    for _ in 0..10 {
        if out.status.success() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
        out = docker(&args);
    }
    assert!(
        out.status.success(),
        "docker {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .filter(|l| !l.is_empty())
        .collect()
}

/// The id of the one container of this instance labelled with `session_id`.
pub fn container_of(instance: &str, session_id: &str) -> String {
    let label = format!("codebroker.session={session_id}");
    let ids = containers_matching(instance, &[&label]);
    assert_eq!(ids.len(), 1, "containers of {session_id}: {ids:?}");
    ids[0].clone()
}

/// Removes every container of the instance, as a broker that never came back would leave
/// them.
pub fn remove_containers_of(instance: &str) {
    let ids = containers_of(instance);
    if !ids.is_empty() {
        let _ = Command::new("docker")
            .arg("rm")
            .arg("-f")
            .args(&ids)
            .output();
    }
}

/// `docker kill` of one container from outside the broker.
pub fn kill_container(id: &str) -> Output {
    docker(&["kill", id])
}

/// `docker inspect` of one container, as JSON.
pub fn inspect(id: &str) -> Value {
    let out = docker(&["inspect", id]);
    let list: Value = serde_json::from_slice(&out.stdout).expect("inspect json");
    list[0].clone()
}

/// Whether the container is running (a removed one is not).
pub fn is_running(id: &str) -> bool {
    inspect(id)["State"]["Running"].as_bool().unwrap_or(false)
}

/// Removes an instance's containers when dropped, however the test ends.
pub struct RemoveContainers(pub String);

impl Drop for RemoveContainers {
    fn drop(&mut self) {
        remove_containers_of(&self.0);
    }
}

/// The full id of a container named by a short id.
pub fn full_id(id: &str) -> String {
    inspect(id)["Id"].as_str().unwrap_or(id).to_string()
}

/// CPU time a container has used so far, from its cgroup (v1, then v2 with the systemd
/// driver); `None` when neither can be read.
pub fn container_cpu(id: &str) -> Option<std::time::Duration> {
    let id = full_id(id);
    if let Ok(ns) =
        std::fs::read_to_string(format!("/sys/fs/cgroup/cpuacct/docker/{id}/cpuacct.usage"))
    {
        return ns.trim().parse().ok().map(std::time::Duration::from_nanos);
    }
    let stat = std::fs::read_to_string(format!(
        "/sys/fs/cgroup/system.slice/docker-{id}.scope/cpu.stat"
    ))
    .ok()?;
    stat.lines()
        .find_map(|l| l.strip_prefix("usage_usec "))
        .and_then(|v| v.trim().parse().ok())
        .map(std::time::Duration::from_micros)
}

/// Memory charged to a container now, from its cgroup (v1, then v2), in bytes: all of
/// it (page cache included, charged to the first container that read a file), and its
/// anonymous memory alone (what the container's processes hold of their own).
pub fn container_memory(id: &str) -> Option<(u64, u64)> {
    let id = full_id(id);
    let read = |paths: [String; 2]| paths.iter().find_map(|p| std::fs::read_to_string(p).ok());
    let total = read([
        format!("/sys/fs/cgroup/memory/docker/{id}/memory.usage_in_bytes"),
        format!("/sys/fs/cgroup/system.slice/docker-{id}.scope/memory.current"),
    ])?
    .trim()
    .parse()
    .ok()?;
    let stat = read([
        format!("/sys/fs/cgroup/memory/docker/{id}/memory.stat"),
        format!("/sys/fs/cgroup/system.slice/docker-{id}.scope/memory.stat"),
    ])?;
    let anon = stat
        .lines()
        .find_map(|l| l.strip_prefix("rss ").or_else(|| l.strip_prefix("anon ")))
        .and_then(|v| v.trim().parse().ok())?;
    Some((total, anon))
}

/// Waits until a container's CPU use stops growing (less than 5 ms over half a second),
/// at most `within`; the CPU it had used by then, or `None` when its cgroup cannot be read
/// (after waiting `within`).
pub async fn wait_until_idle(id: &str, within: std::time::Duration) -> Option<std::time::Duration> {
    let step = std::time::Duration::from_millis(500);
    let deadline = std::time::Instant::now() + within;
    let Some(mut last) = container_cpu(id) else {
        tokio::time::sleep(within).await;
        return None;
    };
    while std::time::Instant::now() < deadline {
        tokio::time::sleep(step).await;
        let now = container_cpu(id)?;
        if now.saturating_sub(last) < std::time::Duration::from_millis(5) {
            return Some(now);
        }
        last = now;
    }
    Some(last)
}
