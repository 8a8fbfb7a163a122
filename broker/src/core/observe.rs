//! Watching execs and file operations for the operators. Each exec observer is told how
//! the exec ended: the metrics count it and time it, and the audit log records who ran
//! what. Uploads, downloads and deletes are counted and recorded by [`observe_files`].

use crate::audit::Audit;
use crate::core::{ExecInput, ExecOutput};
use crate::metrics::{limit_kind, Metrics};
use crate::session::Session;
use serde_json::json;
use std::sync::Arc;
use std::time::Instant;

/// What watches execs: told once how each ended.
trait ExecObserver {
    /// The exec ended with `output` after `seconds`.
    fn finished(&mut self, seconds: f64, output: &ExecOutput);
    /// The exec ended without an output (it failed before it had one, or was cancelled).
    fn failed(&mut self, seconds: f64);
}

/// Counts execs by language and outcome, with their latency and the limits hit.
struct MetricsObserver<'a> {
    /// Where the counts go.
    metrics: &'a Metrics,
    /// The language's short name.
    lang: &'static str,
}

impl ExecObserver for MetricsObserver<'_> {
    fn finished(&mut self, seconds: f64, output: &ExecOutput) {
        let outcome = output.verdict().outcome();
        self.metrics
            .exec(self.lang, outcome, seconds, &output.limits);
    }

    fn failed(&mut self, seconds: f64) {
        self.metrics.exec(self.lang, "error", seconds, &[]);
    }
}

/// Writes one `exec` record to the audit log.
struct AuditObserver<'a> {
    /// Where the record goes.
    audit: &'a Audit,
    /// The record's fields known at the start (user, session, code hash, inputs).
    record: serde_json::Value,
}

impl AuditObserver<'_> {
    /// Adds what the end tells and writes the record.
    fn write(
        &mut self,
        duration_ms: u64,
        exit_code: Option<i32>,
        outcome: &str,
        output: Option<&ExecOutput>,
    ) {
        let mut record = std::mem::take(&mut self.record);
        record["duration_ms"] = json!(duration_ms);
        record["exit_code"] = json!(exit_code);
        record["outcome"] = json!(outcome);
        record["limits"] = json!(output.map_or_else(Vec::new, |o| o
            .limits
            .iter()
            .map(|l| limit_kind(*l))
            .collect::<Vec<_>>()));
        record["files_out"] = json!(output.map_or_else(Vec::new, |o| o
            .files
            .iter()
            .map(|f| json!({ "id": f.id, "name": f.name }))
            .collect::<Vec<_>>()));
        self.audit.record("exec", record);
    }
}

impl ExecObserver for AuditObserver<'_> {
    fn finished(&mut self, seconds: f64, output: &ExecOutput) {
        let duration_ms = output.duration_ms.max((seconds * 1000.0) as u64);
        let outcome = output.verdict().outcome();
        self.write(duration_ms, output.exit_code, outcome, Some(output));
    }

    fn failed(&mut self, seconds: f64) {
        self.write((seconds * 1000.0) as u64, None, "failed", None);
    }
}

/// One exec being watched: made when it starts, finished with its output. Dropped
/// unfinished (the exec failed before it had an output, or was cancelled), it is counted
/// as an `error` and audited without an exit code.
pub(crate) struct ExecObservation<'a> {
    /// When the exec started, for its latency.
    started: Instant,
    /// Who is told how it ended, in this order.
    observers: Vec<Box<dyn ExecObserver + Send + 'a>>,
    /// Set once finished, so the drop does not tell them again.
    done: bool,
}

impl<'a> ExecObservation<'a> {
    /// Starts watching an exec of `input` in `session`.
    pub(crate) fn start(
        metrics: &'a Metrics,
        audit: &'a Audit,
        session: &Session,
        input: &ExecInput,
    ) -> ExecObservation<'a> {
        let mut observers: Vec<Box<dyn ExecObserver + Send + 'a>> =
            vec![Box::new(MetricsObserver {
                metrics,
                lang: input.lang.as_str(),
            })];
        if audit.enabled() {
            let files_in: Vec<_> = input
                .files
                .iter()
                .map(|f| json!({ "id": f.id, "name": f.name, "session_id": f.session_id }))
                .collect();
            let mut record = json!({
                "user": session.meta.user,
                "session": session.id(),
                "language": input.lang.as_str(),
                "code_sha256": crate::audit::sha256_hex(input.code.as_bytes()),
                "files_in": files_in,
            });
            if audit.include_code() {
                record["code"] = json!(input.code);
            }
            observers.push(Box::new(AuditObserver { audit, record }));
        }
        ExecObservation {
            started: Instant::now(),
            observers,
            done: false,
        }
    }

    /// Tells the observers the exec's output.
    pub(crate) fn finish(mut self, output: &ExecOutput) {
        self.done = true;
        let seconds = self.started.elapsed().as_secs_f64();
        for observer in &mut self.observers {
            observer.finished(seconds, output);
        }
    }
}

impl Drop for ExecObservation<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let seconds = self.started.elapsed().as_secs_f64();
        for observer in &mut self.observers {
            observer.failed(seconds);
        }
    }
}

/// A file operation a client asked for, whichever front end it came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FileEvent {
    /// Files stored into a session.
    Upload,
    /// A file's bytes handed to a client.
    Download,
    /// A file id deleted.
    Delete,
}

impl FileEvent {
    /// Its name in the audit log.
    fn name(self) -> &'static str {
        match self {
            FileEvent::Upload => "upload",
            FileEvent::Download => "download",
            FileEvent::Delete => "delete",
        }
    }
}

/// Counts a file operation's bytes and writes its audit record: the one place every front
/// end's uploads, downloads and deletes are observed, so the audit log holds a record of
/// each however it was asked for.
pub(crate) fn observe_files(
    metrics: &Metrics,
    audit: &Audit,
    event: FileEvent,
    user: Option<&str>,
    session: &Session,
    files: &[&crate::workspace::FileRecord],
) {
    let bytes: u64 = files.iter().map(|r| r.size).sum();
    match event {
        FileEvent::Upload => metrics.uploaded(bytes),
        FileEvent::Download => metrics.downloaded(bytes),
        FileEvent::Delete => {}
    }
    let listed: Vec<_> = files
        .iter()
        .map(|r| match event {
            FileEvent::Delete => json!({ "id": r.id, "name": r.name }),
            _ => json!({ "id": r.id, "name": r.name, "size": r.size }),
        })
        .collect();
    let mut record = json!({
        "user": user.or(session.meta.user.as_deref()),
        "session": session.id(),
        "files": listed,
    });
    if event == FileEvent::Upload {
        record["bytes"] = json!(bytes);
    }
    audit.record(event.name(), record);
}

/// Every connection through the egress proxy: counted on `/metrics` (verdict, reason,
/// bytes) and one audit record (who, where to, what it moved, the verdict).
pub(crate) struct EgressRecords {
    /// The broker's metrics.
    pub(crate) metrics: Arc<Metrics>,
    /// The broker's audit log.
    pub(crate) audit: Arc<Audit>,
}

impl crate::egress::gateway::EgressObserver for EgressRecords {
    fn connection(
        &self,
        exec: Option<&crate::egress::gateway::ExecEgress>,
        outcome: &crate::egress::proxy::Outcome,
    ) {
        let (verdict, reason) = match (outcome.address.is_some(), outcome.verdict) {
            (_, "allowed") => ("allowed", ""),
            // Connected, then cut by a cap.
            (true, cap @ ("exec_bytes" | "session_bytes"))
                if outcome.bytes_down + outcome.bytes_up > 0 =>
            {
                ("allowed", cap)
            }
            (_, reason) => ("refused", reason),
        };
        self.metrics
            .egress(verdict, reason, outcome.bytes_up, outcome.bytes_down);
        if verdict == "refused" {
            tracing::info!(host = %outcome.host, port = outcome.port, reason, "egress refused");
        }
        self.audit.record(
            "egress",
            json!({
                "user": exec.and_then(|e| e.user.as_deref()),
                "tenant": exec.and_then(|e| e.tenant.as_deref()),
                "session": exec.map(|e| e.session.as_str()),
                "method": outcome.method,
                "host": outcome.host,
                "port": outcome.port,
                "address": outcome.address.map(|a| a.to_string()),
                "verdict": verdict,
                "reason": (!reason.is_empty()).then_some(reason),
                "bytes_up": outcome.bytes_up,
                "bytes_down": outcome.bytes_down,
            }),
        );
    }
}

/// The engine's failed calls are counted on `/metrics`.
impl crate::sandbox::engine::EngineObserver for crate::metrics::Metrics {
    fn api_error(&self, op: &str) {
        self.docker_error(op);
    }
}
