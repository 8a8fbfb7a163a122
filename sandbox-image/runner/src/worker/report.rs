//! The answer of an exec: the limits it hit, the notes that explain them, and the
//! `ExecResponse` (sent whole, or after its output was streamed).

use super::{ExecState, Stop, Worker, SHM};
use crate::capture::Capture;
use crate::quota::{Quota, Usage};
use crate::reaper::Exit;
use crate::scratch;
use sandbox_runner::{ExecRequest, ExecResponse, Limit, RuntimeStatus, Stream, WorkerMessage};
use std::path::Path;
use std::time::Instant;

/// What an exec measured around its program, for its answer.
pub(super) struct Ran {
    /// When the exec started, for its duration.
    pub(super) start: Instant,
    /// The same moment as a file time, to find what the exec made in a full scratch mount.
    pub(super) started_at: (i64, i64),
    /// The cgroup's OOM kill count before the exec, to tell whether it ran out of memory.
    pub(super) oom_before: Option<u64>,
    /// The workspace usage the exec started with (only with a quota).
    pub(super) quota_base: Option<Usage>,
    /// How the program ended; `None` when it never ran.
    pub(super) exit: Option<Exit>,
    /// Whether the exec ran in a new or a reused Python kernel.
    pub(super) runtime_status: RuntimeStatus,
}

impl Worker {
    /// Builds the answer of an exec whose program has ended (or never ran).
    pub(super) fn report(
        &self,
        req: &ExecRequest,
        mut ctl: ExecState,
        mut sink: Capture,
        ran: Ran,
    ) -> WorkerMessage {
        let Ran {
            start,
            started_at,
            oom_before,
            quota_base,
            exit,
            runtime_status,
        } = ran;
        let job = ctl.job;
        let quota = self.cfg.quota.as_ref();
        // Growth since the watcher's last look (or a file that hit RLIMIT_FSIZE, set to
        // the quota) counts too; the sweep has stopped every writer by now.
        let quota_end = quota.map(Quota::measure);
        let workspace_full = ctl.stop == Some(Stop::Disk)
            || exit == Some(Exit::Signal(libc::SIGXFSZ))
            || matches!((quota, quota_base, quota_end), (Some(q), Some(base), Some(end)) if q.exceeded(base, end));
        if let (Some(end), Some(_)) = (quota_end, &self.kernel) {
            // The kernel's threads may go on writing between execs.
            self.control.watch_idle(end);
        }
        // A scratch mount this exec filled: what it wrote there goes, or no later exec
        // could even write its program (only in a container: on a host these are shared).
        let mut scratch_full = Vec::new();
        if self.cfg.pid1 {
            for dir in [self.cfg.tmp.as_path(), Path::new(SHM)] {
                if scratch::nearly_full(dir) {
                    let removed = scratch::remove_changed_since(dir, started_at);
                    scratch_full.push(format!(
                        "{} full: {removed} entries this exec made there were removed",
                        dir.display()
                    ));
                }
            }
        }
        let mut limits = Vec::new();
        if ctl.stop == Some(Stop::Time) {
            limits.push(Limit::Time);
        }
        if ctl.disk_full || workspace_full || !scratch_full.is_empty() {
            limits.push(Limit::Disk);
        }
        // Only the cgroup's OOM kill counter says it: a SIGKILL we did not send may be the
        // code's own `kill -9`. Without a counter (gVisor shows no cgroup files) no claim is
        // made; there the host ends the whole sandbox and the broker asks the engine.
        let out_of_memory = matches!((oom_before, oom_kills()), (Some(a), Some(b)) if b > a);
        if out_of_memory {
            limits.push(Limit::Memory);
        }
        limits.extend(sink.limits());

        let mut notes = std::mem::take(&mut ctl.notes);
        for limit in &limits {
            notes.push(match limit {
                Limit::Time => format!("Error: {limit} ({} s)", seconds(req.timeout_ms)),
                Limit::Stdout | Limit::Stderr => {
                    format!("Error: {limit} (limit {} bytes)", sink.cap())
                }
                Limit::Disk => {
                    let mut places = Vec::new();
                    if workspace_full {
                        places.push(quota.map_or_else(
                            || self.cfg.workdir.display().to_string(),
                            Quota::describe,
                        ));
                    }
                    if ctl.disk_full && scratch_full.is_empty() {
                        places.push(self.cfg.tmp.display().to_string());
                    }
                    places.extend(scratch_full.iter().cloned());
                    format!("Error: {limit} ({})", places.join("; "))
                }
                _ => format!("Error: {limit}"),
            });
        }
        let mut note = String::new();
        if !notes.is_empty() {
            if sink.stderr_needs_newline() {
                note.push('\n');
            }
            note.push_str(&notes.join("\n"));
        }
        if req.stream {
            for which in [Stream::Stdout, Stream::Stderr] {
                let mut text = sink.flush(which);
                if which == Stream::Stderr {
                    text.push_str(&note);
                }
                self.send_chunk(job, which, text);
            }
        }
        let (stdout, mut stderr) = sink.into_text();
        if !req.stream {
            stderr.push_str(&note);
        }
        WorkerMessage::ExecDone(ExecResponse {
            exit_code: match exit {
                Some(Exit::Code(c)) => Some(c),
                _ => None,
            },
            signal: match exit {
                Some(Exit::Signal(s)) => Some(s),
                _ => None,
            },
            stdout,
            stderr,
            limits,
            runtime_status,
            duration_ms: start.elapsed().as_millis().try_into().unwrap_or(u64::MAX),
            cancelled: ctl.stop == Some(Stop::Cancel),
            compile_cached: ctl.compile_cached,
        })
    }
}

/// How many times the kernel was OOM-killed in this container's memory cgroup so far.
pub(super) fn oom_kills() -> Option<u64> {
    const SOURCES: [&str; 2] = [
        "/sys/fs/cgroup/memory/memory.oom_control", // cgroup v1
        "/sys/fs/cgroup/memory.events",             // cgroup v2
    ];
    SOURCES.iter().find_map(|path| {
        let text = std::fs::read_to_string(path).ok()?;
        text.lines().find_map(|line| {
            line.strip_prefix("oom_kill ")
                .and_then(|v| v.trim().parse().ok())
        })
    })
}

/// Milliseconds as seconds for a note: `30`, `0.5`, `1.25`.
fn seconds(ms: u64) -> String {
    if ms % 1000 == 0 {
        (ms / 1000).to_string()
    } else {
        let s = format!("{}.{:03}", ms / 1000, ms % 1000);
        s.trim_end_matches('0').to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_read_naturally() {
        assert_eq!(seconds(30_000), "30");
        assert_eq!(seconds(500), "0.5");
        assert_eq!(seconds(1250), "1.25");
        assert_eq!(seconds(1), "0.001");
    }
}
