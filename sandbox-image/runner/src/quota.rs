//! The workspace quota: bytes and files under the workspace, watched during each exec.
//!
//! The workspace is a bind mount of a host directory (ext4 or overlay, without project
//! quotas, created by a broker that may not be root), so the kernel cannot enforce a
//! quota on it. The runner does instead: while an exec runs, a thread started at
//! start-up measures the workspace every [`MIN_INTERVAL`] or more (allocated blocks,
//! `st_blocks * 512`, so sparse files count for what they really take, and entries) with a
//! bounded walk, and stops the exec (its process group and leftovers, as a time limit
//! does) once it has grown past the quota. The worker measures once more when the program
//! ends, to report growth that happened between two checks.
//!
//! Between execs only the Python kernel can still run (the sweep killed the rest), and its
//! threads may go on writing: while it is alive the thread keeps measuring, as often as
//! during an exec while the workspace grows, else every [`IDLE_INTERVAL`] or twenty times
//! the last walk's duration, and the worker kills the kernel once the workspace grew past
//! the quota. An exec over the quota also kills the kernel at once rather than
//! interrupting it, since an interrupt reaches only its main thread.
//!
//! Bounds: what one exec can write past the quota is what it writes during one check
//! interval plus one walk (the interval is at least [`MIN_INTERVAL`], and four times the
//! last walk's duration so the watcher takes at most a fifth of a CPU, but never more than
//! [`MAX_INTERVAL`]: a walk stalled on a loaded host must not stretch the next pause to
//! seconds, as one did to 300 MiB past a 64 MiB quota). The duration is wall time, not the
//! thread's CPU time: under gVisor a walk's stats are served by the Sentry, which the
//! thread's CPU clock does not see, and pauses from it left the watcher walking 40 times
//! a second beside the code. RLIMIT_FSIZE
//! (the container's `fsize` ulimit, which the broker sets to at most the quota) keeps any
//! single file under the quota. A workspace already over its quota is not cleaned (files
//! are never deleted): the next exec may run, may delete files, and is stopped as soon as
//! it makes the workspace grow.

use crate::worker::{Control, Watch};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Shortest pause between two measurements during an exec.
pub const MIN_INTERVAL: Duration = Duration::from_millis(25);

/// Longest pause between two measurements during an exec (and between execs while the
/// workspace grows), whatever the last walk cost.
pub const MAX_INTERVAL: Duration = Duration::from_millis(250);

/// Longest pause between two measurements between execs while the workspace does not grow.
pub const IDLE_MAX_INTERVAL: Duration = Duration::from_secs(2);

/// Shortest pause between two measurements between execs, while a Python kernel (whose
/// threads may go on writing) is alive.
pub const IDLE_INTERVAL: Duration = Duration::from_millis(100);

/// The quota of one workspace, from the environment the broker gives the container.
#[derive(Debug, Clone)]
pub struct Quota {
    /// The workspace directory.
    pub root: PathBuf,
    /// Most bytes (allocated blocks) it may hold; `None`: no limit.
    pub max_bytes: Option<u64>,
    /// Most entries (files, directories, links) it may hold; `None`: no limit.
    pub max_files: Option<u64>,
}

/// What a workspace holds, as far as a bounded walk saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Allocated bytes (`st_blocks * 512`) of every entry seen.
    pub bytes: u64,
    /// Entries seen.
    pub files: u64,
}

impl Quota {
    /// Reads `CODEBROKER_WORKSPACE_QUOTA` (bytes) and `CODEBROKER_WORKSPACE_MAX_FILES`;
    /// unset, empty or 0 means no limit. `None` when neither is set.
    pub fn from_env(root: &Path) -> Option<Quota> {
        let limit = |name: &str| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .filter(|&v| v > 0)
        };
        let quota = Quota {
            root: root.to_path_buf(),
            max_bytes: limit("CODEBROKER_WORKSPACE_QUOTA"),
            max_files: limit("CODEBROKER_WORKSPACE_MAX_FILES"),
        };
        (quota.max_bytes.is_some() || quota.max_files.is_some()).then_some(quota)
    }

    /// Most entries one walk visits: twice the file cap, so that growth past the cap is
    /// still seen, while a workspace of a million files costs a bounded walk.
    fn walk_budget(&self) -> u64 {
        self.max_files
            .map_or(1_000_000, |n| n.saturating_mul(2).saturating_add(16))
    }

    /// Measures the workspace (bounded; see [`Quota::walk_budget`]).
    pub fn measure(&self) -> Usage {
        let mut usage = Usage::default();
        let mut budget = self.walk_budget();
        walk(&self.root, &mut usage, &mut budget, 0);
        usage
    }

    /// Whether `now` is over the quota and grew past what the exec started with (`base`):
    /// only growth is stopped, so a session over its quota can still delete files.
    pub fn exceeded(&self, base: Usage, now: Usage) -> bool {
        let bytes = self
            .max_bytes
            .is_some_and(|max| now.bytes >= max && now.bytes > base.bytes);
        let files = self
            .max_files
            .is_some_and(|max| now.files > max && now.files > base.files);
        bytes || files
    }

    /// The quota for a note: `/mnt/data: 64 MiB, 2000 files`.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(b) = self.max_bytes {
            parts.push(format!("{} MiB", b / (1024 * 1024)));
        }
        if let Some(f) = self.max_files {
            parts.push(format!("{f} files"));
        }
        format!("{}: {}", self.root.display(), parts.join(", "))
    }
}

/// Deepest directory level walked; deeper trees are counted only down to it.
const MAX_DEPTH: usize = 64;

fn walk(dir: &Path, usage: &mut Usage, budget: &mut u64, depth: usize) {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries {
        if *budget == 0 {
            return;
        }
        *budget -= 1;
        let Ok(entry) = entry else { continue };
        // lstat: symlinks are not followed, so nothing outside the workspace is counted.
        let Ok(meta) = entry.metadata() else { continue };
        usage.files += 1;
        usage.bytes = usage
            .bytes
            .saturating_add(meta.blocks().saturating_mul(512));
        if meta.is_dir() && depth < MAX_DEPTH {
            walk(&entry.path(), usage, budget, depth + 1);
        }
    }
}

/// The pause before the next measurement, given how long the last walk took.
fn interval(last_walk: Duration) -> Duration {
    (last_walk * 4).clamp(MIN_INTERVAL, MAX_INTERVAL)
}

/// The pause between execs while the workspace does not grow, given how long the last
/// walk took: idle kernels are the common case, so at most a twentieth of a CPU.
fn idle_interval(last_walk: Duration) -> Duration {
    (last_walk * 20).clamp(IDLE_INTERVAL, IDLE_MAX_INTERVAL)
}

/// Measures and times one walk.
fn timed_measure(quota: &Quota) -> (Usage, Duration) {
    let started = Instant::now();
    let usage = quota.measure();
    (usage, started.elapsed())
}

/// Measures the workspace while the kernel idles, less often than during an exec, until
/// the next exec starts; kills the kernel (through the worker) if it grew past the quota.
fn watch_idle(quota: &Quota, control: &Control, base: Usage) {
    let mut pause = MIN_INTERVAL;
    loop {
        std::thread::sleep(pause);
        if !control.idle_watching() {
            return;
        }
        let (now, took) = timed_measure(quota);
        if quota.exceeded(base, now) {
            control.idle_over_quota();
            return;
        }
        // As often as during an exec while the workspace grows (threads still writing).
        pause = if now.bytes > base.bytes || now.files > base.files {
            interval(took)
        } else {
            idle_interval(took)
        };
    }
}

/// The quota watcher thread's body: measures the workspace while each exec runs, and
/// stops the exec once it grew past the quota (see the module comment).
pub fn watch_quota(quota: Quota, control: Arc<Control>) {
    let mut last = None;
    loop {
        let (job, base) = match control.next_watch(last) {
            Watch::Exec(job, base) => (job, base),
            Watch::Idle(base) => {
                watch_idle(&quota, &control, base);
                continue;
            }
        };
        last = Some(job);
        let mut pause = MIN_INTERVAL;
        loop {
            std::thread::sleep(pause);
            if !control.watching(job) {
                break;
            }
            let (now, took) = timed_measure(&quota);
            if quota.exceeded(base, now) {
                control.over_quota(job);
                break;
            }
            pause = interval(took);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quota(dir: &Path, bytes: Option<u64>, files: Option<u64>) -> Quota {
        Quota {
            root: dir.to_path_buf(),
            max_bytes: bytes,
            max_files: files,
        }
    }

    #[test]
    fn counts_allocated_blocks_and_entries() {
        let dir = std::env::temp_dir().join(format!("quota-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("sub/a"), vec![1u8; 64 * 1024]).unwrap();
        // A sparse file: a huge length, nothing allocated.
        let sparse = std::fs::File::create(dir.join("sparse")).unwrap();
        sparse.set_len(1 << 40).unwrap();
        let q = quota(&dir, Some(1 << 20), Some(2));
        let u = q.measure();
        assert_eq!(u.files, 3, "{u:?}");
        assert!(u.bytes >= 64 * 1024 && u.bytes < 1 << 20, "{u:?}");
        // Over the file cap, and grown: exceeded; not grown: not.
        assert!(q.exceeded(Usage::default(), u));
        assert!(!q.exceeded(u, u));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_pause_is_bounded_whatever_the_last_walk_cost() {
        // A cheap walk: the shortest pauses.
        assert_eq!(interval(Duration::from_micros(300)), MIN_INTERVAL);
        assert_eq!(idle_interval(Duration::from_micros(300)), IDLE_INTERVAL);
        // A costly one: four (twenty) times its cost, so the watcher takes at most a fifth
        // (a twentieth) of a CPU.
        assert_eq!(
            interval(Duration::from_millis(20)),
            Duration::from_millis(80)
        );
        assert_eq!(
            idle_interval(Duration::from_millis(20)),
            Duration::from_millis(400)
        );
        // Never longer than the cap, or a writer goes on unwatched.
        assert_eq!(interval(Duration::from_secs(3)), MAX_INTERVAL);
        assert_eq!(idle_interval(Duration::from_secs(3)), IDLE_MAX_INTERVAL);
    }

    #[test]
    fn only_growth_past_the_quota_counts() {
        let q = quota(Path::new("/nonexistent"), Some(100), None);
        let base = Usage {
            bytes: 50,
            files: 1,
        };
        assert!(!q.exceeded(
            base,
            Usage {
                bytes: 99,
                files: 1
            }
        ));
        assert!(q.exceeded(
            base,
            Usage {
                bytes: 100,
                files: 1
            }
        ));
        let over = Usage {
            bytes: 200,
            files: 1,
        };
        assert!(!q.exceeded(
            over,
            Usage {
                bytes: 150,
                files: 1
            }
        ));
        assert!(q.exceeded(
            over,
            Usage {
                bytes: 201,
                files: 1
            }
        ));
    }
}
