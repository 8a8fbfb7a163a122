//! Saving the kernel's globals before the sandbox goes, and loading them into the next
//! sandbox's kernel (see `sandbox_runner::state` and `kernel_state.py`, "State"). Both are
//! requests to the idle kernel, answered by one event; the worker waits for it within the
//! request's time bound, throwing away what the kernel prints meanwhile (pickling may run
//! user code), and kills a kernel that does not answer in time.

use super::kernel::{Kernel, KernelEvent};
use super::Worker;
use crate::sys::{self, Read};
use sandbox_runner::{
    not_kept, InstallsPacked, InstallsUnpacked, PackInstallsRequest, RestoreStateRequest,
    SaveStateRequest, StateRestored, StateSaved, UnpackInstallsRequest, STATE_DIR, STATE_FILE,
};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How much longer than its own bound the kernel gets to answer a save (it writes the
/// file's index after the bound).
const SAVE_GRACE: Duration = Duration::from_secs(2);

/// The runner's state directory under `tmp`, mode 0700; made when `create`.
pub(crate) fn state_dir(tmp: &Path, create: bool) -> io::Result<PathBuf> {
    let dir = tmp.join(STATE_DIR);
    if create {
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(e),
            _ => {}
        }
    }
    // The code runs as the runner's uid and may have put anything there: only a real
    // directory of ours is used, and kept private.
    let meta = std::fs::symlink_metadata(&dir)?;
    // SAFETY: geteuid has no preconditions.
    if !meta.is_dir() || meta.uid() != unsafe { libc::geteuid() } {
        return Err(io::Error::other("the state directory is not the runner's"));
    }
    if meta.mode() & 0o777 != 0o700 {
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(dir)
}

/// Removes the state file, if there is one.
fn remove_state_file(dir: &Path) {
    let _ = std::fs::remove_file(dir.join(STATE_FILE));
}

impl Worker {
    /// Has the kernel save its globals (nothing when no kernel holds state).
    pub(super) fn save_state(&mut self, req: &SaveStateRequest) -> StateSaved {
        let start = Instant::now();
        let mut answer = self.try_save_state(req).unwrap_or_else(|error| StateSaved {
            error: Some(error),
            ..StateSaved::default()
        });
        answer.duration_ms = start.elapsed().as_millis() as u64;
        answer
    }

    fn try_save_state(&mut self, req: &SaveStateRequest) -> Result<StateSaved, String> {
        self.drop_dead_kernel();
        let dir = state_dir(&self.cfg.tmp, true).map_err(|e| format!("no state directory: {e}"))?;
        remove_state_file(&dir);
        if !self.kernel.as_ref().is_some_and(|k| k.ran_code) {
            return Ok(StateSaved::default()); // no kernel, or one that ran no code
        }
        let request = serde_json::json!({
            "type": "save_state",
            "path": dir.join(STATE_FILE),
            "max_bytes": req.max_bytes,
            "timeout_ms": req.timeout_ms,
        });
        let wait = Duration::from_millis(req.timeout_ms) + SAVE_GRACE;
        let ev = self.kernel_state_call(request, wait)?;
        if let Some(error) = ev.error {
            remove_state_file(&dir);
            return Err(error);
        }
        let bytes = ev.bytes.unwrap_or(0);
        // The kernel keeps to the bound; a file over it (the code wrote there) is refused.
        let on_disk = std::fs::symlink_metadata(dir.join(STATE_FILE)).map_or(0, |m| m.len());
        if bytes > 0 && (on_disk != bytes || bytes > req.max_bytes) {
            remove_state_file(&dir);
            return Err("the state file is not what the kernel wrote".into());
        }
        Ok(StateSaved {
            bytes,
            saved: ev.saved.unwrap_or(0),
            modules: ev.modules.unwrap_or(0),
            skipped: not_kept(ev.skipped.as_deref().unwrap_or_default()),
            error: None,
            duration_ms: 0,
        })
    }

    /// Packs the workspace's installs into the state directory's archive.
    pub(super) fn pack_installs(&mut self, req: &PackInstallsRequest) -> InstallsPacked {
        match state_dir(&self.cfg.tmp, true) {
            Ok(dir) => crate::installs_archive::pack(&self.cfg.workdir, &dir, req.max_bytes),
            Err(e) => InstallsPacked {
                error: Some(format!("no state directory: {e}")),
                ..InstallsPacked::default()
            },
        }
    }

    /// Unpacks the installs archive the broker wrote into the workspace. Before any code
    /// ran: a kernel started before the installs came would not see the user site.
    pub(super) fn unpack_installs(&mut self, req: &UnpackInstallsRequest) -> InstallsUnpacked {
        match state_dir(&self.cfg.tmp, false) {
            Ok(dir) => crate::installs_archive::unpack(&self.cfg.workdir, &dir, req.max_bytes),
            Err(e) => InstallsUnpacked {
                error: Some(format!("no archive of the installs: {e}")),
                ..InstallsUnpacked::default()
            },
        }
    }

    /// Has the kernel (started if none runs) load the state file the broker wrote.
    pub(super) fn restore_state(&mut self, req: &RestoreStateRequest) -> StateRestored {
        let start = Instant::now();
        let mut answer = self
            .try_restore_state(req)
            .unwrap_or_else(|error| StateRestored {
                error: Some(error),
                ..StateRestored::default()
            });
        if let Ok(dir) = state_dir(&self.cfg.tmp, false) {
            remove_state_file(&dir); // /tmp is memory: the bytes are in the kernel now
        }
        answer.duration_ms = start.elapsed().as_millis() as u64;
        answer
    }

    fn try_restore_state(&mut self, req: &RestoreStateRequest) -> Result<StateRestored, String> {
        let dir = state_dir(&self.cfg.tmp, false).map_err(|e| format!("no saved state: {e}"))?;
        let meta = std::fs::symlink_metadata(dir.join(STATE_FILE))
            .map_err(|e| format!("no saved state: {e}"))?;
        if !meta.is_file() || meta.len() > req.max_bytes {
            return Err(format!(
                "the saved state has {} bytes, more than the {} allowed",
                meta.len(),
                req.max_bytes
            ));
        }
        self.drop_dead_kernel();
        if self.kernel.is_none() {
            self.start_kernel()
                .map_err(|e| format!("cannot start the Python kernel: {e}"))?;
        }
        if self.kernel.as_ref().is_some_and(|k| k.ran_code) {
            return Err("the kernel has run code already".into());
        }
        let request = serde_json::json!({
            "type": "restore_state",
            "path": dir.join(STATE_FILE),
            "max_bytes": req.max_bytes,
        });
        let ev = self.kernel_state_call(request, Duration::from_millis(req.timeout_ms))?;
        let restored = ev.restored.unwrap_or(0);
        if restored > 0 {
            if let Some(k) = self.kernel.as_mut() {
                k.ran_code = true; // the next exec reports `reused`
            }
        }
        if let Some(error) = ev.error {
            return Err(error);
        }
        Ok(StateRestored {
            restored,
            failed: not_kept(ev.failed.as_deref().unwrap_or_default()),
            error: None,
            duration_ms: 0,
        })
    }

    /// Sends one state request to the idle kernel and waits up to `wait` for its answer;
    /// a kernel that dies, breaks or does not answer in time is discarded.
    fn kernel_state_call(
        &mut self,
        mut request: serde_json::Value,
        wait: Duration,
    ) -> Result<KernelEvent, String> {
        let Some(mut k) = self.kernel.take() else {
            return Err("no Python kernel".into());
        };
        k.discard_pending(&mut self.buf);
        k.last_id += 1;
        let id = k.last_id;
        request["id"] = id.into();
        let mut line = request.to_string().into_bytes();
        line.push(b'\n');
        let result = self.await_state_reply(&mut k, &line, id, wait);
        if result.is_ok() && k.broken_at.is_none() && k.exit.is_none() {
            self.kernel = Some(k);
        } else {
            self.discard_kernel(k);
        }
        result
    }

    fn await_state_reply(
        &mut self,
        k: &mut Kernel,
        line: &[u8],
        id: u64,
        wait: Duration,
    ) -> Result<KernelEvent, String> {
        // A short line into the idle kernel's empty pipe: written whole, or not at all.
        let written = k.requests.as_ref().map(|fd| sys::write(fd, line));
        if !matches!(written, Some(Ok(n)) if n == line.len()) {
            return Err("cannot reach the Python kernel".into());
        }
        let deadline = Instant::now() + wait;
        loop {
            if let Some(ev) = k.state_reply.take() {
                return Ok(ev);
            }
            if k.exit.is_none() {
                k.exit = self.tracker.take_exit(k.pid);
            }
            if k.exit.is_some() || k.broken_at.is_some() || k.events.is_none() {
                return Err("the Python kernel ended".into());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "the Python kernel did not answer within {} ms",
                    wait.as_millis()
                ));
            }
            let mut fds = vec![sys::pollin(&self.wake_r)];
            for fd in [&k.stdout, &k.stderr, &k.events].into_iter().flatten() {
                fds.push(sys::pollin(fd));
            }
            if sys::poll(&mut fds, Some(left)).is_err() {
                std::thread::sleep(Duration::from_millis(1));
            }
            sys::drain(&self.wake_r);
            // What pickling prints belongs to no exec.
            let mut closed = false;
            for slot in [&mut k.stdout, &mut k.stderr] {
                for _ in 0..64 {
                    let Some(fd) = slot.as_ref() else { break };
                    match sys::read(fd, &mut self.buf) {
                        Ok(Read::Data(_)) => {}
                        Ok(Read::WouldBlock) => break,
                        Ok(Read::Eof) | Err(_) => {
                            *slot = None;
                            closed = true;
                        }
                    }
                }
            }
            if closed {
                k.mark_broken();
            }
            k.read_events(&mut self.buf, Some(id));
        }
    }
}
