//! Killing whatever an exec left behind.
//!
//! Background jobs, `setsid`, double forks and `nohup` all escape a process group, so after
//! each exec the runner walks `/proc` and SIGKILLs every process it may kill, in passes,
//! until only zombies remain. A process that has been sent SIGKILL cannot fork any more, so
//! each pass only has to catch what was forked during the previous one; a fork bomb
//! converges within a few passes.
//!
//! As PID 1 "every process" means everything in the container but the runner and the
//! kernel. On a host (tests), it means only the runner's descendants: anything else is not
//! ours to kill.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// One process as `/proc/<pid>/stat` describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Proc {
    /// Its pid.
    pub pid: libc::pid_t,
    /// Its parent's pid, to find descendants.
    pub ppid: libc::pid_t,
    /// Its state letter; `Z` and `X` are already dead.
    pub state: u8,
}

impl Proc {
    /// Whether the process has already died (and only waits to be reaped).
    fn dead(&self) -> bool {
        matches!(self.state, b'Z' | b'X' | b'x')
    }
}

/// Parses the state and parent out of a `/proc/<pid>/stat` line. The command name is in
/// parentheses and may itself contain spaces and parentheses, so parsing starts after the
/// last `)`.
pub fn parse_stat(pid: libc::pid_t, line: &str) -> Option<Proc> {
    let rest = &line[line.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace();
    let state = *fields.next()?.as_bytes().first()?;
    let ppid = fields.next()?.parse().ok()?;
    Some(Proc { pid, ppid, state })
}

/// Whether `pid` is a live process that is not about to die: not a zombie, not gone, and
/// no SIGKILL pending (a process killed a moment ago may not have run its exit yet).
pub fn alive(pid: libc::pid_t) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|s| status_alive(&s))
}

/// [`alive`] on the text of `/proc/<pid>/status`.
fn status_alive(status: &str) -> bool {
    let kill_bit = 1u64 << (libc::SIGKILL - 1);
    status.lines().all(|line| {
        if let Some(state) = line.strip_prefix("State:") {
            return !state.trim_start().starts_with(['Z', 'X', 'x']);
        }
        match line
            .strip_prefix("SigPnd:")
            .or_else(|| line.strip_prefix("ShdPnd:"))
        {
            Some(mask) => u64::from_str_radix(mask.trim(), 16).map_or(true, |m| m & kill_bit == 0),
            None => true,
        }
    })
}

/// Every process currently visible in `/proc`.
pub fn scan() -> Vec<Proc> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| {
        let e = e.ok()?;
        let pid: libc::pid_t = e.file_name().to_str()?.parse().ok()?;
        let line = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        parse_stat(pid, &line)
    })
    .collect()
}

/// The live processes to kill: as PID 1 all but ourselves and `spare`; on a host only our
/// descendants, except `spare` (whose own descendants are included).
pub fn targets(
    procs: &[Proc],
    me: libc::pid_t,
    spare: Option<libc::pid_t>,
    pid1: bool,
) -> Vec<libc::pid_t> {
    let keep = |p: &Proc| p.pid != me && p.pid != 1 && Some(p.pid) != spare && !p.dead();
    if pid1 {
        return procs.iter().filter(|p| keep(p)).map(|p| p.pid).collect();
    }
    let mut children: HashMap<libc::pid_t, Vec<&Proc>> = HashMap::new();
    for p in procs {
        children.entry(p.ppid).or_default().push(p);
    }
    let mut out = Vec::new();
    let mut stack = vec![me];
    let mut seen = std::collections::HashSet::new();
    while let Some(parent) = stack.pop() {
        for child in children.get(&parent).into_iter().flatten() {
            if !seen.insert(child.pid) {
                continue;
            }
            stack.push(child.pid);
            if keep(child) {
                out.push(child.pid);
            }
        }
    }
    out
}

/// Kills leftovers until none are alive, or until `limit` passes (for processes stuck in
/// the kernel, or a spared process that keeps forking); returns how many were still alive
/// in the last pass (0: all dead).
pub fn kill_leftovers(spare: Option<libc::pid_t>, pid1: bool, limit: Duration) -> usize {
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    let start = Instant::now();
    let mut pass = 0u32;
    loop {
        let victims = targets(&scan(), me, spare, pid1);
        for &pid in &victims {
            crate::sys::kill(pid, libc::SIGKILL);
        }
        if victims.is_empty() || start.elapsed() > limit {
            return victims.len();
        }
        // Killed processes take a moment to turn into zombies; back off a little so the
        // next pass does not just see the same dying processes.
        pass += 1;
        std::thread::sleep(Duration::from_micros(50 * u64::from(pass.min(20))));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_odd_names() {
        let p = parse_stat(42, "42 (a) b (c)) S 7 42 42 0 -1").unwrap();
        assert_eq!(
            p,
            Proc {
                pid: 42,
                ppid: 7,
                state: b'S'
            }
        );
        assert_eq!(parse_stat(1, "1 (init) Z 0").unwrap().state, b'Z');
        assert_eq!(parse_stat(1, "garbage"), None);
        assert_eq!(parse_stat(1, "1 (x)"), None);
    }

    #[test]
    fn status_shows_dying_processes() {
        let live = "Name:\tpython3\nState:\tS (sleeping)\nSigPnd:\t0000000000000000\nShdPnd:\t0000000000000000\n";
        assert!(status_alive(live));
        assert!(!status_alive(&live.replace("S (sleeping)", "Z (zombie)")));
        let killed = live.replace("ShdPnd:\t0000000000000000", "ShdPnd:\t0000000000000100");
        assert!(!status_alive(&killed));
        let interrupted = live.replace("SigPnd:\t0000000000000000", "SigPnd:\t0000000000000002");
        assert!(status_alive(&interrupted));
        assert!(alive(std::process::id() as i32));
        assert!(!alive(-5));
    }

    fn p(pid: i32, ppid: i32, state: u8) -> Proc {
        Proc { pid, ppid, state }
    }

    #[test]
    fn host_mode_kills_only_descendants() {
        let procs = [
            p(1, 0, b'S'),
            p(50, 1, b'S'),   // unrelated host process
            p(100, 50, b'S'), // the runner
            p(101, 100, b'S'),
            p(102, 101, b'S'),
            p(103, 100, b'Z'), // already dead
            p(104, 100, b'S'), // the kernel
            p(105, 104, b'S'), // the kernel's child
            p(200, 50, b'S'),
        ];
        let mut t = targets(&procs, 100, Some(104), false);
        t.sort();
        assert_eq!(t, vec![101, 102, 105]);
    }

    #[test]
    fn pid1_mode_kills_all_but_self_and_spare() {
        let procs = [p(1, 0, b'S'), p(7, 1, b'S'), p(8, 0, b'T'), p(9, 1, b'Z')];
        assert_eq!(targets(&procs, 1, Some(7), true), vec![8]);
        assert_eq!(targets(&procs, 1, None, true), vec![7, 8]);
    }
}
