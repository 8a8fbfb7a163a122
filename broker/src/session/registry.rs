//! All sessions of this broker, in memory and on disk.

use super::{Session, SessionMeta};
use crate::ids::is_valid_id;
use crate::workspace::Workspace;
use dashmap::DashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The name of a session's metadata file in its workspace root.
pub(crate) const META_FILE: &str = "session.json";

/// `(tenant, user, entity_id or hint)`: what an affinity is remembered by. Two callers
/// share a session this way only in one tenant, as one user (or both naming none).
type AffinityKey = (String, String, String);

/// Sessions by id, plus the `entity_id` affinity map.
pub(crate) struct Registry {
    /// Where workspaces live; sessions not in memory are loaded from here.
    data_dir: PathBuf,
    /// Sessions loaded so far.
    sessions: DashMap<String, Arc<Session>>,
    /// `(tenant, user, entity_id)` to session id: LibreChat agents name their entity on
    /// each call, so calls of one agent find one session.
    entities: DashMap<AffinityKey, String>,
    /// The tenant sessions saved before tenants were recorded belong to: the broker's only
    /// tenant, when it has exactly one (one key, or auth off), so that such a setup keeps
    /// its sessions across the upgrade; `None`: nobody's.
    untenanted_owner: Option<String>,
}

impl Registry {
    /// The sessions under `data_dir`; those saved without a tenant are given to
    /// `untenanted_owner`.
    pub(crate) fn new(data_dir: &Path, untenanted_owner: Option<String>) -> Registry {
        Registry {
            data_dir: data_dir.to_path_buf(),
            sessions: DashMap::new(),
            entities: DashMap::new(),
            untenanted_owner,
        }
    }

    /// Number of sessions loaded in memory.
    pub(crate) fn len(&self) -> usize {
        self.sessions.len()
    }

    /// Every loaded session.
    pub(crate) fn all(&self) -> Vec<Arc<Session>> {
        self.sessions.iter().map(|e| e.value().clone()).collect()
    }

    /// The session `id`, from memory or, after a restart, from disk.
    pub(crate) fn get(&self, id: &str) -> Option<Arc<Session>> {
        if !is_valid_id(id) {
            return None;
        }
        if let Some(s) = self.sessions.get(id) {
            return Some(s.clone());
        }
        let session = Arc::new(load(&self.data_dir, id, self.untenanted_owner.as_deref()).ok()?);
        Some(
            self.sessions
                .entry(id.to_string())
                .or_insert(session)
                .clone(),
        )
    }

    /// The session made for `entity_id` by `user` in `tenant`.
    pub(crate) fn by_entity(
        &self,
        tenant: Option<&str>,
        user: Option<&str>,
        entity_id: &str,
    ) -> Option<Arc<Session>> {
        let tenant = tenant?;
        let key = affinity_key(Some(tenant), user, entity_id);
        let id = self.entities.get(&key)?.clone();
        self.get(&id)
    }

    /// The session made for `runtime_session_hint` `hint` by `user` in `tenant`.
    pub(crate) fn by_hint(
        &self,
        tenant: Option<&str>,
        user: Option<&str>,
        hint: &str,
    ) -> Option<Arc<Session>> {
        self.by_entity(tenant, user, &hint_key(hint))
    }

    /// Registers the affinity keys (entity, hint) of a session. A session of shared files
    /// has none: no exec or upload is to find it by its entity.
    fn index_keys(&self, meta: &SessionMeta) {
        if meta.shared_in.is_some() {
            return;
        }
        // Nobody's session is nobody's to find.
        let Some(tenant) = meta.tenant.as_deref() else {
            return;
        };
        let user = meta.user.as_deref();
        if let Some(entity) = &meta.entity_id {
            self.entities
                .insert(affinity_key(Some(tenant), user, entity), meta.id.clone());
        }
        if let Some(hint) = &meta.runtime_hint {
            self.entities.insert(
                affinity_key(Some(tenant), user, &hint_key(hint)),
                meta.id.clone(),
            );
        }
    }

    /// Registers a new session whose workspace exists already, and persists its metadata.
    pub(crate) fn insert_new(
        &self,
        meta: SessionMeta,
        workspace: Workspace,
    ) -> io::Result<Arc<Session>> {
        workspace.save_meta(META_FILE, &meta)?;
        self.index_keys(&meta);
        let session = Arc::new(Session::new(meta, workspace, Default::default()));
        self.sessions
            .insert(session.id().to_string(), session.clone());
        Ok(session)
    }

    /// Forgets a session (its workspace is the caller's to remove).
    pub(crate) fn remove(&self, id: &str) {
        if let Some((_, session)) = self.sessions.remove(id) {
            let (tenant, user) = session.owner_key();
            let keys = [
                session.meta.entity_id.clone(),
                session.meta.runtime_hint.as_deref().map(hint_key),
            ];
            for key in keys.into_iter().flatten() {
                let key = affinity_key(tenant.as_deref(), user.as_deref(), &key);
                self.entities.remove_if(&key, |_, v| v == id);
            }
        }
    }

    /// Reads every session on disk, so `entity_id` affinity survives a restart.
    pub(crate) fn load_all(&self) -> io::Result<usize> {
        let dir = self.data_dir.join("sessions");
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(e),
        };
        let mut n = 0;
        for entry in entries.flatten() {
            let Some(id) = entry.file_name().to_str().map(str::to_string) else {
                continue;
            };
            if let Some(session) = self.get(&id) {
                self.index_keys(&session.meta);
                // Nothing uses the session yet: blobs its index does not name (left by a
                // crash) can go, so the disk matches the storage budget's count.
                let _ = session.workspace.sweep_blobs(&session.index());
                n += 1;
            }
        }
        Ok(n)
    }
}

fn affinity_key(tenant: Option<&str>, user: Option<&str>, key: &str) -> AffinityKey {
    (
        tenant.unwrap_or_default().to_string(),
        user.unwrap_or_default().to_string(),
        key.to_string(),
    )
}

/// Hints live in the entity map under a prefix no entity id carries.
fn hint_key(hint: &str) -> String {
    format!("\u{1}hint:{hint}")
}

fn load(data_dir: &Path, id: &str, untenanted_owner: Option<&str>) -> io::Result<Session> {
    let workspace = Workspace::new(data_dir, id);
    let mut meta: SessionMeta = workspace.load_meta(META_FILE)?;
    if meta.tenant.is_none() && meta.shared_in.is_none() {
        meta.tenant = untenanted_owner.map(str::to_string);
    }
    if meta.id != id {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "session id mismatch",
        ));
    }
    let index = workspace.load_index()?;
    Ok(Session::new(meta, workspace, index))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::new_id;

    #[test]
    fn sessions_and_entities_survive_a_restart() {
        let tmp = tempfile::tempdir().unwrap();
        let id = new_id();
        let registry = Registry::new(tmp.path(), None);
        let ws = Workspace::new(tmp.path(), &id);
        std::fs::create_dir_all(ws.files_dir()).unwrap();
        let meta = SessionMeta {
            id: id.clone(),
            user: Some("u1".into()),
            entity_id: Some("agent".into()),
            runtime_hint: Some("conv-1".into()),
            created_ms: 1,
            shared_in: None,
            tenant: Some("t1".into()),
        };
        registry.insert_new(meta, ws).unwrap();
        let t1 = Some("t1");
        assert!(registry.by_entity(t1, Some("u1"), "agent").is_some());
        assert!(registry.by_entity(t1, Some("u2"), "agent").is_none());
        assert!(registry
            .by_entity(Some("t2"), Some("u1"), "agent")
            .is_none());
        assert!(registry.by_entity(None, Some("u1"), "agent").is_none());

        let again = Registry::new(tmp.path(), None);
        assert_eq!(again.load_all().unwrap(), 1);
        let session = again.by_entity(t1, Some("u1"), "agent").unwrap();
        assert_eq!(again.by_hint(t1, Some("u1"), "conv-1").unwrap().id(), id);
        assert!(again.by_hint(t1, Some("u2"), "conv-1").is_none());
        assert!(again.by_hint(Some("t2"), Some("u1"), "conv-1").is_none());
        assert_eq!(session.id(), id);
        assert!(again.get("not-an-id").is_none());
        assert!(again.get(&new_id()).is_none());
    }

    #[test]
    fn shared_sessions_have_no_entity_and_stay_shared_after_a_restart() {
        let tmp = tempfile::tempdir().unwrap();
        let id = new_id();
        let registry = Registry::new(tmp.path(), None);
        let ws = Workspace::new(tmp.path(), &id);
        std::fs::create_dir_all(ws.files_dir()).unwrap();
        let meta = SessionMeta {
            id: id.clone(),
            user: Some("u1".into()),
            entity_id: Some("agent".into()),
            runtime_hint: None,
            created_ms: 1,
            shared_in: Some("jwt:t1".into()),
            tenant: Some("jwt:t1".into()),
        };
        registry.insert_new(meta, ws).unwrap();
        let t1 = Some("jwt:t1");
        assert!(registry.by_entity(t1, Some("u1"), "agent").is_none());

        let again = Registry::new(tmp.path(), None);
        assert_eq!(again.load_all().unwrap(), 1);
        assert!(again.by_entity(t1, Some("u1"), "agent").is_none());
        let session = again.get(&id).unwrap();
        assert_eq!(session.meta.shared_in.as_deref(), Some("jwt:t1"));
        assert!(!session.visible_to(t1, Some("u1")));
        assert!(session.readable_by(Some("u2"), Some("jwt:t1")));
    }

    /// A session saved before tenants were recorded: the only tenant of a broker gets it
    /// (and its affinity), a broker of several tenants gives it to none.
    #[test]
    fn untenanted_sessions_go_to_the_only_tenant() {
        let tmp = tempfile::tempdir().unwrap();
        let id = new_id();
        let ws = Workspace::new(tmp.path(), &id);
        std::fs::create_dir_all(ws.files_dir()).unwrap();
        let old = serde_json::json!({ "id": id, "user": null, "entity_id": "agent",
                                      "created_ms": 1 });
        ws.save_meta(META_FILE, &old).unwrap();

        let sole = Registry::new(tmp.path(), Some("key:one".into()));
        assert_eq!(sole.load_all().unwrap(), 1);
        let session = sole.get(&id).unwrap();
        assert!(session.visible_to(Some("key:one"), None));
        assert!(!session.visible_to(Some("key:two"), None));
        assert_eq!(
            sole.by_entity(Some("key:one"), None, "agent").unwrap().id(),
            id
        );

        let several = Registry::new(tmp.path(), None);
        assert_eq!(several.load_all().unwrap(), 1);
        let session = several.get(&id).unwrap();
        assert!(!session.visible_to(Some("key:one"), None));
        assert!(several.by_entity(Some("key:one"), None, "agent").is_none());
    }
}
