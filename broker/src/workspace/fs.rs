//! The cap-std helpers: beneath-only opens, safe client names, directories made for the
//! sandbox, atomic writes.

use crate::ids::new_id;
use cap_fs_ext::{DirExt, FollowSymlinks, OpenOptionsFollowExt};
use cap_std::fs::{Dir, OpenOptions, OpenOptionsExt};
use sha2::{Digest, Sha256};
use std::io::{self, Read};
use std::path::{Path, PathBuf};

/// Opens a regular file beneath `dir` without following symlinks and without blocking on
/// a FIFO.
pub(super) fn open_regular(dir: &Dir, path: &Path) -> io::Result<cap_std::fs::File> {
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
pub(crate) fn safe_relative_path(name: &str) -> Option<PathBuf> {
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
pub(super) fn make_parents(
    dir: &Dir,
    rel: &Path,
    sandbox_uid: u32,
    read_only: bool,
) -> io::Result<Dir> {
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
            // The code may have renamed its directory between the open and the change of
            // owner, and put another at the name: the file would land in the one it moved
            // away, and the code's own would stand at the name.
            still_at(&current, part.as_os_str(), &next)?;
        } else if created {
            hand_to_sandbox(&next, sandbox_uid)?;
            rustix::fs::fchmod(&next, rustix::fs::Mode::from_raw_mode(0o755))?;
        }
        current = Dir::from_std_file(std::fs::File::from(next));
    }
    Ok(current)
}

/// Fails unless `name` in `parent` is the directory `opened`, found without following a
/// link: what was opened and protected is still what the path leads to.
pub(super) fn still_at(
    parent: impl std::os::fd::AsFd,
    name: &std::ffi::OsStr,
    opened: impl std::os::fd::AsFd,
) -> io::Result<()> {
    let at = rustix::fs::statat(parent, name, rustix::fs::AtFlags::SYMLINK_NOFOLLOW)?;
    let held = rustix::fs::fstat(opened)?;
    if (at.st_dev, at.st_ino) != (held.st_dev, held.st_ino) {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "a directory on the path was replaced while it was being protected",
        ));
    }
    Ok(())
}

/// Makes `dir` the broker's, group of the sandbox, mode 1770: the sandbox may add entries,
/// but may neither list it to others nor unlink or rename entries it does not own.
/// A broker running as the sandbox's own uid owns everything anyway, and only sets the
/// mode.
pub(super) fn protect_dir(dir: impl std::os::fd::AsFd, sandbox_uid: u32) -> io::Result<()> {
    let me = euid();
    if me != sandbox_uid {
        std::os::unix::fs::fchown(&dir, Some(me), Some(sandbox_uid))?;
    }
    rustix::fs::fchmod(&dir, rustix::fs::Mode::from_raw_mode(0o1770))?;
    Ok(())
}

/// How directories are opened to change their owner and mode: for reading (a path-only
/// descriptor cannot), never through a symlink.
pub(super) fn dir_flags() -> rustix::fs::OFlags {
    use rustix::fs::OFlags;
    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

/// The broker's effective uid.
pub(crate) fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Gives a file or directory the broker created to the sandbox user (nothing to do when
/// the broker runs as that uid).
pub(super) fn hand_to_sandbox(fd: impl std::os::fd::AsFd, sandbox_uid: u32) -> io::Result<()> {
    if euid() == sandbox_uid {
        return Ok(());
    }
    std::os::unix::fs::fchown(fd, Some(sandbox_uid), Some(sandbox_uid))
}

/// How deep [`reown_beneath`] goes into a workspace: far below what any program makes,
/// and a bound on the directories it holds open at once.
const MAX_REOWN_DEPTH: usize = 256;

/// Hands everything beneath `dir` that the sandboxes own to `uid` (owner and group), never
/// following a link (a link is re-owned itself). What the broker owns stays its own: its
/// read-only files, and the protected directories on their way, which only take the group
/// `uid`. Entries deeper than [`MAX_REOWN_DEPTH`] are left as they are (counted).
/// Returns how many entries were left.
pub(super) fn reown_beneath(dir: &Dir, uid: u32, depth: usize) -> io::Result<u64> {
    use rustix::fs::{AtFlags, FileType, Gid, Uid};
    let me = euid();
    let owner = (Some(Uid::from_raw(uid)), Some(Gid::from_raw(uid)));
    let mut left = 0;
    for entry in dir.entries()? {
        let name = entry?.file_name();
        let stat = rustix::fs::statat(dir, &name, AtFlags::SYMLINK_NOFOLLOW)?;
        let is_dir = FileType::from_raw_mode(stat.st_mode) == FileType::Directory;
        if stat.st_uid == me {
            // The broker's own: a protected directory takes the sandbox's group.
            if is_dir && stat.st_gid != uid {
                rustix::fs::chownat(dir, &name, None, owner.1, AtFlags::SYMLINK_NOFOLLOW)?;
            }
        } else if (stat.st_uid, stat.st_gid) != (uid, uid) {
            rustix::fs::chownat(dir, &name, owner.0, owner.1, AtFlags::SYMLINK_NOFOLLOW)?;
        }
        if is_dir {
            if depth >= MAX_REOWN_DEPTH {
                left += 1;
                continue;
            }
            let sub = dir.open_dir_nofollow(&name)?;
            left += reown_beneath(&sub, uid, depth + 1)?;
        }
    }
    Ok(left)
}

/// Copies `src` to `dst` while hashing; `None` when more than `max_bytes` came.
pub(crate) fn copy_hashing(
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
pub(super) fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_atomic_mode(path, bytes, 0o600)
}

/// Writes `path` through a temporary file created 0600 and given `mode` (whatever the
/// umask), then renamed over it.
pub(super) fn write_atomic_mode(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let tmp = path.with_extension(format!("tmp-{}", new_id()));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    if mode != 0o600 {
        if let Err(e) = rustix::fs::fchmod(&file, rustix::fs::Mode::from_raw_mode(mode)) {
            let _ = std::fs::remove_file(&tmp);
            return Err(e.into());
        }
    }
    if let Err(e) = file.write_all(bytes) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_swapped_after_it_was_opened_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        std::fs::create_dir(root.join("skill")).unwrap();
        let parent = std::fs::File::open(root).unwrap();
        let opened =
            rustix::fs::openat(&parent, "skill", dir_flags(), rustix::fs::Mode::empty()).unwrap();
        still_at(&parent, "skill".as_ref(), &opened).expect("unmoved: accepted");
        // Between the open and the check, the directory moves and another takes its name.
        std::fs::rename(root.join("skill"), root.join("moved")).unwrap();
        std::fs::create_dir(root.join("skill")).unwrap();
        let err = still_at(&parent, "skill".as_ref(), &opened).expect_err("swapped: refused");
        assert_eq!(err.kind(), io::ErrorKind::AlreadyExists);
        // A link to the moved directory at the name is refused too.
        std::fs::remove_dir(root.join("skill")).unwrap();
        std::os::unix::fs::symlink("moved", root.join("skill")).unwrap();
        still_at(&parent, "skill".as_ref(), &opened).expect_err("a link: refused");
        // Gone altogether.
        std::fs::remove_file(root.join("skill")).unwrap();
        still_at(&parent, "skill".as_ref(), &opened).expect_err("gone: refused");
    }

    #[test]
    fn a_skill_lands_where_its_name_says_or_nowhere() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let dir = Dir::open_ambient_dir(root, cap_std::ambient_authority()).unwrap();
        std::fs::create_dir_all(root.join("skills/pptx")).unwrap();
        let last = make_parents(&dir, Path::new("skills/pptx"), euid(), true).unwrap();
        let held = rustix::fs::fstat(&last).unwrap();
        let at = std::fs::metadata(root.join("skills/pptx")).unwrap();
        use std::os::unix::fs::MetadataExt as _;
        assert_eq!(held.st_ino, at.ino());
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
}
