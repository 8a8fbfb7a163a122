//! The Docker profile of a sandbox: what `docker create` gets (mounts, limits, seccomp,
//! tmpfs sizes, ulimits), the lockdown SECURITY.md describes. The mirror of the
//! Kubernetes backend's `pod_spec.rs`.

use super::*;

impl DockerBackend {
    /// What `docker create` gets for a session's sandbox: the lockdown SECURITY.md describes ("Layers").
    pub(super) fn container_body(
        &self,
        session_id: &str,
        workspace: &Workspace,
        uid: u32,
        egress: Option<&crate::egress::gateway::SandboxEgress>,
    ) -> ContainerCreateBody {
        let c = &self.profile;
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let mut labels = HashMap::from([
            (labels::INSTANCE.to_string(), c.instance.clone()),
            (labels::SESSION.to_string(), session_id.to_string()),
            (labels::CREATED.to_string(), created.to_string()),
            (labels::UID.to_string(), uid.to_string()),
        ]);
        let mut binds = vec![
            format!("{}:{WORKDIR}:rw", workspace.files_dir().display()),
            format!("{}:/etc/passwd:ro", workspace.sandbox_passwd().display()),
            format!("{}:/etc/group:ro", workspace.sandbox_group().display()),
        ];
        if let Some((egress, dir)) = egress.and_then(|e| Some((e, e.dir()?))) {
            // The directory of its proxy socket, read-only: connecting needs no write.
            binds.push(format!(
                "{}:{}:ro",
                dir.display(),
                crate::egress::gateway::SANDBOX_DIR
            ));
            labels.insert(labels::EGRESS.to_string(), egress.name().to_string());
        }
        // Bounded at parse (at most 1 TiB), so this cannot overflow.
        let memory = i64::try_from(c.memory_mb.saturating_mul(1024 * 1024)).unwrap_or(i64::MAX);
        let tmpfs = HashMap::from([
            (
                "/tmp".to_string(),
                format!(
                    "rw,exec,nosuid,nodev,size={}m,nr_inodes={},mode=1777",
                    c.tmp_mb,
                    scratch_inodes(c.tmp_mb)
                ),
            ),
            (
                "/dev/shm".to_string(),
                format!(
                    "rw,noexec,nosuid,nodev,size={}m,nr_inodes={},mode=1777",
                    c.shm_mb,
                    scratch_inodes(c.shm_mb)
                ),
            ),
        ]);
        let ulimit = |name: &str, value: i64| ResourcesUlimits {
            name: Some(name.to_string()),
            soft: Some(value),
            hard: Some(value),
        };
        let host_config = HostConfig {
            binds: Some(binds),
            network_mode: Some(if c.network_none { "none" } else { "bridge" }.to_string()),
            cap_drop: c.drop_capabilities.then(|| vec!["ALL".to_string()]),
            // Whatever the capabilities: setuid binaries and file capabilities in the
            // image or the workspace never raise privileges.
            security_opt: Some(
                std::iter::once("no-new-privileges".to_string())
                    .chain(self.seccomp.iter().map(|json| format!("seccomp={json}")))
                    .collect(),
            ),
            // Its own cgroup namespace: on cgroup v1 hosts the sandbox would otherwise
            // read the host's cgroup paths in /proc/self/cgroup.
            cgroupns_mode: Some(HostConfigCgroupnsModeEnum::PRIVATE),
            readonly_rootfs: Some(c.readonly_rootfs),
            tmpfs: Some(tmpfs),
            pids_limit: Some(c.pids_limit),
            memory: Some(memory),
            memory_swap: Some(memory),
            nano_cpus: Some((c.cpus * 1e9) as i64),
            ulimits: Some(vec![
                ulimit("nofile", c.nofile),
                ulimit("fsize", fsize_bytes(c)),
            ]),
            ipc_mode: Some("private".to_string()),
            log_config: Some(HostConfigLogConfig {
                typ: Some("none".to_string()),
                config: None,
            }),
            init: Some(false),
            runtime: Some(c.runtime.trim())
                .filter(|r| !r.is_empty())
                .map(str::to_string),
            ..Default::default()
        };
        ContainerCreateBody {
            image: Some(c.image.clone()),
            user: Some(format!("{uid}:{uid}")),
            working_dir: Some(WORKDIR.to_string()),
            env: Some(self.sandbox_env()),
            open_stdin: Some(true),
            stdin_once: Some(false),
            attach_stdin: Some(true),
            attach_stdout: Some(true),
            attach_stderr: Some(true),
            tty: Some(false),
            network_disabled: Some(c.network_none),
            labels: Some(labels),
            host_config: Some(host_config),
            ..Default::default()
        }
    }

    /// The environment of every sandbox: its home and user, the limits the runner watches,
    /// its unattended limit, and what the egress gateway says (its proxy; with egress on,
    /// its socket and registries).
    fn sandbox_env(&self) -> Vec<String> {
        let c = &self.profile;
        let mut env = vec![
            format!("HOME={WORKDIR}"),
            // The uid has no entry in the image's /etc/passwd: the name is what
            // programs that ask (Python's getpass) read instead.
            "USER=sandbox".to_string(),
            "LOGNAME=sandbox".to_string(),
            // The runner watches the workspace against these during each exec.
            format!("CODEBROKER_WORKSPACE_QUOTA={}", c.workspace_quota),
            format!("CODEBROKER_WORKSPACE_MAX_FILES={}", c.workspace_max_files),
            // A kept container whose broker never comes back ends itself after the
            // idle TTL, as the reaper would have removed it.
            format!(
                "{}={}",
                sandbox_runner::UNATTENDED_EXIT_ENV,
                unattended_exit_ms(self.idle_ttl_secs)
            ),
        ];
        if let Some(gateway) = self.egress.get() {
            env.extend(gateway.sandbox_env());
        }
        env
    }
}

/// The `seccomp=` option for CODEBROKER_SECCOMP: the built-in profile, a file's (read and
/// checked to be JSON now, so a broken file stops the start rather than every sandbox),
/// or none for the daemon's default.
pub(super) fn seccomp_option(choice: &SeccompChoice) -> anyhow::Result<Option<String>> {
    let text = match choice {
        SeccompChoice::Daemon => return Ok(None),
        SeccompChoice::Builtin => BUILTIN_SECCOMP.to_string(),
        SeccompChoice::File(path) => std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the seccomp profile {}", path.display()))?,
    };
    // Sent compact: the profile travels in the create request of every sandbox.
    let profile: serde_json::Value =
        serde_json::from_str(&text).context("the seccomp profile is not JSON")?;
    if !profile.is_object() || profile.get("defaultAction").is_none() {
        anyhow::bail!("the seccomp profile has no defaultAction");
    }
    Ok(Some(profile.to_string()))
}

/// Inodes of a scratch tmpfs of `mb` MiB: 64 per MiB (at least 4096). Without a cap a
/// tmpfs allows about one inode per two pages of host RAM, and a million empty files cost
/// the host kernel memory the size limit does not see.
pub(super) fn scratch_inodes(mb: u64) -> u64 {
    mb.saturating_mul(64).max(4096)
}

/// The `fsize` ulimit: CODEBROKER_FSIZE_MB, and never over the workspace quota, so that a
/// single file cannot outgrow the quota between two of the runner's measurements.
pub(super) fn fsize_bytes(c: &SandboxProfile) -> i64 {
    let fsize = u64::try_from(c.fsize_mb)
        .unwrap_or(0)
        .saturating_mul(1024 * 1024);
    let bytes = match c.workspace_quota {
        0 => fsize,
        quota => fsize.min(quota),
    };
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

/// The sandboxes' syscall filter unless CODEBROKER_SECCOMP names another: Docker's
/// default profile for a container without capabilities, less io_uring and every socket
/// family but AF_UNIX, AF_INET, AF_INET6 and AF_NETLINK (each rule says why).
pub(crate) const BUILTIN_SECCOMP: &str = include_str!("../seccomp.json");
