//! The broker's file operations on sessions: uploads, input refs, deletion and expiry.
//! Blocking disk work runs on the blocking pool; each session's index changes only while
//! its turn is held, so an exec's harvest and an upload never overwrite each other.

use crate::clock::now_ms;
use crate::core::error::{Error, Result};
use crate::core::limits::{too_many_names, MAX_NAMES_PER_BLOB, NAMES_CAP_FROM_BYTES};
use crate::core::observe::{observe_files, FileEvent};
use crate::core::{Broker, InputFile};
use crate::ids::new_id;
use crate::session::Session;
use crate::workspace::{
    human_bytes, safe_relative_path, FileRecord, LeftOut, Origin, StorageBudget, Workspace,
};
use std::path::PathBuf;
use std::sync::Arc;

/// A file received from a client, hashed and parked in the staging area until its
/// session is known (multipart fields may come after the files).
#[derive(Debug)]
pub(crate) struct StagedFile {
    /// Where it goes under `/mnt/data`, checked to stay beneath it.
    pub(crate) name: PathBuf,
    /// The staged bytes.
    pub(crate) temp: PathBuf,
    /// SHA-256 of the bytes, hex.
    pub(crate) sha256: String,
    /// Size in bytes.
    pub(crate) size: u64,
}

/// How uploaded files are to be kept.
#[derive(Debug, Clone, Default)]
pub(crate) struct UploadOptions {
    /// Never report them as generated, and keep the code from changing them (when the
    /// broker's uid is not the sandbox's; see `workspace`).
    pub(crate) read_only: bool,
    /// The new contract's `kind` (`user`, `agent`, `skill`).
    pub(crate) kind: Option<String>,
    /// The user the upload is for, as the audit log names it (else the session's user).
    pub(crate) by: Option<String>,
}

/// An exec's input ref that is in place in `/mnt/data`: how the client named it, and
/// where it is.
#[derive(Debug, Clone)]
pub(crate) struct PlacedInput {
    /// The name the ref carried (the file's own name when it carried none): the one
    /// `deleted_files` reports, since clients match it against the refs they sent.
    pub(crate) sent_name: String,
    /// Its path below `/mnt/data`, as the index names it.
    pub(crate) name: String,
}

/// An exec's input refs that were not placed, by reason: each reason makes one note line,
/// bounded whatever the number of refs or the length of their names.
#[derive(Debug, Default)]
struct InputsLeftOut {
    /// Refs to files that do not exist, have expired, or are another tenant's.
    missing: LeftOut,
    /// Refs whose name is not a path beneath `/mnt/data`.
    invalid: LeftOut,
    /// Refs whose copy would go over the storage budget.
    over_budget: LeftOut,
    /// Refs to a large file already placed under `MAX_NAMES_PER_BLOB` other names.
    too_many_names: LeftOut,
    /// Refs the broker could not write (something in the way at the name).
    unplaced: LeftOut,
    /// Why the first of `unplaced` could not be written.
    first_error: Option<String>,
}

impl InputsLeftOut {
    /// One line per reason that has refs.
    fn notes(&self, budget: &StorageBudget) -> Vec<String> {
        let mut notes = Vec::new();
        let were = |left: &LeftOut| if left.count == 1 { "was" } else { "were" };
        let inputs = |left: &LeftOut| {
            if left.count == 1 {
                "1 input file".to_string()
            } else {
                format!("{} input files", left.count)
            }
        };
        if self.missing.count > 0 {
            notes.push(format!(
                "{} {} not found: {}",
                inputs(&self.missing),
                were(&self.missing),
                self.missing.list()
            ));
        }
        if self.invalid.count > 0 {
            notes.push(format!(
                "{} {} not placed: the name is not a relative path without '..': {}",
                inputs(&self.invalid),
                were(&self.invalid),
                self.invalid.list()
            ));
        }
        if self.over_budget.count > 0 {
            notes.push(format!(
                "{} {} not placed: each copy in /mnt/data counts, and they are over \
                 {}: {}",
                inputs(&self.over_budget),
                were(&self.over_budget),
                budget.describe(),
                self.over_budget.list()
            ));
        }
        if self.too_many_names.count > 0 {
            notes.push(format!(
                "{} {} not placed: a file over {} is placed under at most {} names in a \
                 session, and it already has them: {}",
                inputs(&self.too_many_names),
                were(&self.too_many_names),
                human_bytes(NAMES_CAP_FROM_BYTES),
                MAX_NAMES_PER_BLOB,
                self.too_many_names.list()
            ));
        }
        if self.unplaced.count > 0 {
            let why = self.first_error.as_deref().unwrap_or("unknown error");
            notes.push(format!(
                "{} could not be placed ({}): {}",
                inputs(&self.unplaced),
                shorten_note(why),
                self.unplaced.list()
            ));
        }
        notes
    }
}

/// An error's text for a note, cut to a line's worth.
fn shorten_note(text: &str) -> String {
    const MAX: usize = 120;
    let mut end = text.len().min(MAX);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].replace('\n', " ")
}

impl Broker {
    /// The staging directory for uploads in flight; on the data volume, so a staged file
    /// moves into its session with a rename.
    pub(crate) fn staging_dir(&self) -> PathBuf {
        self.config.data_dir.join("staging")
    }

    /// A client-chosen file name as a path beneath `/mnt/data`, or a clear 400.
    pub(crate) fn check_upload_name(name: &str) -> Result<PathBuf> {
        safe_relative_path(name).ok_or_else(|| {
            Error::BadRequest(format!(
                "invalid file name {name:?}: it must be a relative path without '..' \
                 (for example data.csv or skills/pptx/SKILL.md)"
            ))
        })
    }

    /// The most one upload's files may hold together, whatever session they go to: the
    /// session budget (each file is kept and placed, so more could never be stored).
    /// `None` when sessions have no budget of their own.
    pub(crate) fn upload_budget(&self) -> Option<StorageBudget> {
        let limit = self.config.caps.session_storage;
        (limit > 0).then_some(StorageBudget {
            room: limit,
            limit,
            per_user: false,
        })
    }

    /// Refuses (503) to stage upload bytes while the data volume is below
    /// CODEBROKER_MIN_FREE_DISK.
    pub(crate) fn check_room_to_stage(&self) -> Result<()> {
        crate::core::diskspace::check_room_to_stage(
            &self.config.data_dir,
            self.config.caps.min_free_disk,
        )
    }

    /// What `session`'s stored versions may take now: its own budget, or what its user's
    /// budget leaves it after the user's other sessions, whichever is smaller. Sessions of
    /// callers that name no user have only their own: such callers hold the full-scope key,
    /// and one shared budget would let one of their end users lock out all the others.
    pub(crate) fn storage_budget(&self, session: &Session) -> StorageBudget {
        let mut budget = StorageBudget::UNLIMITED;
        if self.config.caps.session_storage > 0 {
            budget = StorageBudget {
                room: self.config.caps.session_storage,
                limit: self.config.caps.session_storage,
                per_user: false,
            };
        }
        if let (Some(_), limit @ 1..) =
            (session.meta.user.as_deref(), self.config.caps.user_storage)
        {
            // A user is a user of one tenant: the same name in another is someone else.
            let owner = session.owner_key();
            let others: u64 = self
                .registry
                .all()
                .iter()
                .filter(|s| s.id() != session.id() && s.owner_key() == owner)
                .map(|s| {
                    s.index().stored_bytes()
                        + s.workspace.saved_state_bytes()
                        + s.workspace.installs_bytes()
                })
                .sum();
            let room = limit.saturating_sub(others);
            if room < budget.room {
                budget = StorageBudget {
                    room,
                    limit,
                    per_user: true,
                };
            }
        }
        budget
    }

    /// Moves staged files into `session`: into its blob store, and placed at their names
    /// in `/mnt/data`. Returns one record per file, in order. A file that does not fit the
    /// storage budget, even after versions that are no longer current were dropped, is a
    /// 413 (the files before it are kept).
    pub(crate) async fn store_uploads(
        &self,
        session: &Arc<Session>,
        files: Vec<StagedFile>,
        options: UploadOptions,
    ) -> Result<Vec<FileRecord>> {
        let _turn = session.acquire().await;
        let workspace = session.workspace.clone();
        let (at, backend) = (session.files(), self.backend.clone());
        // Shared files are read-only for everyone, the uploader too.
        let read_only = options.read_only
            || session.is_shared()
            || matches!(options.kind.as_deref(), Some("skill") | Some("agent"));
        let kind = options.kind.clone();
        let budget = self.storage_budget(session);
        // Only this turn changes the index: a copy is changed, then put back.
        let mut index = session.index().clone();
        let (index, records, unused, result) = tokio::task::spawn_blocking(move || {
            let mut records = Vec::new();
            let mut unused = Vec::new();
            let mut store = |file: StagedFile| -> Result<()> {
                let name = file.name.to_string_lossy().into_owned();
                if too_many_names(file.size, index.placed_names(&file.sha256, &name)) {
                    return Err(Error::TooLarge(format!(
                        "{name} ({}) is not stored: the session already has the same bytes \
                         under {MAX_NAMES_PER_BLOB} names, the most a file over {} may have. \
                         Delete some of them first",
                        human_bytes(file.size),
                        human_bytes(NAMES_CAP_FROM_BYTES),
                    )));
                }
                // The blob, and the copy placed at the name.
                let extra = index.placed_cost_of(&file.sha256, file.size);
                let Some(dropped) =
                    index.make_room(extra, budget.room, Some(&name), Some(&file.sha256))
                else {
                    return Err(Error::TooLarge(format!(
                        "{name} ({}) does not fit {}: the session keeps {} of file versions \
                         that are still current and of their copies in /mnt/data. Delete \
                         files first",
                        human_bytes(file.size),
                        budget.describe(),
                        human_bytes(index.stored_bytes()),
                    )));
                };
                unused.extend(dropped.blobs);
                workspace
                    .create_blobs_dir()
                    .and_then(|()| workspace.commit_blob(&file.temp, &file.sha256))
                    .map_err(|e| Error::internal(format!("cannot store upload: {e}")))?;
                // The workspace is the code's: a directory, or a link leading out of it,
                // may stand where the name goes. That is the name's problem, not ours.
                let placed = backend.place_file(
                    &at,
                    &workspace.blob_path(&file.sha256),
                    &file.name,
                    read_only,
                );
                let stamp = match placed {
                    Ok(stamp) => stamp,
                    Err(e) => {
                        unused.push(file.sha256.clone());
                        return Err(match in_the_way(&e) {
                            Some(why) => Error::Conflict(format!(
                                "cannot place {:?} in /mnt/data: {why}",
                                file.name
                            )),
                            None => Error::internal(format!("cannot place upload: {e}")),
                        });
                    }
                };
                let record = FileRecord {
                    id: new_id(),
                    name,
                    size: file.size,
                    sha256: file.sha256,
                    created_ms: now_ms(),
                    stamp,
                    current: true,
                    origin: Origin::Uploaded,
                    read_only,
                    kind: kind.clone(),
                    modified_from: None,
                };
                index.push_current(record.clone());
                records.push(record);
                Ok(())
            };
            let mut result = Ok(());
            for file in files {
                result = store(file);
                if result.is_err() {
                    break;
                }
            }
            (index, records, unused, result)
        })
        .await
        .map_err(Error::task("upload"))?;
        // What was stored before a failure stays, recorded.
        *session.index() = index.clone();
        save_index(&session.workspace, &index).await?;
        delete_unused_blobs(&session.workspace, &index, unused).await;
        session.touch();
        if !records.is_empty() {
            observe_files(
                &self.metrics,
                &self.audit,
                FileEvent::Upload,
                options.by.as_deref(),
                session,
                &records.iter().collect::<Vec<_>>(),
            );
        }
        result.map(|()| records)
    }

    /// Places an exec's input refs in its session (with its turn held): refs to this
    /// session's files must exist; files of other sessions of the same user are copied
    /// in, and so are shared files of the caller's `tenant`, read-only. Missing inputs are
    /// named in `notes`, and so are shared files of another tenant, as if they did not
    /// exist; another user's file is a 403. Returns the inputs that are in place.
    ///
    /// Each copy written into `/mnt/data` is charged to the storage budget (see
    /// `FileIndex::placed_cost_of`), and recorded before the next ref is looked at, so
    /// that refs to one file under many names cannot multiply it on disk. Refs left out
    /// make one bounded note line per reason.
    ///
    /// The refs were authorised against the caller when the session was chosen
    /// ([`Broker::choose_session`]); this checks the source against the destination's
    /// owner as well, so that no file moves into a session whose owner could not see it
    /// (an unnamed caller may run in any user's session). A shared file is checked against
    /// the caller's tenant instead: whoever may read it may copy it where they may write.
    pub(crate) async fn place_inputs(
        &self,
        session: &Arc<Session>,
        files: &[InputFile],
        tenant: Option<&str>,
        notes: &mut Vec<String>,
    ) -> Result<Vec<PlacedInput>> {
        crate::core::limits::check_input_refs(files.len())?;
        let mut in_place = Vec::new();
        let mut left_out = InputsLeftOut::default();
        let mut unused = Vec::new();
        let mut changed = false;
        let budget = self.storage_budget(session);
        for file in files {
            let source = if file.session_id.is_empty() || file.session_id == session.id() {
                session.clone()
            } else {
                match self.registry.get(&file.session_id) {
                    Some(s) if s.is_shared() => {
                        if !s.readable_by(None, tenant) {
                            left_out.missing.add(file.shown_name());
                            continue;
                        }
                        s
                    }
                    Some(s)
                        if s.visible_to(
                            session.meta.tenant.as_deref(),
                            session.meta.user.as_deref(),
                        ) =>
                    {
                        s
                    }
                    // Another tenant's: as unknown, so its ids cannot be probed.
                    Some(s)
                        if !crate::session::same_tenant(
                            session.meta.tenant.as_deref(),
                            s.meta.tenant.as_deref(),
                        ) =>
                    {
                        left_out.missing.add(file.shown_name());
                        continue;
                    }
                    Some(_) => {
                        return Err(Error::Forbidden(
                            "an input file belongs to another user".into(),
                        ))
                    }
                    None => {
                        left_out.missing.add(file.shown_name());
                        continue;
                    }
                }
            };
            let record = source.index().get(&file.id).cloned();
            let Some(record) = record.filter(|r| !self.is_expired(r)) else {
                left_out.missing.add(file.shown_name());
                continue;
            };
            let target = if file.name.is_empty() {
                record.name.clone()
            } else {
                file.name.clone()
            };
            let Some(target_path) = safe_relative_path(&target) else {
                left_out.invalid.add(&target);
                continue;
            };
            let target_name = target_path.to_string_lossy().into_owned();
            // This session's current version at the name, when it has the same bytes.
            let (same_bytes, placed_read_only, placed_stamp) = session
                .index()
                .current(&target_name)
                .filter(|c| c.sha256 == record.sha256)
                .map(|c| (Some(c.id.clone()), c.read_only, Some(c.stamp)))
                .unwrap_or((None, false, None));
            if Arc::ptr_eq(&source, session) && same_bytes.is_some() {
                // Still in place as this version (the harvest checked it): nothing to do.
                in_place.push(PlacedInput {
                    sent_name: target,
                    name: target_name,
                });
                continue;
            }
            // A shared file copied in at an earlier exec, which the code cannot have
            // changed: a skill's files come with every call, and are not written again,
            // once the file at the name is seen to be the one placed (the code may have
            // moved a directory on the path while it was being protected).
            let unchanged_if = (!Arc::ptr_eq(&source, session)
                && record.read_only
                && placed_read_only
                && self.read_only_stays_as_placed())
            .then_some(placed_stamp)
            .flatten();
            if unchanged_if.is_none() {
                // Every copy written is a new version of this session: budgeted, with the
                // copies this exec placed before it counted.
                let (fits, names) = {
                    let index = session.index();
                    let extra = index.placed_cost_of(&record.sha256, record.size);
                    (
                        index.could_fit(extra, budget.room, Some(&target_name)),
                        index.placed_names(&record.sha256, &target_name),
                    )
                };
                if too_many_names(record.size, names) {
                    left_out.too_many_names.add(&target);
                    continue;
                }
                if !fits {
                    left_out.over_budget.add(&target);
                    continue;
                }
            }
            let from = source.workspace.clone();
            let to = session.workspace.clone();
            let (at, backend) = (session.files(), self.backend.clone());
            let rec = record.clone();
            let target_for_copy = target_path.clone();
            let result = tokio::task::spawn_blocking(move || {
                if let Some(stamp) = unchanged_if {
                    if to.placed_stamp(&target_for_copy) == Some(stamp) {
                        return Ok(None);
                    }
                }
                to.create_blobs_dir()?;
                let blob = to.blob_path(&rec.sha256);
                if !blob.exists() {
                    let src = from.blob_path(&rec.sha256);
                    // Blobs are immutable and broker-owned: a hard link is a safe copy.
                    if std::fs::hard_link(&src, &blob).is_err() {
                        std::fs::copy(&src, &blob)?;
                    }
                }
                backend
                    .place_file(&at, &blob, &target_for_copy, rec.read_only)
                    .map(Some)
            })
            .await
            .map_err(Error::task("copy"))?;
            let stamp = match result {
                Ok(Some(stamp)) => stamp,
                Ok(None) => {
                    in_place.push(PlacedInput {
                        sent_name: target,
                        name: target_name,
                    });
                    continue;
                }
                Err(err) => {
                    left_out.unplaced.add(&target);
                    left_out.first_error.get_or_insert_with(|| err.to_string());
                    continue;
                }
            };
            in_place.push(PlacedInput {
                sent_name: target,
                name: target_name.clone(),
            });
            let placed = FileRecord {
                // Restoring a version of this session at its own name keeps its id; so
                // does a copy of the bytes this session already has at the name (a
                // skill's files, copied again at every exec, are written afresh but not
                // recorded again); any other placement is a new file of this session.
                id: if Arc::ptr_eq(&source, session) && record.name == target_name {
                    record.id.clone()
                } else if let Some(id) = same_bytes {
                    id
                } else {
                    new_id()
                },
                name: target_name,
                stamp,
                current: true,
                origin: Origin::Input,
                created_ms: now_ms(),
                modified_from: None,
                ..record
            };
            // Recorded now, so that the next ref's budget check counts this copy.
            let mut index = session.index();
            // A restored version of this session keeps its id: drop the old entry (its
            // blob is the one the restored version names, so it stays).
            if index.get(&placed.id).is_some() {
                index.remove(&placed.id);
            }
            // Old versions make room as for any new version; what was placed is recorded
            // even if they cannot (it was checked to fit before).
            let extra = index.placed_cost_of(&placed.sha256, placed.size);
            let keep = Some(placed.sha256.as_str());
            if let Some(dropped) = index.make_room(extra, budget.room, Some(&placed.name), keep) {
                unused.extend(dropped.blobs);
            }
            index.push_current(placed);
            changed = true;
        }
        notes.extend(left_out.notes(&budget));
        if changed {
            let index = session.index().clone();
            save_index(&session.workspace, &index).await?;
            delete_unused_blobs(&session.workspace, &index, unused).await;
        }
        Ok(in_place)
    }

    /// Whether a read-only file placed in a workspace stays as placed whatever the code
    /// does: the broker writes it as its own (the host file path) and is not the sandbox's
    /// uid (SECURITY.md). Through the runner, or as the sandbox uid, code can change its
    /// copy, so such a copy is placed again at every exec that names it.
    fn read_only_stays_as_placed(&self) -> bool {
        self.backend.files_on_host()
            && self.config.sandbox.sandbox_uids()
                != crate::config::SandboxUids::Shared(crate::workspace::euid())
    }

    /// Deletes one file id for a client (`user`), audited: its record, its bytes when no
    /// other id needs them, and the sandbox's copy when it is still that version.
    pub(crate) async fn delete_file(
        &self,
        session: &Arc<Session>,
        file_id: &str,
        user: Option<&str>,
    ) -> Result<()> {
        let deleted = self.remove_file_id(session, file_id).await?;
        observe_files(
            &self.metrics,
            &self.audit,
            FileEvent::Delete,
            user,
            session,
            &deleted.iter().take(1).collect::<Vec<_>>(),
        );
        Ok(())
    }

    /// Opens the broker-owned copy of `record` for a client (`user`), counted and audited
    /// as a download: what the sandbox did to the file since cannot change it, and no
    /// sandbox path is opened. Returns the file and its size.
    pub(crate) async fn open_download(
        &self,
        session: &Session,
        record: &FileRecord,
        user: Option<&str>,
    ) -> Result<(tokio::fs::File, u64)> {
        let not_found = || Error::NotFound(format!("file {} not found", record.id));
        let file = tokio::fs::File::open(session.workspace.blob_path(&record.sha256))
            .await
            .map_err(|_| not_found())?;
        let size = file.metadata().await.map_or(record.size, |m| m.len());
        // Counted when served (a client that stops reading early still counts in full).
        self.observe_download(session, record, size, user);
        Ok((file, size))
    }

    /// The bytes of `record` for a client (`user`) that shows them inline, counted and
    /// audited as a download.
    pub(crate) async fn read_download(
        &self,
        session: &Session,
        record: &FileRecord,
        user: Option<&str>,
    ) -> Result<Vec<u8>> {
        let bytes = crate::render::read_blob(session, record).await?;
        self.observe_download(session, record, bytes.len() as u64, user);
        Ok(bytes)
    }

    /// Counts and audits `size` bytes of `record` served to `user`.
    fn observe_download(
        &self,
        session: &Session,
        record: &FileRecord,
        size: u64,
        user: Option<&str>,
    ) {
        let served = FileRecord {
            size,
            ..record.clone()
        };
        observe_files(
            &self.metrics,
            &self.audit,
            FileEvent::Download,
            user,
            session,
            &[&served],
        );
    }

    /// Removes one file id (its record, its bytes when no other id needs them, the
    /// sandbox's copy when it is still that version); returns its records.
    async fn remove_file_id(
        &self,
        session: &Arc<Session>,
        file_id: &str,
    ) -> Result<Vec<FileRecord>> {
        let _turn = session.acquire().await;
        let (dropped, index) = {
            let mut index = session.index();
            let dropped = index.remove(file_id);
            if dropped.records.is_empty() {
                return Err(Error::NotFound(format!("file {file_id} not found")));
            }
            (dropped, index.clone())
        };
        save_index(&session.workspace, &index).await?;
        let deleted = dropped.records.clone();
        let workspace = session.workspace.clone();
        let (at, backend) = (session.files(), self.backend.clone());
        tokio::task::spawn_blocking(move || {
            for record in dropped.records.iter().filter(|r| r.current) {
                let _ = backend.remove_file(&at, record);
            }
            workspace.delete_unused_blobs(&index, &dropped.blobs);
        })
        .await
        .map_err(Error::task("delete"))?;
        Ok(deleted)
    }

    /// Whether a file version is past the file TTL.
    pub(crate) fn is_expired(&self, record: &FileRecord) -> bool {
        let ttl_ms = self.config.lifecycle.file_ttl_secs.saturating_mul(1000);
        now_ms().saturating_sub(record.created_ms) >= ttl_ms
    }

    /// Frees expired files of every session, and removes sessions that have nothing left
    /// and have been idle past the file TTL (their workspaces too).
    pub(crate) async fn expire_files(&self) {
        let ttl_ms = self.config.lifecycle.file_ttl_secs.saturating_mul(1000);
        for session in self.registry.all() {
            let expired: Vec<String> = session
                .index()
                .files
                .iter()
                .filter(|r| self.is_expired(r))
                .map(|r| r.id.clone())
                .collect();
            for id in expired {
                let _ = self.remove_file_id(&session, &id).await;
            }
            let idle = now_ms().saturating_sub(session.last_used_ms()) >= ttl_ms;
            if idle && session.sandbox().is_none() && session.index().files.is_empty() {
                if let Some(_turn) = session.try_acquire() {
                    self.registry.remove(session.id());
                    let root = session.workspace.root().to_path_buf();
                    let _ =
                        tokio::task::spawn_blocking(move || std::fs::remove_dir_all(root)).await;
                    tracing::debug!(session = session.id(), "session expired");
                }
            }
        }
    }
}

/// Whether placing a file failed because of what the code left in the workspace (a
/// directory at the name, a link or special file on the path), and why in words for the
/// client; `None` for the broker's own failures (a full disk).
fn in_the_way(err: &std::io::Error) -> Option<&'static str> {
    use std::io::ErrorKind;
    match (err.kind(), err.raw_os_error()) {
        (ErrorKind::AlreadyExists | ErrorKind::IsADirectory, _) => {
            Some("a directory or a link is in the way")
        }
        (ErrorKind::NotADirectory, _) | (_, Some(libc::ENOTDIR)) => {
            Some("a part of the path is not a directory")
        }
        // cap-std's answer to a path that would leave the workspace, and ELOOP for a link
        // opened without following it.
        (ErrorKind::PermissionDenied, _) | (_, Some(libc::ELOOP)) => {
            Some("a part of the path is a link")
        }
        _ => None,
    }
}

/// Deletes blobs no record of the (saved) index names, off the async threads.
pub(crate) async fn delete_unused_blobs(
    workspace: &Workspace,
    index: &crate::workspace::FileIndex,
    blobs: Vec<String>,
) {
    if blobs.is_empty() {
        return;
    }
    let workspace = workspace.clone();
    let index = index.clone();
    let _ =
        tokio::task::spawn_blocking(move || workspace.delete_unused_blobs(&index, &blobs)).await;
}

/// Writes a session's index off the async threads.
pub(crate) async fn save_index(
    workspace: &Workspace,
    index: &crate::workspace::FileIndex,
) -> Result<()> {
    let workspace = workspace.clone();
    let index = index.clone();
    tokio::task::spawn_blocking(move || workspace.save_index(&index))
        .await
        .map_err(Error::task("index"))?
        .map_err(|e| Error::internal(format!("cannot save the file index: {e}")))
}

impl Broker {
    /// The file `name` below `/mnt/data` as the code sees it now, for a front end that
    /// reads the live workspace (E2B's envd); at most `cap` bytes. Counted and audited as
    /// a download. A session without a live sandbox on the runner transport serves the
    /// current stored version.
    pub(crate) async fn read_live_file(
        &self,
        session: &Session,
        name: &str,
        cap: u64,
    ) -> Result<Vec<u8>> {
        let (at, backend, owned) = (session.files(), self.backend.clone(), name.to_string());
        let read = tokio::task::spawn_blocking(move || backend.read_file(&at, &owned, cap))
            .await
            .map_err(Error::task("read"))?;
        let missing = || Error::NotFound(format!("path '{name}' does not exist"));
        let bytes = match read {
            Ok(Some(bytes)) => bytes,
            Ok(None) => {
                return Err(Error::TooLarge(format!(
                    "{name} is larger than {}, the most one read returns",
                    human_bytes(cap)
                )))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotConnected => {
                let record = session.index().current(name).cloned().ok_or_else(missing)?;
                return self.read_download(session, &record, None).await;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(missing()),
            Err(e)
                if e.kind() == std::io::ErrorKind::IsADirectory
                    || e.raw_os_error() == Some(libc::EISDIR) =>
            {
                return Err(Error::BadRequest(format!("path '{name}' is a directory")))
            }
            Err(e) => match in_the_way(&e) {
                Some(why) => return Err(Error::BadRequest(format!("cannot read {name}: {why}"))),
                None => return Err(Error::internal(format!("cannot read {name}: {e}"))),
            },
        };
        // A file the code wrote since the last exec has no record yet: the audit names it.
        let known = session.index().current(name).cloned();
        let record = known.unwrap_or_else(|| FileRecord {
            id: String::new(),
            name: name.to_string(),
            size: 0,
            sha256: String::new(),
            created_ms: now_ms(),
            stamp: Default::default(),
            current: true,
            origin: Origin::Generated,
            read_only: false,
            kind: None,
            modified_from: None,
        });
        self.observe_download(session, &record, bytes.len() as u64, None);
        Ok(bytes)
    }
}
