//! The Python state of a sandbox's kernel, through its runner (see `sandbox_runner::state`):
//! saved to the runner's state file and pulled in chunks before the sandbox is removed;
//! pushed in chunks into the next sandbox and loaded. The archive of a session's installs
//! (`sandbox_runner::installs`) moves the same way. Backend-neutral: it needs only the
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
    InstallsPacked, InstallsUnpacked, PackInstallsRequest, ReadStateRequest, Request,
    RestoreStateRequest, SaveStateRequest, StateFile, StateRestored, StateSaved,
    UnpackInstallsRequest, WriteStateRequest,
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

/// Copies `file` of the runner's state directory into `out`: its hash and size, or `None`
/// when the runner sends more than `max_bytes`.
pub(crate) fn pull(
    sandbox: &Sandbox,
    file: StateFile,
    out: &mut impl Write,
    max_bytes: u64,
    deadline: Instant,
) -> io::Result<Option<(String, u64)>> {
    let fetch = |offset, len| {
        let req = ReadStateRequest { file, offset, len };
        request_until(sandbox, req, deadline)
    };
    read_chunks(fetch, max_bytes, out)
}

/// Writes the file `src` as `file` of the runner's state directory.
pub(crate) fn push(
    sandbox: &Sandbox,
    file: StateFile,
    src: &Path,
    deadline: Instant,
) -> io::Result<()> {
    let put = |offset, data, _last| {
        let req = WriteStateRequest {
            file,
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

/// Has the runner pack the workspace's installs into its archive, within `max_bytes`.
pub(crate) fn pack_installs(
    sandbox: &Sandbox,
    max_bytes: u64,
    deadline: Instant,
) -> io::Result<InstallsPacked> {
    request_until(sandbox, PackInstallsRequest { max_bytes }, deadline)
}

/// Has the runner unpack the archive pushed before into the workspace.
pub(crate) fn unpack_installs(
    sandbox: &Sandbox,
    max_bytes: u64,
    deadline: Instant,
) -> io::Result<InstallsUnpacked> {
    request_until(sandbox, UnpackInstallsRequest { max_bytes }, deadline)
}
