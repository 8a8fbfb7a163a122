//! `CODEBROKER_MAX_CONTAINERS=auto`: sandboxes admitted by what the Docker host holds now,
//! not by what each one may take at most. Each sandbox has its own memory limit, so a
//! memory bomb stays in its own cgroup; an idle sandbox uses 8 to 73 MiB of its 1 GiB. So
//! `auto` keeps a hard ceiling (three quarters of the host over [`IDLE_SANDBOX_BYTES`])
//! and, below it, admits a new sandbox while the host's available memory, less what the
//! starts under way will take, stays above a reserve (a quarter of the host), and while
//! the host is not under memory pressure. A start the memory refuses first takes the
//! place of the least recently used idle sandbox, as at the ceiling; when none is idle it
//! is a 429.
//!
//! The figures are the host kernel's (`/proc/meminfo`, `/proc/pressure/memory`), read at
//! each start: only right when the broker runs on the Docker host (as with compose, where
//! a container's /proc shows the host's memory). [`HostMemory::for_host`] checks that the
//! memory the kernel reports is the engine's; where it is not (a remote engine), `auto`
//! falls back to the ceiling by the per-sandbox limit alone.

use std::path::{Path, PathBuf};

/// What an idle sandbox is taken to use for the hard ceiling: an idle preloaded
/// container holds about 66 MiB (docs/PERFORMANCE.md).
pub(crate) const IDLE_SANDBOX_BYTES: u64 = 64 << 20;

/// What a sandbox being started is expected to take soon (a first `import pandas` and a
/// plot), counted for each start under way: their memory is not in the available figure
/// yet, and a burst of starts must not all pass on the same reading.
const STARTING_SANDBOX_BYTES: u64 = 256 << 20;

/// Memory pressure (PSI `some avg10`: the share of the last 10 s in which some task
/// waited for memory, in percent) at or above which no new sandbox is admitted: the host
/// is reclaiming page cache or swapping, and one more sandbox would make every exec
/// slower.
const MAX_PRESSURE_PERCENT: f64 = 10.0;

/// How far the kernel's MemTotal may be from the engine's for the two to be taken as the
/// same host (the engine rounds, the kernel reserves some).
const SAME_HOST_TOLERANCE: f64 = 0.05;

/// The host's memory as admission reads it.
#[derive(Debug)]
pub(crate) struct HostMemory {
    /// The host's proc directory (`CODEBROKER_HOST_PROC`): `meminfo` and
    /// `pressure/memory` are read from it at each admission.
    proc_dir: PathBuf,
    /// Memory kept for the host, the engine and the broker: a start is not admitted when
    /// less than this would remain available after it.
    reserve: u64,
}

impl HostMemory {
    /// The gate for a Docker host of `engine_memory` bytes, when `proc_dir` is that host's
    /// (its MemTotal within 5 % of the engine's); `None` otherwise.
    pub(crate) fn for_host(proc_dir: &Path, engine_memory: Option<u64>) -> Option<HostMemory> {
        let engine = engine_memory?;
        let total = read_meminfo(proc_dir, "MemTotal")?;
        let off = (total as f64 - engine as f64).abs() / engine.max(1) as f64;
        if off > SAME_HOST_TOLERANCE {
            tracing::info!(
                engine_mib = engine >> 20,
                here_mib = total >> 20,
                "the Docker host's memory is not this host's: sandboxes are admitted by the \
                 per-sandbox limit alone"
            );
            return None;
        }
        Some(HostMemory {
            proc_dir: proc_dir.to_path_buf(),
            reserve: engine / 4,
        })
    }

    /// `Ok` when one more sandbox fits with `starting` others being started; else why not,
    /// in words for the 429.
    pub(crate) fn room(&self, starting: usize) -> Result<(), String> {
        if let Some(pressure) = read_pressure(&self.proc_dir) {
            if pressure >= MAX_PRESSURE_PERCENT {
                return Err(format!(
                    "the host is short of memory (tasks waited for memory {pressure:.0}% of \
                     the last 10 s)"
                ));
            }
        }
        // Unreadable: admitted, as the ceiling still holds.
        let Some(available) = read_meminfo(&self.proc_dir, "MemAvailable") else {
            return Ok(());
        };
        let coming = STARTING_SANDBOX_BYTES.saturating_mul(starting as u64 + 1);
        if available.saturating_sub(coming) < self.reserve {
            return Err(format!(
                "the host is short of memory ({} MiB available, {} MiB kept for the host)",
                available >> 20,
                self.reserve >> 20
            ));
        }
        Ok(())
    }
}

/// How many sandboxes of `each` bytes `auto` admits, one after another, on a host of
/// `total` bytes with `available` bytes available now: the ceiling, or fewer when the
/// memory runs short first (the last one admitted still left a start's worth above the
/// reserve). For the bench, which shows what this host holds.
pub fn sandboxes_that_fit(total: u64, available: u64, each: u64) -> u64 {
    let ceiling = crate::config::auto_ceiling(total) as u64;
    let by_memory = match available.checked_sub(total / 4 + STARTING_SANDBOX_BYTES) {
        Some(left) => left / each.max(1) + 1,
        None => 0,
    };
    by_memory.min(ceiling)
}

/// A `meminfo` field, in bytes.
pub fn read_meminfo(proc_dir: &Path, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(proc_dir.join("meminfo")).ok()?;
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(field)?.strip_prefix(':')?;
        let kib: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
        Some(kib.saturating_mul(1024))
    })
}

/// PSI's `some avg10` for memory, in percent; `None` where the kernel has no PSI.
fn read_pressure(proc_dir: &Path) -> Option<f64> {
    let text = std::fs::read_to_string(proc_dir.join("pressure").join("memory")).ok()?;
    let some = text.lines().find(|l| l.starts_with("some "))?;
    some.split_whitespace()
        .find_map(|f| f.strip_prefix("avg10="))?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A proc directory with `meminfo` (total and available, in MiB) and, when given, a
    /// memory pressure of `pressure` percent.
    fn fake_proc(total_mib: u64, available_mib: u64, pressure: Option<f64>) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(
            dir.path().join("meminfo"),
            format!(
                "MemTotal:       {} kB\nMemFree:         1000 kB\nMemAvailable:   {} kB\n",
                total_mib * 1024,
                available_mib * 1024
            ),
        )
        .expect("meminfo");
        if let Some(p) = pressure {
            std::fs::create_dir(dir.path().join("pressure")).expect("pressure dir");
            std::fs::write(
                dir.path().join("pressure").join("memory"),
                format!(
                    "some avg10={p:.2} avg60=0.00 avg300=0.00 total=1\n\
                     full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
                ),
            )
            .expect("pressure");
        }
        dir
    }

    const GIB: u64 = 1 << 30;

    #[test]
    fn a_host_with_memory_to_spare_admits_and_keeps_a_quarter() {
        let proc = fake_proc(24 * 1024, 20 * 1024, Some(0.0));
        let gate = HostMemory::for_host(proc.path(), Some(24 * GIB)).expect("same host");
        assert_eq!(gate.reserve, 6 * GIB);
        assert!(gate.room(0).is_ok());
        // 20 GiB available, 6 kept: about 56 starts of 256 MiB may be under way at once.
        assert!(gate.room(50).is_ok());
        let refused = gate.room(60).expect_err("too many starts at once");
        assert!(refused.contains("6144 MiB kept"), "{refused}");
    }

    #[test]
    fn little_memory_available_refuses_with_the_figures() {
        let proc = fake_proc(24 * 1024, 6 * 1024, None);
        let gate = HostMemory::for_host(proc.path(), Some(24 * GIB)).expect("same host");
        let refused = gate.room(0).expect_err("short");
        assert!(refused.contains("6144 MiB available"), "{refused}");
    }

    #[test]
    fn memory_pressure_refuses_even_with_memory_available() {
        let proc = fake_proc(24 * 1024, 20 * 1024, Some(35.5));
        let gate = HostMemory::for_host(proc.path(), Some(24 * GIB)).expect("same host");
        let refused = gate.room(0).expect_err("under pressure");
        assert!(refused.contains("36%"), "{refused}");
        let calm = fake_proc(24 * 1024, 20 * 1024, Some(9.9));
        let gate = HostMemory::for_host(calm.path(), Some(24 * GIB)).expect("same host");
        assert!(gate.room(0).is_ok());
    }

    #[test]
    fn another_hosts_memory_is_not_read() {
        let proc = fake_proc(8 * 1024, 7 * 1024, None);
        assert!(HostMemory::for_host(proc.path(), Some(64 * GIB)).is_none());
        assert!(HostMemory::for_host(proc.path(), None).is_none());
        let missing = tempfile::tempdir().expect("tempdir");
        assert!(HostMemory::for_host(missing.path(), Some(8 * GIB)).is_none());
    }

    #[test]
    fn the_sandboxes_that_fit_are_those_room_admits_one_by_one() {
        let total = 24 * GIB;
        // Idle ones: the ceiling (3/4 of the host over 64 MiB) comes first.
        assert_eq!(sandboxes_that_fit(total, 20 * GIB, 8 << 20), 288);
        // Busy ones: the memory; check against room() with the host filled that far.
        let each = 100 << 20;
        let n = sandboxes_that_fit(total, 20 * GIB, each);
        let room_after = |k: u64| {
            let proc = fake_proc(24 * 1024, (20 * GIB - k * each) >> 20, None);
            HostMemory::for_host(proc.path(), Some(total))
                .expect("same host")
                .room(0)
        };
        assert!(room_after(n - 1).is_ok(), "the {n}th is admitted");
        assert!(room_after(n).is_err(), "the {}th is not", n + 1);
        assert_eq!(sandboxes_that_fit(total, 5 * GIB, each), 0);
        assert_eq!(
            sandboxes_that_fit(total, 20 * GIB, 0),
            288,
            "no figure: the ceiling"
        );
    }

    #[test]
    fn unreadable_figures_admit() {
        let proc = fake_proc(8 * 1024, 7 * 1024, None);
        let gate = HostMemory::for_host(proc.path(), Some(8 * GIB)).expect("same host");
        std::fs::remove_file(proc.path().join("meminfo")).expect("rm");
        assert!(gate.room(0).is_ok());
    }
}
