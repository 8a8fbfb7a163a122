//! The scratch tmpfs mounts (`/tmp`, `/dev/shm`): when an exec fills one to the brim, what
//! that exec wrote there is removed afterwards.
//!
//! The mounts have fixed sizes and inode counts (the container profile), so a fill stops
//! with `No space left on device`, but a full `/tmp` would also keep every later exec from
//! writing its program there: the session would be stuck. So after an exec that left a
//! scratch mount (nearly) full of space or inodes, the runner removes the files changed
//! during that exec (a bounded walk; files from earlier execs stay) and reports the disk
//! limit.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Most entries one reclaim walk visits.
const WALK_BUDGET: usize = 200_000;

/// Whether the mount holding `dir` has (nearly) run out of space or inodes: less than
/// 1/64 of either left.
pub fn nearly_full(dir: &Path) -> bool {
    let Ok(path) = CString::new(dir.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: statvfs is plain data that the call fills in.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid path and pointer.
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return false;
    }
    let low = |free: u64, total: u64| total > 0 && free < total.div_ceil(64);
    low(st.f_bavail, st.f_blocks) || low(st.f_favail, st.f_files)
}

/// Removes the files and directories below `dir` changed at or after `since` (seconds and
/// nanoseconds since the epoch, as `st_ctime`); returns how many entries went.
pub fn remove_changed_since(dir: &Path, since: (i64, i64)) -> usize {
    let mut removed = 0;
    let mut budget = WALK_BUDGET;
    walk(dir, since, &mut budget, &mut removed, 0);
    removed
}

fn walk(dir: &Path, since: (i64, i64), budget: &mut usize, removed: &mut usize, depth: usize) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut subdirs: Vec<PathBuf> = Vec::new();
    for entry in entries {
        if *budget == 0 {
            break;
        }
        *budget -= 1;
        let Ok(entry) = entry else { continue };
        let Ok(meta) = entry.metadata() else { continue };
        if meta.is_dir() {
            if depth < 32 {
                subdirs.push(entry.path());
            }
        } else if (meta.ctime(), meta.ctime_nsec()) >= since
            && std::fs::remove_file(entry.path()).is_ok()
        {
            *removed += 1;
        }
    }
    for sub in subdirs {
        walk(&sub, since, budget, removed, depth + 1);
        // Empty now and made during the exec: it goes too (a non-empty one stays).
        if std::fs::metadata(&sub).is_ok_and(|m| (m.ctime(), m.ctime_nsec()) >= since)
            && std::fs::remove_dir(&sub).is_ok()
        {
            *removed += 1;
        }
    }
}

/// Now, as [`remove_changed_since`] takes it.
pub fn now() -> (i64, i64) {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    (
        i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        i64::from(d.subsec_nanos()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removes_only_what_changed_since() {
        let dir = std::env::temp_dir().join(format!("scratch-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("old")).unwrap();
        std::fs::write(dir.join("old/keep"), b"x").unwrap();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        // Everything here was just made: a cutoff in the future spares it all.
        assert_eq!(remove_changed_since(&dir, (now + 3600, 0)), 0);
        assert!(dir.join("old/keep").exists());
        std::fs::create_dir_all(dir.join("new/deeper")).unwrap();
        std::fs::write(dir.join("new/deeper/f"), b"x").unwrap();
        assert!(remove_changed_since(&dir, (now - 1, 0)) >= 4);
        assert!(!dir.join("new").exists());
        assert!(!dir.join("old/keep").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
