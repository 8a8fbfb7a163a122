//! The runner's side of moving workspace files over the channel (see
//! `sandbox_runner::files`): listing, reading, writing and removing files below the
//! workspace. Every path is walked one component at a time from a descriptor of the
//! workspace with `O_NOFOLLOW`, so a symlink the code planted anywhere on a name is
//! refused, never followed; files are opened non-blocking and must be regular.

use sandbox_runner::files::{
    is_listed_name, is_plain_name, FileChunk, FileList, FileRemoved, FileStamp, FileWritten,
    ListFilesRequest, ListedFile, ReadFileRequest, RemoveFileRequest, WriteFileRequest,
    HARVEST_MAX_DEPTH, HARVEST_MAX_ENTRIES, HARVEST_SKIPPED_DIRS, MAX_CHUNK_BYTES,
};
use sha2::{Digest, Sha256};
use std::ffi::CString;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;

/// Most bytes of names a listing holds, so that its frame stays well below the frame cap
/// whatever the names (JSON may escape a byte as six).
const MAX_LISTING_NAME_BYTES: usize = 4 * 1024 * 1024;

/// Lists the regular files below `root` as the harvest sees them.
pub fn list(root: &Path, req: &ListFilesRequest) -> io::Result<FileList> {
    let dir = open_dir_at(None, root)?;
    let mut walk = Walk {
        budget: HARVEST_MAX_ENTRIES,
        name_bytes: 0,
        out: FileList::default(),
        hash_up_to: req.hash_up_to,
    };
    walk.dir(&dir, "", 0)?;
    if walk.budget == 0 || walk.name_bytes > MAX_LISTING_NAME_BYTES {
        walk.out.truncated = true;
    }
    Ok(walk.out)
}

/// One listing under way.
struct Walk {
    /// Entries still to look at.
    budget: usize,
    /// Bytes of names listed so far.
    name_bytes: usize,
    /// What was found.
    out: FileList,
    /// Hash files up to this size (0: none).
    hash_up_to: u64,
}

impl Walk {
    fn dir(&mut self, dir: &OwnedFd, prefix: &str, depth: usize) -> io::Result<()> {
        if depth > HARVEST_MAX_DEPTH {
            return Ok(());
        }
        // The directory as this descriptor holds it, whatever its path now names.
        let entries = std::fs::read_dir(format!("/proc/self/fd/{}", dir.as_raw_fd()))?;
        for entry in entries {
            if self.budget == 0 || self.name_bytes > MAX_LISTING_NAME_BYTES {
                return Ok(());
            }
            self.budget -= 1;
            let Ok(entry) = entry else { continue };
            let file_name = entry.file_name();
            let Some(name) = file_name.to_str() else {
                continue;
            };
            if name.starts_with('.') || HARVEST_SKIPPED_DIRS.contains(&name) {
                continue;
            }
            let path = if prefix.is_empty() {
                name.to_string()
            } else {
                format!("{prefix}/{name}")
            };
            // lstat: a symlink is a symlink here, never what it points to.
            let Ok(meta) = entry.metadata() else { continue };
            if meta.file_type().is_dir() {
                if let Ok(sub) = open_dir_at(Some(dir), Path::new(name)) {
                    self.dir(&sub, &path, depth + 1)?;
                }
            } else if meta.file_type().is_file() && is_listed_name(&path) {
                let sha256 = (self.hash_up_to > 0 && meta.len() <= self.hash_up_to)
                    .then(|| hash_file(dir, name, self.hash_up_to))
                    .flatten();
                self.name_bytes += path.len();
                self.out.files.push(ListedFile {
                    name: path,
                    stamp: stamp_of(&meta),
                    sha256,
                });
            }
        }
        Ok(())
    }
}

/// SHA-256 of the regular file `name` in `dir`, if it has at most `max` bytes.
fn hash_file(dir: &OwnedFd, name: &str, max: u64) -> Option<String> {
    let file = open_file_at(dir, name, libc::O_RDONLY, 0).ok()?;
    let mut hasher = Sha256::new();
    let mut reader = (&file).take(max + 1);
    let mut buf = vec![0u8; 64 * 1024];
    let mut total = 0u64;
    loop {
        let n = reader.read(&mut buf).ok()?;
        if n == 0 {
            break;
        }
        total += n as u64;
        hasher.update(&buf[..n]);
    }
    (total <= max).then(|| {
        hasher
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    })
}

/// A piece of the file `req.name`.
pub fn read(root: &Path, req: &ReadFileRequest) -> io::Result<FileChunk> {
    let (dir, leaf) = open_parent(root, &req.name, false)?;
    let file = open_file_at(&dir, &leaf, libc::O_RDONLY, 0)?;
    let size = file.metadata()?.len();
    let len = req.len.min(MAX_CHUNK_BYTES) as usize;
    let mut data = vec![0u8; len];
    let mut filled = 0;
    while filled < len {
        match file.read_at(&mut data[filled..], req.offset + filled as u64) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    data.truncate(filled);
    Ok(FileChunk {
        eof: filled < len || req.offset + filled as u64 >= size,
        data,
        size,
    })
}

/// Writes a piece of the file `req.name`: the first replaces whatever is at the name
/// (but a directory) with a new file, mode 0600; the directories on the way are made.
pub fn write(root: &Path, req: &WriteFileRequest) -> io::Result<FileWritten> {
    if req.data.len() > MAX_CHUNK_BYTES as usize {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "chunk too large",
        ));
    }
    let (dir, leaf) = open_parent(root, &req.name, req.create)?;
    let file = if req.create {
        match lstat_at(&dir, &leaf) {
            Ok(st) if st.st_mode & libc::S_IFMT == libc::S_IFDIR => {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    "a directory has that name",
                ))
            }
            Ok(_) => unlink_at(&dir, &leaf)?,
            Err(_) => {}
        }
        open_file_at(
            &dir,
            &leaf,
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
            0o600,
        )?
    } else {
        open_file_at(&dir, &leaf, libc::O_WRONLY, 0)?
    };
    file.write_all_at(&req.data, req.offset)?;
    if req.read_only {
        file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o444))?;
    }
    Ok(FileWritten {
        stamp: stamp_of(&file.metadata()?),
    })
}

/// Removes the file `req.name` if its inode and change time are still `req.stamp`'s.
pub fn remove(root: &Path, req: &RemoveFileRequest) -> io::Result<FileRemoved> {
    let (dir, leaf) = open_parent(root, &req.name, false)?;
    let st = lstat_at(&dir, &leaf)?;
    let same = st.st_mode & libc::S_IFMT == libc::S_IFREG
        && st.st_ino == req.stamp.ino
        && st.st_ctime == req.stamp.ctime
        && st.st_ctime_nsec == req.stamp.ctime_nsec;
    if same {
        unlink_at(&dir, &leaf)?;
    }
    Ok(FileRemoved { removed: same })
}

/// The directory holding `name` below `root`, walked without following symlinks (made
/// as needed when `create`), and the last component.
fn open_parent(root: &Path, name: &str, create: bool) -> io::Result<(OwnedFd, String)> {
    if !is_plain_name(name) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "bad file name"));
    }
    let mut dir = open_dir_at(None, root)?;
    let mut parts: Vec<&str> = name.split('/').collect();
    let leaf = parts.pop().unwrap_or_default().to_string();
    for part in parts {
        if create {
            let c = cstring(part)?;
            // SAFETY: a valid descriptor and a NUL-terminated name.
            if unsafe { libc::mkdirat(dir.as_raw_fd(), c.as_ptr(), 0o755) } != 0 {
                let err = io::Error::last_os_error();
                if err.raw_os_error() != Some(libc::EEXIST) {
                    return Err(err);
                }
            }
        }
        dir = open_dir_at(Some(&dir), Path::new(part))?;
    }
    Ok((dir, leaf))
}

/// Opens a directory (relative to `dir` when given) without following a symlink.
fn open_dir_at(dir: Option<&OwnedFd>, path: &Path) -> io::Result<OwnedFd> {
    let c = cstring(path.to_str().unwrap_or_default())?;
    let at = dir.map_or(libc::AT_FDCWD, |d| d.as_raw_fd());
    let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    // SAFETY: a valid descriptor (or AT_FDCWD) and a NUL-terminated path.
    let fd = unsafe { libc::openat(at, c.as_ptr(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor just opened, owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Opens the regular file `name` in `dir` without following a symlink or blocking on a
/// FIFO; anything but a regular file is refused.
fn open_file_at(dir: &OwnedFd, name: &str, flags: libc::c_int, mode: u32) -> io::Result<File> {
    let c = cstring(name)?;
    let flags = flags | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC;
    // SAFETY: a valid descriptor and a NUL-terminated name.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), c.as_ptr(), flags, mode as libc::c_uint) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor just opened, owned by nothing else.
    let file = unsafe { File::from_raw_fd(fd) };
    if !file.metadata()?.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    Ok(file)
}

/// `fstatat` of `name` in `dir`, not following a symlink.
fn lstat_at(dir: &OwnedFd, name: &str) -> io::Result<libc::stat> {
    let c = cstring(name)?;
    // SAFETY: an all-zero stat is a valid value to be overwritten.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor, a NUL-terminated name and a stat to fill.
    let rc = unsafe {
        libc::fstatat(
            dir.as_raw_fd(),
            c.as_ptr(),
            &mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

/// Unlinks the non-directory `name` in `dir`.
fn unlink_at(dir: &OwnedFd, name: &str) -> io::Result<()> {
    let c = cstring(name)?;
    // SAFETY: a valid descriptor and a NUL-terminated name.
    if unsafe { libc::unlinkat(dir.as_raw_fd(), c.as_ptr(), 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn cstring(s: &str) -> io::Result<CString> {
    CString::new(s).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in a name"))
}

fn stamp_of(meta: &std::fs::Metadata) -> FileStamp {
    FileStamp {
        ino: meta.ino(),
        size: meta.len(),
        ctime: meta.ctime(),
        ctime_nsec: meta.ctime_nsec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_all(root: &Path, name: &str, data: &[u8]) -> io::Result<FileWritten> {
        write(
            root,
            &WriteFileRequest {
                name: name.into(),
                offset: 0,
                data: data.to_vec(),
                create: true,
                read_only: false,
            },
        )
    }

    #[test]
    fn lists_reads_writes_and_removes_without_following_links() {
        let dir = tempfile_dir();
        let root = dir.as_path();
        let written = write_all(root, "out/a.txt", b"hello").expect("write");
        std::fs::write(root.join(".hidden"), b"x").expect("hidden");
        std::fs::create_dir_all(root.join("node_modules")).expect("dir");
        std::fs::write(root.join("node_modules/m.js"), b"x").expect("skipped");
        std::os::unix::fs::symlink("/etc/passwd", root.join("passwd")).expect("link");
        std::os::unix::fs::symlink("/etc", root.join("etc")).expect("dir link");

        let listed = list(root, &ListFilesRequest { hash_up_to: 1024 }).expect("list");
        let names: Vec<&str> = listed.files.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["out/a.txt"]);
        assert_eq!(listed.files[0].stamp, written.stamp);
        assert_eq!(
            listed.files[0].sha256.as_deref(),
            Some("2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824")
        );

        let chunk = read(
            root,
            &ReadFileRequest {
                name: "out/a.txt".into(),
                offset: 1,
                len: 3,
            },
        )
        .expect("read");
        assert_eq!(
            (chunk.data.as_slice(), chunk.size, chunk.eof),
            (&b"ell"[..], 5, false)
        );
        for refused in ["passwd", "etc/passwd", "../x", "/etc/passwd"] {
            let req = ReadFileRequest {
                name: refused.into(),
                offset: 0,
                len: 10,
            };
            assert!(read(root, &req).is_err(), "{refused}");
            assert!(
                write_all(root, &format!("{refused}/x"), b"x").is_err(),
                "{refused}"
            );
        }
        // A new file replaces a link at its name instead of writing through it.
        write_all(root, "passwd", b"mine").expect("replace the link");
        assert_eq!(std::fs::read(root.join("passwd")).expect("read"), b"mine");

        let stale = RemoveFileRequest {
            name: "out/a.txt".into(),
            stamp: FileStamp::default(),
        };
        assert!(!remove(root, &stale).expect("remove").removed);
        let current = RemoveFileRequest {
            name: "out/a.txt".into(),
            stamp: written.stamp,
        };
        assert!(remove(root, &current).expect("remove").removed);
        assert!(!root.join("out/a.txt").exists());
    }

    /// A fresh directory under the system's temporary directory.
    fn tempfile_dir() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "runner-files-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0)
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir
    }
}
