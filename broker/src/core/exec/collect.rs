//! What an exec leaves: the file moves that waited for its sandbox, the files it made or
//! changed, read-only uploads put back, and the inputs it removed.

use super::{Collected, Delivery, ExecOutput};
use crate::core::error::{Error, Result};
use crate::core::files::PlacedInput;
use crate::core::Broker;
use crate::sandbox::{SandboxBackend, SandboxFiles};
use crate::session::Session;
use crate::workspace::{FileIndex, FileRecord, HarvestLimits};
use std::sync::Arc;

impl Broker {
    /// Adds the files the exec created or changed to its output with how many could not
    /// be kept, the `inputs` it removed, and the notes of input placement and harvest to
    /// its stderr.
    pub(super) async fn collect_files(
        &self,
        session: &Arc<Session>,
        output: &mut ExecOutput,
        mut notes: Vec<String>,
        inputs: &[PlacedInput],
    ) -> Result<()> {
        let limits = HarvestLimits {
            max_files: self.config.exec_limits.max_output_files,
            max_file_bytes: self
                .config
                .exec_limits
                .max_output_file_mb
                .saturating_mul(1024 * 1024),
            storage: self.storage_budget(session),
        };
        let collected = self.harvest(session, limits).await?;
        notes.extend(collected.notes);
        output.files = collected.files;
        output.delivery = collected.delivery;
        output.deleted_files = deleted_inputs(inputs, &collected.gone);
        for note in notes {
            if !output.stderr.is_empty() && !output.stderr.ends_with('\n') {
                output.stderr.push('\n');
            }
            output.stderr.push_str(&note);
            output.stderr.push('\n');
        }
        Ok(())
    }

    /// Carries out the file moves that waited for `session`'s sandbox (see
    /// `SandboxBackend::settle_files`) and saves the index when it changed; failures become
    /// notes, as a harvest's do.
    pub(super) async fn settle_files(&self, session: &Arc<Session>) -> Vec<String> {
        let at = session.files();
        let mut index = session.index().clone();
        let backend = self.backend.clone();
        let install_time = std::time::Duration::from_secs(self.config.state.state_timeout_secs);
        let settled = tokio::task::spawn_blocking(move || {
            let mut settled = backend.settle_files(&at, &mut index)?;
            if settled.index_changed {
                at.workspace.save_index(&index)?;
            }
            if settled.new_disk {
                let notes = crate::core::installs::restore_into_new_sandbox(&at, install_time);
                settled.notes.extend(notes);
            }
            let changed = settled.index_changed;
            Ok::<_, std::io::Error>((changed.then_some(index), settled.notes))
        })
        .await;
        match settled {
            Ok(Ok((index, notes))) => {
                if let Some(index) = index {
                    *session.index() = index;
                }
                notes
            }
            failed => {
                tracing::error!(session = session.id(), result = ?failed.map(|r| r.map(|_| ())), "cannot bring the sandbox's files up to date");
                vec!["Input files could not be placed".into()]
            }
        }
    }

    /// Finds the files the exec created or changed, puts back read-only files the code
    /// removed, and saves the index.
    pub(crate) async fn harvest(
        &self,
        session: &Arc<Session>,
        limits: HarvestLimits,
    ) -> Result<Collected> {
        let mut index = session.index().clone();
        let (at, backend) = (session.files(), self.backend.clone());
        let workspace = session.workspace.clone();
        let result = tokio::task::spawn_blocking(move || {
            let mut report = backend.harvest(&at, &mut index, limits)?;
            let put_back = put_back_read_only(&backend, &at, &mut index, &mut report.vanished);
            let saved = if !report.files.is_empty() || report.index_changed {
                workspace.save_index(&index)
            } else {
                Ok(())
            };
            Ok::<_, std::io::Error>((index, report, put_back, saved))
        })
        .await
        .map_err(Error::task("harvest"))?;
        match result {
            Ok((index, mut report, put_back, Ok(()))) => {
                // Blobs go only once neither the saved nor the served index names them: a
                // download of a dropped version is a 404 from then on, never a lost blob.
                let unused = std::mem::take(&mut report.unused_blobs);
                if unused.is_empty() {
                    *session.index() = index;
                } else {
                    *session.index() = index.clone();
                    crate::core::files::delete_unused_blobs(&session.workspace, &index, unused)
                        .await;
                }
                let delivered = report.files.len();
                let mut notes = report.notes;
                notes.extend(put_back.iter().map(|name| {
                    format!("{name} is a read-only upload; it was put back in /mnt/data")
                }));
                Ok(Collected {
                    files: report.files.into_iter().map(|h| h.record).collect(),
                    notes,
                    delivery: Delivery {
                        attempted: delivered + report.not_kept,
                        failed: report.not_kept,
                    },
                    gone: report.vanished.into_iter().map(|r| r.name).collect(),
                })
            }
            Ok((_, report, _, Err(err))) => {
                // Nothing of this harvest is recorded: none of its files can be served.
                tracing::error!(session = session.id(), error = %err, "cannot save the file index after a harvest");
                let mut blobs = report.unused_blobs;
                blobs.extend(report.files.iter().map(|h| h.record.sha256.clone()));
                let index = session.index().clone();
                crate::core::files::delete_unused_blobs(&session.workspace, &index, blobs).await;
                let attempted = report.files.len() + report.not_kept;
                Ok(Collected {
                    notes: vec!["Generated files could not be recorded".into()],
                    delivery: Delivery {
                        attempted,
                        failed: attempted,
                    },
                    gone: report.vanished.into_iter().map(|r| r.name).collect(),
                    ..Collected::default()
                })
            }
            Err(err) => {
                tracing::error!(session = session.id(), error = %err, "harvest failed");
                Ok(Collected {
                    notes: vec!["Generated files could not be collected".into()],
                    ..Collected::default()
                })
            }
        }
    }
}

/// Places the read-only versions among `vanished` back at their names (read-only files
/// stay as uploaded: the code cannot remove them when the broker's uid is not the
/// sandbox's, and this keeps it so when it is, or when files move through the runner).
/// Those placed back leave `vanished`; returns their names.
fn put_back_read_only(
    backend: &SandboxBackend,
    at: &SandboxFiles,
    index: &mut FileIndex,
    vanished: &mut Vec<FileRecord>,
) -> Vec<String> {
    let mut put_back = Vec::new();
    vanished.retain(|record| {
        if !record.read_only {
            return true;
        }
        let blob = at.workspace.blob_path(&record.sha256);
        match backend.place_file(at, &blob, std::path::Path::new(&record.name), true) {
            Ok(stamp) if index.reinstate(&record.id, stamp) => {
                put_back.push(record.name.clone());
                false
            }
            Ok(_) => true,
            Err(err) => {
                tracing::warn!(file = %record.name, error = %err, "cannot put a read-only file back");
                true
            }
        }
    });
    put_back
}

/// The names, as their refs carried them, of the `inputs` whose files are `gone`, each
/// once, in the order of the refs.
fn deleted_inputs(inputs: &[PlacedInput], gone: &[String]) -> Vec<String> {
    let gone: std::collections::HashSet<&str> = gone.iter().map(String::as_str).collect();
    let mut seen = std::collections::HashSet::new();
    inputs
        .iter()
        .filter(|input| gone.contains(input.name.as_str()))
        .filter(|input| seen.insert(input.sent_name.as_str()))
        .map(|input| input.sent_name.clone())
        .collect()
}
