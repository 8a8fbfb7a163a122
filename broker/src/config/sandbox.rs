//! The sandbox profile, the backend and its Kubernetes settings, and the uids sandboxes run as.

use super::*;

/// What every sandbox container is: its image, its resources and its confinement, the
/// label that names its broker, and how files move in and out of it. The sandbox backend
/// takes this group.
#[derive(Debug, Clone, clap::Args)]
pub struct SandboxProfile {
    /// The sandbox image every session's container starts from.
    #[arg(
        long,
        env = "CODEBROKER_IMAGE",
        default_value = "codebroker-sandbox:latest"
    )]
    pub image: String,

    /// Memory limit of a sandbox, in MiB (swap is not allowed on top of it).
    #[arg(long, env = "CODEBROKER_MEMORY_MB", default_value_t = 1024, value_parser = mebibytes(6))]
    pub memory_mb: u64,

    /// CPUs a sandbox may use (fractions allowed).
    #[arg(long, env = "CODEBROKER_CPUS", default_value_t = 1.0)]
    pub cpus: f64,

    /// Maximum number of processes and threads in a sandbox.
    #[arg(long, env = "CODEBROKER_PIDS_LIMIT", default_value_t = 256)]
    pub pids_limit: i64,

    /// Size of the sandbox's `/tmp` tmpfs, in MiB (compilers work there).
    #[arg(long, env = "CODEBROKER_TMP_MB", default_value_t = 512)]
    pub tmp_mb: u64,

    /// Size of the sandbox's `/dev/shm` tmpfs, in MiB.
    #[arg(long, env = "CODEBROKER_SHM_MB", default_value_t = 64)]
    pub shm_mb: u64,

    /// Open files per process in a sandbox (`nofile` ulimit).
    #[arg(long, env = "CODEBROKER_NOFILE", default_value_t = 1024)]
    pub nofile: i64,

    /// Largest file a sandbox process may write, in MiB (`fsize` ulimit).
    #[arg(long, env = "CODEBROKER_FSIZE_MB", default_value_t = 1024)]
    pub fsize_mb: i64,

    /// Most a session's workspace (`/mnt/data`) may hold, in allocated bytes: `1073741824`,
    /// or with a unit (`64MiB`, `1GiB`, `500M`). The sandbox's runner watches it during each
    /// exec and stops an exec that grows it past the quota (`Disk quota exceeded`); no
    /// single file may be larger (`fsize` ulimit). 0: no quota.
    #[arg(long, env = "CODEBROKER_WORKSPACE_QUOTA", default_value = "1GiB", value_parser = parse_size)]
    pub workspace_quota: u64,

    /// Most files and directories a session's workspace may hold, watched like the quota.
    /// 0: no cap.
    #[arg(
        long,
        env = "CODEBROKER_WORKSPACE_MAX_FILES",
        default_value_t = 100_000
    )]
    pub workspace_max_files: u64,

    /// The uids sandboxes run as, `first-last`: each live sandbox runs as one of its own
    /// (its gid the same number), never two at once, so code that escapes one owns no
    /// other's processes or workspace and shares no per-uid kernel limit with them. The
    /// first is given to no sandbox: workspaces without a live sandbox are its. Far from
    /// real accounts by default; must not hold the broker's own uid, and must have a uid for
    /// each container CODEBROKER_MAX_CONTAINERS allows. Brokers sharing a Docker host need
    /// ranges that do not overlap: each only knows its own sandboxes. Docker only.
    #[arg(long, env = "CODEBROKER_SANDBOX_UIDS", default_value = "200000-265535")]
    pub sandbox_uids: UidRange,

    /// One uid (and gid) for every sandbox instead of CODEBROKER_SANDBOX_UIDS: sandboxes
    /// then share it, and code escaping one reaches the others. For a trial as your own
    /// user (`$(id -u)`), where read-only uploads are not protected either. On Kubernetes,
    /// the uid of every sandbox pod (unset: 10001).
    #[arg(long, env = "CODEBROKER_SANDBOX_UID")]
    pub sandbox_uid: Option<u32>,

    /// Give sandboxes no network at all (`NetworkMode=none`). Turn off only for trusted use.
    #[arg(long, env = "CODEBROKER_NETWORK_NONE", default_value_t = true, action = clap::ArgAction::Set)]
    pub network_none: bool,

    /// Mount the sandbox's root filesystem read-only.
    #[arg(long, env = "CODEBROKER_READONLY_ROOTFS", default_value_t = true, action = clap::ArgAction::Set)]
    pub readonly_rootfs: bool,

    /// Drop every Linux capability in sandboxes. Gaining privileges (setuid binaries,
    /// file capabilities) is forbidden either way (`no-new-privileges`).
    #[arg(long, env = "CODEBROKER_DROP_CAPABILITIES", default_value_t = true, action = clap::ArgAction::Set)]
    pub drop_capabilities: bool,

    /// The sandboxes' syscall filter: `builtin` (the broker's own profile: Docker's
    /// default less io_uring, ptrace, process_vm_*, sync and the TIOCSTI, TIOCSETD and
    /// TIOCLINUX ioctls; sockets of AF_UNIX, of AF_INET and AF_INET6 with TCP or UDP, and
    /// of AF_NETLINK with NETLINK_ROUTE only; see SECURITY.md), `daemon` (whatever the Docker daemon applies by
    /// default, which a daemon started with `seccomp=unconfined` turns off), or the path
    /// of a seccomp profile (JSON, Docker's format), read at start-up.
    #[arg(long, env = "CODEBROKER_SECCOMP", default_value = "builtin")]
    pub seccomp: SeccompChoice,

    /// OCI runtime of the sandbox containers (`HostConfig.Runtime`), e.g. `runsc` (gVisor) or
    /// `kata-runtime`, registered with the Docker daemon first; empty: the daemon's default
    /// (runc). A user-space kernel is what stands between code and a host kernel bug.
    #[arg(long, env = "CODEBROKER_RUNTIME", default_value = "")]
    pub runtime: String,

    /// Name of this broker; containers carry it as a label so that a restarted broker
    /// finds its own and leaves other brokers' alone.
    #[arg(long, env = "CODEBROKER_INSTANCE", default_value = "codebroker")]
    pub instance: String,

    /// How files move between the broker and a sandbox: `host` reads and writes the
    /// sandbox's mounted workspace directory on this host (symlink-safe, beneath-only),
    /// `runner` goes through the sandbox's runner over its channel and never touches that
    /// directory (the path of a backend whose sandboxes run on other machines). Under
    /// CODEBROKER_BACKEND=kubernetes always `runner`: the broker cannot see a pod's disk.
    #[arg(
        long,
        env = "CODEBROKER_FILE_TRANSFER",
        default_value = "host",
        value_enum
    )]
    pub file_transfer: FileTransfer,
}

/// Where sandboxes run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendKind {
    /// Containers on the Docker engine beside the broker.
    Docker,
    /// One pod per session through the Kubernetes API.
    Kubernetes,
}

impl BackendKind {
    /// The name `CODEBROKER_BACKEND` takes, as `/health` reports it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            BackendKind::Docker => "docker",
            BackendKind::Kubernetes => "kubernetes",
        }
    }
}

/// The Kubernetes backend (CODEBROKER_BACKEND=kubernetes): where its pods go and how long
/// one may take to start. The pods get the sandbox profile's image, limits and lockdown.
#[derive(Debug, Clone, clap::Args)]
pub struct KubernetesConfig {
    /// Namespace of the sandbox pods. Unset: the broker's own namespace when it runs in
    /// a pod (its service account's `namespace` file), else `codebroker`.
    #[arg(long, env = "CODEBROKER_K8S_NAMESPACE")]
    pub k8s_namespace: Option<String>,

    /// `runtimeClassName` of the sandbox pods, e.g. `gvisor` (a RuntimeClass the cluster
    /// defines); empty: the cluster's default runtime.
    #[arg(long, env = "CODEBROKER_K8S_RUNTIME_CLASS", default_value = "")]
    pub k8s_runtime_class: String,

    /// Seconds a new sandbox pod may take to be running and attached (scheduling and the
    /// image pull included); a pod that is not is deleted, and the request that waited
    /// for it gets 503 with the reason.
    #[arg(
        long,
        env = "CODEBROKER_K8S_READY_TIMEOUT_SECS",
        default_value_t = 120,
        value_parser = clap::value_parser!(u64).range(1..=3600)
    )]
    pub k8s_ready_timeout_secs: u64,

    /// How sandboxes are made on Kubernetes: `pods` (the broker creates one pod per
    /// session) or `agent-sandbox` (the broker creates a `SandboxClaim` per sandbox
    /// against CODEBROKER_K8S_SANDBOX_TEMPLATE and attaches to the pod the
    /// kubernetes-sigs/agent-sandbox controller binds it to, from a `SandboxWarmPool` when
    /// one is warm; targets agent-sandbox's v1alpha1 API, releases v0.1.x, installed with
    /// its extensions). In agent-sandbox mode the template says the pod (image, limits,
    /// lockdown, runtime class), not the CODEBROKER_* sandbox settings.
    #[arg(long, env = "CODEBROKER_K8S_MODE", default_value = "pods", value_enum)]
    pub k8s_mode: KubernetesMode,

    /// agent-sandbox mode: the `SandboxTemplate` (in the sandbox namespace) the broker's
    /// claims name; a claim not bound to a running pod within
    /// CODEBROKER_K8S_READY_TIMEOUT_SECS is deleted and reported.
    #[arg(
        long,
        env = "CODEBROKER_K8S_SANDBOX_TEMPLATE",
        default_value = "codebroker-sandbox"
    )]
    pub k8s_sandbox_template: String,
}

/// CODEBROKER_K8S_MODE: how the Kubernetes backend gets its sandboxes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KubernetesMode {
    /// One pod per session, created and deleted by the broker.
    Pods,
    /// `SandboxClaim`s against a `SandboxTemplate` of kubernetes-sigs/agent-sandbox.
    AgentSandbox,
}

/// Whether `text` may be a Kubernetes label value (empty aside): at most 63 characters of
/// `[A-Za-z0-9-_.]`, beginning and ending with a letter or digit.
pub(crate) fn is_label_value(text: &str) -> bool {
    let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    !text.is_empty()
        && text.len() <= 63
        && alnum(text.chars().next())
        && alnum(text.chars().last())
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// Whether `text` is a DNS label (RFC 1123), what namespace names are.
pub(crate) fn is_dns_label(text: &str) -> bool {
    let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    !text.is_empty()
        && text.len() <= 63
        && alnum(text.chars().next())
        && alnum(text.chars().last())
        && text
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
}

/// Whether `text` is a DNS subdomain (RFC 1123), what most resource names are: dot-separated
/// DNS labels, at most 253 characters in all.
pub(crate) fn is_dns_subdomain(text: &str) -> bool {
    text.len() <= 253 && text.split('.').all(is_dns_label)
}

/// The uid of every Kubernetes sandbox pod unless CODEBROKER_SANDBOX_UID names another:
/// the image's `sandbox` user.
pub(crate) const DEFAULT_POD_UID: u32 = 10001;

/// The highest uid a sandbox may be given: uids are 32-bit, but `(uid_t)-1` means "no
/// change" to the kernel and some programs take uids for signed numbers.
pub(crate) const MAX_SANDBOX_UID: u32 = i32::MAX as u32;

/// A range of uids, both ends included (CODEBROKER_SANDBOX_UIDS): the first is the
/// workspaces' at rest, the others are handed to sandboxes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UidRange {
    /// The lowest uid of the range: given to no sandbox, owner of idle workspaces.
    pub first: u32,
    /// The highest uid of the range.
    pub last: u32,
}

impl UidRange {
    /// Whether `uid` is in the range.
    pub(crate) fn contains(&self, uid: u32) -> bool {
        (self.first..=self.last).contains(&uid)
    }
}

impl std::fmt::Display for UidRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.first, self.last)
    }
}

impl std::str::FromStr for UidRange {
    type Err = String;

    /// `first-last`: 1 <= first < last <= 2^31 - 1, so that at least one uid is left for a
    /// sandbox besides the first.
    fn from_str(text: &str) -> Result<UidRange, String> {
        let bad = || format!("{text:?} is not a uid range such as 200000-265535");
        let (first, last) = text.trim().split_once('-').ok_or_else(bad)?;
        let first: u32 = first.trim().parse().map_err(|_| bad())?;
        let last: u32 = last.trim().parse().map_err(|_| bad())?;
        if first == 0 || first >= last || last > MAX_SANDBOX_UID {
            return Err(format!(
                "uid range {text:?}: needs 1 <= first < last <= {MAX_SANDBOX_UID} (root is never \
                 a sandbox's, and the first uid is given to none)"
            ));
        }
        Ok(UidRange { first, last })
    }
}

/// Which uids sandboxes run as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SandboxUids {
    /// One uid for every sandbox (CODEBROKER_SANDBOX_UID).
    Shared(u32),
    /// A uid of its own for each live sandbox, from this range (CODEBROKER_SANDBOX_UIDS).
    Own(UidRange),
}

impl SandboxUids {
    /// Who a workspace without a live sandbox is handed to: the shared uid, or the first
    /// of the range, which no sandbox runs as.
    pub(crate) fn resting(&self) -> u32 {
        match self {
            SandboxUids::Shared(uid) => *uid,
            SandboxUids::Own(range) => range.first,
        }
    }
}

impl SandboxProfile {
    /// Which uids Docker sandboxes run as: the one of CODEBROKER_SANDBOX_UID when it is
    /// set, else each its own from CODEBROKER_SANDBOX_UIDS.
    pub(crate) fn sandbox_uids(&self) -> SandboxUids {
        match self.sandbox_uid {
            Some(uid) => SandboxUids::Shared(uid),
            None => SandboxUids::Own(self.sandbox_uids),
        }
    }

    /// The uid of every Kubernetes sandbox pod.
    pub(crate) fn pod_uid(&self) -> u32 {
        self.sandbox_uid.unwrap_or(DEFAULT_POD_UID)
    }
}

/// CODEBROKER_SECCOMP: which syscall filter sandboxes get.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SeccompChoice {
    /// The profile compiled into the broker (`sandbox/seccomp.json`).
    Builtin,
    /// The Docker daemon's default (no `seccomp=` option is sent).
    Daemon,
    /// A profile read from this file at start-up.
    File(PathBuf),
}

impl std::str::FromStr for SeccompChoice {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.trim() {
            "" => Err("empty: use `builtin`, `daemon` or a file path".into()),
            t if t.eq_ignore_ascii_case("builtin") => Ok(SeccompChoice::Builtin),
            t if t.eq_ignore_ascii_case("daemon") => Ok(SeccompChoice::Daemon),
            path => Ok(SeccompChoice::File(PathBuf::from(path))),
        }
    }
}

/// How files move between the broker and a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum FileTransfer {
    /// Through the workspace directory the sandbox mounts, on this host.
    Host,
    /// Through the sandbox's runner, over its channel.
    Runner,
}
