//! The audit log: one JSON line per session create, exec, upload, download, delete and
//! expiry, appended to `CODEBROKER_AUDIT_LOG`. Records go through a channel to a writer
//! thread of their own, so a slow disk never holds up the async runtime; a failed write is
//! logged and never fails the request that caused it.

use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::PathBuf;
use std::sync::mpsc;

/// The sending end of the audit log; off when no path is configured.
pub(crate) struct Audit {
    /// Lines for the writer thread; `None` when the log is off.
    tx: Option<mpsc::Sender<String>>,
    /// Whether exec records carry the code itself (`CODEBROKER_AUDIT_CODE`), not only its hash.
    include_code: bool,
}

impl Audit {
    /// An audit log that records nothing.
    pub(crate) fn off() -> Audit {
        Audit {
            tx: None,
            include_code: false,
        }
    }

    /// Appends to `path` (empty: off). The file is opened by the writer thread; when it
    /// cannot be, each record's failure is logged and the broker runs on.
    pub(crate) fn open(path: &str, include_code: bool) -> Audit {
        let path = path.trim();
        if path.is_empty() {
            return Audit::off();
        }
        let (tx, rx) = mpsc::channel::<String>();
        let path = PathBuf::from(path);
        let spawned = std::thread::Builder::new()
            .name("audit-log".into())
            .spawn(move || write_loop(path, rx));
        if let Err(err) = spawned {
            tracing::error!(error = %err, "cannot start the audit log writer; auditing is off");
            return Audit::off();
        }
        Audit {
            tx: Some(tx),
            include_code,
        }
    }

    /// Whether records are written.
    pub(crate) fn enabled(&self) -> bool {
        self.tx.is_some()
    }

    /// Whether exec records carry the code.
    pub(crate) fn include_code(&self) -> bool {
        self.include_code
    }

    /// Queues one record: `fields` (an object) with `time` (RFC 3339) and `event` added.
    pub(crate) fn record(&self, event: &str, fields: Value) {
        let Some(tx) = &self.tx else {
            return;
        };
        let mut record = json!({ "time": now_rfc3339(), "event": event });
        if let (Some(out), Value::Object(fields)) = (record.as_object_mut(), fields) {
            out.extend(fields);
        }
        if tx.send(record.to_string()).is_err() {
            tracing::error!(event, "the audit log writer has stopped; record lost");
        }
    }
}

/// Writes each line as it comes, reopening the file after a failure.
fn write_loop(path: PathBuf, rx: mpsc::Receiver<String>) {
    let open = || {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
    };
    let mut file = None;
    for mut line in rx {
        line.push('\n');
        if file.is_none() {
            match open() {
                Ok(f) => file = Some(f),
                Err(err) => {
                    tracing::error!(path = %path.display(), error = %err, "cannot open the audit log; record lost");
                    continue;
                }
            }
        }
        // One write per record: with O_APPEND each line lands whole at the end.
        if let Some(f) = file.as_mut() {
            if let Err(err) = f.write_all(line.as_bytes()) {
                tracing::error!(path = %path.display(), error = %err, "cannot write the audit log; record lost");
                file = None;
            }
        }
    }
}

/// The current time in RFC 3339 (UTC).
pub(crate) fn now_rfc3339() -> String {
    time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

/// The hex SHA-256 of `bytes`.
pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appends_json_lines() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("audit.jsonl");
        std::fs::write(&path, "{\"earlier\":true}\n").expect("seed");
        let audit = Audit::open(&path.to_string_lossy(), false);
        audit.record("upload", json!({ "user": "u", "files": [] }));
        audit.record("download", json!({ "user": "u" }));
        drop(audit);
        let mut lines = Vec::new();
        for _ in 0..100 {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            lines = text.lines().map(str::to_string).collect();
            if lines.len() == 3 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(lines.len(), 3, "{lines:?}");
        let first: Value = serde_json::from_str(&lines[1]).expect("json");
        assert_eq!(first["event"], "upload");
        assert_eq!(first["user"], "u");
        assert!(first["time"].as_str().is_some_and(|t| t.ends_with('Z')));
    }

    #[test]
    fn off_when_no_path() {
        let audit = Audit::open("  ", true);
        assert!(!audit.enabled());
        audit.record("exec", json!({}));
    }
}
