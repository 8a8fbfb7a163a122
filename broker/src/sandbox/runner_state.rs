//! The Python state of a sandbox's kernel, through its runner (see `sandbox_runner::state`):
//! saved to the runner's state file and pulled in chunks before the sandbox is removed;
//! pushed in chunks into the next sandbox and loaded. Backend-neutral: it needs only the
//! runner channel, whichever way the backend moves workspace files.
//!
//! The bytes are pickles, so the broker treats them as opaque: it never parses them, bounds
//! them by size and re-hashes them as they come (the chunk loops are the workspace files'
//! own, `runner_files`). Only the session's own next kernel ever loads them.
//!
//! Every function blocks (each chunk waits on the runtime) and gives up at `deadline`: call
//! them off the async threads, holding the session's turn.

use super::runner_files::{read_chunks, request_within, write_chunks};
use super::Sandbox;
use sandbox_runner::{
    ReadStateRequest, Request, RestoreStateRequest, SaveStateRequest, StateRestored, StateSaved,
    WriteStateRequest,
};
use std::io::{self, Write};
use std::path::Path;
use std::time::{Duration, Instant};

/// Sends `req` and waits for its answer until `deadline`.
fn request_until<R: Request>(
    sandbox: &Sandbox,
    req: R,
    deadline: Instant,
) -> io::Result<R::Response> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::Error::new(io::ErrorKind::TimedOut, "out of time"));
    }
    request_within(sandbox, req, left)
}

/// Has the kernel save its globals within `max_bytes`, pickling for `pickle_for` at most.
pub(crate) fn save(
    sandbox: &Sandbox,
    max_bytes: u64,
    pickle_for: Duration,
    deadline: Instant,
) -> io::Result<StateSaved> {
    let req = SaveStateRequest {
        max_bytes,
        timeout_ms: pickle_for.as_millis().max(1) as u64,
    };
    request_until(sandbox, req, deadline)
}

/// Copies the saved state file into `out`: its hash and size, or `None` when the runner
/// sends more than `max_bytes`.
pub(crate) fn pull(
    sandbox: &Sandbox,
    out: &mut impl Write,
    max_bytes: u64,
    deadline: Instant,
) -> io::Result<Option<(String, u64)>> {
    let fetch = |offset, len| request_until(sandbox, ReadStateRequest { offset, len }, deadline);
    read_chunks(fetch, max_bytes, out)
}

/// Writes the file `src` as the sandbox's state file.
pub(crate) fn push(sandbox: &Sandbox, src: &Path, deadline: Instant) -> io::Result<()> {
    let put = |offset, data, _last| {
        let req = WriteStateRequest {
            offset,
            data,
            create: offset == 0,
        };
        request_until(sandbox, req, deadline)
    };
    write_chunks(src, put).map(|_| ())
}

/// Has the kernel load the state file pushed before it runs code.
pub(crate) fn restore(
    sandbox: &Sandbox,
    max_bytes: u64,
    deadline: Instant,
) -> io::Result<StateRestored> {
    let left = deadline.saturating_duration_since(Instant::now());
    let req = RestoreStateRequest {
        max_bytes,
        timeout_ms: left.as_millis().max(1) as u64,
    };
    // The runner gives up at the same time; a moment more for its answer to come.
    request_until(sandbox, req, deadline + Duration::from_secs(2))
}
