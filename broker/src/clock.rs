//! Wall-clock time as the sessions, the limits and the file index record it.

use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the epoch.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
