//! The host side of a session's files.
//!
//! On disk a session is `DATA_DIR/sessions/<session id>/` holding `session.json` (who owns
//! it), `index.json` (file ids), `blobs/` (file versions), the saved Python state of its
//! last container if any (`python-state.bin` and `.json`, see `state`) and `files/`, the
//! directory mounted at `/mnt/data`. The
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
//! delete them. Each sandbox has a uid of its own (`crate::sandbox::uids`), so a session's
//! next sandbox is handed the workspace before it starts (`Workspace::hand_to`): what the
//! earlier ones wrote becomes its uid's, and `files/` takes its group. Without a live
//! sandbox a workspace stays with the last uid it was handed to; its 0700 parent keeps
//! that uid, once given to another sandbox, out of it.

mod blobs;
mod fs;
mod harvest;
mod index;
mod state;

pub(crate) use fs::{euid, safe_relative_path};
pub(crate) use harvest::{HarvestLimits, HarvestReport, HarvestSource, LeftOut, MAX_ENTRIES};
pub(crate) use index::{human_bytes, FileIndex, FileRecord, Origin, Stamp, StorageBudget};
pub(crate) use state::SavedState;

use cap_std::ambient_authority;
use cap_std::fs::{Dir, MetadataExt};
use fs::{dir_flags, open_regular, protect_dir, write_atomic, write_atomic_mode};
use serde::{Deserialize, Serialize};
use std::io;
use std::path::{Path, PathBuf};

/// The directories of one session.
#[derive(Debug, Clone)]
pub(crate) struct Workspace {
    /// `DATA_DIR/sessions/<id>`: metadata, not visible to the sandbox.
    root: PathBuf,
}

impl Workspace {
    /// The workspace of `session_id` under `data_dir` (not created).
    pub(crate) fn new(data_dir: &Path, session_id: &str) -> Workspace {
        Workspace {
            root: data_dir.join("sessions").join(session_id),
        }
    }

    /// Where the session's metadata lives.
    pub(crate) fn root(&self) -> &Path {
        &self.root
    }

    /// The directory mounted at `/mnt/data`.
    pub(crate) fn files_dir(&self) -> PathBuf {
        self.root.join("files")
    }

    /// Creates the directories, or brings existing ones (of an older version) to the modes
    /// and owners described in the module doc: the root 0700, `files/` the broker's, group
    /// of the sandbox, 1770.
    pub(crate) fn create(&self, sandbox_uid: u32) -> io::Result<()> {
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

    /// Hands the files directory to the sandbox about to mount it, which runs as `uid`:
    /// `files/` takes the group `uid`, and whatever earlier sandboxes of the session (each
    /// with a uid of its own) left in it becomes `uid`'s, so that the new sandbox may
    /// change it; the broker's read-only files stay the broker's. Nothing to do for a
    /// broker that runs as `uid` itself. Call it while no sandbox runs on the directory.
    pub(crate) fn hand_to(&self, uid: u32) -> io::Result<()> {
        let files = rustix::fs::open(self.files_dir(), dir_flags(), rustix::fs::Mode::empty())?;
        protect_dir(&files, uid)?;
        if euid() == uid {
            return Ok(());
        }
        let dir = Dir::from_std_file(std::fs::File::from(files));
        let left = fs::reown_beneath(&dir, uid, 0)?;
        if left > 0 {
            tracing::warn!(workspace = %self.root.display(), uid, left, "directories nested too deep were not handed to the new sandbox");
        }
        Ok(())
    }

    /// The `/etc/passwd` its sandbox sees (see [`Workspace::write_accounts`]).
    pub(crate) fn sandbox_passwd(&self) -> PathBuf {
        self.root.join("sandbox-passwd")
    }

    /// The `/etc/group` its sandbox sees.
    pub(crate) fn sandbox_group(&self) -> PathBuf {
        self.root.join("sandbox-group")
    }

    /// Writes the account files the next sandbox mounts read-only at `/etc/passwd` and
    /// `/etc/group` (its uid changes from one sandbox to the next): the broker's, mode
    /// 0444, beside the metadata, out of the sandbox's reach otherwise.
    pub(crate) fn write_accounts(&self, passwd: &[u8], group: &[u8]) -> io::Result<()> {
        write_atomic_mode(&self.sandbox_passwd(), passwd, 0o444)?;
        write_atomic_mode(&self.sandbox_group(), group, 0o444)
    }

    /// The uid the files directory was last handed to (its group): the live sandbox's,
    /// the one before it, or the range's first, which no sandbox runs as.
    pub(crate) fn handed_to(&self) -> io::Result<u32> {
        use std::os::unix::fs::MetadataExt as _;
        Ok(std::fs::symlink_metadata(self.files_dir())?.gid())
    }

    /// Reads `index.json`; a missing one is an empty index.
    pub(crate) fn load_index(&self) -> io::Result<FileIndex> {
        match std::fs::read(self.root.join("index.json")) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(FileIndex::default()),
            Err(e) => Err(e),
        }
    }

    /// Writes `index.json` atomically.
    pub(crate) fn save_index(&self, index: &FileIndex) -> io::Result<()> {
        write_atomic(&self.root.join("index.json"), &serde_json::to_vec(index)?)
    }

    /// Reads a JSON metadata file of the session (`session.json`).
    pub(crate) fn load_meta<T: for<'de> Deserialize<'de>>(&self, name: &str) -> io::Result<T> {
        let bytes = std::fs::read(self.root.join(name))?;
        serde_json::from_slice(&bytes).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }

    /// Writes a JSON metadata file of the session atomically.
    pub(crate) fn save_meta<T: Serialize>(&self, name: &str, value: &T) -> io::Result<()> {
        write_atomic(&self.root.join(name), &serde_json::to_vec(value)?)
    }

    /// Makes `pooled`'s files directory this workspace's own, keeping this workspace's
    /// files: they move into it, then it takes the place of `files/`. A sandbox that
    /// mounts `pooled`'s directory then sees this workspace's files, because a bind mount
    /// follows the directory, not its path. `pooled` must be empty (a fresh pooled
    /// workspace); its metadata directory is removed. On failure nothing is lost: what was
    /// moved goes back.
    pub(crate) fn take_files_dir_of(&self, pooled: &Workspace) -> io::Result<()> {
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
    pub(crate) fn open_file(&self, name: &str) -> io::Result<(std::fs::File, u64)> {
        let dir = self.open_files()?;
        let file = open_regular(&dir, Path::new(name))?;
        let file = file.into_std();
        let size = file.metadata()?.len();
        Ok((file, size))
    }

    /// Removes the sandbox's file `name` if it is still the version `record` describes
    /// (a changed file is the code's, and stays).
    pub(crate) fn remove_if_unchanged(&self, record: &FileRecord) -> io::Result<()> {
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
}

/// A new file at `path` that only the broker reads (0600), failing if anything is there:
/// a temporary file never opens what another process planted.
pub(crate) fn create_private(path: &Path) -> io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
}

#[cfg(test)]
mod tests {
    use super::fs::euid;
    use super::*;

    pub(super) fn limits() -> HarvestLimits {
        HarvestLimits {
            max_files: 50,
            max_file_bytes: 1 << 20,
            storage: StorageBudget::UNLIMITED,
        }
    }

    pub(super) fn workspace() -> (tempfile::TempDir, Workspace) {
        let tmp = tempfile::tempdir().unwrap();
        let ws = Workspace::new(tmp.path(), "s");
        std::fs::create_dir_all(ws.files_dir()).unwrap();
        (tmp, ws)
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
    fn a_new_sandbox_uid_is_handed_what_older_ones_wrote_but_not_the_brokers_files() {
        if euid() != 0 {
            // Handing files to another uid takes root (or the broker image's capabilities).
            return;
        }
        use std::os::unix::fs::MetadataExt as _;
        let (old, new) = (300_001, 300_002);
        let owner = |path: &Path| {
            let meta = std::fs::symlink_metadata(path).expect("metadata");
            (meta.uid(), meta.gid())
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let ws = Workspace::new(dir.path(), "s");
        ws.create(300_000).expect("create");
        ws.hand_to(old).expect("hand");
        assert_eq!(ws.handed_to().expect("gid"), old);
        let blob = dir.path().join("blob");
        std::fs::write(&blob, "# skill").expect("blob");
        ws.place_blob(&blob, Path::new("skills/pptx/SKILL.md"), old, true)
            .expect("place");
        ws.place_blob(&blob, Path::new("skills/pptx/notes.md"), old, false)
            .expect("place");
        // What the old sandbox made: a deep file, a link out, a private directory.
        let files = ws.files_dir();
        std::fs::create_dir_all(files.join("a/b/c")).expect("mkdir");
        std::fs::write(files.join("a/b/c/deep.txt"), "d").expect("write");
        std::os::unix::fs::symlink("/etc/passwd", files.join("link")).expect("symlink");
        for path in ["a", "a/b", "a/b/c", "a/b/c/deep.txt", "link"] {
            std::os::unix::fs::lchown(files.join(path), Some(old), Some(old)).expect("chown");
        }
        std::fs::set_permissions(
            files.join("a/b"),
            std::os::unix::fs::PermissionsExt::from_mode(0o700),
        )
        .expect("chmod");
        let passwd = owner(Path::new("/etc/passwd"));

        ws.hand_to(new).expect("hand");

        assert_eq!(ws.handed_to().expect("gid"), new);
        assert_eq!(owner(&files), (0, new));
        for path in [
            "a",
            "a/b",
            "a/b/c",
            "a/b/c/deep.txt",
            "link",
            "skills/pptx/notes.md",
        ] {
            assert_eq!(owner(&files.join(path)), (new, new), "{path}");
        }
        // The broker's stay its own; their protected directories take the new group.
        assert_eq!(owner(&files.join("skills/pptx/SKILL.md")).0, 0);
        assert_eq!(owner(&files.join("skills")), (0, new));
        assert_eq!(owner(&files.join("skills/pptx")), (0, new));
        assert_eq!(owner_mode(&files.join("skills/pptx")), (0, 0o1770));
        // The link was re-owned itself, never followed.
        assert_eq!(owner(Path::new("/etc/passwd")), passwd);
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
}
