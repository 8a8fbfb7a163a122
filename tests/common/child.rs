//! The broker binary as a child process, for the suites that measure the broker's own
//! memory and CPU (`hostile_http.rs`, `hostile_stream.rs`): a broker in the test process
//! would count the client's allocations as its own. Included by path from those suites
//! only.

#![allow(dead_code)]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A broker binary on its own port, data directory and instance label; killed on drop,
/// with its containers removed.
pub struct ChildBroker {
    /// The running binary: its pid is what `/proc` is read by.
    child: Child,
    /// `http://127.0.0.1:<port>`.
    pub base: String,
    /// For tests that speak raw TCP to it.
    pub port: u16,
    /// Its containers' label, removed on drop.
    pub instance: String,
    /// Kept until the broker is dropped.
    _data: tempfile::TempDir,
}

impl ChildBroker {
    /// Starts the binary with no pool, warnings only in its log, and `env` on top (auth is
    /// the caller's to set); waits until `/health` answers. `CODEBROKER_TEST_BROKER_BIN`
    /// names another build to run instead (an earlier commit's, to compare figures).
    pub async fn start(tag: &str, env: &[(&str, &str)]) -> ChildBroker {
        crate::common::require_image();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let data = tempfile::tempdir().expect("tempdir");
        let instance = crate::common::instance_name(tag);
        let binary = std::env::var("CODEBROKER_TEST_BROKER_BIN")
            .unwrap_or_else(|_| env!("CARGO_BIN_EXE_codebroker").to_string());
        let mut command = Command::new(binary);
        command
            .env("CODEBROKER_LISTEN", format!("127.0.0.1:{port}"))
            .env("CODEBROKER_DATA_DIR", data.path())
            .env("CODEBROKER_INSTANCE", &instance)
            .env("CODEBROKER_IMAGE", crate::common::image())
            .env("CODEBROKER_POOL_SIZE", "0")
            .env("RUST_LOG", "codebroker=warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        for (name, value) in env {
            command.env(name, value);
        }
        let child = command.spawn().expect("start the broker binary");
        let broker = ChildBroker {
            child,
            base: format!("http://127.0.0.1:{port}"),
            port,
            instance,
            _data: data,
        };
        let client = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(resp) = client.get(broker.url("/health")).send().await {
                if resp.status().is_success() || resp.status() == 503 {
                    break;
                }
            }
            assert!(Instant::now() < deadline, "the broker did not come up");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        broker
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A field of `/proc/<pid>/status` in bytes (`VmRSS`, `VmHWM`).
    pub fn status_bytes(&self, field: &str) -> u64 {
        proc_status_bytes(self.pid(), field)
    }

    /// CPU time the broker used so far (user + system).
    pub fn cpu(&self) -> Duration {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid()))
            .expect("the broker is alive");
        let fields: Vec<&str> = stat[stat.rfind(')').expect("comm") + 2..]
            .split_whitespace()
            .collect();
        // utime and stime are fields 14 and 15 of the whole line, in clock ticks.
        let ticks: u64 =
            fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime");
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
        Duration::from_millis(ticks * 1000 / hz)
    }
}

impl Drop for ChildBroker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        crate::common::remove_containers_of(&self.instance);
    }
}

/// A field of `/proc/<pid>/status` in bytes; 0 once the process is gone.
pub fn proc_status_bytes(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}
