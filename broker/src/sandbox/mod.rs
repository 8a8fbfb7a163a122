//! The sandbox side: one sandbox per session (a Docker container or a Kubernetes pod),
//! reached over its runner channel.

pub(crate) mod channel;
pub(crate) mod docker;
pub(crate) mod engine;
pub(crate) mod files;
pub(crate) mod kubernetes;
pub(crate) mod runner_files;
pub(crate) mod runner_state;
#[cfg(test)]
mod seccomp_tests;
pub(crate) mod uids;

pub(crate) use channel::{ChannelError, RunnerChannel};
pub(crate) use docker::DockerBackend;
pub(crate) use engine::{SandboxEngine, SandboxUnavailable};
pub(crate) use files::{SandboxBackend, SandboxFiles};
pub(crate) use kubernetes::KubernetesBackend;

use sandbox_runner::{ExecRequest, ExecResponse, JobId, ToolResult, WorkerMessage};

/// Connects to the backend `config` names: its engine, and the transport its files take.
/// The one place that matches on the backend kind; a new backend is a folder beside
/// `docker/` and `kubernetes/` with an impl of [`SandboxEngine`], and an arm here.
pub(crate) async fn connect(config: &crate::config::Config) -> anyhow::Result<SandboxBackend> {
    let engine: Box<dyn SandboxEngine> = match config.backend {
        crate::config::BackendKind::Docker => {
            let docker =
                DockerBackend::connect(config.sandbox.clone(), config.lifecycle.idle_ttl_secs)
                    .await?;
            if !docker.image_present().await {
                tracing::warn!(image = %config.sandbox.image, "the sandbox image is missing; build it with `make image`");
            }
            Box::new(docker)
        }
        crate::config::BackendKind::Kubernetes => {
            if config.caps.max_containers == crate::config::ContainerCap::Auto {
                tracing::warn!(
                    sandboxes = crate::config::AUTO_CONTAINERS_MIN,
                    "CODEBROKER_MAX_CONTAINERS=auto cannot see the cluster's nodes and allows \
                     its minimum; set the number of sandbox pods the cluster holds"
                );
            }
            if config.sandbox.file_transfer != crate::config::FileTransfer::Runner {
                tracing::info!(
                    "CODEBROKER_BACKEND=kubernetes: files move through the runner \
                     (CODEBROKER_FILE_TRANSFER=runner); the broker cannot see a pod's disk"
                );
            }
            Box::new(KubernetesBackend::connect(config).await?)
        }
    };
    Ok(SandboxBackend::new(engine))
}

/// Labels every sandbox of ours carries (container or pod); a restarted broker finds its
/// sandboxes by them.
pub(crate) mod labels {
    /// The broker instance that owns the container.
    pub(crate) const INSTANCE: &str = "codebroker.instance";
    /// The session whose workspace the container mounts.
    pub(crate) const SESSION: &str = "codebroker.session";
    /// Unix seconds when the container was created.
    pub(crate) const CREATED: &str = "codebroker.created";
    /// The uid the container's code runs as, so that a restarted broker holds it again.
    pub(crate) const UID: &str = "codebroker.uid";
    /// The name of the container's egress socket, so that a restarted broker serves it again.
    pub(crate) const EGRESS: &str = "codebroker.egress";
}

/// What a new sandbox's runner does before its first exec.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Warmup {
    /// Nothing: the first exec starts the kernel. For a sandbox a request waits on, whose
    /// code must not share the CPU with anything started ahead of it.
    Nothing,
    /// Start the Python kernel now (a pooled sandbox).
    Kernel,
}

/// How much CPU a sandbox gets when the host is busy, against the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CpuWeight {
    /// The lowest: only CPU no other sandbox wants (a pooled sandbox while it preloads).
    Low,
    /// As much as any other sandbox.
    Usual,
}

/// A started sandbox (a container, a pod) with its runner attached.
pub(crate) struct Sandbox {
    /// The backend's id of the sandbox (a Docker container id, a pod name), for removal
    /// and logs.
    pub(crate) container_id: String,
    /// The attached stdio of the runner.
    channel: RunnerChannel,
    /// The runner reported a process killed for memory in one of its execs: a cluster
    /// marks the container `OOMKilled` from then on, however it ends later.
    oom_killed_before: std::sync::atomic::AtomicBool,
    /// Its egress socket when egress is on: served while the sandbox lives, its connections
    /// counted against the exec under way.
    egress: Option<std::sync::Arc<crate::egress::gateway::SandboxEgress>>,
}

impl Sandbox {
    pub(crate) fn new(container_id: String, channel: RunnerChannel) -> Sandbox {
        Sandbox {
            container_id,
            channel,
            oom_killed_before: std::sync::atomic::AtomicBool::new(false),
            egress: None,
        }
    }

    /// The sandbox with its egress socket.
    pub(crate) fn with_egress(
        mut self,
        egress: Option<std::sync::Arc<crate::egress::gateway::SandboxEgress>>,
    ) -> Sandbox {
        self.egress = egress;
        self
    }

    /// With egress on over the runner transport, has the runner tunnel its connections
    /// over the channel, served by `gateway` while the sandbox lives.
    pub(crate) async fn tunnel_egress(
        mut self,
        gateway: Option<&std::sync::Arc<crate::egress::gateway::Gateway>>,
    ) -> anyhow::Result<Sandbox> {
        use anyhow::Context as _;
        let Some(gateway) = gateway.filter(|g| g.uses_tunnels()) else {
            return Ok(self);
        };
        let standing = self
            .channel
            .standing_job(sandbox_runner::EgressListenRequest {})
            .await
            .context("cannot open the egress tunnel")?;
        self.egress = Some(gateway.open_tunnel(&self.container_id, standing));
        Ok(self)
    }

    /// Its egress socket, when egress is on.
    pub(crate) fn egress(&self) -> Option<&std::sync::Arc<crate::egress::gateway::SandboxEgress>> {
        self.egress.as_ref()
    }

    /// A sandbox of ours re-attached after a broker restart, once its runner is idle: it
    /// may still run an exec of the broker that died, which is stopped first. The runner
    /// stops an exec within a second or two (a kernel that ignores SIGINT is killed), so
    /// `within` (the hello timeout) bounds the wait.
    pub(crate) async fn adopted(
        container_id: String,
        channel: RunnerChannel,
        within: std::time::Duration,
    ) -> anyhow::Result<Sandbox> {
        use anyhow::Context;
        let sandbox = Sandbox::new(container_id, channel);
        tokio::time::timeout(within, sandbox.stop_orphaned_job())
            .await
            .map_err(|_| anyhow::anyhow!("the runner did not become idle within {within:?}"))?
            .context("the runner did not answer")?;
        Ok(sandbox)
    }

    /// Whether an exec of this sandbox had a process killed for memory (the runner lived
    /// on and said so).
    pub(crate) fn had_an_oom_kill(&self) -> bool {
        self.oom_killed_before
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether the runner can still be reached.
    pub(crate) fn is_alive(&self) -> bool {
        !self.channel.is_closed()
    }

    /// Marks the sandbox dead (its container is about to be removed).
    pub(crate) fn close(&self, reason: &str) {
        self.channel.close(reason);
    }

    /// A fresh job id, to be passed to [`Sandbox::exec_as`] and, if needed, [`Sandbox::cancel`].
    pub(crate) fn new_job(&self) -> JobId {
        self.channel.new_job()
    }

    /// Runs one exec to its end; `on_event` turns each streamed message into what `sink`
    /// receives.
    pub(crate) async fn exec_as<E>(
        &self,
        job: JobId,
        request: ExecRequest,
        on_event: impl FnMut(WorkerMessage) -> Option<E>,
        sink: Option<&tokio::sync::mpsc::Sender<E>>,
    ) -> Result<ExecResponse, ChannelError> {
        let response = self
            .channel
            .request_as(job, request, on_event, sink)
            .await?;
        if response.limits.contains(&sandbox_runner::Limit::Memory) {
            self.oom_killed_before
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(response)
    }

    /// Sends one file request (`sandbox_runner::files`) and waits for its answer.
    pub(crate) async fn file_request<R: sandbox_runner::Request>(
        &self,
        request: R,
    ) -> Result<R::Response, ChannelError> {
        self.channel.request(request).await
    }

    /// Sends a piece of the stdin of `job`'s program.
    pub(crate) async fn stdin(
        &self,
        job: JobId,
        chunk: sandbox_runner::StdinChunk,
    ) -> Result<(), ChannelError> {
        self.channel.stdin(job, chunk).await
    }

    /// Answers a tool call of the exec of `job`.
    pub(crate) async fn tool_result(
        &self,
        job: JobId,
        result: ToolResult,
    ) -> Result<(), ChannelError> {
        self.channel.tool_result(job, result).await
    }

    /// Asks the runner to stop the exec of `job`.
    pub(crate) async fn cancel(&self, job: JobId) -> Result<(), ChannelError> {
        self.channel.cancel(job).await
    }

    /// Checks the runner answers; optionally starts its Python kernel.
    pub(crate) async fn hello(
        &self,
        warmup: Warmup,
    ) -> Result<sandbox_runner::HelloResponse, ChannelError> {
        let req = sandbox_runner::HelloRequest {
            start_kernel: matches!(warmup, Warmup::Kernel),
            preload: Vec::new(),
        };
        self.channel.request(req).await
    }

    /// Asks the kernel of a sandbox no session has used yet to import `modules` in the
    /// background (checked names, `config::PreloadModules`); the runner's answers say
    /// `preloading` until it is done. A kernel that has run code ignores it.
    pub(crate) async fn preload(
        &self,
        modules: &[String],
    ) -> Result<sandbox_runner::HelloResponse, ChannelError> {
        let req = sandbox_runner::HelloRequest {
            start_kernel: true,
            preload: modules.to_vec(),
        };
        self.channel.request(req).await
    }

    /// Stops an exec the runner still runs for an earlier broker (one that died during
    /// it) and waits until the runner is idle, so the next exec is not refused as busy.
    async fn stop_orphaned_job(&self) -> Result<(), ChannelError> {
        loop {
            let hello = self.hello(Warmup::Nothing).await?;
            let Some(job) = hello.running_job else {
                return Ok(());
            };
            self.channel.cancel(job).await?;
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
}

/// A sandbox of ours found on the engine (a container, or a pod).
#[derive(Debug, Clone)]
pub(crate) struct Listed {
    /// The backend's id: a Docker container id, or a pod name.
    pub(crate) id: String,
    /// The session label, if it has one.
    pub(crate) session: Option<String>,
    /// Whether it is running (only running ones can be re-attached).
    pub(crate) running: bool,
}

/// Where the workspace appears inside every sandbox.
pub(crate) const WORKDIR: &str = "/mnt/data";

/// How long a runner may hear nothing from a broker before it exits: the idle TTL, at
/// least [`MIN_UNATTENDED`] (a TTL of 0 removes idle containers at once; heartbeats still
/// come). The floor is four heartbeats at the slowest rate any broker beats, so a container
/// re-attached by a broker with another TTL is never left to time out between beats.
pub(crate) fn unattended_exit_ms(idle_ttl_secs: u64) -> u64 {
    idle_ttl_secs
        .saturating_mul(1000)
        .max(MIN_UNATTENDED.as_millis() as u64)
}

/// The shortest unattended limit a runner is given.
const MIN_UNATTENDED: std::time::Duration = std::time::Duration::from_secs(20);

/// How often the broker tells each runner it is there: four times within the runner's
/// unattended limit, and at least every 5 s, so a broker restarted with a longer TTL still
/// beats often enough for the containers it re-attaches to.
pub(crate) fn heartbeat_every(idle_ttl_secs: u64) -> std::time::Duration {
    std::time::Duration::from_millis(unattended_exit_ms(idle_ttl_secs) / 4)
        .min(std::time::Duration::from_secs(5))
}

/// The first 12 characters of a container id, as `docker ps` shows it.
pub(crate) fn short(id: &str) -> String {
    id.chars().take(12).collect()
}
