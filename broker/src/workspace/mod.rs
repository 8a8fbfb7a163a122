//! The host side of a session's files.
//!
//! On disk a session is `DATA_DIR/sessions/<session id>/` holding `session.json` (who owns
//! it), `index.json` (file ids) and `files/`, the directory mounted at `/mnt/data`. The
//! sandbox controls everything under `files/`: it can plant symlinks, FIFOs, sockets and
//! races. So the broker reads it only through `cap-std` (every lookup stays beneath the
//! directory: a link that would lead out is an error, a relative link inside it may be
//! followed in a directory part; the last component is never followed) and opens files
//! non-blocking, checking each really is a regular file before reading it.
//!
//! Ownership: everything but the inside of `files/` is the broker's alone (directories
//! 0700, files 0600, created so). `files/` itself belongs to the broker too, group of the
//! sandbox, mode 1770: the sandbox may create what it likes there, but the sticky bit keeps
//! it from unlinking or renaming what it does not own. Read-only uploads are the broker's
//! files, mode 0444, in directories that are the broker's and sticky as well; so, when the
//! broker's uid is not the sandbox's, code can read them but not change, replace, move or
//! delete them.

use crate::clock::now_ms;
use crate::ids::new_id;
use cap_fs_ext::{DirExt, FollowSymlinks, OpenOptionsFollowExt};
use cap_std::ambient_authority;
use cap_std::fs::{Dir, MetadataExt, OpenOptions, OpenOptionsExt};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

/// Directories whose contents are never reported as generated files; shared with the
/// runner, which lists files by the same rules.
const SKIPPED_DIRS: &[&str] = sandbox_runner::HARVEST_SKIPPED_DIRS;

/// How deep the harvest walks, and how many entries it looks at, so that a sandbox that
/// creates millions of files cannot stall the broker.
const MAX_DEPTH: usize = sandbox_runner::HARVEST_MAX_DEPTH;
pub(crate) const MAX_ENTRIES: usize = sandbox_runner::HARVEST_MAX_ENTRIES;

/// One file id: a version of a file in the workspace.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FileRecord {
    /// The 21-character id clients download it by.
    pub id: String,
    /// Path relative to `/mnt/data`, `/`-separated.
    pub name: String,
    /// Size in bytes when it was recorded.
    pub size: u64,
    /// SHA-256 of the content, hex: how changes are told apart (not mtime, which the
    /// sandbox controls).
    pub sha256: String,
    /// Milliseconds since the epoch when this version was recorded.
    pub created_ms: u64,
    /// Inode and change time when recorded: a cheap "unchanged" check before hashing.
    /// The sandbox cannot set ctime.
    #[serde(default)]
    pub stamp: Stamp,
    /// Whether this is the newest version of `name` (older ids are kept for clients
    /// that still hold them).
    pub current: bool,
    /// How the file came to be: its kind of origin decides whether it is reported.
    #[serde(default)]
    pub origin: Origin,
    /// Uploaded read-only (or as kind `skill`/`agent`): never reported as generated,
    /// whatever the code does to it.
    #[serde(default)]
    pub read_only: bool,
    /// The uploader's `kind` (`user`, `agent`, `skill`), for listings.
    #[serde(default)]
    pub kind: Option<String>,
    /// The id of the version this one replaced.
    #[serde(default)]
    pub modified_from: Option<String>,
}

/// Where a file version came from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Origin {
    /// Written by code in the sandbox.
    #[default]
    Generated,
    /// Uploaded by a client.
    Uploaded,
    /// Copied in from another session as an exec's input.
    Input,
}

/// What a cheap look at a file tells: enough to know it was not touched.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stamp {
    /// Inode number.
    pub ino: u64,
    /// Size in bytes.
    pub size: u64,
    /// Change time, seconds and nanoseconds.
    pub ctime: i64,
    /// Nanoseconds part of the change time.
    pub ctime_nsec: i64,
}

/// Stored versions are counted in whole blocks of this many bytes (what a file takes on
/// disk), at least one each.
const BLOCK: u64 = 4096;

/// What each version costs against a storage budget on top of its bytes: its entry in
/// `index.json`, which is rewritten at every harvest. Without it, versions of empty files
/// would be free and the index could grow without bound.
const RECORD_COST: u64 = 1024;

/// What a blob of `size` bytes costs against a storage budget.
pub fn blob_cost(size: u64) -> u64 {
    size.div_ceil(BLOCK).max(1).saturating_mul(BLOCK)
}

/// The file ids of one session, persisted as `index.json` so ids survive a restart.
///
/// Lookups by id and by name, and the bytes the versions take, are kept in maps beside
/// the list (rebuilt from it on load), so a harvest costs O(files) instead of
/// O(files x versions). Change records only through the methods here, which keep the
/// maps in step.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(from = "StoredIndex")]
pub struct FileIndex {
    /// Every recorded version, oldest first.
    pub files: Vec<FileRecord>,
    /// Position in `files` of each id.
    #[serde(skip)]
    by_id: HashMap<String, usize>,
    /// Position in `files` of the current version of each name.
    #[serde(skip)]
    current: HashMap<String, usize>,
    /// Each blob the records need: its cost and how many records share it.
    #[serde(skip)]
    blobs: HashMap<String, BlobUse>,
    /// What the versions cost against the storage budget: blobs plus records.
    #[serde(skip)]
    stored: u64,
    /// Files the last harvest did not keep (over the size limit or the storage budget), by
    /// a hash of the name, with their stamp: unchanged, they are left out again without a
    /// note, instead of being noted at every exec. Kept in memory only; after a restart
    /// they are noted once more.
    #[serde(skip)]
    noted: HashMap<u64, Stamp>,
}

/// One blob as the index uses it.
#[derive(Debug, Clone, Copy)]
struct BlobUse {
    /// What it costs against the budget.
    cost: u64,
    /// Records that name it.
    records: usize,
}

/// `index.json` as written; the maps are rebuilt from it.
#[derive(Deserialize)]
struct StoredIndex {
    /// Every recorded version, oldest first.
    #[serde(default)]
    files: Vec<FileRecord>,
}

impl From<StoredIndex> for FileIndex {
    fn from(stored: StoredIndex) -> FileIndex {
        let mut index = FileIndex {
            files: stored.files,
            ..FileIndex::default()
        };
        index.reindex();
        index
    }
}

/// Versions dropped to make room for new ones.
#[derive(Debug, Default)]
pub struct Dropped {
    /// The dropped records.
    pub records: Vec<FileRecord>,
    /// Blobs no record named once they were dropped; deleted after the index is saved
    /// (and only if no record names them by then).
    pub blobs: Vec<String>,
}

impl FileIndex {
    /// Rebuilds the maps from `files`. Should two records of a name both claim to be
    /// current, the newer one is.
    fn reindex(&mut self) {
        self.by_id.clear();
        self.current.clear();
        self.blobs.clear();
        let mut stale = Vec::new();
        for (pos, r) in self.files.iter().enumerate() {
            self.by_id.insert(r.id.clone(), pos);
            if r.current {
                if let Some(old) = self.current.insert(r.name.clone(), pos) {
                    stale.push(old);
                }
            }
            self.blobs
                .entry(r.sha256.clone())
                .or_insert(BlobUse {
                    cost: blob_cost(r.size),
                    records: 0,
                })
                .records += 1;
        }
        for pos in stale {
            self.files[pos].current = false;
        }
        self.stored = self.blobs.values().map(|b| b.cost).sum::<u64>()
            + RECORD_COST * self.files.len() as u64;
    }

    /// The record of file id `id`.
    pub fn get(&self, id: &str) -> Option<&FileRecord> {
        self.by_id.get(id).map(|&pos| &self.files[pos])
    }

    /// The newest record of `name`.
    pub fn current(&self, name: &str) -> Option<&FileRecord> {
        self.current.get(name).map(|&pos| &self.files[pos])
    }

    /// Adds `record` as the newest version of its name.
    pub fn push_current(&mut self, record: FileRecord) {
        if let Some(&old) = self.current.get(&record.name) {
            self.files[old].current = false;
        }
        let pos = self.files.len();
        let blob = self.blobs.entry(record.sha256.clone()).or_insert(BlobUse {
            cost: blob_cost(record.size),
            records: 0,
        });
        if blob.records == 0 {
            self.stored += blob.cost;
        }
        blob.records += 1;
        self.stored += RECORD_COST;
        self.by_id.insert(record.id.clone(), pos);
        if record.current {
            self.current.insert(record.name.clone(), pos);
        }
        self.files.push(record);
    }

    /// Records a new stamp for the unchanged version `id`.
    pub fn set_stamp(&mut self, id: &str, stamp: Stamp) {
        if let Some(&pos) = self.by_id.get(id) {
            self.files[pos].stamp = stamp;
        }
    }

    /// Whether any record still needs the blob `sha256`.
    pub fn uses_blob(&self, sha256: &str) -> bool {
        self.blobs.contains_key(sha256)
    }

    /// What the stored versions cost against the storage budget, in bytes.
    pub fn stored_bytes(&self) -> u64 {
        self.stored
    }

    /// Removes the records whose ids `remove` accepts. Returns them, and the blobs no
    /// record needs any more (the caller deletes those once the index is saved).
    pub fn remove_where(&mut self, remove: impl Fn(&FileRecord) -> bool) -> Dropped {
        let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.files)
            .into_iter()
            .partition(|r| remove(r));
        self.files = kept;
        self.reindex();
        let mut blobs: Vec<String> = gone
            .iter()
            .filter(|r| !self.uses_blob(&r.sha256))
            .map(|r| r.sha256.clone())
            .collect();
        blobs.sort();
        blobs.dedup();
        Dropped {
            records: gone,
            blobs,
        }
    }

    /// Removes the record `id`.
    pub fn remove(&mut self, id: &str) -> Dropped {
        self.remove_where(|r| r.id == id)
    }

    /// What the versions would cost with every version that is no longer current dropped.
    pub fn floor_bytes(&self) -> u64 {
        let mut named = std::collections::HashSet::new();
        let mut total = 0;
        for &pos in self.current.values() {
            let r = &self.files[pos];
            total += RECORD_COST;
            if named.insert(r.sha256.as_str()) {
                total += self.blobs.get(&r.sha256).map_or(0, |b| b.cost);
            }
        }
        total
    }

    /// What one more version of `size` bytes costs; nothing for its bytes when a record
    /// already has them (`sha256` known).
    pub fn cost_of(&self, sha256: Option<&str>, size: u64) -> u64 {
        let shared = sha256.is_some_and(|h| self.uses_blob(h));
        RECORD_COST + if shared { 0 } else { blob_cost(size) }
    }

    /// The versions to drop, oldest first, so that `extra` more bytes fit within `limit`:
    /// versions that are no longer current, then the current version of `replacing` (the
    /// name about to get a new one). The blob `keep` (the new version's) is never counted
    /// as freed. `None` when dropping all of them would not make room.
    fn room_plan(
        &self,
        extra: u64,
        limit: u64,
        replacing: Option<&str>,
        keep: Option<&str>,
    ) -> Option<Vec<usize>> {
        let mut need = self.stored.saturating_add(extra).saturating_sub(limit);
        let mut plan = Vec::new();
        if need == 0 {
            return Some(plan);
        }
        let mut refs: HashMap<&str, usize> = HashMap::new();
        let old = self
            .files
            .iter()
            .enumerate()
            .filter(|(_, r)| !r.current)
            .map(|(pos, _)| pos);
        let replaced = replacing.and_then(|name| self.current.get(name).copied());
        for pos in old.chain(replaced) {
            let r = &self.files[pos];
            let blob = self.blobs.get(&r.sha256).copied().unwrap_or(BlobUse {
                cost: 0,
                records: 1,
            });
            let left = refs.entry(&r.sha256).or_insert(blob.records);
            *left = left.saturating_sub(1);
            let mut freed = RECORD_COST;
            if *left == 0 && keep != Some(r.sha256.as_str()) {
                freed += blob.cost;
            }
            plan.push(pos);
            need = need.saturating_sub(freed);
            if need == 0 {
                return Some(plan);
            }
        }
        None
    }

    /// Whether `extra` more bytes could be made to fit within `limit` (see
    /// [`FileIndex::make_room`]); nothing is dropped.
    pub fn could_fit(&self, extra: u64, limit: u64, replacing: Option<&str>) -> bool {
        self.room_plan(extra, limit, replacing, None).is_some()
    }

    /// Makes room for `extra` more bytes within `limit` by dropping versions that are no
    /// longer current, oldest first, and last the current version of `replacing`. `None`
    /// when that cannot make room; then nothing is dropped.
    pub fn make_room(
        &mut self,
        extra: u64,
        limit: u64,
        replacing: Option<&str>,
        keep: Option<&str>,
    ) -> Option<Dropped> {
        let plan = self.room_plan(extra, limit, replacing, keep)?;
        if plan.is_empty() {
            return Some(Dropped::default());
        }
        let ids: std::collections::HashSet<String> =
            plan.iter().map(|&pos| self.files[pos].id.clone()).collect();
        Some(self.remove_where(|r| ids.contains(&r.id)))
    }
}

/// A file the harvest found new or changed.
#[derive(Debug, Clone)]
pub struct Harvested {
    pub record: FileRecord,
}

/// What one harvest found.
#[derive(Debug, Default)]
pub struct HarvestReport {
    /// New or changed files, each with a new id.
    pub files: Vec<Harvested>,
    /// Notes for stderr: files left out and why, one bounded line per reason.
    pub notes: Vec<String>,
    /// Whether the index changed beyond `files` (versions dropped), so it must be saved.
    pub index_changed: bool,
    /// Blobs to delete once the index is saved: those of dropped versions, and of new
    /// versions that were not kept. The caller checks each is still unused.
    pub unused_blobs: Vec<String>,
}

/// Caps on what one harvest reports.
#[derive(Debug, Clone, Copy)]
pub struct HarvestLimits {
    /// Most files reported.
    pub max_files: usize,
    /// Largest file reported, in bytes.
    pub max_file_bytes: u64,
    /// What the session's stored versions may take.
    pub storage: StorageBudget,
}

/// What a session's stored versions may take: the smaller of its own budget and what its
/// user's budget leaves it (see `crate::core::files`).
#[derive(Debug, Clone, Copy)]
pub struct StorageBudget {
    /// Bytes the session's versions may cost in all (`u64::MAX`: no budget).
    pub room: u64,
    /// The configured budget that sets `room`, for notes.
    pub limit: u64,
    /// Whether that is the user's budget, shared by all their sessions.
    pub per_user: bool,
}

impl StorageBudget {
    /// No budget at all.
    pub const UNLIMITED: StorageBudget = StorageBudget {
        room: u64::MAX,
        limit: 0,
        per_user: false,
    };

    /// The budget in words, for notes and errors: `the storage budget (the session's
    /// 256.0 MiB, CODEBROKER_SESSION_STORAGE)`.
    pub fn describe(&self) -> String {
        if self.per_user {
            format!(
                "the storage budget (the user's {} for all their sessions, CODEBROKER_USER_STORAGE)",
                human_bytes(self.limit)
            )
        } else {
            format!(
                "the storage budget (the session's {}, CODEBROKER_SESSION_STORAGE)",
                human_bytes(self.limit)
            )
        }
    }
}

/// `bytes` for people: `512 KiB`, `5.0 MiB`, `1.0 GiB`.
pub fn human_bytes(bytes: u64) -> String {
    const KIB: f64 = 1024.0;
    let b = bytes as f64;
    if b < KIB {
        format!("{bytes} bytes")
    } else if b < KIB * KIB {
        format!("{:.0} KiB", b / KIB)
    } else if b < KIB * KIB * KIB {
        format!("{:.1} MiB", b / (KIB * KIB))
    } else {
        format!("{:.1} GiB", b / (KIB * KIB * KIB))
    }
}

/// Names shown in a note; the rest are counted.
const NOTE_NAMES: usize = 3;

/// Longest name shown in a note, in bytes; longer ones are cut.
const NOTE_NAME_BYTES: usize = 80;

/// Files of one harvest left out for one reason: counted, a few named.
#[derive(Debug, Default)]
struct LeftOut {
    /// How many.
    count: usize,
    /// The first few, cut to [`NOTE_NAME_BYTES`].
    names: Vec<String>,
}

impl LeftOut {
    fn add(&mut self, name: &str) {
        self.count += 1;
        if self.names.len() < NOTE_NAMES {
            self.names.push(shorten(name, NOTE_NAME_BYTES));
        }
    }

    /// `a, b, c and 7 more`: bounded whatever the count.
    fn list(&self) -> String {
        let mut text = self.names.join(", ");
        let more = self.count - self.names.len();
        if more > 0 {
            text.push_str(&format!(" and {more} more"));
        }
        text
    }

    /// `1 file` / `2000 files`.
    fn files(&self) -> String {
        if self.count == 1 {
            "1 file".into()
        } else {
            format!("{} files", self.count)
        }
    }
}

/// `name` cut to about `max` bytes by leaving out its middle: the start and the end
/// (where names that share a long prefix differ) stay.
fn shorten(name: &str, max: usize) -> String {
    if name.len() <= max {
        return name.to_string();
    }
    let mut head = max / 2;
    while !name.is_char_boundary(head) {
        head -= 1;
    }
    let mut tail = name.len() - (max - max / 2);
    while !name.is_char_boundary(tail) {
        tail += 1;
    }
    format!("{}...{}", &name[..head], &name[tail..])
}

/// A key for [`FileIndex::noted`]: a hash of the name, so that thousands of long names
/// do not stay in memory.
fn note_key(name: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    name.hash(&mut hasher);
    hasher.finish()
}

/// The directories of one session.
#[derive(Debug, Clone)]
pub struct Workspace {
    /// `DATA_DIR/sessions/<id>`: metadata, not visible to the sandbox.
    root: PathBuf,
}

impl Workspace {
    /// The workspace of `session_id` under `data_dir` (not created).
    pub fn new(data_dir: &Path, session_id: &str) -> Workspace {
        Workspace {
            root: data_dir.join("sessions").join(session_id),
        }
    }

    /// Where the session's metadata lives.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The directory mounted at `/mnt/data`.
    pub fn files_dir(&self) -> PathBuf {
        self.root.join("files")
    }

    /// Creates the directories, or brings existing ones (of an older version) to the modes
    /// and owners described in the module doc: the root 0700, `files/` the broker's, group
    /// of the sandbox, 1770.
    pub fn create(&self, sandbox_uid: u32) -> io::Result<()> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.root)?;
        std::fs::set_permissions(&self.root, std::fs::Permissions::from_mode(0o700))?;
        match std::fs::DirBuilder::new()
            .mode(0o700)
            .create(self.files_dir())
        {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        let files = rustix::fs::open(self.files_dir(), dir_flags(), rustix::fs::Mode::empty())?;
        protect_dir(&files, sandbox_uid)
    }

    /// Reads `index.json`; a missing one is an empty index.
    pub fn load_index(&self) -> io::Result<FileIndex> {
        match std::fs::read(self.root.join("index.json")) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(FileIndex::default()),
            Err(e) => Err(e),
        }
    }

    /// Writes `index.json` atomically.
    pub fn save_index(&self, index: &FileIndex) -> io::Result<()> {
        write_atomic(&self.root.join("index.json"), &serde_json::to_vec(index)?)
    }

    /// Reads a JSON metadata file of the session (`session.json`).
    pub fn load_meta<T: for<'de> Deserialize<'de>>(&self, name: &str) -> io::Result<T> {
        let bytes = std::fs::read(self.root.join(name))?;
        serde_json::from_slice(&bytes).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }

    /// Writes a JSON metadata file of the session atomically.
    pub fn save_meta<T: Serialize>(&self, name: &str, value: &T) -> io::Result<()> {
        write_atomic(&self.root.join(name), &serde_json::to_vec(value)?)
    }

    /// Makes `pooled`'s files directory this workspace's own, keeping this workspace's
    /// files: they move into it, then it takes the place of `files/`. A sandbox that
    /// mounts `pooled`'s directory then sees this workspace's files, because a bind mount
    /// follows the directory, not its path. `pooled` must be empty (a fresh pooled
    /// workspace); its metadata directory is removed. On failure nothing is lost: what was
    /// moved goes back.
    pub fn take_files_dir_of(&self, pooled: &Workspace) -> io::Result<()> {
        let ours = self.open_files()?;
        let theirs = pooled.open_files()?;
        if theirs.entries()?.next().is_some() {
            return Err(io::Error::other("the pooled workspace is not empty"));
        }
        let names = ours
            .entries()?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<io::Result<Vec<_>>>()?;
        // Renames move links and directories as they are, never following them.
        let put_back = |moved: &[std::ffi::OsString]| {
            for name in moved {
                let _ = theirs.rename(name, &ours, name);
            }
        };
        for (i, name) in names.iter().enumerate() {
            if let Err(err) = ours.rename(name, &theirs, name) {
                put_back(&names[..i]);
                return Err(err);
            }
        }
        // `files/` is empty now, and a directory may be renamed over an empty one. If the
        // sandbox's files were written to meanwhile it is not, and everything goes back.
        if let Err(err) = std::fs::rename(pooled.files_dir(), self.files_dir()) {
            put_back(&names);
            return Err(err);
        }
        let _ = std::fs::remove_dir_all(pooled.root());
        Ok(())
    }

    /// Opens the sandbox-controlled files directory for beneath-only access.
    fn open_files(&self) -> io::Result<Dir> {
        Dir::open_ambient_dir(self.files_dir(), ambient_authority())
    }

    /// Opens `name` (relative, `/`-separated) for reading, beneath the workspace: a link
    /// as the last component, a link leading out anywhere on the path, FIFOs, devices and
    /// sockets are refused (a relative link inside, in a directory part, is followed and
    /// stays beneath). Returns the file and its size.
    pub fn open_file(&self, name: &str) -> io::Result<(std::fs::File, u64)> {
        let dir = self.open_files()?;
        let file = open_regular(&dir, Path::new(name))?;
        let file = file.into_std();
        let size = file.metadata()?.len();
        Ok((file, size))
    }

    /// The directory of immutable copies of every recorded version, named by SHA-256.
    /// Broker-owned and outside the mount: downloads read from here, so what the sandbox
    /// does later to its files never changes what an id serves.
    pub fn blobs_dir(&self) -> PathBuf {
        self.root.join("blobs")
    }

    /// The stored bytes of a version.
    pub fn blob_path(&self, sha256: &str) -> PathBuf {
        self.blobs_dir().join(sha256)
    }

    /// A new temporary file in the blob store, for an upload to stream into.
    pub fn blob_temp(&self) -> io::Result<(PathBuf, std::fs::File)> {
        self.create_blobs_dir()?;
        let path = self.blobs_dir().join(format!(".tmp-{}", new_id()));
        use std::os::unix::fs::OpenOptionsExt as _;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)?;
        Ok((path, file))
    }

    /// Creates the blob store if it is missing, readable by the broker only.
    pub fn create_blobs_dir(&self) -> io::Result<()> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(self.blobs_dir())
    }

    /// Moves a finished temporary file into the blob store under its hash.
    pub fn commit_blob(&self, temp: &Path, sha256: &str) -> io::Result<()> {
        let target = self.blob_path(sha256);
        if target.exists() {
            std::fs::remove_file(temp)
        } else {
            std::fs::rename(temp, target)
        }
    }

    /// Copies the file `name` of the sandbox into the blob store, hashing it on the way.
    /// Returns its hash and size; `None` when it is larger than `max_bytes` (the copy is
    /// dropped).
    fn store_blob_from(
        &self,
        dir: &Dir,
        name: &str,
        max_bytes: u64,
    ) -> io::Result<Option<(String, u64)>> {
        let mut src = open_regular(dir, Path::new(name))?;
        let (temp, mut out) = self.blob_temp()?;
        let copied = copy_hashing(&mut src, &mut out, max_bytes);
        // The bytes copied, which the code may have changed since it was looked at.
        let size = out.metadata().map(|m| m.len());
        drop(out);
        match (copied, size) {
            (Ok(Some(sha)), Ok(size)) => {
                self.commit_blob(&temp, &sha)?;
                Ok(Some((sha, size)))
            }
            (Ok(None), _) => {
                let _ = std::fs::remove_file(&temp);
                Ok(None)
            }
            (Err(err), _) | (Ok(Some(_)), Err(err)) => {
                let _ = std::fs::remove_file(&temp);
                Err(err)
            }
        }
    }

    /// Deletes the blobs `shas` that no record of `index` names (the index is saved first,
    /// so a crash in between leaves only unnamed blobs, which [`Workspace::sweep_blobs`]
    /// removes at the next start).
    pub fn delete_unused_blobs(&self, index: &FileIndex, shas: &[String]) {
        for sha in shas.iter().filter(|sha| !index.uses_blob(sha)) {
            let _ = std::fs::remove_file(self.blob_path(sha));
        }
    }

    /// Removes whatever in the blob store no record names: temporary files and blobs left
    /// by a crash between saving the index and deleting them. Run when the broker starts,
    /// before anything uses the session, so that the budget (counted from the index) and
    /// the disk agree. Returns the bytes freed.
    pub fn sweep_blobs(&self, index: &FileIndex) -> io::Result<u64> {
        let entries = match std::fs::read_dir(self.blobs_dir()) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(e),
        };
        let mut freed = 0;
        for entry in entries.flatten() {
            let name = entry.file_name();
            if name.to_str().is_some_and(|n| index.uses_blob(n)) {
                continue;
            }
            let size = entry.metadata().map(|m| m.len()).unwrap_or(0);
            if std::fs::remove_file(entry.path()).is_ok() {
                freed += size;
            }
        }
        Ok(freed)
    }

    /// Places a stored blob at `name` in the sandbox's files (directories created as
    /// needed). A read-only file is the broker's, mode 0444, in directories the broker owns
    /// with the sticky bit (see the module doc); any other file and the directories made
    /// for it belong to the sandbox user. Returns the stamp of the placed file, so the next
    /// harvest sees it unchanged.
    pub fn place_blob(
        &self,
        blob: &Path,
        name: &Path,
        sandbox_uid: u32,
        read_only: bool,
    ) -> io::Result<Stamp> {
        let files = self.open_files()?;
        let (dir, leaf) = match name.parent().filter(|p| !p.as_os_str().is_empty()) {
            Some(parent) => (
                make_parents(&files, parent, sandbox_uid, read_only)?,
                name.file_name().map(Path::new).unwrap_or(name),
            ),
            None => (files, name),
        };
        // Whatever the sandbox left at that name (a symlink, a FIFO) is replaced, never
        // followed.
        match dir.symlink_metadata(leaf) {
            Ok(meta) if meta.is_dir() => {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    "a directory has that name",
                ))
            }
            Ok(_) => dir.remove_file(leaf)?,
            Err(_) => {}
        }
        let mut options = OpenOptions::new();
        options
            .write(true)
            .create_new(true)
            .follow(FollowSymlinks::No)
            .mode(0o600)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY);
        let dst = dir.open_with(leaf, &options)?;
        let mut dst = dst.into_std();
        let mut src = std::fs::File::open(blob)?;
        io::copy(&mut src, &mut dst)?;
        if read_only {
            // Owned by the broker, as created; readable by everyone who can reach it
            // (only the sandbox: `files/` is closed to other users).
            rustix::fs::fchmod(&dst, rustix::fs::Mode::from_raw_mode(0o444))?;
        } else {
            hand_to_sandbox(&dst, sandbox_uid)?;
        }
        let meta = dst.metadata()?;
        use std::os::unix::fs::MetadataExt as _;
        Ok(Stamp {
            ino: meta.ino(),
            size: meta.len(),
            ctime: meta.ctime(),
            ctime_nsec: meta.ctime_nsec(),
        })
    }

    /// Removes the sandbox's file `name` if it is still the version `record` describes
    /// (a changed file is the code's, and stays).
    pub fn remove_if_unchanged(&self, record: &FileRecord) -> io::Result<()> {
        let dir = self.open_files()?;
        match dir.symlink_metadata(&record.name) {
            Ok(meta)
                if meta.is_file()
                    && meta.ino() == record.stamp.ino
                    && meta.ctime() == record.stamp.ctime
                    && meta.ctime_nsec() == record.stamp.ctime_nsec =>
            {
                dir.remove_file(&record.name)
            }
            _ => Ok(()),
        }
    }

    /// Finds files created or changed since `index` was last updated, gives each a new id,
    /// and updates `index` (the caller saves it, then deletes `unused_blobs`). New
    /// versions that do not fit the storage budget first drop versions that are no longer
    /// current, oldest first; what still does not fit is not kept. Blocking: run it off
    /// the async threads.
    pub fn harvest(
        &self,
        index: &mut FileIndex,
        limits: HarvestLimits,
    ) -> io::Result<HarvestReport> {
        let mut host = HostFiles {
            dir: self.open_files()?,
        };
        self.harvest_from(&mut host, index, limits)
    }

    /// [`Workspace::harvest`] of the files `source` finds, into this workspace's blob
    /// store and index: the same rules whichever way the files are reached.
    pub(crate) fn harvest_from(
        &self,
        source: &mut dyn HarvestSource,
        index: &mut FileIndex,
        limits: HarvestLimits,
    ) -> io::Result<HarvestReport> {
        let (mut found, truncated) = source.list()?;
        let mut report = HarvestReport::default();
        if truncated {
            report.notes.push(format!(
                "Only the first {MAX_ENTRIES} entries of /mnt/data were checked for new files"
            ));
        }
        found.sort_by(|a, b| a.0.cmp(&b.0));
        let now = now_ms();
        let room = limits.storage.room;
        let mut left_out = 0usize;
        let mut oversize = LeftOut::default();
        let mut refused = LeftOut::default();
        let (mut dropped, mut dropped_bytes) = (0usize, 0u64);
        // Files noted this time; those noted last time and unchanged since are passed over
        // without a word.
        let mut noted = HashMap::new();
        let mut floor = index.floor_bytes();
        for (name, stamp) in found {
            let previous = index.current(&name).cloned();
            if previous.as_ref().map(|p| p.stamp) == Some(stamp) {
                continue;
            }
            if let Some(prev) = previous.as_ref().filter(|p| p.read_only) {
                // A read-only input is never reported as generated. It cannot change while
                // the broker's uid is not the sandbox's; if it did anyway (the broker runs
                // as the sandbox uid), say so once: its file id still serves the upload.
                let same = source
                    .hash(&name, limits.max_file_bytes)
                    .is_ok_and(|sha| sha.as_deref() == Some(prev.sha256.as_str()));
                if !same {
                    report.notes.push(format!(
                        "{name} is a read-only upload but was changed in /mnt/data; \
                         its file id still serves the uploaded content"
                    ));
                }
                index.set_stamp(&prev.id, stamp);
                continue;
            }
            let key = note_key(&name);
            // Noted at the last harvest and unchanged since: left out again without a word.
            let quiet = index.noted.get(&key) == Some(&stamp);
            if stamp.size > limits.max_file_bytes {
                if !quiet {
                    oversize.add(&name);
                }
                noted.insert(key, stamp);
                continue;
            }
            if report.files.len() >= limits.max_files {
                // Checked before hashing: a flood of files must not cost a copy of each
                // at every exec (files left out are looked at again next time).
                left_out += 1;
                continue;
            }
            // Checked before copying too: a version that cannot fit is not written. The
            // floor (all old versions dropped) answers most cases without a look at each.
            let extra = index.cost_of(None, stamp.size);
            let replaced = previous
                .as_ref()
                .map_or(0, |p| RECORD_COST + blob_cost(p.size));
            if floor.saturating_add(extra) > room.saturating_add(replaced)
                || !index.could_fit(extra, room, Some(&name))
            {
                if !quiet {
                    refused.add(&name);
                }
                noted.insert(key, stamp);
                continue;
            }
            let (sha256, size) = match source.store_blob(self, &name, limits.max_file_bytes) {
                Ok(Some(stored)) => stored,
                Ok(None) => {
                    if !quiet {
                        oversize.add(&name);
                    }
                    noted.insert(key, stamp);
                    continue;
                }
                // Gone or swapped for something that is not a regular file: skip it.
                Err(_) => continue,
            };
            if let Some(prev) = &previous {
                if prev.sha256 == sha256 {
                    // Touched but not changed: remember the new stamp, report nothing.
                    index.set_stamp(&prev.id, stamp);
                    continue;
                }
            }
            let extra = index.cost_of(Some(&sha256), size);
            match index.make_room(extra, room, Some(&name), Some(&sha256)) {
                Some(gone) => {
                    dropped += gone.records.len();
                    dropped_bytes += gone.records.iter().map(|r| r.size).sum::<u64>();
                    report.index_changed |= !gone.records.is_empty();
                    report.unused_blobs.extend(gone.blobs);
                }
                None => {
                    // It grew between the look and the copy: not kept after all.
                    if !quiet {
                        refused.add(&name);
                    }
                    noted.insert(key, stamp);
                    report.unused_blobs.push(sha256);
                    continue;
                }
            }
            let record = FileRecord {
                id: new_id(),
                name,
                size,
                sha256,
                created_ms: now,
                stamp,
                current: true,
                origin: Origin::Generated,
                read_only: false,
                kind: None,
                modified_from: previous.map(|p| p.id),
            };
            index.push_current(record.clone());
            floor = index.floor_bytes();
            report.files.push(Harvested { record });
        }
        index.noted = noted;
        // One line per reason, each bounded whatever the number of files: a flood of
        // files must not flood stderr too.
        if oversize.count > 0 {
            report.notes.push(format!(
                "{} over the limit of {} per file {} left out of the generated files: {}",
                oversize.files(),
                human_bytes(limits.max_file_bytes),
                if oversize.count == 1 { "was" } else { "were" },
                oversize.list()
            ));
        }
        if left_out > 0 {
            report.notes.push(format!(
                "{left_out} more new or changed files were left out of the generated files: \
                 more than {} files changed",
                limits.max_files
            ));
        }
        if dropped > 0 || refused.count > 0 {
            let mut parts = Vec::new();
            if dropped > 0 {
                let (versions, were, ids) = if dropped == 1 {
                    ("version", "was", "its id now answers")
                } else {
                    ("versions", "were", "their ids now answer")
                };
                parts.push(format!(
                    "{dropped} older {versions} ({}) {were} dropped and {ids} 404",
                    human_bytes(dropped_bytes),
                ));
            }
            if refused.count > 0 {
                parts.push(format!(
                    "{} new or changed {} not kept: {}",
                    refused.count,
                    if refused.count == 1 {
                        "file was"
                    } else {
                        "files were"
                    },
                    refused.list()
                ));
            }
            report.notes.push(format!(
                "File versions over {}: {}",
                limits.storage.describe(),
                parts.join("; ")
            ));
        }
        Ok(report)
    }
}

/// Where a harvest finds the sandbox's files: the mounted directory on this host
/// ([`HostFiles`]), or the sandbox's runner (`crate::sandbox::runner_files`).
pub(crate) trait HarvestSource {
    /// The regular files below `/mnt/data` with their stamps (hidden and cache entries,
    /// symlinks and special files left out), and whether the walk stopped at
    /// [`MAX_ENTRIES`].
    fn list(&mut self) -> io::Result<(Vec<(String, Stamp)>, bool)>;

    /// SHA-256 of the file `name`; `None` when it has more than `max_bytes`.
    fn hash(&mut self, name: &str, max_bytes: u64) -> io::Result<Option<String>>;

    /// Copies the file `name` into the blob store of `workspace`, hashing it on the way:
    /// its hash and size, or `None` (nothing kept) when it has more than `max_bytes`.
    fn store_blob(
        &mut self,
        workspace: &Workspace,
        name: &str,
        max_bytes: u64,
    ) -> io::Result<Option<(String, u64)>>;
}

/// The sandbox's files read beneath-only from the mounted directory.
struct HostFiles {
    /// The opened `files/` directory.
    dir: Dir,
}

impl HarvestSource for HostFiles {
    fn list(&mut self) -> io::Result<(Vec<(String, Stamp)>, bool)> {
        let mut found = Vec::new();
        let mut budget = MAX_ENTRIES;
        walk(&self.dir, "", 0, &mut budget, &mut found)?;
        Ok((found, budget == 0))
    }

    fn hash(&mut self, name: &str, max_bytes: u64) -> io::Result<Option<String>> {
        let mut file = open_regular(&self.dir, Path::new(name))?;
        copy_hashing(&mut file, &mut io::sink(), max_bytes)
    }

    fn store_blob(
        &mut self,
        workspace: &Workspace,
        name: &str,
        max_bytes: u64,
    ) -> io::Result<Option<(String, u64)>> {
        workspace.store_blob_from(&self.dir, name, max_bytes)
    }
}

/// Collects regular files below `dir` with their stamps; skips hidden and cache entries,
/// symlinks and special files.
fn walk(
    dir: &Dir,
    prefix: &str,
    depth: usize,
    budget: &mut usize,
    found: &mut Vec<(String, Stamp)>,
) -> io::Result<()> {
    if depth > MAX_DEPTH {
        return Ok(());
    }
    for entry in dir.entries()? {
        if *budget == 0 {
            return Ok(());
        }
        *budget -= 1;
        let Ok(entry) = entry else { continue };
        let file_name = entry.file_name();
        let Some(name) = file_name.to_str() else {
            continue;
        };
        if name.starts_with('.') || SKIPPED_DIRS.contains(&name) {
            continue;
        }
        let Ok(file_type) = entry.file_type() else {
            continue;
        };
        let path = if prefix.is_empty() {
            name.to_string()
        } else {
            format!("{prefix}/{name}")
        };
        if file_type.is_dir() {
            if let Ok(sub) = dir.open_dir_nofollow(name) {
                walk(&sub, &path, depth + 1, budget, found)?;
            }
        } else if file_type.is_file() {
            if let Ok(meta) = entry.metadata() {
                found.push((
                    path,
                    Stamp {
                        ino: meta.ino(),
                        size: meta.len(),
                        ctime: meta.ctime(),
                        ctime_nsec: meta.ctime_nsec(),
                    },
                ));
            }
        }
    }
    Ok(())
}

/// Opens a regular file beneath `dir` without following symlinks and without blocking on
/// a FIFO.
fn open_regular(dir: &Dir, path: &Path) -> io::Result<cap_std::fs::File> {
    let mut options = OpenOptions::new();
    options
        .read(true)
        .follow(FollowSymlinks::No)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY);
    let file = dir.open_with(path, &options)?;
    if !file.metadata()?.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    Ok(file)
}

/// `name` as a relative path that stays beneath its root: no absolute paths, no `..`,
/// no empty or NUL-bearing components. Used for names clients choose.
pub fn safe_relative_path(name: &str) -> Option<PathBuf> {
    if name.is_empty() || name.len() > 1024 || name.contains('\0') || name.starts_with('/') {
        return None;
    }
    let mut path = PathBuf::new();
    for part in name.split('/') {
        match part {
            "" | "." => continue,
            ".." => return None,
            p if p.len() > 255 => return None,
            p => path.push(p),
        }
    }
    (!path.as_os_str().is_empty()).then_some(path)
}

/// Opens (creating what is missing) each directory of `rel` beneath `dir`, one level at a
/// time without following symlinks, and returns the last. Directories it creates belong
/// to the sandbox user, or, for a read-only file, are protected like `files/`. For a
/// read-only file, existing directories on the way are protected too: else the code could
/// rename a directory of its own, with the file in it, and put another in its place.
/// Changes go through the opened descriptor, so a swapped-in symlink redirects nothing.
fn make_parents(dir: &Dir, rel: &Path, sandbox_uid: u32, read_only: bool) -> io::Result<Dir> {
    let mut current = dir.try_clone()?;
    for part in rel.components() {
        let created = match rustix::fs::mkdirat(
            &current,
            part.as_os_str(),
            rustix::fs::Mode::from_raw_mode(0o700),
        ) {
            Ok(()) => true,
            Err(rustix::io::Errno::EXIST) => false,
            Err(e) => return Err(e.into()),
        };
        // One plain component (the name was checked) and no symlink followed: this stays
        // beneath `dir`. Opened for reading, not as a path: modes change through it.
        let next = rustix::fs::openat(
            &current,
            part.as_os_str(),
            dir_flags(),
            rustix::fs::Mode::empty(),
        )?;
        if read_only {
            protect_dir(&next, sandbox_uid)?;
        } else if created {
            hand_to_sandbox(&next, sandbox_uid)?;
            rustix::fs::fchmod(&next, rustix::fs::Mode::from_raw_mode(0o755))?;
        }
        current = Dir::from_std_file(std::fs::File::from(next));
    }
    Ok(current)
}

/// Makes `dir` the broker's, group of the sandbox, mode 1770: the sandbox may add entries,
/// but may neither list it to others nor unlink or rename entries it does not own.
/// A broker running as the sandbox's own uid owns everything anyway, and only sets the
/// mode.
fn protect_dir(dir: impl std::os::fd::AsFd, sandbox_uid: u32) -> io::Result<()> {
    let me = euid();
    if me != sandbox_uid {
        std::os::unix::fs::fchown(&dir, Some(me), Some(sandbox_uid))?;
    }
    rustix::fs::fchmod(&dir, rustix::fs::Mode::from_raw_mode(0o1770))?;
    Ok(())
}

/// How directories are opened to change their owner and mode: for reading (a path-only
/// descriptor cannot), never through a symlink.
fn dir_flags() -> rustix::fs::OFlags {
    use rustix::fs::OFlags;
    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

/// The broker's effective uid.
fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Gives a file or directory the broker created to the sandbox user (nothing to do when
/// the broker runs as that uid).
fn hand_to_sandbox(fd: impl std::os::fd::AsFd, sandbox_uid: u32) -> io::Result<()> {
    if euid() == sandbox_uid {
        return Ok(());
    }
    std::os::unix::fs::fchown(fd, Some(sandbox_uid), Some(sandbox_uid))
}

/// Copies `src` to `dst` while hashing; `None` when more than `max_bytes` came.
pub fn copy_hashing(
    src: &mut impl Read,
    dst: &mut impl io::Write,
    max_bytes: u64,
) -> io::Result<Option<String>> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut total = 0u64;
    loop {
        let n = src.read(&mut buf)?;
        if n == 0 {
            break;
        }
        total += n as u64;
        if total > max_bytes {
            return Ok(None);
        }
        hasher.update(&buf[..n]);
        dst.write_all(&buf[..n])?;
    }
    Ok(Some(hex::encode(hasher.finalize())))
}

/// Writes `path` through a temporary file created 0600, then renamed over it.
fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let tmp = path.with_extension(format!("tmp-{}", new_id()));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    if let Err(e) = file.write_all(bytes) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> HarvestLimits {
        HarvestLimits {
            max_files: 50,
            max_file_bytes: 1 << 20,
            storage: StorageBudget::UNLIMITED,
        }
    }

    fn workspace() -> (tempfile::TempDir, Workspace) {
        let tmp = tempfile::tempdir().unwrap();
        let ws = Workspace::new(tmp.path(), "s");
        std::fs::create_dir_all(ws.files_dir()).unwrap();
        (tmp, ws)
    }

    #[test]
    fn new_and_changed_files_get_new_ids() {
        let (_tmp, ws) = workspace();
        let files = ws.files_dir();
        std::fs::create_dir_all(files.join("charts")).unwrap();
        std::fs::write(files.join("a.txt"), "one").unwrap();
        std::fs::write(files.join("charts/b.png"), "png").unwrap();
        let mut index = FileIndex::default();
        let first = ws.harvest(&mut index, limits()).unwrap();
        let names: Vec<_> = first.files.iter().map(|f| f.record.name.clone()).collect();
        assert_eq!(names, ["a.txt", "charts/b.png"]);

        let again = ws.harvest(&mut index, limits()).unwrap();
        assert!(
            again.files.is_empty(),
            "unchanged files are not reported again"
        );

        std::fs::write(files.join("a.txt"), "one").unwrap();
        assert!(
            ws.harvest(&mut index, limits()).unwrap().files.is_empty(),
            "same bytes"
        );

        std::fs::write(files.join("a.txt"), "two").unwrap();
        let changed = ws.harvest(&mut index, limits()).unwrap();
        assert_eq!(changed.files.len(), 1);
        assert_ne!(changed.files[0].record.id, first.files[0].record.id);
        assert!(!index.get(&first.files[0].record.id).unwrap().current);
    }

    #[test]
    fn skips_hidden_caches_symlinks_and_fifos() {
        let (_tmp, ws) = workspace();
        let files = ws.files_dir();
        std::fs::create_dir_all(files.join("__pycache__")).unwrap();
        std::fs::write(files.join("__pycache__/x.pyc"), "x").unwrap();
        std::fs::write(files.join(".hidden"), "x").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", files.join("link")).unwrap();
        std::os::unix::fs::symlink("/", files.join("rootlink")).unwrap();
        let fifo = std::ffi::CString::new(files.join("fifo").to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let mut index = FileIndex::default();
        let report = ws.harvest(&mut index, limits()).unwrap();
        assert!(report.files.is_empty(), "{:?}", report.files);
        assert!(ws.open_file("link").is_err());
        assert!(ws.open_file("rootlink/etc/passwd").is_err());
        assert!(ws.open_file("fifo").is_err());
        assert!(ws.open_file("../../etc/passwd").is_err());
    }

    #[test]
    fn a_pooled_files_dir_takes_over_with_every_file_kept() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ours = Workspace::new(dir.path(), "ours");
        let pooled = Workspace::new(dir.path(), "pooled");
        ours.create(0).expect("create");
        pooled.create(0).expect("create");
        let files = ours.files_dir();
        std::fs::write(files.join("a.csv"), "1,2\n").expect("write");
        std::fs::create_dir_all(files.join("out/deep")).expect("mkdir");
        std::fs::write(files.join("out/deep/b.txt"), "b").expect("write");
        std::os::unix::fs::symlink("/etc/passwd", files.join("link")).expect("symlink");
        // What a sandbox bound to the pooled directory holds open.
        let mounted = std::fs::File::open(pooled.files_dir()).expect("open");
        use std::os::unix::fs::MetadataExt as _;
        let mounted_ino = mounted.metadata().expect("meta").ino();

        ours.take_files_dir_of(&pooled).expect("take");

        assert_eq!(std::fs::metadata(&files).expect("meta").ino(), mounted_ino);
        assert_eq!(
            std::fs::read_to_string(files.join("a.csv")).expect("read"),
            "1,2\n"
        );
        assert_eq!(
            std::fs::read_to_string(files.join("out/deep/b.txt")).expect("read"),
            "b"
        );
        assert_eq!(
            std::fs::read_link(files.join("link")).expect("link"),
            Path::new("/etc/passwd")
        );
        assert!(!pooled.root().exists(), "the pooled workspace is gone");
    }

    #[test]
    fn a_pooled_files_dir_that_is_not_empty_is_refused_and_nothing_moves() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ours = Workspace::new(dir.path(), "ours");
        let pooled = Workspace::new(dir.path(), "pooled");
        ours.create(0).expect("create");
        pooled.create(0).expect("create");
        std::fs::write(ours.files_dir().join("mine"), "m").expect("write");
        std::fs::write(pooled.files_dir().join("theirs"), "t").expect("write");
        assert!(ours.take_files_dir_of(&pooled).is_err());
        assert!(ours.files_dir().join("mine").is_file());
        assert!(!ours.files_dir().join("theirs").exists());
        assert!(pooled.files_dir().join("theirs").is_file());
    }

    fn owner_mode(path: &Path) -> (u32, u32) {
        use std::os::unix::fs::MetadataExt as _;
        let meta = std::fs::symlink_metadata(path).expect("metadata");
        (meta.uid(), meta.mode() & 0o7777)
    }

    /// A uid that is neither the test's own nor root, as the sandbox's.
    const SANDBOX: u32 = 10001;

    #[test]
    fn metadata_and_blobs_are_the_brokers_alone_from_creation() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ws = Workspace::new(dir.path(), "s");
        ws.create(SANDBOX).expect("create");
        ws.save_index(&FileIndex::default()).expect("index");
        let (temp, _file) = ws.blob_temp().expect("blob");
        let me = euid();
        assert_eq!(owner_mode(ws.root()), (me, 0o700));
        assert_eq!(owner_mode(&ws.blobs_dir()), (me, 0o700));
        assert_eq!(owner_mode(&temp), (me, 0o600));
        assert_eq!(owner_mode(&ws.root().join("index.json")), (me, 0o600));
        // The workspace root: the broker's, group of the sandbox, sticky.
        assert_eq!(owner_mode(&ws.files_dir()), (me, 0o1770));
        use std::os::unix::fs::MetadataExt as _;
        if me == 0 {
            assert_eq!(
                std::fs::metadata(ws.files_dir()).expect("meta").gid(),
                SANDBOX
            );
        }
    }

    #[test]
    fn read_only_files_and_their_directories_stay_the_brokers() {
        if euid() != 0 {
            // Handing files to another uid takes root (or the broker image's capabilities).
            return;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let ws = Workspace::new(dir.path(), "s");
        ws.create(SANDBOX).expect("create");
        let blob = dir.path().join("blob");
        std::fs::write(&blob, "# skill").expect("blob");
        // The code made `skills/` its own before the upload came.
        let files = ws.files_dir();
        std::fs::create_dir(files.join("skills")).expect("mkdir");
        std::os::unix::fs::chown(files.join("skills"), Some(SANDBOX), Some(SANDBOX))
            .expect("chown");
        ws.place_blob(&blob, Path::new("skills/pptx/SKILL.md"), SANDBOX, true)
            .expect("place");
        assert_eq!(owner_mode(&files.join("skills")), (0, 0o1770));
        assert_eq!(owner_mode(&files.join("skills/pptx")), (0, 0o1770));
        assert_eq!(owner_mode(&files.join("skills/pptx/SKILL.md")), (0, 0o444));
        // A normal upload beside it is the sandbox's, and leaves the directories alone.
        ws.place_blob(&blob, Path::new("skills/pptx/notes.md"), SANDBOX, false)
            .expect("place");
        ws.place_blob(&blob, Path::new("out/a.csv"), SANDBOX, false)
            .expect("place");
        assert_eq!(
            owner_mode(&files.join("skills/pptx/notes.md")),
            (SANDBOX, 0o600)
        );
        assert_eq!(owner_mode(&files.join("skills/pptx")), (0, 0o1770));
        assert_eq!(owner_mode(&files.join("out")), (SANDBOX, 0o755));
        assert_eq!(owner_mode(&files.join("out/a.csv")), (SANDBOX, 0o600));
    }

    #[test]
    fn a_changed_read_only_file_is_said_once_and_never_reported_as_generated() {
        let (_tmp, ws) = workspace();
        let path = ws.files_dir().join("SKILL.md");
        std::fs::write(&path, "# skill").expect("write");
        let mut index = FileIndex::default();
        let first = ws.harvest(&mut index, limits()).expect("harvest");
        let mut record = first.files[0].record.clone();
        record.read_only = true;
        index = FileIndex::default();
        index.push_current(record);
        std::fs::write(&path, "# injected").expect("write");
        let report = ws.harvest(&mut index, limits()).expect("harvest");
        assert!(report.files.is_empty());
        assert_eq!(report.notes.len(), 1, "{:?}", report.notes);
        assert!(report.notes[0].contains("SKILL.md is a read-only upload"));
        let again = ws.harvest(&mut index, limits()).expect("harvest");
        assert!(
            again.notes.is_empty() && again.files.is_empty(),
            "{again:?}"
        );
    }

    #[test]
    fn client_names_stay_beneath_the_root() {
        assert_eq!(
            safe_relative_path("skills/pptx/SKILL.md"),
            Some(PathBuf::from("skills/pptx/SKILL.md"))
        );
        assert_eq!(safe_relative_path("./a.csv"), Some(PathBuf::from("a.csv")));
        for bad in ["", "/etc/passwd", "../x", "a/../../x", "a\0b", "..", "/"] {
            assert_eq!(safe_relative_path(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn caps_are_reported() {
        let (_tmp, ws) = workspace();
        std::fs::write(ws.files_dir().join("big.bin"), vec![0u8; 2 << 20]).unwrap();
        for i in 0..3 {
            std::fs::write(ws.files_dir().join(format!("f{i}")), "x").unwrap();
        }
        let mut index = FileIndex::default();
        let report = ws
            .harvest(
                &mut index,
                HarvestLimits {
                    max_files: 2,
                    max_file_bytes: 1 << 20,
                    storage: StorageBudget::UNLIMITED,
                },
            )
            .unwrap();
        assert_eq!(report.files.len(), 2);
        assert_eq!(report.notes.len(), 2, "{:?}", report.notes);
        assert!(report.notes.iter().any(|n| n.contains("big.bin")));
    }

    fn record(id: &str, name: &str, sha: &str, size: u64) -> FileRecord {
        FileRecord {
            id: id.into(),
            name: name.into(),
            size,
            sha256: sha.into(),
            created_ms: 0,
            stamp: Stamp::default(),
            current: true,
            origin: Origin::Generated,
            read_only: false,
            kind: None,
            modified_from: None,
        }
    }

    #[test]
    fn the_budget_drops_old_versions_oldest_first_and_refuses_what_cannot_fit() {
        let mib = 1 << 20;
        let mut index = FileIndex::default();
        index.push_current(record("a1", "a", "ha1", mib));
        index.push_current(record("b1", "b", "hb1", mib));
        index.push_current(record("a2", "a", "ha2", mib));
        index.push_current(record("b2", "b", "hb2", mib));
        assert_eq!(index.stored_bytes(), 4 * mib + 4 * RECORD_COST);
        let limit = 4 * mib + 4 * RECORD_COST;
        // One more MiB for a new name: the oldest old version (a1) goes, b1 stays.
        let extra = index.cost_of(Some("hc1"), mib);
        let dropped = index
            .make_room(extra, limit, Some("c"), Some("hc1"))
            .unwrap();
        let ids = |d: &Dropped| d.records.iter().map(|r| r.id.clone()).collect::<Vec<_>>();
        assert_eq!(ids(&dropped), ["a1"]);
        assert_eq!(dropped.blobs, ["ha1"]);
        index.push_current(record("c1", "c", "hc1", mib));
        assert!(index.get("a1").is_none());
        assert_eq!(index.current("a").unwrap().id, "a2");
        // Two MiB more for a new name cannot fit even without b1: nothing is dropped.
        let extra = index.cost_of(Some("hd1"), 2 * mib);
        assert!(!index.could_fit(extra, limit, Some("d")));
        assert!(index
            .make_room(extra, limit, Some("d"), Some("hd1"))
            .is_none());
        assert!(index.get("b1").is_some());
        // A new version of b: the oldest old version (b1) goes.
        let extra = index.cost_of(Some("hb3"), mib);
        let dropped = index
            .make_room(extra, limit, Some("b"), Some("hb3"))
            .unwrap();
        assert_eq!(ids(&dropped), ["b1"]);
        index.push_current(record("b3", "b", "hb3", mib));
        // Two MiB for a new version of c: b2, then c1 (the version it replaces) go.
        let extra = index.cost_of(Some("hc2"), 2 * mib);
        let dropped = index
            .make_room(extra, limit, Some("c"), Some("hc2"))
            .unwrap();
        assert_eq!(ids(&dropped), ["b2", "c1"]);
        index.push_current(record("c2", "c", "hc2", 2 * mib));
        assert!(index.stored_bytes() <= limit);
        // What is counted survives a save and a load.
        let loaded: FileIndex =
            serde_json::from_slice(&serde_json::to_vec(&index).unwrap()).unwrap();
        assert_eq!(loaded.stored_bytes(), index.stored_bytes());
        assert_eq!(loaded.current("b").unwrap().id, "b3");
        assert_eq!(loaded.get("c2").unwrap().name, "c");
    }

    #[test]
    fn a_shared_blob_is_counted_once_and_kept_while_named() {
        let mut index = FileIndex::default();
        index.push_current(record("a1", "a", "same", 10_000));
        index.push_current(record("b1", "b", "same", 10_000));
        assert_eq!(index.stored_bytes(), blob_cost(10_000) + 2 * RECORD_COST);
        assert_eq!(index.cost_of(Some("same"), 10_000), RECORD_COST);
        let dropped = index.remove("a1");
        assert!(dropped.blobs.is_empty(), "b1 still needs it");
        let dropped = index.remove("b1");
        assert_eq!(dropped.blobs, ["same"]);
        assert_eq!(index.stored_bytes(), 0);
    }

    #[test]
    fn harvest_keeps_within_the_budget_and_notes_once() {
        let (_tmp, ws) = workspace();
        let files = ws.files_dir();
        for name in ["a", "b", "c"] {
            std::fs::write(files.join(name), vec![name.as_bytes()[0]; 300_000]).unwrap();
        }
        let budget = StorageBudget {
            room: 700_000,
            limit: 700_000,
            per_user: false,
        };
        let limits = HarvestLimits {
            storage: budget,
            ..limits()
        };
        let mut index = FileIndex::default();
        let report = ws.harvest(&mut index, limits).unwrap();
        let kept: Vec<_> = report
            .files
            .iter()
            .map(|f| f.record.name.as_str())
            .collect();
        assert_eq!(kept, ["a", "b"]);
        assert_eq!(report.notes.len(), 1, "{:?}", report.notes);
        assert!(report.notes[0].contains("1 new or changed file was not kept: c"));
        assert!(
            !ws.blob_path(&sha_of(&files.join("c"))).exists(),
            "never copied"
        );
        // Unchanged: not noted again.
        let again = ws.harvest(&mut index, limits).unwrap();
        assert!(
            again.files.is_empty() && again.notes.is_empty(),
            "{:?}",
            again.notes
        );
        // A new version of a replaces the old one, whose blob goes once the index is saved.
        let old = index.current("a").unwrap().sha256.clone();
        std::fs::write(files.join("a"), vec![b'z'; 300_000]).unwrap();
        let changed = ws.harvest(&mut index, limits).unwrap();
        assert_eq!(changed.files.len(), 1);
        assert!(changed.index_changed);
        assert!(
            changed.notes[0].contains("1 older version (293 KiB) was dropped"),
            "{:?}",
            changed.notes
        );
        ws.delete_unused_blobs(&index, &changed.unused_blobs);
        assert!(!ws.blob_path(&old).exists());
        assert!(index.stored_bytes() <= budget.room);
    }

    fn sha_of(path: &Path) -> String {
        hex::encode(Sha256::digest(std::fs::read(path).unwrap()))
    }

    #[test]
    fn oversized_files_make_one_bounded_note() {
        let (_tmp, ws) = workspace();
        for i in 0..300 {
            let name = format!("{}{i}", "N".repeat(240));
            let f = std::fs::File::create(ws.files_dir().join(name)).unwrap();
            f.set_len(2 << 20).unwrap();
        }
        let mut index = FileIndex::default();
        let report = ws.harvest(&mut index, limits()).unwrap();
        assert_eq!(report.notes.len(), 1, "{:?}", report.notes);
        assert!(
            report.notes[0].starts_with("300 files over"),
            "{}",
            report.notes[0]
        );
        assert!(
            report.notes[0].ends_with("and 297 more"),
            "{}",
            report.notes[0]
        );
        assert!(report.notes[0].len() < 512, "{}", report.notes[0].len());
        assert!(
            report.notes[0].contains("N...N") && report.notes[0].contains("N0, "),
            "{}",
            report.notes[0]
        );
        assert_eq!(shorten("ab\u{e9}cdef", 4), "ab...ef");
        assert_eq!(shorten("\u{e9}\u{e9}\u{e9}\u{e9}", 4), "\u{e9}...\u{e9}");
        let again = ws.harvest(&mut index, limits()).unwrap();
        assert!(again.notes.is_empty(), "{:?}", again.notes);
    }

    #[test]
    fn blobs_no_record_names_are_swept() {
        let (_tmp, ws) = workspace();
        std::fs::write(ws.files_dir().join("a"), "a").unwrap();
        let mut index = FileIndex::default();
        ws.harvest(&mut index, limits()).unwrap();
        std::fs::write(ws.blobs_dir().join("orphan"), "x").unwrap();
        std::fs::write(ws.blobs_dir().join(".tmp-1"), "x").unwrap();
        assert_eq!(ws.sweep_blobs(&index).unwrap(), 2);
        let kept: Vec<_> = std::fs::read_dir(ws.blobs_dir()).unwrap().collect();
        assert_eq!(kept.len(), 1);
        assert!(ws.blob_path(&index.current("a").unwrap().sha256).exists());
    }
}
