//! Choosing the session an exec runs in, and making new sessions.

use crate::clock::now_ms;
use crate::core::error::{Error, Result};
use crate::core::limits::ContainerSlot;
use crate::core::{Broker, InputFile};
use crate::ids::{is_valid_id, new_id};
use crate::session::{same_tenant, OwnerKey, Session, SessionMeta};
use crate::workspace::{FileRecord, Workspace};
use sha2::Digest as _;
use std::sync::Arc;

/// How the caller wants a session chosen (docs/API.md, "POST /exec").
#[derive(Debug, Clone, Default)]
pub(crate) struct SessionChoice {
    /// The end user the caller names.
    pub(crate) user: Option<String>,
    /// An explicit session id.
    pub(crate) session_id: Option<String>,
    /// A runtime session the client saw earlier.
    pub(crate) runtime_session_hint: Option<String>,
    /// A LibreChat agent or assistant id.
    pub(crate) entity_id: Option<String>,
    /// The caller's tenant: whose shared files (skills, agent files) the refs may name.
    pub(crate) tenant: Option<String>,
}

impl Broker {
    /// Finds the session an exec should run in, or makes a new one. Its input refs are
    /// authorised here, against the caller: a ref into a session the caller may not see is
    /// a 403 whichever session the exec runs in.
    ///
    /// A session made here for the exec comes with the reservation of its container
    /// start, which the exec hands to [`Broker::sandbox_for`]: the caps are checked once.
    pub(crate) async fn choose_session(
        &self,
        choice: &SessionChoice,
        files: &[InputFile],
    ) -> Result<(Arc<Session>, Option<ContainerSlot>)> {
        let user = choice.user.as_deref();
        let tenant = choice.tenant.as_deref();
        self.authorize_refs(tenant, user, files)?;
        let visible = |id: &str| self.registry.get(id).filter(|s| s.visible_to(tenant, user));
        let shared = self.shared_refs_key(user, tenant, files);
        if let Some(id) = choice.session_id.as_deref().filter(|s| !s.is_empty()) {
            if !is_valid_id(id) {
                return Err(Error::BadRequest(format!("invalid session_id: {id:?}")));
            }
            // An unknown (expired, or another user's or tenant's) session id gets a new
            // session; the response names it.
            if let Some(s) = visible(id) {
                return Ok((s, None));
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
                        .by_hint(tenant, user, h)
                        .filter(|s| s.visible_to(tenant, user))
                })
            })
        {
            return Ok((s, None));
        } else if let Some(s) = self.session_of_refs(tenant, user, files)? {
            return Ok((s, None));
        } else if let Some(s) = shared
            .as_deref()
            .and_then(|key| self.registry.by_hint(tenant, user, key))
            .filter(|s| s.visible_to(tenant, user))
        {
            return Ok((s, None));
        } else if let Some(s) = choice
            .entity_id
            .as_deref()
            .filter(|e| !e.is_empty())
            .and_then(|e| self.registry.by_entity(tenant, user, e))
            .filter(|s| s.visible_to(tenant, user))
        {
            return Ok((s, None));
        }
        let hint = choice
            .runtime_session_hint
            .as_deref()
            .filter(|h| !h.is_empty() && !is_valid_id(h))
            .or(shared.as_deref());
        let owner = (tenant.map(str::to_string), user.map(str::to_string));
        self.create_session(owner, choice.entity_id.as_deref(), hint, None, true)
            .await
    }

    /// An upload into an existing session costs the caller one exec of its rate, as one
    /// that makes a session does (in `create_session`): each writes to disk and to the
    /// file index. For every front end that uploads (HTTP, MCP).
    pub(crate) fn charge_upload(&self, tenant: Option<&str>, user: Option<&str>) -> Result<()> {
        self.limits
            .check_exec(&(tenant.map(str::to_string), user.map(str::to_string)))
    }

    /// Refuses refs to files of sessions of the caller's tenant that `user` may not see.
    /// Unknown sessions pass: the exec runs and names the missing input. So do sessions of
    /// other tenants and of shared files: those shared in the caller's tenant are placed
    /// read-only, any other is named missing like an unknown one, so another tenant's ids
    /// cannot be probed ([`Broker::place_inputs`]).
    pub(crate) fn authorize_refs(
        &self,
        tenant: Option<&str>,
        user: Option<&str>,
        files: &[InputFile],
    ) -> Result<()> {
        let foreign = files.iter().any(|f| {
            !f.session_id.is_empty()
                && self.registry.get(&f.session_id).is_some_and(|s| {
                    !s.is_shared()
                        && same_tenant(tenant, s.meta.tenant.as_deref())
                        && !s.visible_to(tenant, user)
                })
        });
        if foreign {
            return Err(Error::Forbidden(
                "an input file belongs to another user".into(),
            ));
        }
        Ok(())
    }

    /// The one session every input ref belongs to, when there is one. Refs to shared files
    /// (skills, agent files, injected into every call) do not count: the exec never runs in
    /// their session, and the conversation's own files still lead to its session.
    pub(crate) fn session_of_refs(
        &self,
        tenant: Option<&str>,
        user: Option<&str>,
        files: &[InputFile],
    ) -> Result<Option<Arc<Session>>> {
        let own: Vec<&InputFile> = files
            .iter()
            .filter(|f| {
                self.registry
                    .get(&f.session_id)
                    .is_none_or(|s| !s.is_shared())
            })
            .collect();
        let Some(first) = own.first() else {
            return Ok(None);
        };
        if own.iter().any(|f| f.session_id != first.session_id) {
            return Ok(None);
        }
        match self.registry.get(&first.session_id) {
            Some(s) if s.visible_to(tenant, user) => Ok(Some(s)),
            // Another tenant's: as unknown.
            Some(s) if !same_tenant(tenant, s.meta.tenant.as_deref()) => Ok(None),
            Some(_) => Err(Error::Forbidden(
                "an input file belongs to another user".into(),
            )),
            None => Ok(None),
        }
    }

    /// When every input ref names a shared file the caller may read (the first call with
    /// a skill, or a classic agent's files), the key the caller's own session for those
    /// shared sessions is remembered by, as a hint is: the next such call finds it again
    /// (its Python state too), as a call with the agent's `entity_id` finds the agent's.
    fn shared_refs_key(
        &self,
        user: Option<&str>,
        tenant: Option<&str>,
        files: &[InputFile],
    ) -> Option<String> {
        let mut ids: Vec<&str> = Vec::new();
        for f in files {
            let shared = self
                .registry
                .get(&f.session_id)
                .is_some_and(|s| s.is_shared() && s.readable_by(user, tenant));
            if !shared {
                return None;
            }
            ids.push(&f.session_id);
        }
        if ids.is_empty() {
            return None;
        }
        ids.sort_unstable();
        ids.dedup();
        let digest = sha2::Sha256::digest(ids.join(",").as_bytes());
        Some(format!("shared:{}", hex::encode(&digest[..12])))
    }

    /// A new session: a pooled sandbox when one is ready (and `for_exec`: an upload
    /// session needs none), else an empty workspace whose sandbox starts at the first exec.
    pub(crate) async fn new_session(
        &self,
        tenant: Option<&str>,
        user: Option<&str>,
        entity_id: Option<&str>,
        for_exec: bool,
    ) -> Result<Arc<Session>> {
        let owner = (tenant.map(str::to_string), user.map(str::to_string));
        let (session, _slot) = self
            .create_session(owner, entity_id, None, None, for_exec)
            .await?;
        Ok(session)
    }

    /// A new session for files `user` uploads to share in `tenant` (skills, agent files):
    /// readable by every caller of the tenant, changed by none (see
    /// [`SessionMeta::shared_in`]). Each such upload gets one of its own, as LibreChat's
    /// own code server does, so no later upload can replace what earlier refs point to.
    pub(crate) async fn new_shared_session(
        &self,
        user: Option<&str>,
        tenant: &str,
        entity_id: Option<&str>,
    ) -> Result<Arc<Session>> {
        let owner = (Some(tenant.to_string()), user.map(str::to_string));
        let (session, _) = self
            .create_session(owner, entity_id, None, Some(tenant), false)
            .await?;
        Ok(session)
    }

    /// A new session in the registry, with its workspace. `for_exec`: the caps are
    /// checked for its container, a pooled sandbox is taken when one is ready, and
    /// otherwise the reservation of the start comes back with the session.
    async fn create_session(
        &self,
        owner: OwnerKey,
        entity_id: Option<&str>,
        hint: Option<&str>,
        shared_in: Option<&str>,
        for_exec: bool,
    ) -> Result<(Arc<Session>, Option<ContainerSlot>)> {
        crate::core::diskspace::check_room_for_new_session(
            &self.config.data_dir,
            self.config.caps.min_free_disk,
        )?;
        let removals = if for_exec {
            // Refused anyway: no other user's idle container is taken for it.
            self.limits.check_user_room(&self.registry, &owner)?;
            self.make_room(&owner)
        } else {
            // A session made by an upload holds no container, but a directory and a
            // registry entry until its files expire: it costs one of the user's execs.
            self.limits.check_exec(&owner)?;
            None
        };
        // A session made to run code needs a sandbox: over a cap, 429 before anything is made.
        let room_made = removals.is_some();
        let slot = for_exec
            .then(|| {
                self.limits
                    .container_slot(&self.registry, &owner, room_made)
            })
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
                ws.create(self.config.workspace_uid())
                    .map_err(|e| Error::internal(format!("cannot create workspace: {e}")))?;
                (id, ws)
            }
        };
        let (tenant, user) = owner;
        let meta = SessionMeta {
            id,
            user: user.clone(),
            entity_id: entity_id.filter(|e| !e.is_empty()).map(str::to_string),
            runtime_hint: hint.map(str::to_string),
            created_ms: now_ms(),
            shared_in: shared_in.map(str::to_string),
            tenant,
        };
        let session = self
            .registry
            .insert_new(meta, workspace)
            .map_err(|e| Error::internal(format!("cannot save session: {e}")))?;
        let created = serde_json::json!({
            "user": user,
            "tenant": session.meta.tenant,
            "session": session.id(),
            "entity_id": entity_id,
            "pooled": pooled.is_some(),
            "shared_in": shared_in,
        });
        self.audit.record("session_create", created);
        if let Some(removals) = removals {
            session.hold_until_exec_ends(removals);
        }
        match pooled {
            Some(p) => {
                self.take_pooled(&p);
                session.set_sandbox(Some(p.sandbox));
                // Live now, so counted as live: the reservation is done.
                Ok((session, None))
            }
            None => Ok((session, slot)),
        }
    }
}

impl Broker {
    /// The session `session_id` as `user` sees it: the id's shape checked (bad request),
    /// then found and visible to `user` (not found otherwise, so other users' sessions
    /// cannot be probed).
    pub(crate) fn visible_session(
        &self,
        tenant: Option<&str>,
        user: Option<&str>,
        session_id: &str,
    ) -> Result<Arc<Session>> {
        self.session_if(session_id, |s| s.visible_to(tenant, user))
    }

    /// The session id a front end that names no user for its end users (MCP clients,
    /// LobeChat) may go back to: `session_id`, unless it is the session of a named user.
    /// Such a front end acts for everyone behind one key, and the ids of sessions it made
    /// travel in transcripts and shared chats; a named user's id leaked into one starts a
    /// new session instead. Callers that name a user are held to their own sessions
    /// anyway.
    pub(crate) fn front_end_session_id(
        &self,
        user: Option<&str>,
        session_id: Option<String>,
    ) -> Option<String> {
        session_id.filter(|id| {
            user.is_some()
                || !is_valid_id(id)
                || self.registry.get(id).is_none_or(|s| s.meta.user.is_none())
        })
    }

    /// The session `session_id` if a caller naming `user` in `tenant` may read it: one it
    /// may see, or one shared in its tenant (not found otherwise, for the same reason).
    pub(crate) fn readable_session(
        &self,
        user: Option<&str>,
        tenant: Option<&str>,
        session_id: &str,
    ) -> Result<Arc<Session>> {
        self.session_if(session_id, |s| s.readable_by(user, tenant))
    }

    fn session_if(
        &self,
        session_id: &str,
        allowed: impl Fn(&Session) -> bool,
    ) -> Result<Arc<Session>> {
        if !is_valid_id(session_id) {
            return Err(Error::BadRequest(format!(
                "invalid session id: {session_id:?}"
            )));
        }
        self.registry
            .get(session_id)
            .filter(|s| allowed(s))
            .ok_or_else(|| Error::NotFound(format!("session {session_id} not found")))
    }

    /// The live (not expired) record of `file_id` in a session a caller naming `user` in
    /// `tenant` may read.
    pub(crate) fn readable_record(
        &self,
        user: Option<&str>,
        tenant: Option<&str>,
        session_id: &str,
        file_id: &str,
    ) -> Result<(Arc<Session>, FileRecord)> {
        if !is_valid_id(file_id) {
            return Err(Error::BadRequest(format!("invalid file id: {file_id:?}")));
        }
        let session = self.readable_session(user, tenant, session_id)?;
        let record = session
            .index()
            .get(file_id)
            .cloned()
            .filter(|r| !self.is_expired(r))
            .ok_or_else(|| Error::NotFound(format!("file {file_id} not found")))?;
        Ok((session, record))
    }
}

impl Broker {
    /// Ends a session at its front end's request (E2B's kill): waits for its turn (the
    /// caller cancels a running exec first), removes its sandbox without saving state, then
    /// its files and its workspace. `false` when it was already gone.
    pub(crate) async fn delete_session(&self, session: &Arc<Session>) -> bool {
        let _turn = session.acquire().await;
        if self.registry.get(session.id()).is_none() {
            return false;
        }
        if let Some(sandbox) = session.set_sandbox(None) {
            self.discard_sandbox(session, &sandbox).await;
        }
        self.registry.remove(session.id());
        let root = session.workspace.root().to_path_buf();
        let _ = tokio::task::spawn_blocking(move || std::fs::remove_dir_all(root)).await;
        self.audit.record(
            "session_delete",
            serde_json::json!({
                "session_id": session.id(),
                "tenant": session.meta.tenant,
                "user": session.meta.user,
            }),
        );
        true
    }

    /// Releases a session's sandbox and keeps its files (E2B's pause): the Python state is
    /// saved first and loads itself before the session's next Python exec.
    pub(crate) async fn release_sandbox(&self, session: &Session) {
        let _turn = session.acquire().await;
        if let Some(sandbox) = session.sandbox() {
            self.retire_sandbox(session, &sandbox).await;
        }
    }

    /// The session `id` if `tenant` may see it (any user of the tenant: a front end that
    /// keeps its own owner records, E2B's).
    pub(crate) fn tenant_session(&self, tenant: Option<&str>, id: &str) -> Option<Arc<Session>> {
        self.registry
            .get(id)
            .filter(|s| !s.is_shared() && same_tenant(tenant, s.meta.tenant.as_deref()))
    }
}

impl Broker {
    /// Restarts a session's kernel (E2B's context restart): its sandbox is removed
    /// without saving state, and any state saved before is forgotten. Files stay.
    pub(crate) async fn restart_sandbox(&self, session: &Session) {
        let _turn = session.acquire().await;
        if let Some(sandbox) = session.sandbox() {
            self.discard_sandbox(session, &sandbox).await;
        }
        let workspace = session.workspace.clone();
        let _ = tokio::task::spawn_blocking(move || workspace.forget_state()).await;
    }
}
