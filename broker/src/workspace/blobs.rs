//! The blob store: immutable copies of every recorded version, named by SHA-256.

use super::fs::{copy_hashing, dir_flags, hand_to_sandbox, make_parents, open_regular};
use super::{FileIndex, Stamp, Workspace};
use crate::ids::new_id;
use cap_fs_ext::{FollowSymlinks, OpenOptionsFollowExt};
use cap_std::fs::{Dir, OpenOptions, OpenOptionsExt};
use std::io;
use std::path::{Path, PathBuf};

impl Workspace {
    /// The directory of immutable copies of every recorded version, named by SHA-256.
    /// Broker-owned and outside the mount: downloads read from here, so what the sandbox
    /// does later to its files never changes what an id serves.
    pub(crate) fn blobs_dir(&self) -> PathBuf {
        self.root.join("blobs")
    }

    /// The stored bytes of a version.
    pub(crate) fn blob_path(&self, sha256: &str) -> PathBuf {
        self.blobs_dir().join(sha256)
    }

    /// A new temporary file in the blob store, for an upload to stream into.
    pub(crate) fn blob_temp(&self) -> io::Result<(PathBuf, std::fs::File)> {
        self.create_blobs_dir()?;
        let path = self.blobs_dir().join(format!(".tmp-{}", new_id()));
        let file = super::create_private(&path)?;
        Ok((path, file))
    }

    /// Creates the blob store if it is missing, readable by the broker only.
    pub(crate) fn create_blobs_dir(&self) -> io::Result<()> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(self.blobs_dir())
    }

    /// Moves a finished temporary file into the blob store under its hash.
    pub(crate) fn commit_blob(&self, temp: &Path, sha256: &str) -> io::Result<()> {
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
    pub(super) fn store_blob_from(
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
    pub(crate) fn delete_unused_blobs(&self, index: &FileIndex, shas: &[String]) {
        for sha in shas.iter().filter(|sha| !index.uses_blob(sha)) {
            let _ = std::fs::remove_file(self.blob_path(sha));
        }
    }

    /// Removes whatever in the blob store no record names: temporary files and blobs left
    /// by a crash between saving the index and deleting them. Run when the broker starts,
    /// before anything uses the session, so that the budget (counted from the index) and
    /// the disk agree. Returns the bytes freed.
    pub(crate) fn sweep_blobs(&self, index: &FileIndex) -> io::Result<u64> {
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

    /// The stamp of the regular file at `name` in the sandbox's files, found without
    /// following a link anywhere on the path; `None` when there is none. A placement is
    /// skipped only when this is the stamp the index recorded for it: the file the broker
    /// placed, where it placed it.
    pub(crate) fn placed_stamp(&self, name: &Path) -> Option<Stamp> {
        let mut dir = std::os::fd::OwnedFd::from(self.open_files().ok()?.into_std_file());
        let mut parts: Vec<_> = name.components().collect();
        let leaf = parts.pop()?;
        for part in parts {
            dir = rustix::fs::openat(
                &dir,
                part.as_os_str(),
                dir_flags(),
                rustix::fs::Mode::empty(),
            )
            .ok()?;
        }
        let stat = rustix::fs::statat(
            &dir,
            leaf.as_os_str(),
            rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
        )
        .ok()?;
        if rustix::fs::FileType::from_raw_mode(stat.st_mode) != rustix::fs::FileType::RegularFile {
            return None;
        }
        Some(Stamp {
            ino: stat.st_ino,
            size: stat.st_size as u64,
            ctime: stat.st_ctime,
            ctime_nsec: stat.st_ctime_nsec as i64,
        })
    }

    /// Places a stored blob at `name` in the sandbox's files (directories created as
    /// needed). A read-only file is the broker's, mode 0444, in directories the broker owns
    /// with the sticky bit (see the module doc); any other file and the directories made
    /// for it belong to the sandbox user. Returns the stamp of the placed file, so the next
    /// harvest sees it unchanged.
    pub(crate) fn place_blob(
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workspace::euid;
    use crate::workspace::tests::{limits, workspace};

    #[test]
    fn a_placed_file_is_known_by_its_stamp_where_it_was_placed_only() {
        let (_tmp, ws) = workspace();
        let blob = ws.root().join("blob");
        std::fs::write(&blob, "skill").unwrap();
        let name = Path::new("skills/s/SKILL.md");
        let stamp = ws.place_blob(&blob, name, euid(), true).unwrap();
        assert_eq!(ws.placed_stamp(name), Some(stamp));
        // The directory moved and another put at its name, with a file of the same
        // name: not the placed file, though the old one still exists.
        let files = ws.files_dir();
        std::fs::rename(files.join("skills/s"), files.join("skills/moved")).unwrap();
        std::fs::create_dir(files.join("skills/s")).unwrap();
        std::fs::write(files.join("skills/s/SKILL.md"), "skill").unwrap();
        assert_ne!(ws.placed_stamp(name), Some(stamp));
        // A link to the moved directory leads to the placed file, and is not followed.
        std::fs::remove_dir_all(files.join("skills/s")).unwrap();
        std::os::unix::fs::symlink("moved", files.join("skills/s")).unwrap();
        assert_eq!(ws.placed_stamp(name), None);
        assert_eq!(
            ws.placed_stamp(Path::new("skills/moved/SKILL.md")),
            Some(stamp)
        );
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
