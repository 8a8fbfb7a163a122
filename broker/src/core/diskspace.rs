//! Free space on the data directory's volume: below CODEBROKER_MIN_FREE_DISK new sessions
//! and uploads are refused with 503, so that a filling disk stops growth before
//! workspaces, blobs and the index can no longer be written. Sessions that exist keep
//! running.

use crate::core::error::{Error, Result};
use std::path::Path;

/// Bytes available to the broker (not root's reserve) on the volume holding `dir`.
pub(crate) fn free_bytes(dir: &Path) -> std::io::Result<u64> {
    let stat = rustix::fs::statvfs(dir)?;
    Ok(stat.f_bavail.saturating_mul(stat.f_frsize))
}

/// Refuses a new session when the data volume has less than `min_free` bytes free.
pub(crate) fn check_room_for_new_session(data_dir: &Path, min_free: u64) -> Result<()> {
    match low_on_space(data_dir, min_free) {
        Some(free) => {
            tracing::warn!(
                free,
                min_free,
                "data volume low on space: refusing new sessions"
            );
            Err(Error::Unavailable(format!(
                "the data volume is low on free space ({} MiB free, {} MiB required): \
                 new sessions are refused until space is freed; existing sessions still run",
                free >> 20,
                min_free >> 20
            )))
        }
        None => Ok(()),
    }
}

/// Refuses to stage (more of) an upload when the data volume has less than `min_free`
/// bytes free: uploads into existing sessions would otherwise fill it.
pub(crate) fn check_room_to_stage(data_dir: &Path, min_free: u64) -> Result<()> {
    match low_on_space(data_dir, min_free) {
        Some(free) => {
            tracing::warn!(free, min_free, "data volume low on space: refusing uploads");
            Err(Error::Unavailable(format!(
                "the data volume is low on free space ({} MiB free, {} MiB required): \
                 uploads are refused until space is freed",
                free >> 20,
                min_free >> 20
            )))
        }
        None => Ok(()),
    }
}

/// The bytes free when they are fewer than `min_free` (never when `min_free` is 0).
fn low_on_space(data_dir: &Path, min_free: u64) -> Option<u64> {
    if min_free == 0 {
        return None;
    }
    match free_bytes(data_dir) {
        Ok(free) if free < min_free => Some(free),
        Ok(_) => None,
        // Not knowing is no reason to refuse service; the log says why.
        Err(err) => {
            tracing::warn!(error = %err, "cannot read the data volume's free space");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_below_the_threshold_only() {
        let dir = std::env::temp_dir();
        let free = free_bytes(&dir).expect("statvfs");
        assert!(free > 0);
        assert!(check_room_for_new_session(&dir, 0).is_ok());
        assert!(check_room_for_new_session(&dir, 1).is_ok());
        let err = check_room_for_new_session(&dir, u64::MAX).expect_err("refused");
        assert!(matches!(err, Error::Unavailable(_)));
        assert!(err.to_string().contains("data volume is low"), "{err}");
        assert!(check_room_to_stage(&dir, 0).is_ok());
        assert!(check_room_to_stage(&dir, 1).is_ok());
        let err = check_room_to_stage(&dir, u64::MAX).expect_err("refused");
        assert!(err.to_string().contains("uploads are refused"), "{err}");
    }
}
