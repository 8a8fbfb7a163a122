//! Watching one exec for the operators: its counts and latency go to the metrics, and a
//! record of who ran what goes to the audit log.

use crate::audit::Audit;
use crate::core::{ExecInput, ExecOutput};
use crate::metrics::Metrics;
use crate::session::Session;
use serde_json::json;
use std::time::Instant;

/// One exec being watched: made when it starts, finished with its output. Dropped
/// unfinished (the exec failed before it had an output, or was cancelled), it is counted
/// as an `error` and audited without an exit code.
pub(crate) struct ExecObservation<'a> {
    /// Where the counts go.
    metrics: &'a Metrics,
    /// Where the record goes.
    audit: &'a Audit,
    /// When the exec started, for its latency.
    started: Instant,
    /// The language's short name.
    lang: &'static str,
    /// The audit record's fields known at the start (user, session, code hash, inputs);
    /// `None` when the audit log is off.
    record: Option<serde_json::Value>,
    /// Set once finished, so the drop does not count it again.
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
        let record = audit.enabled().then(|| {
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
            record
        });
        ExecObservation {
            metrics,
            audit,
            started: Instant::now(),
            lang: input.lang.as_str(),
            record,
            done: false,
        }
    }

    /// Counts and audits the exec's output.
    pub(crate) fn finish(mut self, output: &ExecOutput) {
        self.done = true;
        let seconds = self.started.elapsed().as_secs_f64();
        let outcome = output.verdict().outcome();
        self.metrics
            .exec(self.lang, outcome, seconds, &output.limits);
        if let Some(mut record) = self.record.take() {
            record["duration_ms"] = json!(output.duration_ms.max((seconds * 1000.0) as u64));
            record["exit_code"] = json!(output.exit_code);
            record["outcome"] = json!(outcome);
            record["limits"] = json!(output
                .limits
                .iter()
                .map(|l| crate::metrics::limit_kind(*l))
                .collect::<Vec<_>>());
            record["files_out"] = json!(output
                .files
                .iter()
                .map(|f| json!({ "id": f.id, "name": f.name }))
                .collect::<Vec<_>>());
            self.audit.record("exec", record);
        }
    }
}

impl Drop for ExecObservation<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let seconds = self.started.elapsed().as_secs_f64();
        self.metrics.exec(self.lang, "error", seconds, &[]);
        if let Some(mut record) = self.record.take() {
            record["duration_ms"] = json!((seconds * 1000.0) as u64);
            record["exit_code"] = serde_json::Value::Null;
            record["outcome"] = json!("failed");
            record["limits"] = json!([]);
            record["files_out"] = json!([]);
            self.audit.record("exec", record);
        }
    }
}
