// Over 600 lines: the last quarter is the tests of the lockdown each sandbox gets.
//! Sandboxes as Docker containers, driven through the Engine API (bollard).

use super::channel::AttachOutput;
use super::engine::{EngineObserver, SandboxUnavailable};
use super::uids::SandboxUidPool;
use super::{
    heartbeat_every, labels, short, unattended_exit_ms, CpuWeight, Listed, RunnerChannel, Sandbox,
    Warmup, WORKDIR,
};
use crate::config::{SandboxProfile, SandboxUids, SeccompChoice};
use crate::sync::LockExt as _;
use crate::workspace::Workspace;
use anyhow::{anyhow, Context};
use bollard::container::LogOutput;
use bollard::models::{
    ContainerCreateBody, HostConfig, HostConfigCgroupnsModeEnum, HostConfigLogConfig,
    ResourcesUlimits,
};
use bollard::query_parameters::{
    AttachContainerOptionsBuilder, DownloadFromContainerOptionsBuilder, EventsOptionsBuilder,
    InspectContainerOptions, ListContainersOptionsBuilder, RemoveContainerOptionsBuilder,
    WaitContainerOptions,
};
use futures::{StreamExt, TryStreamExt};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

mod engine;
mod profile;

use profile::seccomp_option;
#[cfg(test)]
pub(crate) use profile::BUILTIN_SECCOMP;

/// The CPU weight (cgroup `cpu.shares`) of a pooled container while it preloads: the
/// lowest there is, so that it only takes CPU no other container wants.
const LOW_CPU_SHARES: i64 = 2;

/// The CPU weight of every other container (the engine's default).
const USUAL_CPU_SHARES: i64 = 1024;

/// How long a new runner may take to answer its first hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(20);

/// How long to wait for the engine to record the end of a container whose runner went
/// away, before asking how it ended.
const EXIT_WAIT: Duration = Duration::from_secs(5);

/// How long an `oom` event may come in after the container's exit is recorded.
const OOM_EVENT_WAIT: Duration = Duration::from_secs(2);

/// The name the sandbox's uid has in its account files.
const SANDBOX_USER: &str = "sandbox";

/// The accounts a sandbox has when the image's own cannot be read.
const FALLBACK_PASSWD: &str = "root:x:0:0:root:/root:/usr/sbin/nologin\n\
     nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n";

/// The groups a sandbox has when the image's own cannot be read.
const FALLBACK_GROUP: &str = "root:x:0:\nnogroup:x:65534:\n";

/// Creates, attaches to, and removes sandbox containers.
pub(crate) struct DockerBackend {
    /// The Engine API client, version negotiated.
    docker: bollard::Docker,
    /// Image, limits, lockdown, labels and file path: the sandbox group of the settings.
    profile: SandboxProfile,
    /// The broker's idle TTL, from which the runner's unattended limit and the heartbeat
    /// rate are made (a runner must outlive any idle session its broker keeps).
    idle_ttl_secs: u64,
    /// Told of failed Engine API calls (the broker's metrics), so that an engine in
    /// trouble shows on `/metrics`; unset until the broker installs it.
    pub(super) observer: std::sync::OnceLock<Arc<dyn EngineObserver>>,
    /// Where the sandboxes' proxy connections go (a socket per sandbox, mounted) and what
    /// their environment says of it; unset until the broker installs it.
    pub(super) egress: std::sync::OnceLock<Arc<crate::egress::gateway::Gateway>>,
    /// The egress socket of each container that has one: its directory goes when the
    /// container is removed (not when the broker stops: a kept container mounts it, and a
    /// restarted broker serves it again).
    egress_sockets: std::sync::Mutex<HashMap<String, String>>,
    /// The Docker host's memory in bytes (`docker info`), what CODEBROKER_MAX_CONTAINERS
    /// `auto` is made from; `None` when the engine does not say. The broker may itself
    /// run in a container, so its own view of memory is not the host's.
    pub(crate) host_memory: Option<u64>,
    /// The `seccomp=` security option every sandbox gets (`None`: the daemon's default),
    /// the profile's JSON read once at start-up.
    seccomp: Option<String>,
    /// Whether a running sandbox's CPU weight can be changed: false under gVisor, whose
    /// `runsc` refuses `docker update`, so the pool stops asking (and logging) per container.
    cpu_weight_settable: AtomicBool,
    /// The uid each container runs as: one of its own, so that code escaping one sandbox
    /// owns no other's processes or files.
    uids: SandboxUidPool,
    /// The image's `/etc/passwd` and `/etc/group`, read once: each sandbox gets them with
    /// its own uid as `sandbox`, since programs that look their uid up (LibreOffice,
    /// `whoami`, Node's `os.userInfo`) fail on a uid without an entry.
    image_accounts: tokio::sync::OnceCell<Accounts>,
}

/// A sandbox's account files (`/etc/passwd`, `/etc/group`).
#[derive(Debug, Clone)]
struct Accounts {
    /// The lines of `/etc/passwd`.
    passwd: String,
    /// The lines of `/etc/group`.
    group: String,
}

impl Accounts {
    /// These accounts, with `sandbox` (and any other entry of `uid`) replaced by `uid`'s,
    /// home `/mnt/data`.
    fn for_uid(&self, uid: u32) -> Accounts {
        let uid_field = uid.to_string();
        let keep = |text: &str, entry: String| {
            let mut out: String = text
                .lines()
                .filter(|line| {
                    let mut fields = line.split(':');
                    let name = fields.next().unwrap_or_default();
                    let id = fields.nth(1).unwrap_or_default();
                    !line.trim().is_empty() && name != SANDBOX_USER && id != uid_field
                })
                .map(|line| format!("{line}\n"))
                .collect();
            out.push_str(&entry);
            out
        };
        Accounts {
            passwd: keep(
                &self.passwd,
                format!("{SANDBOX_USER}:x:{uid}:{uid}::{WORKDIR}:/bin/bash\n"),
            ),
            group: keep(&self.group, format!("{SANDBOX_USER}:x:{uid}:\n")),
        }
    }
}

/// Whether `runtime` (the `HostConfig.Runtime` name) is gVisor's, by its usual names.
fn is_gvisor(runtime: &str) -> bool {
    let name = runtime.trim();
    name.contains("runsc") || name.contains("gvisor")
}

/// Whether an engine error says the OCI runtime itself refused an update (gVisor's
/// `runsc` answers `update` with its usage and exit status 128), not that one container
/// is gone or the engine is busy.
fn runtime_cannot_update(error: &str) -> bool {
    error.contains("did not terminate successfully") && error.contains("Cannot update container")
}

impl DockerBackend {
    /// Connects to the local engine (`DOCKER_HOST` or the default socket) and negotiates
    /// the API version, so Docker 20.10 (API 1.41) works as well as newer engines.
    pub(crate) async fn connect(
        profile: SandboxProfile,
        idle_ttl_secs: u64,
    ) -> anyhow::Result<DockerBackend> {
        let docker = bollard::Docker::connect_with_local_defaults()
            .context("cannot reach the Docker engine")?
            .negotiate_version()
            .await
            .context("cannot negotiate the Docker API version")?;
        let host_memory = match docker.info().await {
            Ok(info) => info.mem_total.and_then(|m| u64::try_from(m).ok()),
            Err(err) => {
                tracing::warn!(error = %err, "cannot read the Docker host's memory");
                None
            }
        };
        let seccomp = seccomp_option(&profile.seccomp)?;
        let profile_runtime = profile.runtime.clone();
        let uids = SandboxUidPool::new(profile.sandbox_uids());
        Ok(DockerBackend {
            docker,
            profile,
            idle_ttl_secs,
            observer: std::sync::OnceLock::new(),
            egress: std::sync::OnceLock::new(),
            egress_sockets: std::sync::Mutex::default(),
            host_memory,
            seccomp,
            cpu_weight_settable: AtomicBool::new(!is_gvisor(&profile_runtime)),
            uids,
            image_accounts: tokio::sync::OnceCell::new(),
        })
    }

    /// How files move between the broker and its sandboxes.
    pub(super) fn file_transfer(&self) -> crate::config::FileTransfer {
        self.profile.file_transfer
    }

    /// Who the files placed in `workspace` for its code belong to: the one sandbox uid, or
    /// the uid the workspace was last handed to (its sandbox's), or else the range's
    /// first, which no sandbox runs as (the next sandbox is handed them all).
    pub(super) fn workspace_owner(&self, workspace: &Workspace) -> std::io::Result<u32> {
        match self.profile.sandbox_uids() {
            SandboxUids::Shared(uid) => Ok(uid),
            SandboxUids::Own(range) => {
                let handed = workspace.handed_to()?;
                Ok(Some(handed)
                    .filter(|uid| range.contains(*uid))
                    .unwrap_or(range.first))
            }
        }
    }

    /// Counts one failed Engine API call of `op`.
    fn failed(&self, op: &str) {
        if let Some(observer) = self.observer.get() {
            observer.api_error(op);
        }
    }

    /// Whether the engine answers.
    pub(crate) async fn ping(&self) -> bool {
        self.docker.ping().await.is_ok()
    }

    /// Whether the sandbox image is present.
    pub(crate) async fn image_present(&self) -> bool {
        self.docker.inspect_image(&self.profile.image).await.is_ok()
    }

    /// Creates and starts a sandbox for `session_id` on `workspace`, attached before it
    /// starts so no frame is missed, and waits for its runner to answer. The sandbox gets
    /// a uid no live sandbox has, and the workspace's files are handed to it first: the
    /// session's earlier sandboxes wrote them as other uids.
    pub(crate) async fn create(
        &self,
        session_id: &str,
        workspace: &Workspace,
        warmup: Warmup,
    ) -> anyhow::Result<Sandbox> {
        let uid = self
            .uids
            .take()
            .map_err(|e| anyhow::Error::new(SandboxUnavailable(e.to_string())))?;
        let t0 = std::time::Instant::now();
        let accounts = self.image_accounts().await.for_uid(uid);
        let handed = {
            let workspace = workspace.clone();
            tokio::task::spawn_blocking(move || {
                workspace.hand_to(uid)?;
                workspace.write_accounts(accounts.passwd.as_bytes(), accounts.group.as_bytes())
            })
            .await
        };
        let t_hand = t0.elapsed();
        let egress = match self.open_egress(&crate::ids::new_id()) {
            Ok(egress) => egress,
            Err(err) => {
                self.uids.untake(uid);
                return Err(err);
            }
        };
        let created = match handed {
            Ok(Ok(())) => {
                let body = self.container_body(session_id, workspace, uid, egress.as_deref());
                self.docker
                    .create_container(
                        None::<bollard::query_parameters::CreateContainerOptions>,
                        body,
                    )
                    .await
                    .inspect_err(|_| self.failed("create"))
                    .context("docker create failed")
            }
            Ok(Err(err)) => Err(anyhow::Error::new(err).context(format!(
                "cannot hand the workspace of {session_id} to uid {uid}"
            ))),
            Err(err) => Err(anyhow!("handing a workspace to uid {uid} failed: {err}")),
        };
        let id = match created {
            Ok(created) => created.id,
            Err(err) => {
                self.uids.untake(uid);
                return Err(err);
            }
        };
        self.uids.bind(&id, uid);
        if let Some(egress) = &egress {
            self.egress_sockets
                .locked()
                .insert(id.clone(), egress.name().to_string());
        }
        let t_create = t0.elapsed();
        let sandbox = async {
            let channel = self.attach_channel(&id).await?;
            let t_attach = t0.elapsed();
            self.docker
                .start_container(
                    &id,
                    None::<bollard::query_parameters::StartContainerOptions>,
                )
                .await
                .inspect_err(|_| self.failed("start"))
                .context("docker start failed")?;
            let t_start = t0.elapsed();
            let sandbox = Sandbox::new(id.clone(), channel).with_egress(egress);
            tokio::time::timeout(HELLO_TIMEOUT, sandbox.hello(warmup))
                .await
                .map_err(|_| anyhow!("the runner did not answer within {HELLO_TIMEOUT:?}"))?
                .context("the runner did not answer")?;
            let sandbox = sandbox.tunnel_egress(self.egress.get()).await?;
            // Where a start's time goes, for profiling bursts (see docs/PERFORMANCE.md).
            tracing::debug!(
                container = %short(&id),
                uid,
                hand = ?t_hand,
                create = ?(t_create - t_hand),
                attach = ?(t_attach - t_create),
                start = ?(t_start - t_attach),
                hello = ?(t0.elapsed() - t_start),
                ?warmup,
                "sandbox started"
            );
            anyhow::Ok(sandbox)
        }
        .await;
        if sandbox.is_err() {
            self.remove(&id).await;
        }
        sandbox
    }

    /// The image's account files, read at the first start of a sandbox (the minimal ones
    /// if the image has none: a sandbox still starts).
    async fn image_accounts(&self) -> &Accounts {
        self.image_accounts
            .get_or_init(|| async {
                let read = |path| async move {
                    self.read_image_file(path)
                        .await
                        .ok()
                        .and_then(|bytes| String::from_utf8(bytes).ok())
                };
                let passwd = read("/etc/passwd").await;
                let group = read("/etc/group").await;
                if passwd.is_none() || group.is_none() {
                    tracing::warn!(image = %self.profile.image, "cannot read the image's /etc/passwd and /etc/group: sandboxes get minimal ones");
                }
                Accounts {
                    passwd: passwd.unwrap_or_else(|| FALLBACK_PASSWD.to_string()),
                    group: group.unwrap_or_else(|| FALLBACK_GROUP.to_string()),
                }
            })
            .await
    }

    /// Re-attaches to a running container of ours (after a broker restart).
    pub(crate) async fn adopt(&self, container_id: &str) -> anyhow::Result<Sandbox> {
        // Its egress socket is served again at the path the container mounts.
        let egress_name = self
            .docker
            .inspect_container(
                container_id,
                None::<bollard::query_parameters::InspectContainerOptions>,
            )
            .await
            .inspect_err(|_| self.failed("inspect"))
            .context("docker inspect failed")?
            .config
            .and_then(|c| c.labels)
            .and_then(|l| l.get(labels::EGRESS).cloned());
        let egress = match egress_name {
            Some(name) => self.open_egress(&name)?,
            None => None,
        };
        if let Some(egress) = &egress {
            self.egress_sockets
                .locked()
                .insert(container_id.to_string(), egress.name().to_string());
        }
        let channel = self.attach_channel(container_id).await?;
        let sandbox = Sandbox::adopted(container_id.to_string(), channel, HELLO_TIMEOUT).await?;
        sandbox
            .with_egress(egress)
            .tunnel_egress(self.egress.get())
            .await
    }

    /// The egress socket `name` of a new or adopted sandbox, when egress is on through
    /// sockets.
    fn open_egress(
        &self,
        name: &str,
    ) -> anyhow::Result<Option<Arc<crate::egress::gateway::SandboxEgress>>> {
        match self.egress.get() {
            Some(gateway) if gateway.uses_sockets() => gateway
                .open(name)
                .map(Some)
                .with_context(|| format!("cannot open the egress socket {name}")),
            _ => Ok(None),
        }
    }

    async fn attach_channel(&self, id: &str) -> anyhow::Result<RunnerChannel> {
        let options = AttachContainerOptionsBuilder::new()
            .stdin(true)
            .stdout(true)
            .stderr(true)
            .stream(true)
            .logs(false)
            .build();
        let attached = self
            .docker
            .attach_container(id, Some(options))
            .await
            .inspect_err(|_| self.failed("attach"))
            .context("docker attach failed")?;
        let output = attached.output.map(|item| match item {
            Ok(LogOutput::StdErr { message }) => Ok(AttachOutput::Stderr(message)),
            Ok(LogOutput::StdOut { message } | LogOutput::Console { message }) => {
                Ok(AttachOutput::Stdout(message))
            }
            Ok(LogOutput::StdIn { .. }) => Ok(AttachOutput::Stderr(bytes::Bytes::new())),
            Err(err) => Err(err.to_string()),
        });
        let channel = RunnerChannel::new(short(id), output, attached.input);
        Ok(channel.with_heartbeat(heartbeat_every(self.idle_ttl_secs)))
    }

    /// Sets a container's CPU weight ([`LOW_CPU_SHARES`] or [`USUAL_CPU_SHARES`]);
    /// whether the engine did. Under a runtime that cannot change a running container's
    /// resources (gVisor's `runsc` has no `update`), nothing is asked and the answer is
    /// `false`: pooled sandboxes then preload at the usual weight.
    pub(crate) async fn set_cpu_weight(&self, id: &str, weight: CpuWeight) -> bool {
        if !self.cpu_weight_settable.load(Ordering::Relaxed) {
            return false;
        }
        let shares = match weight {
            CpuWeight::Low => LOW_CPU_SHARES,
            CpuWeight::Usual => USUAL_CPU_SHARES,
        };
        let body = bollard::models::ContainerUpdateBody {
            cpu_shares: Some(shares),
            ..Default::default()
        };
        match self.docker.update_container(id, body).await {
            Ok(_) => true,
            Err(err) if runtime_cannot_update(&err.to_string()) => {
                // The runtime, not this container: asking again would fail the same way.
                self.cpu_weight_settable.store(false, Ordering::Relaxed);
                tracing::info!(runtime = %self.profile.runtime.trim(), "the sandbox runtime cannot change a running container's CPU weight: pooled sandboxes preload at the usual weight");
                false
            }
            Err(err) => {
                self.failed("update");
                tracing::warn!(container = %short(id), ?weight, error = %err, "cannot set the CPU weight of a sandbox");
                false
            }
        }
    }

    /// Removes a container, whatever state it is in. Failures are logged: the reconciler
    /// at the next start removes what is left.
    pub(crate) async fn remove(&self, id: &str) {
        let options = RemoveContainerOptionsBuilder::new()
            .force(true)
            .v(true)
            .build();
        match self.docker.remove_container(id, Some(options)).await {
            // Gone: its uid may serve another sandbox. A container that may still exist
            // keeps its uid, until a later removal (the reconciler's) succeeds.
            Ok(_)
            | Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 404, ..
            }) => {
                self.uids.release(id);
                let socket = self.egress_sockets.locked().remove(id);
                if let (Some(name), Some(gateway)) = (socket, self.egress.get()) {
                    gateway.remove(&name);
                }
            }
            Err(err) => {
                self.failed("remove");
                tracing::warn!(container = %short(id), error = %err, "cannot remove container");
            }
        }
    }

    /// Whether the container ended because its memory cgroup ran out during an exec that
    /// started at `since`: it has stopped with a failing exit code, and the engine reported
    /// an `oom` event for it since then. Under runc the runner survives an OOM kill and
    /// reports it itself; under gVisor (runsc) the host kills the whole sandbox and only
    /// the engine can tell. The event, not `State.OOMKilled`: that flag stays set for the
    /// container's life once any process was OOM-killed, and Docker 20.10 leaves it unset
    /// when the OOM event comes in after the exit.
    pub(crate) async fn ended_out_of_memory(&self, id: &str, since: SystemTime) -> bool {
        let running = |state: &Option<bollard::models::ContainerState>| {
            state.as_ref().is_some_and(|s| s.running == Some(true))
        };
        // Still running (the runner's stdio broke, the container did not): no exit to
        // wait for.
        if let Ok(info) = self
            .docker
            .inspect_container(id, None::<InspectContainerOptions>)
            .await
        {
            if running(&info.state) {
                let mut exited = self.docker.wait_container(id, None::<WaitContainerOptions>);
                // A non-zero exit is an `Err` of the wait; the inspect below reads the state.
                let _ = tokio::time::timeout(EXIT_WAIT, exited.next()).await;
            }
        }
        let state = match self
            .docker
            .inspect_container(id, None::<InspectContainerOptions>)
            .await
        {
            Ok(info) => info.state,
            Err(err) => {
                self.failed("inspect");
                tracing::warn!(container = %short(id), error = %err, "cannot inspect container");
                return false;
            }
        };
        state.as_ref().is_some_and(stopped_failing) && self.oom_event_since(id, since).await
    }

    /// Whether the engine reported an `oom` event for container `id` since `since`,
    /// waiting [`OOM_EVENT_WAIT`] for one still on its way.
    async fn oom_event_since(&self, id: &str, since: SystemTime) -> bool {
        // The engine takes `seconds.nanoseconds`; both clocks are the host's.
        let stamp = |t: SystemTime| {
            let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
            format!("{}.{:09}", d.as_secs(), d.subsec_nanos())
        };
        let filters = HashMap::from([
            ("container".to_string(), vec![id.to_string()]),
            ("event".to_string(), vec!["oom".to_string()]),
        ]);
        let options = EventsOptionsBuilder::new()
            .since(&stamp(since))
            .until(&stamp(SystemTime::now() + OOM_EVENT_WAIT))
            .filters(&filters)
            .build();
        let mut events = self.docker.events(Some(options));
        match tokio::time::timeout(OOM_EVENT_WAIT + Duration::from_secs(1), events.next()).await {
            Ok(Some(Ok(_))) => true,
            Ok(Some(Err(err))) => {
                self.failed("events");
                tracing::warn!(container = %short(id), error = %err, "cannot read engine events");
                false
            }
            Ok(None) | Err(_) => false,
        }
    }

    /// Every container carrying this instance's label.
    pub(crate) async fn list_own(&self) -> anyhow::Result<Vec<Listed>> {
        let filters = HashMap::from([(
            "label".to_string(),
            vec![format!("{}={}", labels::INSTANCE, self.profile.instance)],
        )]);
        let options = ListContainersOptionsBuilder::new()
            .all(true)
            .filters(&filters)
            .build();
        let list = self
            .docker
            .list_containers(Some(options))
            .await
            .inspect_err(|_| self.failed("list"))
            .context("docker ps failed")?;
        Ok(list
            .into_iter()
            .filter_map(|c| {
                let id = c.id?;
                let session = c
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(labels::SESSION).cloned());
                // Whatever becomes of the container, its uid is not handed out while it
                // may run.
                if let Some(uid) = c
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(labels::UID))
                    .and_then(|uid| uid.parse().ok())
                {
                    self.uids.hold(&id, uid);
                }
                let running = c.state.map(|s| s.to_string() == "running").unwrap_or(false);
                Some(Listed {
                    id,
                    session,
                    running,
                })
            })
            .collect())
    }

    /// Reads one file out of the sandbox image, without starting a container.
    pub(crate) async fn read_image_file(&self, path: &str) -> anyhow::Result<Vec<u8>> {
        let body = ContainerCreateBody {
            image: Some(self.profile.image.clone()),
            labels: Some(HashMap::from([(
                labels::INSTANCE.to_string(),
                self.profile.instance.clone(),
            )])),
            network_disabled: Some(true),
            ..Default::default()
        };
        let id = self
            .docker
            .create_container(
                None::<bollard::query_parameters::CreateContainerOptions>,
                body,
            )
            .await
            .inspect_err(|_| self.failed("read_image"))
            .context("docker create failed")?
            .id;
        let options = DownloadFromContainerOptionsBuilder::new()
            .path(path)
            .build();
        let tar_bytes: Result<Vec<u8>, _> = self
            .docker
            .download_from_container(&id, Some(options))
            .map_ok(|b| b.to_vec())
            .try_concat()
            .await;
        self.remove(&id).await;
        if tar_bytes.is_err() {
            self.failed("read_image");
        }
        let tar_bytes = tar_bytes.with_context(|| format!("cannot read {path} from the image"))?;
        let mut archive = tar::Archive::new(&tar_bytes[..]);
        let mut entry = archive
            .entries()?
            .next()
            .ok_or_else(|| anyhow!("empty archive for {path}"))??;
        let mut out = Vec::new();
        std::io::Read::read_to_end(&mut entry, &mut out)?;
        Ok(out)
    }
}

/// Whether a container has stopped with a failing exit code: how one ended by the OOM
/// killer looks, given an `oom` event. Not only 137 (SIGKILL): under runsc the killer
/// may take one of gVisor's own processes rather than its kernel, and the sandbox then
/// exits with another code (2 here, for one to four of eight sandboxes that hit their
/// limit at once).
fn stopped_failing(state: &bollard::models::ContainerState) -> bool {
    state.running != Some(true) && state.exit_code.is_some_and(|code| code != 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use std::path::Path;

    #[test]
    fn heartbeats_come_at_least_four_times_within_the_unattended_limit() {
        for ttl in [0, 1, 5, 20, 600, 86_400] {
            let limit = Duration::from_millis(unattended_exit_ms(ttl));
            assert!(limit >= Duration::from_secs(ttl.max(1)), "{ttl}");
            assert!(heartbeat_every(ttl) * 4 <= limit, "{ttl}");
            assert!(heartbeat_every(ttl) <= Duration::from_secs(5), "{ttl}");
            // Any broker's beat keeps any container's limit.
            assert!(Duration::from_secs(5) * 4 <= limit, "{ttl}");
        }
    }

    fn backend(config: Config) -> DockerBackend {
        DockerBackend {
            docker: bollard::Docker::connect_with_local_defaults().expect("client"),
            seccomp: seccomp_option(&config.sandbox.seccomp).expect("seccomp profile"),
            uids: SandboxUidPool::new(config.sandbox.sandbox_uids()),
            image_accounts: tokio::sync::OnceCell::new(),
            profile: config.sandbox,
            idle_ttl_secs: config.lifecycle.idle_ttl_secs,
            observer: std::sync::OnceLock::new(),
            egress: std::sync::OnceLock::new(),
            egress_sockets: std::sync::Mutex::default(),
            host_memory: None,
            cpu_weight_settable: AtomicBool::new(true),
        }
    }

    #[test]
    fn each_sandbox_is_named_in_its_account_files_under_its_own_uid() {
        let image = Accounts {
            passwd: "root:x:0:0:root:/root:/bin/bash\n\nnobody:x:65534:65534::/:/bin/false\n\
                     sandbox:x:10001:10001::/mnt/data:/bin/bash\nold:x:200123:1::/:/bin/sh"
                .to_string(),
            group: "root:x:0:\nsandbox:x:10001:\n".to_string(),
        };
        let mine = image.for_uid(200_123);
        assert_eq!(
            mine.passwd,
            "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534::/:/bin/false\n\
             sandbox:x:200123:200123::/mnt/data:/bin/bash\n"
        );
        assert_eq!(mine.group, "root:x:0:\nsandbox:x:200123:\n");
        let fallback = Accounts {
            passwd: FALLBACK_PASSWD.into(),
            group: FALLBACK_GROUP.into(),
        }
        .for_uid(10001);
        assert!(fallback
            .passwd
            .ends_with("sandbox:x:10001:10001::/mnt/data:/bin/bash\n"));
        assert!(fallback.passwd.starts_with("root:x:0:0:"));
    }

    #[test]
    fn gvisor_is_known_by_its_runtime_name_and_by_its_refusal_to_update() {
        assert!(is_gvisor(" runsc "));
        assert!(is_gvisor("runsc-kvm"));
        assert!(!is_gvisor(""));
        assert!(!is_gvisor("runc"));
        // What Docker 20.10 answers when runsc is asked to update a container.
        let refused = "Docker responded with status code 500: Cannot update container e6b7: \
            /var/lib/docker/runtimes/runsc did not terminate successfully: exit status 128: \
            Usage: runsc <flags> <subcommand> <subcommand args>";
        assert!(runtime_cannot_update(refused));
        let gone = "Docker responded with status code 404: No such container: e6b7";
        assert!(!runtime_cannot_update(gone));
    }

    #[tokio::test]
    async fn under_gvisor_the_cpu_weight_is_left_alone_without_asking_the_engine() {
        let mut config = Config::for_tests("/data".into(), "t");
        config.sandbox.runtime = "runsc".into();
        let mut docker = backend(config);
        docker.cpu_weight_settable = AtomicBool::new(!is_gvisor(&docker.profile.runtime));
        // No such container: had the engine been asked, the failure would be counted.
        let counted = Arc::new(CountingObserver::default());
        let _ = docker.observer.set(counted.clone());
        assert!(
            !docker
                .set_cpu_weight("no-such-container", CpuWeight::Low)
                .await
        );
        assert_eq!(counted.errors.load(Ordering::SeqCst), 0);
    }

    #[derive(Default)]
    struct CountingObserver {
        errors: std::sync::atomic::AtomicUsize,
    }

    impl EngineObserver for CountingObserver {
        fn api_error(&self, _op: &str) {
            self.errors.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[tokio::test]
    async fn the_profile_is_locked_down_and_names_the_runtime() {
        let mut config = Config::for_tests("/data".into(), "t");
        let body = backend(config.clone()).container_body(
            "s",
            &Workspace::new(Path::new("/data"), "s"),
            200_123,
            None,
        );
        let host = body.host_config.expect("host config");
        assert_eq!(host.runtime, None, "the daemon's default runtime");
        assert_eq!(host.cap_drop, Some(vec!["ALL".to_string()]));
        let opts = host.security_opt.expect("security options");
        assert_eq!(opts[0], "no-new-privileges");
        let profile: serde_json::Value = opts[1]
            .strip_prefix("seccomp=")
            .and_then(|json| serde_json::from_str(json).ok())
            .expect("the built-in seccomp profile");
        assert_eq!(profile["defaultAction"], "SCMP_ACT_ERRNO");
        assert_eq!(opts.len(), 2);
        assert_eq!(
            host.cgroupns_mode,
            Some(HostConfigCgroupnsModeEnum::PRIVATE)
        );
        assert_eq!(host.network_mode.as_deref(), Some("none"));
        assert_eq!(host.readonly_rootfs, Some(true));
        assert_eq!(
            host.binds,
            Some(vec![
                format!("/data/sessions/s/files:{WORKDIR}:rw"),
                "/data/sessions/s/sandbox-passwd:/etc/passwd:ro".to_string(),
                "/data/sessions/s/sandbox-group:/etc/group:ro".to_string(),
            ])
        );
        assert_eq!(body.user.as_deref(), Some("200123:200123"));
        let labels = body.labels.expect("labels");
        assert_eq!(labels[labels::UID], "200123", "read back after a restart");
        assert_eq!(host.cpu_shares, None, "the engine's default weight");

        config.sandbox.runtime = " runsc ".into();
        let body = backend(config).container_body(
            "s",
            &Workspace::new(Path::new("/data"), "s"),
            10001,
            None,
        );
        assert_eq!(
            body.host_config.expect("host config").runtime.as_deref(),
            Some("runsc")
        );
    }

    #[tokio::test]
    async fn no_new_privileges_does_not_depend_on_dropping_capabilities() {
        let mut config = Config::for_tests("/data".into(), "t");
        config.sandbox.drop_capabilities = false;
        config.sandbox.seccomp = SeccompChoice::Daemon;
        let body = backend(config).container_body(
            "s",
            &Workspace::new(Path::new("/data"), "s"),
            10001,
            None,
        );
        let host = body.host_config.expect("host config");
        assert_eq!(host.cap_drop, None);
        assert_eq!(
            host.security_opt,
            Some(vec!["no-new-privileges".to_string()])
        );
    }

    #[test]
    fn a_sandbox_the_oom_killer_ended_may_exit_with_any_failing_code() {
        let ended = |running, exit_code| bollard::models::ContainerState {
            running: Some(running),
            exit_code: Some(exit_code),
            ..Default::default()
        };
        // 137: runc, or runsc when its kernel was killed; 2: runsc when the killer took
        // another of gVisor's processes.
        assert!(stopped_failing(&ended(false, 137)));
        assert!(stopped_failing(&ended(false, 2)));
        assert!(!stopped_failing(&ended(false, 0)));
        assert!(!stopped_failing(&ended(true, 0)));
        assert!(!stopped_failing(&bollard::models::ContainerState::default()));
    }

    #[test]
    fn the_builtin_profile_refuses_what_sandboxed_code_never_needs() {
        let profile: serde_json::Value =
            serde_json::from_str(BUILTIN_SECCOMP).expect("the profile is JSON");
        let rules = profile["syscalls"].as_array().expect("rules");
        let allowed = |name: &str| {
            rules.iter().any(|r| {
                r["action"] == "SCMP_ACT_ALLOW"
                    && r["names"]
                        .as_array()
                        .is_some_and(|n| n.iter().any(|x| x == name))
            })
        };
        for never in [
            "io_uring_setup",
            "io_uring_enter",
            "io_uring_register",
            "userfaultfd",
            "bpf",
            "keyctl",
            "add_key",
            "request_key",
            "perf_event_open",
            "unshare",
            "setns",
            "mount",
        ] {
            assert!(!allowed(never), "{never} is allowed");
        }
        for needed in [
            "read", "execve", "futex", "clone", "socket", "mmap", "wait4",
        ] {
            assert!(allowed(needed), "{needed} is refused");
        }
        // What `socket` and `ioctl` are allowed with: seccomp_tests.rs.
        // No 32-bit personalities: socketcall(2) would pass any family by pointer.
        for arch in profile["archMap"].as_array().expect("archMap") {
            assert_eq!(arch["subArchitectures"], serde_json::json!([]));
        }
    }

    #[test]
    fn a_seccomp_file_is_read_and_checked() {
        let dir = tempfile::tempdir().expect("tempdir");
        let good = dir.path().join("good.json");
        std::fs::write(&good, r#"{ "defaultAction": "SCMP_ACT_ALLOW" }"#).expect("write");
        assert_eq!(
            seccomp_option(&SeccompChoice::File(good)).expect("read"),
            Some(r#"{"defaultAction":"SCMP_ACT_ALLOW"}"#.to_string())
        );
        let bad = dir.path().join("bad.json");
        std::fs::write(&bad, "not json").expect("write");
        assert!(seccomp_option(&SeccompChoice::File(bad)).is_err());
        let missing = dir.path().join("missing.json");
        assert!(seccomp_option(&SeccompChoice::File(missing)).is_err());
        assert_eq!(
            seccomp_option(&SeccompChoice::Daemon).expect("daemon"),
            None
        );
    }
}
