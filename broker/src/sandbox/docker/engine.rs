//! The Docker engine as a [`SandboxEngine`].

use super::DockerBackend;
use crate::config::FileTransfer;
use crate::sandbox::engine::{EngineObserver, SandboxEngine};
use crate::sandbox::files::FileTransport;
use crate::sandbox::{CpuWeight, Listed, Sandbox, Warmup};
use crate::workspace::Workspace;
use std::io;
use std::sync::Arc;
use std::time::SystemTime;

#[async_trait::async_trait]
impl SandboxEngine for DockerBackend {
    async fn create(
        &self,
        session_id: &str,
        workspace: &Workspace,
        warmup: Warmup,
    ) -> anyhow::Result<Sandbox> {
        DockerBackend::create(self, session_id, workspace, warmup).await
    }

    async fn adopt(&self, sandbox_id: &str) -> anyhow::Result<Sandbox> {
        DockerBackend::adopt(self, sandbox_id).await
    }

    async fn set_cpu_weight(&self, sandbox_id: &str, weight: CpuWeight) -> bool {
        DockerBackend::set_cpu_weight(self, sandbox_id, weight).await
    }

    async fn remove(&self, sandbox_id: &str) {
        DockerBackend::remove(self, sandbox_id).await
    }

    async fn list_own(&self) -> anyhow::Result<Vec<Listed>> {
        DockerBackend::list_own(self).await
    }

    async fn ping(&self) -> bool {
        DockerBackend::ping(self).await
    }

    async fn image_present(&self) -> bool {
        DockerBackend::image_present(self).await
    }

    /// The engine's `oom` events are timed, so an earlier OOM kill does not count.
    async fn ended_out_of_memory(
        &self,
        sandbox_id: &str,
        since: SystemTime,
        _oom_before: bool,
    ) -> bool {
        DockerBackend::ended_out_of_memory(self, sandbox_id, since).await
    }

    async fn read_image_file(&self, path: &str) -> anyhow::Result<Vec<u8>> {
        DockerBackend::read_image_file(self, path).await
    }

    fn host_memory(&self) -> Option<u64> {
        self.host_memory
    }

    fn observe(&self, observer: Arc<dyn EngineObserver>) {
        // Only the first observer counts: the broker installs it once, at start.
        let _ = self.observer.set(observer);
    }

    fn carry_egress(&self, gateway: Arc<crate::egress::gateway::Gateway>) {
        let _ = self.egress.set(gateway);
    }

    fn file_transport(&self) -> FileTransport {
        match self.file_transfer() {
            FileTransfer::Host => FileTransport::Host,
            FileTransfer::Runner => FileTransport::Runner,
        }
    }

    fn workspace_owner(&self, workspace: &Workspace) -> io::Result<u32> {
        DockerBackend::workspace_owner(self, workspace)
    }

    fn hands_over_pooled(&self) -> bool {
        true
    }

    fn take_pooled_workspace(&self, session: &Workspace, pooled: &Workspace) -> io::Result<()> {
        // Whichever way files move, what a container mounts is the engine's business: the
        // directory behind the pooled container's mount becomes the session's (entries
        // are renamed, never opened), so a later container on the session's workspace
        // sees what this one wrote. The files the session's earlier sandboxes wrote, as
        // other uids, become the pooled sandbox's.
        session.take_files_dir_of(pooled)?;
        let owner = DockerBackend::workspace_owner(self, session)?;
        session.hand_to(owner)
    }
}
