//! The host side of a session's files.
//!
//! On disk a session is `DATA_DIR/sessions/<session id>/` holding `session.json` (who owns
//! it), `index.json` (file ids) and `files/`, the directory mounted at `/mnt/data`. The
//! sandbox controls everything under `files/`: it can plant symlinks, FIFOs, sockets and
//! races. So the broker reads it only through `cap-std` (every lookup stays beneath the
//! directory, no symlink is followed) and opens files non-blocking, checking each really is
//! a regular file before reading it.

use crate::ids::new_id;
use cap_fs_ext::{DirExt, FollowSymlinks, OpenOptionsFollowExt};
use cap_std::ambient_authority;
use cap_std::fs::{Dir, MetadataExt, OpenOptions, OpenOptionsExt};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// Directories whose contents are never reported as generated files.
const SKIPPED_DIRS: &[&str] = &[
    "__pycache__",
    "node_modules",
    ".venv",
    "venv",
    ".cache",
    ".git",
    ".ipython",
    ".local",
    ".config",
    ".npm",
    ".matplotlib",
];

/// How deep the harvest walks, and how many entries it looks at, so that a sandbox that
/// creates millions of files cannot stall the broker.
const MAX_DEPTH: usize = 16;
const MAX_ENTRIES: usize = 20_000;

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

/// The file ids of one session, persisted as `index.json` so ids survive a restart.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FileIndex {
    /// Every recorded version, oldest first.
    pub files: Vec<FileRecord>,
}

impl FileIndex {
    /// The record of file id `id`.
    pub fn get(&self, id: &str) -> Option<&FileRecord> {
        self.files.iter().find(|r| r.id == id)
    }

    /// The newest record of `name`.
    pub fn current(&self, name: &str) -> Option<&FileRecord> {
        self.files
            .iter()
            .rev()
            .find(|r| r.current && r.name == name)
    }

    /// Adds `record` as the newest version of its name.
    pub fn push_current(&mut self, record: FileRecord) {
        for r in self.files.iter_mut().filter(|r| r.name == record.name) {
            r.current = false;
        }
        self.files.push(record);
    }

    /// Whether any record still needs the blob `sha256`.
    pub fn uses_blob(&self, sha256: &str) -> bool {
        self.files.iter().any(|r| r.sha256 == sha256)
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
    /// Notes for stderr: files left out and why.
    pub notes: Vec<String>,
}

/// Caps on what one harvest reports.
#[derive(Debug, Clone, Copy)]
pub struct HarvestLimits {
    /// Most files reported.
    pub max_files: usize,
    /// Largest file reported, in bytes.
    pub max_file_bytes: u64,
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

    /// Creates the directories; `files/` is handed to the sandbox user.
    pub fn create(&self, sandbox_uid: u32) -> io::Result<()> {
        std::fs::create_dir_all(self.files_dir())?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&self.root, std::fs::Permissions::from_mode(0o711))?;
        std::fs::set_permissions(self.files_dir(), std::fs::Permissions::from_mode(0o700))?;
        // Only root may hand a directory to another uid; an unprivileged broker must run
        // its sandboxes as its own uid instead (CODEBROKER_SANDBOX_UID).
        if unsafe { libc::geteuid() } == 0 {
            std::os::unix::fs::chown(self.files_dir(), Some(sandbox_uid), Some(sandbox_uid))?;
        }
        Ok(())
    }

    /// Whether the workspace exists on disk.
    pub fn exists(&self) -> bool {
        self.files_dir().is_dir()
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

    /// Opens `name` (relative, `/`-separated) for reading, refusing symlinks anywhere on
    /// the path, FIFOs, devices and sockets. Returns the file and its size.
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
        std::fs::create_dir_all(self.blobs_dir())?;
        let path = self.blobs_dir().join(format!(".tmp-{}", new_id()));
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)?;
        Ok((path, file))
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
    /// `None` when it is larger than `max_bytes` (the copy is dropped).
    fn store_blob_from(&self, dir: &Dir, name: &str, max_bytes: u64) -> io::Result<Option<String>> {
        let mut src = open_regular(dir, Path::new(name))?;
        let (temp, mut out) = self.blob_temp()?;
        let copied = copy_hashing(&mut src, &mut out, max_bytes);
        drop(out);
        match copied {
            Ok(Some(sha)) => {
                self.commit_blob(&temp, &sha)?;
                Ok(Some(sha))
            }
            other => {
                let _ = std::fs::remove_file(&temp);
                other
            }
        }
    }

    /// Places a stored blob at `name` in the sandbox's files (directories created as
    /// needed). Read-only files are owned by root when the broker is root, so the code can
    /// read but not change them; others belong to the sandbox user. Returns the stamp of
    /// the placed file, so the next harvest sees it unchanged.
    pub fn place_blob(
        &self,
        blob: &Path,
        name: &Path,
        sandbox_uid: u32,
        read_only: bool,
    ) -> io::Result<Stamp> {
        let dir = self.open_files()?;
        if let Some(parent) = name.parent().filter(|p| !p.as_os_str().is_empty()) {
            dir.create_dir_all(parent)?;
            chown_tree(&dir, parent, sandbox_uid)?;
        }
        // Whatever the sandbox left at that name (a symlink, a FIFO) is replaced, never
        // followed.
        match dir.symlink_metadata(name) {
            Ok(meta) if meta.is_dir() => {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    "a directory has that name",
                ))
            }
            Ok(_) => dir.remove_file(name)?,
            Err(_) => {}
        }
        let mut options = OpenOptions::new();
        options
            .write(true)
            .create_new(true)
            .follow(FollowSymlinks::No)
            .mode(if read_only { 0o644 } else { 0o600 })
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY);
        let dst = dir.open_with(name, &options)?;
        let mut dst = dst.into_std();
        let mut src = std::fs::File::open(blob)?;
        io::copy(&mut src, &mut dst)?;
        if unsafe { libc::geteuid() } == 0 {
            let owner = if read_only { 0 } else { sandbox_uid };
            std::os::unix::fs::fchown(&dst, Some(owner), Some(owner))?;
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
    /// and updates `index` (the caller saves it). Blocking: run it off the async threads.
    pub fn harvest(
        &self,
        index: &mut FileIndex,
        limits: HarvestLimits,
    ) -> io::Result<HarvestReport> {
        let dir = self.open_files()?;
        let mut found = Vec::new();
        let mut budget = MAX_ENTRIES;
        walk(&dir, "", 0, &mut budget, &mut found)?;
        let mut report = HarvestReport::default();
        if budget == 0 {
            report.notes.push(format!(
                "Only the first {MAX_ENTRIES} entries of /mnt/data were checked for new files"
            ));
        }
        found.sort_by(|a, b| a.0.cmp(&b.0));
        let now = now_ms();
        let mut left_out = 0usize;
        for (name, stamp) in found {
            let previous = index.current(&name).cloned();
            if previous.as_ref().map(|p| p.stamp) == Some(stamp) {
                continue;
            }
            if stamp.size > limits.max_file_bytes {
                report.notes.push(format!(
                    "{name} was left out of the generated files: {} bytes is over the limit of {}",
                    stamp.size, limits.max_file_bytes
                ));
                continue;
            }
            if previous.as_ref().is_some_and(|p| p.read_only) {
                // A read-only input is never reported, whatever the code did to it.
                continue;
            }
            if report.files.len() >= limits.max_files {
                // Checked before hashing: a flood of files must not cost a copy of each
                // at every exec (files left out are looked at again next time).
                left_out += 1;
                continue;
            }
            let sha256 = match self.store_blob_from(&dir, &name, limits.max_file_bytes) {
                Ok(Some(h)) => h,
                Ok(None) => {
                    report.notes.push(format!(
                        "{name} was left out of the generated files: over the limit of {} bytes",
                        limits.max_file_bytes
                    ));
                    continue;
                }
                // Gone or swapped for something that is not a regular file: skip it.
                Err(_) => continue,
            };
            if let Some(prev) = &previous {
                if prev.sha256 == sha256 {
                    // Touched but not changed: remember the new stamp, report nothing.
                    if let Some(rec) = index.files.iter_mut().rev().find(|r| r.id == prev.id) {
                        rec.stamp = stamp;
                    }
                    continue;
                }
            }
            if report.files.len() >= limits.max_files {
                left_out += 1;
                continue;
            }
            let record = FileRecord {
                id: new_id(),
                name,
                size: stamp.size,
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
            report.files.push(Harvested { record });
        }
        if left_out > 0 {
            // One note, however many: a flood of files must not flood stderr too.
            report.notes.push(format!(
                "{left_out} more new or changed files were left out of the generated files: \
                 more than {} files changed",
                limits.max_files
            ));
        }
        Ok(report)
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

/// Hands each directory of `rel` (beneath `dir`) to the sandbox user. Each level is
/// opened without following symlinks and changed through its parent's descriptor, so a
/// swapped-in symlink cannot redirect the change.
fn chown_tree(dir: &Dir, rel: &Path, uid: u32) -> io::Result<()> {
    if unsafe { libc::geteuid() } != 0 {
        return Ok(());
    }
    let mut parent = dir.try_clone()?;
    for part in rel.components() {
        let name = std::ffi::CString::new(part.as_os_str().as_encoded_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in name"))?;
        use std::os::fd::AsRawFd;
        let rc = unsafe {
            libc::fchownat(
                parent.as_raw_fd(),
                name.as_ptr(),
                uid,
                uid,
                libc::AT_SYMLINK_NOFOLLOW,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        parent = parent.open_dir_nofollow(part)?;
    }
    Ok(())
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

fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// Milliseconds since the epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A MIME type from a file name's extension.
pub fn content_type(name: &str) -> &'static str {
    let ext = name.rsplit_once('.').map(|(_, e)| e.to_ascii_lowercase());
    match ext.as_deref() {
        Some("png") => "image/png",
        Some("jpg" | "jpeg") => "image/jpeg",
        Some("gif") => "image/gif",
        Some("svg") => "image/svg+xml",
        Some("webp") => "image/webp",
        Some("pdf") => "application/pdf",
        Some("csv") => "text/csv",
        Some("txt" | "log" | "md") => "text/plain; charset=utf-8",
        Some("html" | "htm") => "text/html; charset=utf-8",
        Some("json") => "application/json",
        Some("xml") => "application/xml",
        Some("zip") => "application/zip",
        Some("xlsx") => "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet",
        Some("docx") => "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
        Some("pptx") => "application/vnd.openxmlformats-officedocument.presentationml.presentation",
        _ => "application/octet-stream",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> HarvestLimits {
        HarvestLimits {
            max_files: 50,
            max_file_bytes: 1 << 20,
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
                },
            )
            .unwrap();
        assert_eq!(report.files.len(), 2);
        assert_eq!(report.notes.len(), 2, "{:?}", report.notes);
        assert!(report.notes.iter().any(|n| n.contains("big.bin")));
    }
}
