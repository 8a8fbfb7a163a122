//! Sandboxes as Docker containers, driven through the Engine API (bollard).

use super::channel::AttachOutput;
use super::{labels, RunnerChannel, Sandbox};
use crate::config::Config;
use crate::metrics::{docker_error, DockerErrors};
use anyhow::{anyhow, Context};
use bollard::container::LogOutput;
use bollard::models::{ContainerCreateBody, HostConfig, HostConfigLogConfig, ResourcesUlimits};
use bollard::query_parameters::{
    AttachContainerOptionsBuilder, DownloadFromContainerOptionsBuilder,
    ListContainersOptionsBuilder, RemoveContainerOptionsBuilder,
};
use futures::{StreamExt, TryStreamExt};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Where the workspace appears inside every sandbox.
pub const WORKDIR: &str = "/mnt/data";

/// How long a new runner may take to answer its first hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(20);

/// A container of ours found on the engine.
#[derive(Debug, Clone)]
pub struct OwnContainer {
    /// Docker's id.
    pub id: String,
    /// The session label, if it has one.
    pub session: Option<String>,
    /// Whether it is running (only running ones can be re-attached).
    pub running: bool,
}

/// Creates, attaches to, and removes sandbox containers.
pub struct DockerBackend {
    /// The Engine API client, version negotiated.
    docker: bollard::Docker,
    /// Image, limits and lockdown settings.
    config: Arc<Config>,
    /// Failed Engine API calls by operation, shared with the broker's metrics so that an
    /// engine in trouble shows on `/metrics`.
    pub api_errors: DockerErrors,
}

impl DockerBackend {
    /// Connects to the local engine (`DOCKER_HOST` or the default socket) and negotiates
    /// the API version, so Docker 20.10 (API 1.41) works as well as newer engines.
    pub async fn connect(config: Arc<Config>) -> anyhow::Result<DockerBackend> {
        let docker = bollard::Docker::connect_with_local_defaults()
            .context("cannot reach the Docker engine")?
            .negotiate_version()
            .await
            .context("cannot negotiate the Docker API version")?;
        Ok(DockerBackend {
            docker,
            config,
            api_errors: DockerErrors::default(),
        })
    }

    /// Counts one failed Engine API call of `op`.
    fn failed(&self, op: &str) {
        docker_error(&self.api_errors, op);
    }

    /// Whether the engine answers.
    pub async fn ping(&self) -> bool {
        self.docker.ping().await.is_ok()
    }

    /// Whether the sandbox image is present.
    pub async fn image_present(&self) -> bool {
        self.docker.inspect_image(&self.config.image).await.is_ok()
    }

    /// What `docker create` gets for a session's sandbox: the lockdown of DESIGN.md.
    fn container_body(&self, session_id: &str, workspace: &Path) -> ContainerCreateBody {
        let c = &self.config;
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let labels = HashMap::from([
            (labels::INSTANCE.to_string(), c.instance.clone()),
            (labels::SESSION.to_string(), session_id.to_string()),
            (labels::CREATED.to_string(), created.to_string()),
        ]);
        let mib = 1024 * 1024;
        let memory = (c.memory_mb * mib) as i64;
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
            binds: Some(vec![format!("{}:{WORKDIR}:rw", workspace.display())]),
            network_mode: Some(if c.network_none { "none" } else { "bridge" }.to_string()),
            cap_drop: c.drop_capabilities.then(|| vec!["ALL".to_string()]),
            security_opt: c
                .drop_capabilities
                .then(|| vec!["no-new-privileges".to_string()]),
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
        let uid = c.sandbox_uid;
        ContainerCreateBody {
            image: Some(c.image.clone()),
            user: Some(format!("{uid}:{uid}")),
            working_dir: Some(WORKDIR.to_string()),
            env: Some(vec![
                format!("HOME={WORKDIR}"),
                // The runner watches the workspace against these during each exec.
                format!("CODEBROKER_WORKSPACE_QUOTA={}", c.workspace_quota),
                format!("CODEBROKER_WORKSPACE_MAX_FILES={}", c.workspace_max_files),
            ]),
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

    /// Creates and starts a sandbox for `session_id` on `workspace` (a host directory),
    /// attached before it starts so no frame is missed, and waits for its runner to answer.
    pub async fn create(
        &self,
        session_id: &str,
        workspace: &Path,
        start_kernel: bool,
    ) -> anyhow::Result<Sandbox> {
        let body = self.container_body(session_id, workspace);
        let t0 = std::time::Instant::now();
        let created = self
            .docker
            .create_container(
                None::<bollard::query_parameters::CreateContainerOptions>,
                body,
            )
            .await
            .inspect_err(|_| self.failed("create"))
            .context("docker create failed")?;
        let id = created.id;
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
            let sandbox = Sandbox::new(id.clone(), channel);
            tokio::time::timeout(HELLO_TIMEOUT, sandbox.hello(start_kernel))
                .await
                .map_err(|_| anyhow!("the runner did not answer within {HELLO_TIMEOUT:?}"))?
                .context("the runner did not answer")?;
            // Where a start's time goes, for profiling bursts (see docs/PERFORMANCE.md).
            tracing::debug!(
                container = %short(&id),
                create = ?t_create,
                attach = ?(t_attach - t_create),
                start = ?(t_start - t_attach),
                hello = ?(t0.elapsed() - t_start),
                start_kernel,
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

    /// Re-attaches to a running container of ours (after a broker restart).
    pub async fn adopt(&self, container_id: &str) -> anyhow::Result<Sandbox> {
        let channel = self.attach_channel(container_id).await?;
        let sandbox = Sandbox::new(container_id.to_string(), channel);
        // The runner may still run an exec of the broker that died: stop it first. The
        // runner stops an exec within a second or two (a kernel that ignores SIGINT is
        // killed), so the hello timeout bounds the wait.
        tokio::time::timeout(HELLO_TIMEOUT, sandbox.stop_orphaned_job())
            .await
            .map_err(|_| anyhow!("the runner did not become idle within {HELLO_TIMEOUT:?}"))?
            .context("the runner did not answer")?;
        Ok(sandbox)
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
        Ok(RunnerChannel::new(short(id), output, attached.input))
    }

    /// Removes a container, whatever state it is in. Failures are logged: the reconciler
    /// at the next start removes what is left.
    pub async fn remove(&self, id: &str) {
        let options = RemoveContainerOptionsBuilder::new()
            .force(true)
            .v(true)
            .build();
        if let Err(err) = self.docker.remove_container(id, Some(options)).await {
            if !matches!(
                err,
                bollard::errors::Error::DockerResponseServerError {
                    status_code: 404,
                    ..
                }
            ) {
                self.failed("remove");
                tracing::warn!(container = %short(id), error = %err, "cannot remove container");
            }
        }
    }

    /// Every container carrying this instance's label.
    pub async fn list_own(&self) -> anyhow::Result<Vec<OwnContainer>> {
        let filters = HashMap::from([(
            "label".to_string(),
            vec![format!("{}={}", labels::INSTANCE, self.config.instance)],
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
                let running = c.state.map(|s| s.to_string() == "running").unwrap_or(false);
                Some(OwnContainer {
                    id,
                    session,
                    running,
                })
            })
            .collect())
    }

    /// Reads one file out of the sandbox image, without starting a container.
    pub async fn read_image_file(&self, path: &str) -> anyhow::Result<Vec<u8>> {
        let body = ContainerCreateBody {
            image: Some(self.config.image.clone()),
            labels: Some(HashMap::from([(
                labels::INSTANCE.to_string(),
                self.config.instance.clone(),
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

/// Inodes of a scratch tmpfs of `mb` MiB: 64 per MiB (at least 4096). Without a cap a
/// tmpfs allows about one inode per two pages of host RAM, and a million empty files cost
/// the host kernel memory the size limit does not see.
fn scratch_inodes(mb: u64) -> u64 {
    mb.saturating_mul(64).max(4096)
}

/// The `fsize` ulimit: CODEBROKER_FSIZE_MB, and never over the workspace quota, so that a
/// single file cannot outgrow the quota between two of the runner's measurements.
fn fsize_bytes(c: &Config) -> i64 {
    let fsize = u64::try_from(c.fsize_mb)
        .unwrap_or(0)
        .saturating_mul(1024 * 1024);
    let bytes = match c.workspace_quota {
        0 => fsize,
        quota => fsize.min(quota),
    };
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

/// The first 12 characters of a container id, as `docker ps` shows it.
pub fn short(id: &str) -> String {
    id.chars().take(12).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backend(config: Config) -> DockerBackend {
        DockerBackend {
            docker: bollard::Docker::connect_with_local_defaults().expect("client"),
            config: Arc::new(config),
            api_errors: DockerErrors::default(),
        }
    }

    #[tokio::test]
    async fn the_profile_is_locked_down_and_names_the_runtime() {
        let mut config = Config::for_tests("/data".into(), "t");
        let body = backend(config.clone()).container_body("s", Path::new("/data/s/files"));
        let host = body.host_config.expect("host config");
        assert_eq!(host.runtime, None, "the daemon's default runtime");
        assert_eq!(host.cap_drop, Some(vec!["ALL".to_string()]));
        assert_eq!(
            host.security_opt,
            Some(vec!["no-new-privileges".to_string()])
        );
        assert_eq!(host.network_mode.as_deref(), Some("none"));
        assert_eq!(host.readonly_rootfs, Some(true));
        assert_eq!(
            host.binds,
            Some(vec![format!("/data/s/files:{WORKDIR}:rw")])
        );
        assert_eq!(body.user.as_deref(), Some("10001:10001"));

        config.runtime = " runsc ".into();
        let body = backend(config).container_body("s", Path::new("/data/s/files"));
        assert_eq!(
            body.host_config.expect("host config").runtime.as_deref(),
            Some("runsc")
        );
    }
}
