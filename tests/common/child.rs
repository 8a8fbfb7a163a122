//! The broker as a child process: the real binary (or the broker image's entrypoint) on
//! its own port, data directory and instance label. For the suites that signal or kill
//! the broker, restart it on the same data, start it as its image does, or measure its
//! own memory and CPU (a broker in the test process would count the client's allocations
//! as its own).

use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// What `/health` must answer before a started broker counts as up.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Ready {
    /// 200, or 503 (serving, with the engine or the pool not ready yet).
    Serving,
    /// 200 only.
    Healthy,
}

/// A free port on loopback (the broker binds it right after).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

/// The broker binary under test: `CODEBROKER_TEST_BROKER_BIN` names another build to run
/// instead (an earlier commit's, to compare figures).
pub fn broker_binary() -> String {
    std::env::var("CODEBROKER_TEST_BROKER_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_codebroker").to_string())
}

/// How to start a child broker; `spawn` starts it and waits until it is up.
pub struct Launch {
    /// The program with the broker's settings; callers add their own with `env`.
    command: Command,
    /// The port it listens on.
    port: u16,
    /// Its containers' label.
    instance: String,
    /// Its data directory.
    data_dir: std::path::PathBuf,
    /// The data directory, when the broker owns it (else the caller keeps it).
    data: Option<tempfile::TempDir>,
    /// What `/health` must answer before `spawn` returns.
    ready: Ready,
    /// Remove the instance's containers on drop; off for a broker killed and restarted
    /// on the same containers.
    remove_on_drop: bool,
    /// SIGTERM and up to 30 s to exit on drop before SIGKILL, so that a broker that
    /// drops privileges (and cannot be killed by its own uid's peers) removes its
    /// containers itself.
    term_on_drop: bool,
}

impl Launch {
    /// The broker binary on `data_dir` with label `instance`: no pool, this suite's
    /// sandbox image, stdin closed.
    pub fn binary(instance: &str, data_dir: &Path) -> Launch {
        Launch::program(Command::new(broker_binary()), instance, data_dir)
    }

    /// `program` (which starts the broker, as the image's entrypoint does) with the
    /// settings of [`Launch::binary`].
    pub fn program(mut command: Command, instance: &str, data_dir: &Path) -> Launch {
        let port = free_port();
        command
            .env("CODEBROKER_LISTEN", format!("127.0.0.1:{port}"))
            .env("CODEBROKER_DATA_DIR", data_dir)
            .env("CODEBROKER_INSTANCE", instance)
            .env("CODEBROKER_IMAGE", super::image())
            .env("CODEBROKER_POOL_SIZE", "0")
            .stdin(Stdio::null());
        Launch {
            command,
            port,
            instance: instance.to_string(),
            data_dir: data_dir.to_path_buf(),
            data: None,
            ready: Ready::Serving,
            remove_on_drop: true,
            term_on_drop: false,
        }
    }

    /// One more variable of the broker's environment (a later one wins).
    pub fn env(mut self, name: &str, value: impl AsRef<std::ffi::OsStr>) -> Launch {
        self.command.env(name, value);
        self
    }

    /// More variables of the broker's environment.
    pub fn envs(mut self, vars: &[(&str, &str)]) -> Launch {
        self.command.envs(vars.iter().copied());
        self
    }

    /// Removes a variable the test process has from the broker's environment.
    pub fn env_remove(mut self, name: &str) -> Launch {
        self.command.env_remove(name);
        self
    }

    /// Warnings only in the broker's log, and its stdout dropped.
    pub fn quiet(mut self) -> Launch {
        self.command
            .env("RUST_LOG", "codebroker=warn")
            .stdout(Stdio::null());
        self
    }

    /// The broker owns this data directory until dropped or handed over.
    pub fn owning(mut self, data: tempfile::TempDir) -> Launch {
        self.data = Some(data);
        self
    }

    /// What `/health` must answer before the broker counts as up.
    pub fn ready(mut self, ready: Ready) -> Launch {
        self.ready = ready;
        self
    }

    /// Leaves the instance's containers alone on drop.
    pub fn keep_containers(mut self) -> Launch {
        self.remove_on_drop = false;
        self
    }

    /// SIGTERM on drop, and up to 30 s to exit, before SIGKILL.
    pub fn term_on_drop(mut self) -> Launch {
        self.term_on_drop = true;
        self
    }

    /// Starts the broker without waiting for it to serve.
    pub fn start(mut self) -> ChildBroker {
        let child = self.command.spawn().expect("start the broker");
        ChildBroker {
            child,
            base: format!("http://127.0.0.1:{}", self.port),
            port: self.port,
            instance: self.instance,
            data_dir: self.data_dir,
            data: self.data,
            remove_on_drop: self.remove_on_drop,
            term_on_drop: self.term_on_drop,
        }
    }

    /// Starts the broker and waits (up to a minute) until `/health` answers as `ready`
    /// says.
    pub async fn spawn(self) -> ChildBroker {
        let ready = self.ready;
        let broker = self.start();
        let client = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(resp) = client.get(broker.url("/health")).send().await {
                let status = resp.status();
                if status == 200 || (ready == Ready::Serving && status == 503) {
                    break;
                }
            }
            assert!(Instant::now() < deadline, "the broker did not come up");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        broker
    }
}

/// A broker started by [`Launch`]; killed on drop, with its containers removed unless
/// launched with `keep_containers` or handed over.
pub struct ChildBroker {
    /// The running process: its pid is what `/proc` is read and signals are sent by.
    child: Child,
    /// `http://127.0.0.1:<port>`.
    pub base: String,
    /// For tests that speak raw TCP to it.
    pub port: u16,
    /// Its containers' label.
    pub instance: String,
    /// Its data directory, for tests that look at what it keeps there.
    pub data_dir: std::path::PathBuf,
    /// The data directory it owns, handed to the next broker by `hand_over`.
    data: Option<tempfile::TempDir>,
    /// Remove the instance's containers on drop.
    remove_on_drop: bool,
    /// SIGTERM before SIGKILL on drop.
    term_on_drop: bool,
}

impl ChildBroker {
    /// The binary with its own data directory, no pool, warnings only in its log, and
    /// `env` on top (auth is the caller's to set); waits until `/health` answers.
    pub async fn start(tag: &str, env: &[(&str, &str)]) -> ChildBroker {
        super::require_image();
        let data = tempfile::tempdir().expect("tempdir");
        Launch::binary(&super::instance_name(tag), data.path())
            .owning(data)
            .quiet()
            .envs(env)
            .spawn()
            .await
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` to the broker process.
    pub fn signal(&self, signal: libc::c_int) {
        let pid = self.child.id() as libc::pid_t;
        // SAFETY: kill(2) on our own child's pid.
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0, "kill");
    }

    /// SIGKILL, and reaps the process.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The exit status, once the process has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().expect("try_wait")
    }

    /// Waits for the process to exit; its exit status.
    pub async fn wait(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "the broker did not exit within {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Gives up the instance and data directory for a next broker, leaving the
    /// containers alone.
    pub fn hand_over(mut self) -> (String, tempfile::TempDir) {
        self.remove_on_drop = false;
        let data = self
            .data
            .take()
            .expect("the broker owns its data directory");
        (self.instance.clone(), data)
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
        if self.term_on_drop {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = self.child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        self.kill();
        if self.remove_on_drop {
            super::remove_containers_of(&self.instance);
        }
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
