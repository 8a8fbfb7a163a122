//! Prometheus metrics, served as text at `GET /metrics`: one registry for the broker, with
//! counters the handlers and the core bump, and gauges read from the broker at scrape time.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use sandbox_runner::Limit;

/// The content type of the text exposition (OpenMetrics, which Prometheus reads).
pub(crate) const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Labels of one exec: its language and how it ended.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ExecLabels {
    /// The language's short name (`py`, `js`, ...), to compare languages.
    pub(crate) lang: String,
    /// `ok` (exit code 0), `error` (anything else but a limit) or `limit`.
    pub(crate) outcome: String,
}

/// Labels of a limit hit.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct LimitLabels {
    /// `time`, `memory`, `stdout`, `stderr` or `disk`.
    pub(crate) kind: String,
}

/// Labels of a removed session sandbox.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ReasonLabels {
    /// `idle`, `single_use` or `over_cap` (see `session::evict`).
    pub(crate) reason: String,
}

/// Labels of a compile-cache lookup.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct CacheLabels {
    /// `hit` or `miss`.
    pub(crate) outcome: String,
}

/// Labels of a failed Docker API call.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct DockerOpLabels {
    /// The broker's operation (`create`, `attach`, `start`, `remove`, `list`, `read_image`).
    pub(crate) op: String,
}

/// Labels of one egress connection.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct EgressLabels {
    /// `allowed` or `refused`.
    pub(crate) verdict: String,
    /// Why it was refused (`not_listed`, `not_public`, `ip_literal`, a cap, ...), or why an
    /// allowed one ended early (`exec_bytes`, `session_bytes`); empty otherwise.
    pub(crate) reason: String,
}

/// Labels of egress bytes.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct DirectionLabels {
    /// `up` (from the sandbox) or `down` (to it).
    pub(crate) direction: String,
}

fn exec_histogram() -> Histogram {
    // 5 ms to about 80 s.
    Histogram::new(exponential_buckets(0.005, 2.0, 15))
}

/// Every metric of the broker.
pub(crate) struct Metrics {
    /// What `/metrics` encodes.
    registry: Registry,
    /// Sessions known (with or without a sandbox): the size of the registry.
    sessions: Gauge,
    /// Session sandboxes alive: the containers sessions hold, the pool not counted.
    containers: Gauge,
    /// Started sandboxes waiting in the pool: whether new sessions start warm.
    pool_ready: Gauge,
    /// Execs by language and outcome.
    execs: Family<ExecLabels, Counter>,
    /// Exec wall time in seconds (queueing for the session excluded), by language and outcome.
    exec_seconds: Family<ExecLabels, Histogram, fn() -> Histogram>,
    /// Limits hit by kind: which limit users run into.
    limits: Family<LimitLabels, Counter>,
    /// Bytes received in uploads.
    upload_bytes: Counter,
    /// Bytes served by downloads.
    download_bytes: Counter,
    /// Requests refused with 429 (rate or capacity limits).
    rate_limited: Counter,
    /// Requests refused with 401: a flood of bad credentials shows here, not in the log.
    auth_failures: Counter,
    /// Session sandboxes removed by the eviction rules, by reason: how the cap and the
    /// TTLs keep idle containers bounded.
    sandboxes_removed: Family<ReasonLabels, Counter>,
    /// Compiled programs served by the sandboxes' compile caches, or compiled.
    compile_cache: Family<CacheLabels, Counter>,
    /// Failed engine calls by operation: an engine in trouble shows here.
    docker_errors: Family<DockerOpLabels, Counter>,
    /// Connections through the egress proxy by verdict and reason: what sandboxes try to
    /// reach and what the allowlist refuses.
    egress_connections: Family<EgressLabels, Counter>,
    /// Bytes through the egress proxy, by direction.
    egress_bytes: Family<DirectionLabels, Counter>,
}

impl Metrics {
    /// A registry with every metric.
    pub(crate) fn new() -> Metrics {
        let docker_errors = Family::<DockerOpLabels, Counter>::default();
        let mut registry = Registry::with_prefix("codebroker");
        let sessions = Gauge::default();
        let containers = Gauge::default();
        let pool_ready = Gauge::default();
        let execs = Family::<ExecLabels, Counter>::default();
        let exec_seconds = Family::<ExecLabels, Histogram, fn() -> Histogram>::new_with_constructor(
            exec_histogram,
        );
        let limits = Family::<LimitLabels, Counter>::default();
        let upload_bytes = Counter::default();
        let download_bytes = Counter::default();
        let rate_limited = Counter::default();
        let auth_failures = Counter::default();
        let sandboxes_removed = Family::<ReasonLabels, Counter>::default();
        let compile_cache = Family::<CacheLabels, Counter>::default();
        let egress_connections = Family::<EgressLabels, Counter>::default();
        let egress_bytes = Family::<DirectionLabels, Counter>::default();
        registry.register("sessions", "Sessions known", sessions.clone());
        registry.register(
            "containers",
            "Session sandboxes alive (the pool not counted)",
            containers.clone(),
        );
        registry.register(
            "pool_ready",
            "Started sandboxes waiting in the pool",
            pool_ready.clone(),
        );
        registry.register("execs", "Execs by language and outcome", execs.clone());
        registry.register(
            "exec_duration_seconds",
            "Exec wall time by language and outcome",
            exec_seconds.clone(),
        );
        registry.register("limits_hit", "Exec limits hit by kind", limits.clone());
        registry.register(
            "upload_bytes",
            "Bytes received in uploads",
            upload_bytes.clone(),
        );
        registry.register(
            "download_bytes",
            "Bytes served by downloads",
            download_bytes.clone(),
        );
        registry.register(
            "docker_errors",
            "Failed sandbox backend API calls (Docker's or Kubernetes') by operation",
            docker_errors.clone(),
        );
        registry.register(
            "rate_limited",
            "Requests refused with 429 (rate or capacity limits)",
            rate_limited.clone(),
        );
        registry.register(
            "auth_failures",
            "Requests refused with 401 (missing or invalid credentials)",
            auth_failures.clone(),
        );
        registry.register(
            "sandboxes_removed",
            "Session sandboxes removed by reason (idle, single_use, over_cap)",
            sandboxes_removed.clone(),
        );
        registry.register(
            "compile_cache",
            "Compiled programs by compile-cache outcome (hit, miss)",
            compile_cache.clone(),
        );
        registry.register(
            "egress_connections",
            "Connections through the egress proxy by verdict (allowed, refused) and reason",
            egress_connections.clone(),
        );
        registry.register(
            "egress_bytes",
            "Bytes through the egress proxy by direction (up, down)",
            egress_bytes.clone(),
        );
        Metrics {
            registry,
            sessions,
            containers,
            pool_ready,
            execs,
            exec_seconds,
            limits,
            upload_bytes,
            download_bytes,
            rate_limited,
            auth_failures,
            sandboxes_removed,
            compile_cache,
            docker_errors,
            egress_connections,
            egress_bytes,
        }
    }

    /// One connection through the egress proxy: its verdict, why (when refused or cut), and
    /// the bytes it moved.
    pub(crate) fn egress(&self, verdict: &str, reason: &str, up: u64, down: u64) {
        self.egress_connections
            .get_or_create(&EgressLabels {
                verdict: verdict.to_string(),
                reason: reason.to_string(),
            })
            .inc();
        for (direction, bytes) in [("up", up), ("down", down)] {
            if bytes > 0 {
                self.egress_bytes
                    .get_or_create(&DirectionLabels {
                        direction: direction.to_string(),
                    })
                    .inc_by(bytes);
            }
        }
    }

    /// One failed engine (Docker API) call of the operation `op`.
    pub(crate) fn docker_error(&self, op: &str) {
        self.docker_errors
            .get_or_create(&DockerOpLabels { op: op.to_string() })
            .inc();
    }

    /// The text exposition, after setting the gauges to the values given.
    pub(crate) fn render(&self, sessions: usize, containers: usize, pool_ready: usize) -> String {
        self.sessions.set(sessions as i64);
        self.containers.set(containers as i64);
        self.pool_ready.set(pool_ready as i64);
        let mut out = String::new();
        if let Err(err) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::error!(error = %err, "cannot encode the metrics");
        }
        out
    }

    /// Counts one finished exec.
    pub(crate) fn exec(&self, lang: &str, outcome: &str, seconds: f64, limits: &[Limit]) {
        let labels = ExecLabels {
            lang: lang.to_string(),
            outcome: outcome.to_string(),
        };
        self.execs.get_or_create(&labels).inc();
        self.exec_seconds.get_or_create(&labels).observe(seconds);
        for limit in limits {
            self.limits
                .get_or_create(&LimitLabels {
                    kind: limit_kind(*limit).to_string(),
                })
                .inc();
        }
    }

    /// Counts uploaded bytes.
    pub(crate) fn uploaded(&self, bytes: u64) {
        self.upload_bytes.inc_by(bytes);
    }

    /// Counts downloaded bytes.
    pub(crate) fn downloaded(&self, bytes: u64) {
        self.download_bytes.inc_by(bytes);
    }

    /// Counts one session sandbox removed by the eviction rules.
    pub(crate) fn sandbox_removed(&self, reason: &str) {
        self.sandboxes_removed
            .get_or_create(&ReasonLabels {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Counts one compiled-language exec by whether its compile was cached.
    pub(crate) fn compile_cache(&self, hit: bool) {
        let outcome = if hit { "hit" } else { "miss" };
        self.compile_cache
            .get_or_create(&CacheLabels {
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// Counts one 429.
    pub(crate) fn rate_limited(&self) {
        self.rate_limited.inc();
    }

    /// Counts one 401.
    pub(crate) fn auth_failed(&self) {
        self.auth_failures.inc();
    }
}

/// The label value of a limit.
pub(crate) fn limit_kind(limit: Limit) -> &'static str {
    match limit {
        Limit::Time => "time",
        Limit::Memory => "memory",
        Limit::Stdout => "stdout",
        Limit::Stderr => "stderr",
        Limit::Disk => "disk",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counts_and_gauges() {
        let metrics = Metrics::new();
        metrics.exec("py", "limit", 0.2, &[Limit::Time]);
        metrics.uploaded(10);
        metrics.docker_error("create");
        let text = metrics.render(3, 2, 1);
        assert!(text.contains("codebroker_sessions 3"), "{text}");
        assert!(text.contains("codebroker_containers 2"), "{text}");
        assert!(text.contains("codebroker_pool_ready 1"), "{text}");
        assert!(
            text.contains(r#"codebroker_execs_total{lang="py",outcome="limit"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"codebroker_limits_hit_total{kind="time"} 1"#),
            "{text}"
        );
        assert!(text.contains("codebroker_upload_bytes_total 10"), "{text}");
        assert!(
            text.contains(r#"codebroker_docker_errors_total{op="create"} 1"#),
            "{text}"
        );
        assert!(text.contains("codebroker_exec_duration_seconds_bucket"));
    }
}
