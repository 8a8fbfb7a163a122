//! The core shared by every front end (HTTP, MCP, code mode): choosing a session
//! (`sessions.rs`), running one exec in it (`exec.rs`), the sandboxes behind the sessions
//! (`sandboxes.rs`) and the Python state kept across them (`state.rs`), the files of a
//! session (`files.rs`), and the limits on all of them.
//! The core speaks no HTTP: it fails with [`Error`], which each front end renders.

pub(crate) mod capacity;
pub(crate) mod diskspace;
pub(crate) mod error;
pub(crate) mod exec;
pub(crate) mod files;
mod installs;
pub(crate) mod limits;
pub(crate) mod observe;
pub(crate) mod programmatic;
mod sandboxes;
pub(crate) mod sessions;
mod state;
mod surface;

pub(crate) use error::{Error, Result};
pub(crate) use exec::rich;
pub(crate) use exec::{
    is_env_name, Admitted, Delivery, Display, ExecEvent, ExecHooks, ExecInput, ExecOutput, ExecRun,
    InputFile, OutputStream, ToolBridge, Verdict,
};
pub(crate) use sessions::SessionChoice;
pub(crate) use surface::Refusal;
pub use surface::ResolvedCaps;

use crate::config::Config;
use crate::core::limits::Limits;
use crate::sandbox::SandboxBackend;
use crate::session::{Pool, Registry};
use anyhow::Context as _;
use std::sync::Arc;

/// The broker: configuration, the engine, the sessions and the pool.
pub struct Broker {
    /// Every setting.
    config: Arc<Config>,
    /// Where sandboxes run, and how files reach them.
    backend: Arc<SandboxBackend>,
    /// All sessions.
    registry: Registry,
    /// Started sandboxes waiting for new sessions.
    pool: Arc<Pool>,
    /// The per-user exec rate and the container caps (429s).
    limits: Limits,
    /// `/opt/codebroker/libraries.json` of the image, read once.
    libraries: tokio::sync::OnceCell<serde_json::Value>,
    /// Prometheus counters and gauges (`/metrics`), bumped here and by the handlers.
    metrics: Arc<crate::metrics::Metrics>,
    /// The JSONL audit log (`CODEBROKER_AUDIT_LOG`), for tracing who ran what.
    audit: Arc<crate::audit::Audit>,
    /// The egress gateway: the policy and caps of the sandboxes' proxy connections, each
    /// counted against the exec running in its sandbox.
    egress: Arc<crate::egress::gateway::Gateway>,
    /// Programmatic runs parked between their clients' requests.
    programmatic: Arc<programmatic::ParkedRuns>,
}

impl Broker {
    pub(crate) fn new(config: Arc<Config>, backend: Arc<SandboxBackend>) -> anyhow::Result<Broker> {
        let metrics = Arc::new(crate::metrics::Metrics::new());
        backend.engine().observe(metrics.clone());
        let audit = Arc::new(crate::audit::Audit::open(
            &config.audit_log,
            config.audit_code,
        ));
        let records = Arc::new(crate::core::observe::EgressRecords {
            metrics: metrics.clone(),
            audit: audit.clone(),
        });
        // Checked by `Config::validate`: a policy that does not parse stops the start there.
        let egress = crate::egress::gateway::Gateway::new(
            &config.egress,
            config.egress_transport(),
            &config.data_dir,
            records,
        )
        .map_err(|e| anyhow::anyhow!(e))
        .context("CODEBROKER_EGRESS")?;
        let egress = Arc::new(egress);
        backend.engine().carry_egress(egress.clone());
        Ok(Broker {
            registry: Registry::new(
                &config.data_dir,
                crate::http::auth::sole_tenant(&config).map(|t| t.0),
            ),
            pool: Arc::new(Pool::new(&config.pool)),
            limits: Limits::new(
                &config.caps,
                config.sandbox.memory_mb,
                config.longest_exec_ms(),
                backend.engine().host_memory(),
            ),
            metrics,
            audit,
            egress,
            backend,
            config,
            libraries: tokio::sync::OnceCell::new(),
            programmatic: Arc::default(),
        })
    }

    /// The image's package list, read once.
    pub(crate) async fn libraries(&self) -> Result<serde_json::Value> {
        self.libraries
            .get_or_try_init(|| async {
                let bytes = self
                    .backend
                    .engine()
                    .read_image_file("/opt/codebroker/libraries.json")
                    .await?;
                anyhow::Ok(serde_json::from_slice(&bytes)?)
            })
            .await
            .cloned()
            .map_err(|e| {
                tracing::error!(error = ?e, "cannot read the library list from the image");
                Error::Unavailable("the sandbox image cannot be read".into())
            })
    }
}
