//! Where the CPU of container starts goes: the host's busy time, the engine's processes,
//! this process and the containers' cgroups, read before and after a burst.

/// CPU seconds used so far by the host and by each part of a container start.
pub(crate) struct CpuSnapshot {
    /// All CPUs, busy time.
    busy: f64,
    /// Per process of a part, by pid: the part and its CPU seconds. Parts: the engine
    /// (`dockerd`), `containerd`, the per-container shims with the `runc` runs they waited
    /// for, and this process (the broker and the bench client). By pid, so processes that
    /// exit between two snapshots (the shims of removed containers) do not count.
    processes: std::collections::HashMap<u32, (usize, f64)>,
    /// Per container cgroup (the runner, the kernel, `runc init`), by cgroup directory.
    containers: std::collections::HashMap<String, f64>,
}

/// The parts of [`CpuSnapshot::processes`], in report order.
const CPU_PARTS: [&str; 4] = [
    "dockerd",
    "containerd",
    "shims and runc",
    "broker + bench client",
];

/// The host's busy CPU seconds so far, all CPUs (`/proc/stat`, idle and iowait left out).
pub(crate) fn host_busy_seconds() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|s| {
            let v: Vec<f64> = s
                .lines()
                .next()?
                .split_whitespace()
                .skip(1)
                .filter_map(|x| x.parse().ok())
                .collect();
            let idle = v.get(3)? + v.get(4)?;
            Some((v.iter().sum::<f64>() - idle) / tick)
        })
        .unwrap_or(0.0)
}

impl CpuSnapshot {
    pub(crate) fn take() -> CpuSnapshot {
        let busy = host_busy_seconds();
        // SAFETY: sysconf has no preconditions.
        let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        let mut processes = std::collections::HashMap::new();
        let me = std::process::id();
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
                continue;
            };
            let comm = &stat[open + 1..close];
            // After the state letter: utime, stime, cutime, cstime are fields 11 to 14.
            let f: Vec<f64> = stat[close + 1..]
                .split_whitespace()
                .skip(1)
                .filter_map(|x| x.parse().ok())
                .collect();
            let part = match comm {
                "dockerd" => 0,
                "containerd" => 1,
                c if c.starts_with("containerd-shim") => 2,
                _ if pid == me => 3,
                _ => continue,
            };
            let own = f.get(10).unwrap_or(&0.0) + f.get(11).unwrap_or(&0.0);
            // Waited-for children: a shim's runc runs (not this process's own children).
            let kids = f.get(12).unwrap_or(&0.0) + f.get(13).unwrap_or(&0.0);
            let cpu = (own + if part == 3 { 0.0 } else { kids }) / tick;
            processes.insert(pid, (part, cpu));
        }
        CpuSnapshot {
            busy,
            processes,
            containers: container_cpu(),
        }
    }

    /// One line per part: CPU seconds since `before`, and per session of `n`.
    pub(crate) fn report_since(&self, before: &CpuSnapshot, n: usize) -> Vec<String> {
        let total = self.busy - before.busy;
        let mut lines = Vec::new();
        let mut counted = 0.0;
        let mut line = |name: &str, secs: f64| {
            lines.push(format!(
                "  {name:<46} {secs:>6.2} s  {:>6.1} ms per session",
                secs / n.max(1) as f64 * 1000.0
            ));
        };
        for (part, name) in CPU_PARTS.iter().enumerate() {
            let secs: f64 = self
                .processes
                .iter()
                .filter(|(_, (p, _))| *p == part)
                .map(|(pid, (_, now))| now - before.processes.get(pid).map_or(0.0, |b| b.1))
                .sum();
            counted += secs;
            line(name, secs);
        }
        let inside: f64 = self
            .containers
            .iter()
            .map(|(id, now)| now - before.containers.get(id).unwrap_or(&0.0))
            .sum();
        counted += inside;
        line("in the containers (runc init, runner, kernel)", inside);
        line("the host kernel and the rest", (total - counted).max(0.0));
        line("all CPUs busy", total);
        lines
    }
}

/// CPU seconds of each Docker container cgroup (cgroup v1 or v2, cgroupfs or systemd).
fn container_cpu() -> std::collections::HashMap<String, f64> {
    let mut out = std::collections::HashMap::new();
    let v1 = [
        "/sys/fs/cgroup/cpuacct/docker",
        "/sys/fs/cgroup/cpu,cpuacct/docker",
    ];
    for dir in v1 {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            if let Some(ns) = std::fs::read_to_string(entry.path().join("cpuacct.usage"))
                .ok()
                .and_then(|s| s.trim().parse::<f64>().ok())
            {
                out.insert(entry.file_name().to_string_lossy().to_string(), ns / 1e9);
            }
        }
    }
    for dir in ["/sys/fs/cgroup/docker", "/sys/fs/cgroup/system.slice"] {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().to_string();
            if dir.ends_with("system.slice") && !name.starts_with("docker-") {
                continue;
            }
            let usec = std::fs::read_to_string(entry.path().join("cpu.stat"))
                .ok()
                .and_then(|s| {
                    s.lines()
                        .find_map(|l| l.strip_prefix("usage_usec "))
                        .and_then(|v| v.trim().parse::<f64>().ok())
                });
            if let Some(usec) = usec {
                out.insert(name, usec / 1e6);
            }
        }
    }
    out
}
