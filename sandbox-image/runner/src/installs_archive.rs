//! Packs a session's installs ([`INSTALL_DIRS`] below the workspace) into one tar archive
//! in the runner's state directory, and unpacks such an archive back (see
//! `sandbox_runner::installs` for when the broker asks).
//!
//! Packing follows no symlink (a link is archived as a link) and takes only files,
//! directories and links; the archive is bounded while it is written. Unpacking writes only
//! entries whose path is relative, has no `..`, and starts with an install directory, and
//! only regular files, directories and symlinks; the tar crate's `unpack_in` also refuses to
//! write through a link that leads out of the workspace.

use sandbox_runner::{InstallsPacked, InstallsUnpacked, INSTALLS_FILE, INSTALL_DIRS};
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Component, Path, PathBuf};
use std::time::Instant;

/// Most entries one archive holds: a bound on the walk whatever the code created.
const MAX_ENTRIES: u64 = 500_000;

/// A writer that refuses to go past `max` bytes.
struct Bounded<W> {
    inner: W,
    written: u64,
    max: u64,
}

impl<W: Write> Write for Bounded<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.written.saturating_add(buf.len() as u64) > self.max {
            return Err(io::Error::new(
                io::ErrorKind::FileTooLarge,
                "over the bound",
            ));
        }
        let n = self.inner.write(buf)?;
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Packs the install directories of `workdir` into `state_dir`'s archive, replacing any
/// earlier one; an answer with `bytes: 0` when there is nothing to pack or it failed (then
/// no archive is left).
pub(crate) fn pack(workdir: &Path, state_dir: &Path, max_bytes: u64) -> InstallsPacked {
    let started = Instant::now();
    let archive = state_dir.join(INSTALLS_FILE);
    let _ = std::fs::remove_file(&archive);
    let mut answer = match try_pack(workdir, &archive, max_bytes) {
        Ok((bytes, entries)) => InstallsPacked {
            bytes,
            entries,
            ..InstallsPacked::default()
        },
        Err(err) => {
            let _ = std::fs::remove_file(&archive);
            let error = match err.kind() {
                io::ErrorKind::FileTooLarge => {
                    format!("the installs take more than {max_bytes} bytes")
                }
                io::ErrorKind::StorageFull => {
                    "the sandbox's /tmp has no room for the archive of the installs".to_string()
                }
                _ => format!("cannot pack the installs: {err}"),
            };
            InstallsPacked {
                error: Some(error),
                over_bound: err.kind() == io::ErrorKind::FileTooLarge,
                ..InstallsPacked::default()
            }
        }
    };
    answer.duration_ms = started.elapsed().as_millis() as u64;
    answer
}

fn try_pack(workdir: &Path, archive: &Path, max_bytes: u64) -> io::Result<(u64, u64)> {
    let roots: Vec<&str> = INSTALL_DIRS
        .iter()
        .copied()
        .filter(|d| std::fs::symlink_metadata(workdir.join(d)).is_ok_and(|m| m.is_dir()))
        .collect();
    if roots.is_empty() {
        return Ok((0, 0));
    }
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(archive)?;
    let out = Bounded {
        inner: BufWriter::with_capacity(1 << 20, file),
        written: 0,
        max: max_bytes,
    };
    let mut builder = tar::Builder::new(out);
    builder.follow_symlinks(false);
    let mut entries = 0u64;
    let mut stack: Vec<PathBuf> = roots.iter().map(PathBuf::from).collect();
    while let Some(rel) = stack.pop() {
        entries += 1;
        if entries > MAX_ENTRIES {
            return Err(io::Error::other(format!(
                "more than {MAX_ENTRIES} files and directories installed"
            )));
        }
        let full = workdir.join(&rel);
        let Ok(meta) = std::fs::symlink_metadata(&full) else {
            continue; // gone since it was listed
        };
        let kind = meta.file_type();
        if !(kind.is_file() || kind.is_dir() || kind.is_symlink()) {
            continue; // sockets, fifos, devices: nothing an install needs
        }
        builder.append_path_with_name(&full, &rel)?;
        if kind.is_dir() {
            for child in std::fs::read_dir(&full)? {
                stack.push(rel.join(child?.file_name()));
            }
        }
    }
    let mut out = builder.into_inner()?;
    out.flush()?;
    Ok((out.written, entries))
}

/// Whether an archive entry's path may be written: relative, no `..`, below an install
/// directory.
fn allowed(path: &Path) -> bool {
    let mut parts = path.components();
    let first_ok = matches!(parts.next(), Some(Component::Normal(first))
        if INSTALL_DIRS.iter().any(|d| first == std::ffi::OsStr::new(d)));
    first_ok && parts.all(|c| matches!(c, Component::Normal(_)))
}

/// Unpacks `state_dir`'s archive into `workdir` and removes the archive, whatever happened.
pub(crate) fn unpack(workdir: &Path, state_dir: &Path, max_bytes: u64) -> InstallsUnpacked {
    let started = Instant::now();
    let archive = state_dir.join(INSTALLS_FILE);
    let mut answer = InstallsUnpacked::default();
    if let Err(err) = try_unpack(workdir, &archive, max_bytes, &mut answer) {
        answer.error = Some(err);
    }
    let _ = std::fs::remove_file(&archive);
    answer.duration_ms = started.elapsed().as_millis() as u64;
    answer
}

fn try_unpack(
    workdir: &Path,
    archive: &Path,
    max_bytes: u64,
    answer: &mut InstallsUnpacked,
) -> Result<(), String> {
    let meta = std::fs::symlink_metadata(archive)
        .map_err(|e| format!("no archive of the installs: {e}"))?;
    if !meta.is_file() || meta.len() > max_bytes {
        return Err(format!(
            "the archive of the installs has {} bytes, more than the {max_bytes} allowed",
            meta.len()
        ));
    }
    let file = File::open(archive).map_err(|e| format!("cannot open the archive: {e}"))?;
    let mut tar = tar::Archive::new(io::BufReader::with_capacity(1 << 20, file));
    tar.set_preserve_permissions(true);
    tar.set_preserve_mtime(true);
    tar.set_overwrite(true);
    tar.set_unpack_xattrs(false);
    let mut first_error = None;
    let entries = tar
        .entries()
        .map_err(|e| format!("cannot read the archive: {e}"))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| format!("a damaged archive: {e}"))?;
        let kind = entry.header().entry_type();
        let path_ok = entry.path().is_ok_and(|p| allowed(&p));
        let kind_ok = kind.is_file() || kind.is_dir() || kind.is_symlink();
        if !(path_ok && kind_ok) {
            answer.skipped += 1;
            continue;
        }
        match entry.unpack_in(workdir) {
            Ok(true) => answer.entries += 1,
            Ok(false) => answer.skipped += 1,
            // The first failure is said; the other entries still come.
            Err(e) => {
                answer.skipped += 1;
                first_error.get_or_insert_with(|| format!("cannot unpack the installs: {e}"));
            }
        }
    }
    first_error.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn dirs() -> (tempfile_dir::Dir, tempfile_dir::Dir, tempfile_dir::Dir) {
        (
            tempfile_dir::Dir::new("ws"),
            tempfile_dir::Dir::new("state"),
            tempfile_dir::Dir::new("ws2"),
        )
    }

    /// A directory removed at the end of the test (no dev-dependency for it).
    mod tempfile_dir {
        pub(super) struct Dir(pub(super) std::path::PathBuf);
        impl Dir {
            pub(super) fn new(tag: &str) -> Dir {
                use std::sync::atomic::{AtomicU32, Ordering};
                static N: AtomicU32 = AtomicU32::new(0);
                let n = N.fetch_add(1, Ordering::Relaxed);
                let p =
                    std::env::temp_dir().join(format!("installs-{tag}-{}-{n}", std::process::id()));
                let _ = std::fs::remove_dir_all(&p);
                std::fs::create_dir_all(&p).expect("temp dir");
                Dir(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    #[test]
    fn installs_go_whole_into_a_new_workspace_and_nothing_else_does() {
        let (ws, state, ws2) = dirs();
        let site = ws.0.join(".local/lib/python3.11/site-packages/cbdemo");
        std::fs::create_dir_all(&site).unwrap();
        std::fs::write(site.join("__init__.py"), b"VALUE = 1\n").unwrap();
        let pkg = ws.0.join("node_modules/cbtool");
        std::fs::create_dir_all(&pkg).unwrap();
        std::fs::write(pkg.join("cli.js"), b"#!/usr/bin/env node\n").unwrap();
        std::fs::set_permissions(pkg.join("cli.js"), std::fs::Permissions::from_mode(0o755))
            .unwrap();
        std::fs::create_dir_all(ws.0.join("node_modules/.bin")).unwrap();
        std::os::unix::fs::symlink("../cbtool/cli.js", ws.0.join("node_modules/.bin/cbtool"))
            .unwrap();
        std::fs::write(ws.0.join("data.csv"), b"a,b\n").unwrap();

        let packed = pack(&ws.0, &state.0, 1 << 20);
        assert_eq!(packed.error, None, "{packed:?}");
        assert!(packed.bytes > 0 && packed.entries >= 9, "{packed:?}");
        assert_eq!(
            std::fs::metadata(state.0.join(INSTALLS_FILE))
                .unwrap()
                .len(),
            packed.bytes
        );

        let unpacked = unpack(&ws2.0, &state.0, 1 << 20);
        assert_eq!(unpacked.error, None, "{unpacked:?}");
        assert_eq!(unpacked.skipped, 0, "{unpacked:?}");
        assert_eq!(unpacked.entries, packed.entries);
        let copied = ws2
            .0
            .join(".local/lib/python3.11/site-packages/cbdemo/__init__.py");
        assert_eq!(std::fs::read(copied).unwrap(), b"VALUE = 1\n");
        let cli = ws2.0.join("node_modules/cbtool/cli.js");
        assert_eq!(
            std::fs::metadata(&cli).unwrap().permissions().mode() & 0o777,
            0o755
        );
        let link = std::fs::read_link(ws2.0.join("node_modules/.bin/cbtool")).unwrap();
        assert_eq!(link, Path::new("../cbtool/cli.js"));
        // Only the installs: the session's own files travel the usual way.
        assert!(!ws2.0.join("data.csv").exists());
        // The archive is used once.
        assert!(!state.0.join(INSTALLS_FILE).exists());
    }

    #[test]
    fn nothing_installed_packs_nothing() {
        let (ws, state, _) = dirs();
        std::fs::write(ws.0.join("data.csv"), b"a,b\n").unwrap();
        // A link named like an install directory is not followed.
        std::os::unix::fs::symlink("/etc", ws.0.join(".local")).unwrap();
        let packed = pack(&ws.0, &state.0, 1 << 20);
        assert_eq!(packed.bytes, 0, "{packed:?}");
        assert_eq!(packed.error, None);
        assert!(!state.0.join(INSTALLS_FILE).exists());
    }

    #[test]
    fn installs_past_the_bound_are_not_kept_and_say_so() {
        let (ws, state, _) = dirs();
        std::fs::create_dir_all(ws.0.join(".local/big")).unwrap();
        std::fs::write(ws.0.join(".local/big/blob"), vec![7u8; 64 * 1024]).unwrap();
        let packed = pack(&ws.0, &state.0, 32 * 1024);
        assert_eq!(packed.bytes, 0, "{packed:?}");
        assert!(packed.over_bound, "{packed:?}");
        let error = packed.error.expect("an error");
        assert!(error.contains("more than 32768 bytes"), "{error}");
        assert!(!state.0.join(INSTALLS_FILE).exists());
    }

    #[test]
    fn a_hostile_archive_writes_only_below_the_install_directories() {
        let (ws, state, outside) = dirs();
        // Built by hand: a path out of the workspace, an absolute one, a file that is not an
        // install, a link out, and a write through that link; then one good entry.
        let mut out = Vec::new();
        {
            let mut b = tar::Builder::new(&mut out);
            fn add(b: &mut tar::Builder<&mut Vec<u8>>, name: &str, data: &[u8]) {
                let mut h = tar::Header::new_gnu();
                h.set_size(data.len() as u64);
                h.set_mode(0o644);
                h.set_entry_type(tar::EntryType::Regular);
                // set_path refuses `..`; write the raw name as a hostile archive would.
                let gnu = h.as_gnu_mut().unwrap();
                gnu.name[..name.len()].copy_from_slice(name.as_bytes());
                h.set_cksum();
                b.append(&h, data).unwrap();
            }
            add(&mut b, ".local/../../escaped", b"x");
            add(&mut b, "/tmp/absolute", b"x");
            add(&mut b, "data.csv", b"x");
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(tar::EntryType::Symlink);
            h.set_size(0);
            h.set_cksum();
            b.append_link(&mut h, "node_modules/out", &outside.0)
                .unwrap();
            add(&mut b, "node_modules/out/planted", b"x");
            add(&mut b, ".local/ok", b"fine");
            b.finish().unwrap();
        }
        std::fs::write(state.0.join(INSTALLS_FILE), &out).unwrap();
        let unpacked = unpack(&ws.0, &state.0, 1 << 20);
        assert!(
            std::fs::read_dir(&outside.0).unwrap().next().is_none(),
            "{unpacked:?}"
        );
        assert!(!ws.0.join("data.csv").exists());
        assert!(!ws.0.parent().unwrap().join("escaped").exists());
        // The write through the link is refused and said; the rest still comes.
        assert!(
            unpacked
                .error
                .as_deref()
                .is_some_and(|e| e.contains("outside")),
            "{unpacked:?}"
        );
        assert_eq!(std::fs::read(ws.0.join(".local/ok")).unwrap(), b"fine");
        assert_eq!(unpacked.skipped, 4, "{unpacked:?}");
    }

    #[test]
    fn an_archive_over_the_bound_is_refused_and_removed() {
        let (ws, state, _) = dirs();
        std::fs::write(state.0.join(INSTALLS_FILE), vec![0u8; 4096]).unwrap();
        let unpacked = unpack(&ws.0, &state.0, 1024);
        assert!(
            unpacked
                .error
                .as_deref()
                .is_some_and(|e| e.contains("more than the 1024")),
            "{unpacked:?}"
        );
        assert!(!state.0.join(INSTALLS_FILE).exists());
        assert!(std::fs::read_dir(&ws.0).unwrap().next().is_none());
    }
}
