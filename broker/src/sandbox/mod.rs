//! The container side: one sandbox per session, reached over its runner channel.

pub mod backend;
pub mod channel;
pub mod docker;
pub(crate) mod runner_files;

pub use backend::{SandboxBackend, SandboxFiles};
pub use channel::{ChannelError, RunnerChannel};
pub use docker::{DockerBackend, OwnContainer};

use sandbox_runner::{ExecRequest, ExecResponse, JobId, ToolResult, WorkerMessage};
use std::time::Instant;

/// Labels every container of ours carries; a restarted broker finds its containers by them.
pub mod labels {
    /// The broker instance that owns the container.
    pub const INSTANCE: &str = "codebroker.instance";
    /// The session whose workspace the container mounts.
    pub const SESSION: &str = "codebroker.session";
    /// Unix seconds when the container was created.
    pub const CREATED: &str = "codebroker.created";
}

/// A started container with its runner attached.
pub struct Sandbox {
    /// Docker's id of the container, for removal and logs.
    pub container_id: String,
    /// The attached stdio of the runner.
    channel: RunnerChannel,
    /// When the sandbox became ready, for the idle reaper and metrics.
    pub started: Instant,
}

impl Sandbox {
    pub(crate) fn new(container_id: String, channel: RunnerChannel) -> Sandbox {
        Sandbox {
            container_id,
            channel,
            started: Instant::now(),
        }
    }

    /// Whether the runner can still be reached.
    pub fn is_alive(&self) -> bool {
        !self.channel.is_closed()
    }

    /// Marks the sandbox dead (its container is about to be removed).
    pub fn close(&self, reason: &str) {
        self.channel.close(reason);
    }

    /// A fresh job id, to be passed to [`Sandbox::exec_as`] and, if needed, [`Sandbox::cancel`].
    pub fn new_job(&self) -> JobId {
        self.channel.new_job()
    }

    /// Runs one exec to its end.
    pub async fn exec_as(
        &self,
        job: JobId,
        request: ExecRequest,
        on_event: impl FnMut(WorkerMessage) -> Option<WorkerMessage>,
        sink: Option<&tokio::sync::mpsc::Sender<WorkerMessage>>,
    ) -> Result<ExecResponse, ChannelError> {
        self.channel.request_as(job, request, on_event, sink).await
    }

    /// Sends one file request (`sandbox_runner::files`) and waits for its answer.
    pub(crate) async fn file_request<R: sandbox_runner::Request>(
        &self,
        request: R,
    ) -> Result<R::Response, ChannelError> {
        self.channel.request(request).await
    }

    /// Answers a tool call of the exec of `job`.
    pub async fn tool_result(&self, job: JobId, result: ToolResult) -> Result<(), ChannelError> {
        self.channel.tool_result(job, result).await
    }

    /// Asks the runner to stop the exec of `job`.
    pub async fn cancel(&self, job: JobId) -> Result<(), ChannelError> {
        self.channel.cancel(job).await
    }

    /// Checks the runner answers; optionally starts its Python kernel.
    pub async fn hello(
        &self,
        start_kernel: bool,
    ) -> Result<sandbox_runner::HelloResponse, ChannelError> {
        let req = sandbox_runner::HelloRequest { start_kernel };
        self.channel.request(req).await
    }

    /// Stops an exec the runner still runs for an earlier broker (one that died during
    /// it) and waits until the runner is idle, so the next exec is not refused as busy.
    pub async fn stop_orphaned_job(&self) -> Result<(), ChannelError> {
        loop {
            let hello = self.hello(false).await?;
            let Some(job) = hello.running_job else {
                return Ok(());
            };
            self.channel.cancel(job).await?;
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
}
