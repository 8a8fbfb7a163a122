//! The core shared by every front end (HTTP, and later MCP): choosing a session, running
//! one exec in it, harvesting its files, and keeping containers tidy.

use crate::config::Config;
use crate::error::{AppError, AppResult};
use crate::ids::{is_valid_id, new_id};
use crate::jwt::JwtKeys;
use crate::ratelimit::Limits;
use crate::sandbox::{docker::short, ChannelError, Sandbox, SandboxBackend, SandboxFiles};
use crate::session::evict::{self, Reason};
use crate::session::registry::META_FILE;
use crate::session::{Pool, Registry, Session, SessionMeta};
use crate::workspace::{now_ms, FileRecord, HarvestLimits, Workspace};
use sandbox_runner::{
    Admit, DisplayBudget, ExecRequest, Language, Limit, RuntimeStatus, ToolCall, ToolResult,
    ToolSpec, WorkerMessage,
};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// How much longer than the exec's own limit the broker waits for the runner before it
/// declares the sandbox broken.
const EXEC_GRACE: Duration = Duration::from_secs(15);

/// Where a session records the pooled container it was handed (see
/// [`Broker::sandbox_from_pool`]).
const POOLED_SANDBOX_FILE: &str = "pooled-sandbox.json";

/// The container a session was handed from the pool.
#[derive(serde::Serialize, serde::Deserialize)]
struct PooledSandbox {
    /// Docker's id of the container, whose session label is the pooled id.
    container_id: String,
}

/// The broker: configuration, the engine, the sessions and the pool.
pub struct Broker {
    /// Every setting.
    pub config: Arc<Config>,
    /// Where sandboxes run, and how files reach them.
    pub backend: Arc<dyn SandboxBackend>,
    /// All sessions.
    pub registry: Registry,
    /// Started sandboxes waiting for new sessions.
    pub pool: Arc<Pool>,
    /// The per-user exec rate and the container caps (429s).
    pub limits: Limits,
    /// Public keys that verify LibreChat's JWTs; empty unless configured.
    pub jwt: JwtKeys,
    /// `/opt/codebroker/libraries.json` of the image, read once.
    libraries: tokio::sync::OnceCell<serde_json::Value>,
    /// Prometheus counters and gauges (`/metrics`), bumped here and by the handlers.
    pub metrics: crate::metrics::Metrics,
    /// The JSONL audit log (`CODEBROKER_AUDIT_LOG`), for tracing who ran what.
    pub audit: crate::audit::Audit,
}

/// A reference to an input file, in either contract generation.
#[derive(Debug, Clone)]
pub struct InputFile {
    /// The file id.
    pub id: String,
    /// The session (classic `session_id`, new `storage_session_id`) that holds it.
    pub session_id: String,
    /// Where it goes under `/mnt/data` (may hold a relative path).
    pub name: String,
}

/// How the caller wants a session chosen (API.md, POST /exec).
#[derive(Debug, Clone, Default)]
pub struct SessionChoice {
    /// The end user the caller names.
    pub user: Option<String>,
    /// An explicit session id.
    pub session_id: Option<String>,
    /// A runtime session the client saw earlier.
    pub runtime_session_hint: Option<String>,
    /// A LibreChat agent or assistant id.
    pub entity_id: Option<String>,
}

/// One exec as the front ends ask for it.
#[derive(Debug, Clone)]
pub struct ExecInput {
    pub lang: Language,
    pub code: String,
    pub args: Vec<String>,
    /// Requested wall-time limit in ms; capped by the configuration.
    pub timeout_ms: Option<u64>,
    /// Files to place in `/mnt/data` first.
    pub files: Vec<InputFile>,
}

/// What a front end attaches to an exec besides its input.
#[derive(Default)]
pub struct ExecHooks {
    /// Output chunks and displays as they happen (streaming); `None` collects output
    /// into the result instead. Bounded: a consumer that stops reading holds the exec
    /// back (down to the code's writes) rather than letting events pile up here.
    pub events: Option<mpsc::Sender<WorkerMessage>>,
    /// Tools the code may call, and the way to their caller.
    pub tools: Option<ToolBridge>,
    /// Stops the exec when cancelled (a client gone, the cancel route).
    pub cancel: Option<CancellationToken>,
}

/// The broker's side of programmatic tool calling for one exec.
pub struct ToolBridge {
    /// The tools the code is given.
    pub specs: Vec<ToolSpec>,
    /// Where the code's calls go.
    pub calls: mpsc::UnboundedSender<ToolCall>,
    /// Where their results come from.
    pub results: mpsc::UnboundedReceiver<ToolResult>,
}

/// What one exec produced.
#[derive(Debug, Clone)]
pub struct ExecOutput {
    pub session_id: String,
    pub stdout: String,
    pub stderr: String,
    /// Files created or changed by this exec.
    pub files: Vec<FileRecord>,
    pub runtime_status: RuntimeStatus,
    pub exit_code: Option<i32>,
    pub duration_ms: u64,
    pub limits: Vec<Limit>,
    /// For compiled languages, whether the sandbox's compile cache had the program.
    pub compile_cached: Option<bool>,
}

impl Broker {
    pub fn new(config: Arc<Config>, backend: Arc<dyn SandboxBackend>) -> Broker {
        Broker {
            registry: Registry::new(&config.data_dir),
            pool: Arc::new(Pool::new(
                config.pool_size,
                config.pool_max,
                config.pool_refill_concurrency,
            )),
            limits: Limits::from_config(&config, backend.host_memory()),
            jwt: JwtKeys::default(),
            metrics: crate::metrics::Metrics::new(backend.api_errors()),
            audit: crate::audit::Audit::open(&config.audit_log, config.audit_code),
            backend,
            config,
            libraries: tokio::sync::OnceCell::new(),
        }
    }

    /// Finds the session an exec should run in, or makes a new one. Its input refs are
    /// authorised here, against the caller: a ref into a session the caller may not see is
    /// a 403 whichever session the exec runs in.
    pub async fn choose_session(
        &self,
        choice: &SessionChoice,
        files: &[InputFile],
    ) -> AppResult<Arc<Session>> {
        let user = choice.user.as_deref();
        self.authorize_refs(user, files)?;
        let visible = |id: &str| self.registry.get(id).filter(|s| s.visible_to(user));
        if let Some(id) = choice.session_id.as_deref().filter(|s| !s.is_empty()) {
            if !is_valid_id(id) {
                return Err(AppError::BadRequest(format!("invalid session_id: {id:?}")));
            }
            // An unknown (expired, or another user's) session id gets a new session;
            // the response names it.
            if let Some(s) = visible(id) {
                return Ok(s);
            }
        } else if let Some(s) = choice
            .runtime_session_hint
            .as_deref()
            .filter(|h| !h.is_empty())
            .and_then(|h| {
                // A hint is the client's own key (a conversation id); it may also be one
                // of our session ids.
                visible(h).or_else(|| {
                    self.registry
                        .by_hint(user, h)
                        .filter(|s| s.visible_to(user))
                })
            })
        {
            return Ok(s);
        } else if let Some(s) = self.session_of_refs(user, files)? {
            return Ok(s);
        } else if let Some(s) = choice
            .entity_id
            .as_deref()
            .filter(|e| !e.is_empty())
            .and_then(|e| self.registry.by_entity(user, e))
            .filter(|s| s.visible_to(user))
        {
            return Ok(s);
        }
        let hint = choice
            .runtime_session_hint
            .as_deref()
            .filter(|h| !h.is_empty() && !is_valid_id(h));
        self.new_session_with(user, choice.entity_id.as_deref(), hint, true)
            .await
    }

    /// Refuses refs to files of sessions `user` may not see. Unknown sessions pass: the
    /// exec runs and names the missing input.
    fn authorize_refs(&self, user: Option<&str>, files: &[InputFile]) -> AppResult<()> {
        let foreign = files.iter().any(|f| {
            !f.session_id.is_empty()
                && self
                    .registry
                    .get(&f.session_id)
                    .is_some_and(|s| !s.visible_to(user))
        });
        if foreign {
            return Err(AppError::Forbidden(
                "an input file belongs to another user".into(),
            ));
        }
        Ok(())
    }

    /// The one session every input ref belongs to, when there is one.
    fn session_of_refs(
        &self,
        user: Option<&str>,
        files: &[InputFile],
    ) -> AppResult<Option<Arc<Session>>> {
        let Some(first) = files.first() else {
            return Ok(None);
        };
        if files.iter().any(|f| f.session_id != first.session_id) {
            return Ok(None);
        }
        match self.registry.get(&first.session_id) {
            Some(s) if s.visible_to(user) => Ok(Some(s)),
            Some(_) => Err(AppError::Forbidden(
                "an input file belongs to another user".into(),
            )),
            None => Ok(None),
        }
    }

    /// A new session: a pooled sandbox when one is ready (and `for_exec`: an upload
    /// session needs none), else an empty workspace whose sandbox starts at the first exec.
    pub async fn new_session(
        &self,
        user: Option<&str>,
        entity_id: Option<&str>,
        for_exec: bool,
    ) -> AppResult<Arc<Session>> {
        self.new_session_with(user, entity_id, None, for_exec).await
    }

    /// [`Broker::new_session`], also remembering the client's `runtime_session_hint`.
    pub async fn new_session_with(
        &self,
        user: Option<&str>,
        entity_id: Option<&str>,
        hint: Option<&str>,
        for_exec: bool,
    ) -> AppResult<Arc<Session>> {
        crate::diskspace::check_room_for_new_session(
            &self.config.data_dir,
            self.config.min_free_disk,
        )?;
        if for_exec {
            self.make_room(user);
        } else {
            // A session made by an upload holds no container, but a directory and a
            // registry entry until its files expire: it costs one of the user's execs.
            self.limits.check_exec(user)?;
        }
        // A session made to run code needs a sandbox: over a cap, 429 before anything is made.
        let _slot = for_exec
            .then(|| self.limits.container_slot(&self.registry, user))
            .transpose()?;
        // A miss is counted as demand once, when the first exec takes from the pool again.
        let pooled = if for_exec {
            self.pool.take_if_ready()
        } else {
            None
        };
        let (id, workspace) = match &pooled {
            Some(p) => (p.session_id.clone(), p.workspace.clone()),
            None => {
                let id = new_id();
                let ws = Workspace::new(&self.config.data_dir, &id);
                ws.create(self.config.sandbox_uid)
                    .map_err(|e| AppError::internal(format!("cannot create workspace: {e}")))?;
                (id, ws)
            }
        };
        let meta = SessionMeta {
            id,
            user: user.map(str::to_string),
            entity_id: entity_id.filter(|e| !e.is_empty()).map(str::to_string),
            runtime_hint: hint.map(str::to_string),
            created_ms: now_ms(),
        };
        let session = self
            .registry
            .insert_new(meta, workspace)
            .map_err(|e| AppError::internal(format!("cannot save session: {e}")))?;
        let created = serde_json::json!({
            "user": user,
            "session": session.id(),
            "entity_id": entity_id,
            "pooled": pooled.is_some(),
        });
        self.audit.record("session_create", created);
        if let Some(p) = pooled {
            session.set_sandbox(Some(p.sandbox));
        }
        Ok(session)
    }

    /// Runs one exec in `session`, after the execs queued before it. `hooks` carry what a
    /// front end attaches: a stream for output, tools, a cancel signal. Call it from a task
    /// of its own: if it is dropped half-way the runner is told to stop.
    pub async fn exec(
        &self,
        session: Arc<Session>,
        input: ExecInput,
        hooks: ExecHooks,
    ) -> AppResult<ExecOutput> {
        let _turn = session.acquire().await;
        // Used from now on: the idle reaper leaves the sandbox of a starting exec alone.
        session.touch();
        let observed =
            crate::metrics::ExecObservation::start(&self.metrics, &self.audit, &session, &input);
        let started = Instant::now();
        let mut notes = Vec::new();
        self.place_inputs(&session, &input.files, &mut notes)
            .await?;

        let sandbox = self.sandbox_for(&session).await?;
        notes.extend(crate::sandbox::backend::settle_files(&self.backend, &session).await);
        let cap = if hooks.tools.is_some() {
            self.config.max_programmatic_timeout_ms
        } else {
            self.config.max_exec_timeout_ms
        };
        let timeout_ms = input
            .timeout_ms
            .filter(|t| *t > 0)
            .unwrap_or(self.config.exec_timeout_ms)
            .min(cap);
        let ExecHooks {
            events,
            tools,
            cancel,
        } = hooks;
        let (specs, calls_tx, mut results_rx) = match tools {
            Some(bridge) => (bridge.specs, Some(bridge.calls), Some(bridge.results)),
            None => (Vec::new(), None, None),
        };
        let known: std::collections::HashSet<String> =
            specs.iter().map(|t| t.name.clone()).collect();
        // Calls to tools the code was not given are answered here, never sent on.
        let (refusals_tx, mut refusals_rx) = mpsc::unbounded_channel::<ToolResult>();
        let request = ExecRequest {
            lang: input.lang,
            code: input.code,
            args: input.args,
            timeout_ms,
            max_output_bytes: self.config.max_output_bytes,
            stream: events.is_some(),
            tools: specs,
            max_display_events: self.config.max_display_events,
            max_display_bytes: self.config.max_display_bytes,
        };
        // The runner keeps the same budget; this one holds whatever the sandbox sends.
        let mut displays = DisplayBudget::of(&request);
        let job = sandbox.new_job();
        let guard = CancelOnDrop {
            sandbox: Some(sandbox.clone()),
            job,
        };
        let (mut streamed_out, mut streamed_err) = (String::new(), String::new());
        let on_event = |msg| {
            let other = match msg {
                WorkerMessage::ToolCall(call) => {
                    match &calls_tx {
                        Some(tx) if known.contains(&call.name) => {
                            let _ = tx.send(call);
                        }
                        _ => {
                            let _ = refusals_tx.send(ToolResult {
                                error_message: Some(format!("Unknown tool: '{}'", call.name)),
                                call_id: call.call_id,
                                result: serde_json::Value::Null,
                                is_error: true,
                            });
                        }
                    }
                    return None;
                }
                WorkerMessage::Display(display) => match displays.admit(&display) {
                    Admit::Keep => WorkerMessage::Display(display),
                    // Said once, as streamed stderr, so every front end shows it.
                    Admit::DropFirst(note) => WorkerMessage::Output(sandbox_runner::OutputChunk {
                        stream: sandbox_runner::Stream::Stderr,
                        data: format!("{note}\n"),
                    }),
                    Admit::Drop => return None,
                },
                other => other,
            };
            // Streamed output also goes into the final result.
            if let WorkerMessage::Output(chunk) = &other {
                match chunk.stream {
                    sandbox_runner::Stream::Stdout => streamed_out.push_str(&chunk.data),
                    sandbox_runner::Stream::Stderr => streamed_err.push_str(&chunk.data),
                }
            }
            Some(other)
        };
        // The events go to the front end through a bounded channel: the exec waits for a
        // consumer that is behind.
        let run = sandbox.exec_as(job, request, on_event, events.as_ref());
        let cancel = cancel.unwrap_or_default();
        let drive = async {
            tokio::pin!(run);
            let mut cancelled = false;
            loop {
                tokio::select! {
                    done = &mut run => return done,
                    Some(result) = recv_opt(&mut results_rx) => {
                        let _ = sandbox.tool_result(job, result).await;
                    }
                    Some(result) = refusals_rx.recv() => {
                        let _ = sandbox.tool_result(job, result).await;
                    }
                    _ = cancel.cancelled(), if !cancelled => {
                        cancelled = true;
                        let _ = sandbox.cancel(job).await;
                    }
                }
            }
        };
        let outcome =
            tokio::time::timeout(Duration::from_millis(timeout_ms) + EXEC_GRACE, drive).await;
        guard.disarm();
        let mut output = match outcome {
            Ok(Ok(done)) => ExecOutput {
                session_id: session.id().to_string(),
                stdout: done.stdout + &streamed_out,
                stderr: streamed_err + &done.stderr,
                files: Vec::new(),
                runtime_status: done.runtime_status,
                exit_code: done.exit_code,
                duration_ms: 0,
                limits: done.limits,
                compile_cached: done.compile_cached,
            },
            Ok(Err(err)) => {
                // Under gVisor a full memory cgroup ends the whole sandbox, runner included;
                // the engine says whether that is how it ended.
                let exec_start = std::time::SystemTime::now()
                    .checked_sub(started.elapsed())
                    .unwrap_or(std::time::UNIX_EPOCH);
                // Only a sandbox that went away can have been ended for memory: a refusal
                // or an odd answer comes from a runner still alive, not worth a wait.
                let oom = matches!(err, ChannelError::Closed(_))
                    && self
                        .backend
                        .ended_out_of_memory(&sandbox.container_id, exec_start)
                        .await;
                tracing::warn!(session = session.id(), container = %short(&sandbox.container_id), error = %err, oom, "sandbox failed during an exec");
                self.discard_sandbox(&session, &sandbox).await;
                if oom {
                    failed_output(
                        &session,
                        &format!(
                            "Error: {}; the sandbox was ended and the next call starts a new one.",
                            Limit::Memory
                        ),
                        vec![Limit::Memory],
                    )
                } else {
                    failed_output(
                        &session,
                        "The sandbox stopped unexpectedly; the next call starts a new one.",
                        vec![],
                    )
                }
            }
            Err(_) => {
                tracing::warn!(
                    session = session.id(),
                    "runner did not finish an exec in time; replacing the sandbox"
                );
                self.discard_sandbox(&session, &sandbox).await;
                failed_output(&session, Limit::Time.message(), vec![Limit::Time])
            }
        };

        let limits = HarvestLimits {
            max_files: self.config.max_output_files,
            max_file_bytes: self.config.max_output_file_mb.saturating_mul(1024 * 1024),
            storage: self.storage_budget(&session),
        };
        let (files, harvest_notes) = self.harvest(&session, limits).await?;
        notes.extend(harvest_notes);
        output.files = files;
        for note in notes {
            if !output.stderr.is_empty() && !output.stderr.ends_with('\n') {
                output.stderr.push('\n');
            }
            output.stderr.push_str(&note);
            output.stderr.push('\n');
        }
        output.duration_ms = started.elapsed().as_millis() as u64;
        session.exec_done();
        if let Some(cached) = output.compile_cached {
            self.metrics.compile_cache(cached);
        }
        observed.finish(&output);
        Ok(output)
    }

    /// The session's live sandbox, or a new one on its workspace.
    async fn sandbox_for(&self, session: &Arc<Session>) -> AppResult<Arc<Sandbox>> {
        if let Some(sandbox) = session.sandbox() {
            if sandbox.is_alive() {
                return Ok(sandbox);
            }
            self.discard_sandbox(session, &sandbox).await;
        }
        self.make_room(session.meta.user.as_deref());
        let _slot = self
            .limits
            .container_slot(&self.registry, session.meta.user.as_deref())?;
        // Also brings a workspace of an older version to today's owners and modes.
        session
            .workspace
            .create(self.config.sandbox_uid)
            .map_err(|e| AppError::internal(format!("cannot recreate workspace: {e}")))?;
        if let Some(sandbox) = self.sandbox_from_pool(session).await {
            return Ok(sandbox);
        }
        let cold = self.pool.cold_start();
        let created = self
            .backend
            .create(session.id(), &session.workspace, false)
            .await;
        drop(cold);
        let sandbox = created.map_err(|e| {
            tracing::error!(session = session.id(), error = ?e, "cannot start a sandbox");
            AppError::Unavailable("cannot start a sandbox right now; try again".into())
        })?;
        let sandbox = Arc::new(sandbox);
        session.set_sandbox(Some(sandbox.clone()));
        Ok(sandbox)
    }

    /// A pooled sandbox for a session that has files but no live sandbox (made by an
    /// upload, or whose container went idle): the pooled workspace's mounted directory
    /// takes the place of the session's, with the session's files moved into it. `None`
    /// when the pool is empty or the move fails (the caller then starts a container).
    async fn sandbox_from_pool(&self, session: &Arc<Session>) -> Option<Arc<Sandbox>> {
        if !self.backend.hands_over_pooled() {
            return None;
        }
        let pooled = self.pool.take()?;
        let ours = session.workspace.clone();
        let theirs = pooled.workspace.clone();
        let backend = self.backend.clone();
        let moved =
            tokio::task::spawn_blocking(move || backend.take_pooled_workspace(&ours, &theirs))
                .await;
        match moved {
            Ok(Ok(())) => {}
            failed => {
                tracing::warn!(session = session.id(), result = ?failed, "cannot hand a pooled sandbox to a session");
                self.pool.discard(pooled);
                return None;
            }
        }
        // The container's session label names the pooled id; this record lets a restarted
        // broker re-attach the container to this session.
        let record = PooledSandbox {
            container_id: pooled.sandbox.container_id.clone(),
        };
        if let Err(err) = session.workspace.save_meta(POOLED_SANDBOX_FILE, &record) {
            tracing::warn!(session = session.id(), error = %err, "cannot record the pooled sandbox");
        }
        self.audit.record(
            "sandbox_from_pool",
            serde_json::json!({
                "user": session.meta.user,
                "session": session.id(),
                "container": short(&record.container_id),
            }),
        );
        session.set_sandbox(Some(pooled.sandbox.clone()));
        Some(pooled.sandbox)
    }

    /// Drops a broken sandbox and removes its container.
    async fn discard_sandbox(&self, session: &Session, sandbox: &Arc<Sandbox>) {
        sandbox.close("discarded");
        if let Some(current) = session.sandbox() {
            if Arc::ptr_eq(&current, sandbox) {
                session.set_sandbox(None);
            }
        }
        self.backend.remove(&sandbox.container_id).await;
    }

    /// Finds the files the exec created or changed and saves the index.
    async fn harvest(
        &self,
        session: &Arc<Session>,
        limits: HarvestLimits,
    ) -> AppResult<(Vec<FileRecord>, Vec<String>)> {
        let mut index = session.index().clone();
        let (at, backend) = (SandboxFiles::of(session), self.backend.clone());
        let workspace = session.workspace.clone();
        let result = tokio::task::spawn_blocking(move || {
            let report = backend.harvest(&at, &mut index, limits)?;
            if !report.files.is_empty() || report.index_changed {
                workspace.save_index(&index)?;
            }
            Ok::<_, std::io::Error>((index, report))
        })
        .await
        .map_err(|e| AppError::internal(format!("harvest task failed: {e}")))?;
        match result {
            Ok((index, mut report)) => {
                // Blobs go only once neither the saved nor the served index names them: a
                // download of a dropped version is a 404 from then on, never a lost blob.
                let unused = std::mem::take(&mut report.unused_blobs);
                if unused.is_empty() {
                    *session.index() = index;
                } else {
                    *session.index() = index.clone();
                    crate::storage::delete_unused_blobs(&session.workspace, &index, unused).await;
                }
                Ok((
                    report.files.into_iter().map(|h| h.record).collect(),
                    report.notes,
                ))
            }
            Err(err) => {
                tracing::error!(session = session.id(), error = %err, "harvest failed");
                Ok((
                    Vec::new(),
                    vec!["Generated files could not be collected".into()],
                ))
            }
        }
    }

    /// The image's package list, read once.
    pub async fn libraries(&self) -> AppResult<serde_json::Value> {
        self.libraries
            .get_or_try_init(|| async {
                let bytes = self
                    .backend
                    .read_image_file("/opt/codebroker/libraries.json")
                    .await?;
                anyhow::Ok(serde_json::from_slice(&bytes)?)
            })
            .await
            .cloned()
            .map_err(|e| {
                tracing::error!(error = ?e, "cannot read the library list from the image");
                AppError::Unavailable("the sandbox image cannot be read".into())
            })
    }

    /// At start-up: re-attach to this instance's running session containers, remove the
    /// rest (stopped ones, pool leftovers, sessions that no longer exist).
    pub async fn reconcile(&self) -> anyhow::Result<()> {
        let loaded = self.registry.load_all()?;
        // Pooled containers handed to an existing session carry the pooled id as label.
        let handed: HashMap<String, Arc<Session>> = self
            .registry
            .all()
            .into_iter()
            .filter_map(|s| {
                let record: PooledSandbox = s.workspace.load_meta(POOLED_SANDBOX_FILE).ok()?;
                Some((record.container_id, s))
            })
            .collect();
        let mut adopted = 0;
        let mut removed = 0;
        for container in self.backend.list_own().await? {
            let session = container
                .session
                .as_deref()
                .and_then(|id| self.registry.get(id))
                .or_else(|| handed.get(&container.id).cloned());
            match session {
                Some(session) if container.running && session.sandbox().is_none() => {
                    match self.backend.adopt(&container.id).await {
                        Ok(sandbox) => {
                            session.set_sandbox(Some(Arc::new(sandbox)));
                            adopted += 1;
                            continue;
                        }
                        Err(err) => {
                            tracing::warn!(container = %short(&container.id), error = ?err, "cannot re-attach; removing")
                        }
                    }
                }
                Some(_) => {}
                None => {
                    // A pooled sandbox never handed out: its workspace has no session file.
                    if let Some(id) = container.session.as_deref().filter(|id| is_valid_id(id)) {
                        let ws = Workspace::new(&self.config.data_dir, id);
                        if !ws.root().join(META_FILE).exists() {
                            let _ = std::fs::remove_dir_all(ws.root());
                        }
                    }
                }
            }
            self.backend.remove(&container.id).await;
            removed += 1;
        }
        tracing::info!(sessions = loaded, adopted, removed, "reconciled containers");
        Ok(())
    }

    /// The eviction rules of the configuration. Idle containers go before a cap that
    /// refuses (CODEBROKER_MAX_CONTAINERS, the per-user cap) is reached, so that only
    /// running code is ever refused room.
    fn evict_policy(&self) -> evict::Policy {
        let lowest = |a: usize, b: usize| match (a, b) {
            (0, n) | (n, 0) => n,
            (a, b) => a.min(b),
        };
        evict::Policy {
            idle_ttl_ms: self.config.idle_ttl_secs.saturating_mul(1000),
            single_use_ttl_ms: self.config.single_use_ttl_secs.saturating_mul(1000),
            max_live: lowest(self.config.max_live_sandboxes, self.limits.max_containers()),
            max_per_user: self.limits.max_sessions_per_user(),
        }
    }

    /// Sessions holding a live sandbox, with what the eviction rules look at.
    fn live_sessions(&self) -> (Vec<Arc<Session>>, Vec<evict::Live>) {
        let sessions: Vec<Arc<Session>> = self
            .registry
            .all()
            .into_iter()
            .filter(|s| s.sandbox().is_some_and(|sb| sb.is_alive()))
            .collect();
        let live = sessions
            .iter()
            .map(|s| evict::Live {
                last_used_ms: s.last_used_ms(),
                execs: s.exec_count(),
                busy: s.is_busy(),
                uses: s.uses(),
                user: s.meta.user.clone(),
            })
            .collect();
        (sessions, live)
    }

    /// How many session sandboxes are alive now (the pool not counted).
    pub fn live_sandboxes(&self) -> usize {
        self.live_sessions().0.len()
    }

    /// Before one more session sandbox starts for `user`: removes the least recently
    /// used idle ones over the caps (and any past a TTL). The removal itself runs in the
    /// background, so the new session does not wait for the engine.
    fn make_room(&self, user: Option<&str>) {
        let (sessions, live) = self.live_sessions();
        // Containers still starting for other requests hold no session sandbox yet, but
        // will: counted, so concurrent starts do not overshoot the cap.
        let room = evict::Room {
            total: 1 + self.pool.cold_starts(),
            user: Some(user),
        };
        for (i, reason) in evict::victims(&self.evict_policy(), &live, now_ms(), room) {
            self.evict_detached(&sessions[i], reason, live[i].uses);
        }
    }

    /// Takes the sandbox away from an idle session and removes its container in the
    /// background; a session that became busy meanwhile keeps it.
    fn evict_detached(&self, session: &Arc<Session>, reason: Reason, seen_uses: u64) -> bool {
        // Used since the snapshot that chose it: no longer the least recently used.
        let Some(_turn) = session.claim_unused_since(seen_uses) else {
            return false;
        };
        let Some(sandbox) = session.set_sandbox(None) else {
            return false;
        };
        self.record_eviction(session, reason);
        sandbox.close("evicted");
        let backend = self.backend.clone();
        tokio::spawn(async move { backend.remove(&sandbox.container_id).await });
        true
    }

    fn record_eviction(&self, session: &Session, reason: Reason) {
        tracing::debug!(
            session = session.id(),
            reason = reason.as_str(),
            "removing a session sandbox"
        );
        self.metrics.sandbox_removed(reason.as_str());
        let expired = serde_json::json!({
            "user": session.meta.user,
            "session": session.id(),
            "idle": matches!(reason, Reason::Idle | Reason::SingleUse),
            "reason": reason.as_str(),
        });
        self.audit.record("session_expire", expired);
    }

    /// Removes containers past a TTL or over the cap (their files stay), and dead ones.
    pub async fn reap_idle(&self) {
        for session in self.registry.all() {
            let Some(sandbox) = session.sandbox() else {
                continue;
            };
            if sandbox.is_alive() {
                continue;
            }
            // An exec in progress finds out by itself.
            let Some(_turn) = session.try_acquire() else {
                continue;
            };
            tracing::debug!(session = session.id(), "removing a dead sandbox");
            self.discard_sandbox(&session, &sandbox).await;
        }
        let (sessions, live) = self.live_sessions();
        let room = evict::Room::default();
        for (i, reason) in evict::victims(&self.evict_policy(), &live, now_ms(), room) {
            let session = &sessions[i];
            // An exec that took the turn since the snapshot marked the session used: its
            // sandbox stays.
            let Some(_turn) = session.claim_unused_since(live[i].uses) else {
                continue;
            };
            let Some(sandbox) = session.sandbox() else {
                continue;
            };
            self.record_eviction(session, reason);
            self.discard_sandbox(session, &sandbox).await;
        }
    }

    /// On shutdown: drain the pool; leave session containers for the next start to
    /// re-attach, or remove them (`CODEBROKER_SHUTDOWN_CONTAINERS`).
    pub async fn shutdown(&self) {
        self.pool.drain(&*self.backend).await;
        let remove = self.config.shutdown_containers == crate::config::ShutdownContainers::Remove;
        let mut count = 0;
        for session in self.registry.all() {
            if !remove {
                count += usize::from(session.sandbox().is_some());
                continue;
            }
            if let Some(sandbox) = session.set_sandbox(None) {
                sandbox.close("shutdown");
                self.backend.remove(&sandbox.container_id).await;
                count += 1;
            }
        }
        if remove {
            self.await_no_containers().await;
            tracing::info!(removed = count, "removed session containers");
        } else {
            tracing::info!(kept = count, "session containers left for the next start");
        }
    }
}

impl Broker {
    /// Waits (a few seconds at most) until the engine lists none of this instance's
    /// containers: an exec abandoned at the end of the shutdown grace may be removing its
    /// own sandbox at the same moment, and the engine answers the second removal with a
    /// 409 while the first is still under way.
    async fn await_no_containers(&self) {
        for round in 0..50 {
            match self.backend.list_own().await {
                Ok(left) if left.is_empty() => return,
                Ok(left) if round % 10 == 9 => {
                    for container in left {
                        self.backend.remove(&container.id).await;
                    }
                }
                Ok(_) => {}
                Err(err) => {
                    tracing::warn!(error = %err, "cannot list containers");
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        tracing::warn!("session containers are still being removed");
    }
}

/// Receives from an optional channel; never resolves without one.
async fn recv_opt<T>(rx: &mut Option<mpsc::UnboundedReceiver<T>>) -> Option<T> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

fn failed_output(session: &Session, message: &str, limits: Vec<Limit>) -> ExecOutput {
    ExecOutput {
        session_id: session.id().to_string(),
        stdout: String::new(),
        stderr: format!("{message}\n"),
        files: Vec::new(),
        runtime_status: RuntimeStatus::New,
        exit_code: None,
        duration_ms: 0,
        limits,
        compile_cached: None,
    }
}

/// Tells the runner to stop a job when the exec future is dropped before it finished
/// (a client went away).
struct CancelOnDrop {
    sandbox: Option<Arc<Sandbox>>,
    job: sandbox_runner::JobId,
}

impl CancelOnDrop {
    fn disarm(mut self) {
        self.sandbox = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(sandbox) = self.sandbox.take() {
            let job = self.job;
            tokio::spawn(async move {
                let _ = sandbox.cancel(job).await;
            });
        }
    }
}
