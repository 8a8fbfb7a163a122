//! The work of the MCP file tools: `upload_file`, `list_files` and `read_file`.

use super::tools::{session_arg, CodeTools, ListFilesArgs, ReadFileArgs, UploadFileArgs};
use crate::core::files::{StagedFile, UploadOptions};
use crate::core::{Broker, Error};
use crate::http::auth::Caller;
use crate::ids::new_id;
use crate::render::{content_type, download_url, inline_image_mime, MAX_INLINE_IMAGE_BYTES};
use crate::session::Session;
use crate::workspace::FileRecord;
use base64::Engine as _;
use rmcp::model::{CallToolResult, ContentBlock};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::sync::Arc;

/// Largest text file `read_file` returns inline; larger ones are links.
const MAX_INLINE_TEXT_BYTES: u64 = 1024 * 1024;

impl CodeTools {
    pub(super) async fn upload(
        &self,
        args: UploadFileArgs,
        caller: &Caller,
    ) -> Result<CallToolResult, Error> {
        let broker = self.broker().clone();
        let name = Broker::check_upload_name(&args.name)?;
        let bytes = decode_base64(&args.content_base64)?;
        let max_bytes = broker.config().caps.max_upload_mb * 1024 * 1024;
        if bytes.len() as u64 > max_bytes {
            return Err(Error::TooLarge(format!(
                "{} is larger than the upload limit of {} MiB",
                args.name,
                broker.config().caps.max_upload_mb
            )));
        }
        let user = caller.user.as_deref();
        let tenant = caller.tenant.as_deref();
        let explicit = broker.front_end_session_id(user, session_arg(args.session_id.as_deref())?);
        let broker = &broker;
        let session = self
            .remembering(explicit, |wanted| async move {
                broker
                    .session_for_upload(tenant, user, wanted.as_deref(), None)
                    .await
            })
            .await?;
        let staging = broker.staging_dir();
        tokio::fs::create_dir_all(&staging)
            .await
            .map_err(|e| Error::internal(format!("cannot create staging dir: {e}")))?;
        let temp = staging.join(new_id());
        let staged = StagedFile {
            name,
            temp: temp.clone(),
            sha256: hex::encode(Sha256::digest(&bytes)),
            size: bytes.len() as u64,
        };
        let stored = match tokio::fs::write(&temp, &bytes).await {
            Ok(()) => {
                broker
                    .store_uploads(
                        &session,
                        vec![staged],
                        UploadOptions {
                            by: caller.user.clone(),
                            ..UploadOptions::default()
                        },
                    )
                    .await
            }
            Err(e) => Err(Error::internal(format!("cannot stage upload: {e}"))),
        };
        // Gone after a successful store (moved into the session); removed otherwise.
        let _ = tokio::fs::remove_file(&temp).await;
        let records = stored?;
        let files: Vec<Value> = records
            .iter()
            .map(|r| self.file_json(session.id(), r, false))
            .collect();
        let lines: Vec<String> = records
            .iter()
            .map(|r| format!("uploaded /mnt/data/{} ({} bytes)", r.name, r.size))
            .collect();
        let text = format!("{}\nsession_id: {}", lines.join("\n"), session.id());
        let mut result = CallToolResult::success(vec![ContentBlock::text(text)]);
        result.structured_content = Some(json!({ "session_id": session.id(), "files": files }));
        Ok(result)
    }

    /// The session a listing or a read is about: the argument's, else this MCP session's;
    /// 404 when the caller may not see it.
    async fn session_for_read(
        &self,
        arg: Option<&str>,
        caller: &Caller,
    ) -> Result<Arc<Session>, Error> {
        let Some(id) = self.remembered_or(arg).await? else {
            return Err(Error::BadRequest(
                "no session yet: pass the session_id of an earlier result".into(),
            ));
        };
        let session =
            self.broker()
                .visible_session(caller.tenant.as_deref(), caller.user.as_deref(), &id)?;
        // LobeChat's rule, as for `execute_code`: a front end naming no user reads no named
        // user's session.
        if caller.user.is_none() && session.meta.user.is_some() {
            return Err(Error::NotFound(format!("session {id} not found")));
        }
        Ok(session)
    }

    pub(super) async fn list(
        &self,
        args: ListFilesArgs,
        caller: &Caller,
    ) -> Result<CallToolResult, Error> {
        let session = self
            .session_for_read(args.session_id.as_deref(), caller)
            .await?;
        let broker = self.broker();
        let mut records: Vec<FileRecord> = session
            .index()
            .files
            .iter()
            .filter(|r| r.current && !broker.is_expired(r))
            .cloned()
            .collect();
        records.sort_by(|a, b| a.name.cmp(&b.name));
        let mut lines: Vec<String> = records
            .iter()
            .map(|r| {
                format!(
                    "/mnt/data/{} ({} bytes): {}",
                    r.name,
                    r.size,
                    download_url(self.public_url(), session.id(), &r.id)
                )
            })
            .collect();
        if lines.is_empty() {
            lines.push("(no files)".into());
        }
        lines.push(format!("session_id: {}", session.id()));
        let files: Vec<Value> = records
            .iter()
            .map(|r| self.file_json(session.id(), r, true))
            .collect();
        let mut result = CallToolResult::success(vec![ContentBlock::text(lines.join("\n"))]);
        result.structured_content = Some(json!({ "session_id": session.id(), "files": files }));
        Ok(result)
    }

    pub(super) async fn read(
        &self,
        args: ReadFileArgs,
        caller: &Caller,
    ) -> Result<CallToolResult, Error> {
        let session = self
            .session_for_read(args.session_id.as_deref(), caller)
            .await?;
        let name = args.name.trim();
        let name = name.strip_prefix("/mnt/data/").unwrap_or(name);
        let name = name.strip_prefix("./").unwrap_or(name);
        let record = session
            .index()
            .current(name)
            .filter(|r| !self.broker().is_expired(r))
            .cloned()
            .ok_or_else(|| {
                Error::NotFound(format!(
                    "no file named {name:?} in session {}",
                    session.id()
                ))
            })?;
        let url = download_url(self.public_url(), session.id(), &record.id);
        let about = format!(
            "/mnt/data/{} ({} bytes): {url}\nsession_id: {}",
            record.name,
            record.size,
            session.id()
        );
        if let Some(mime) = inline_image_mime(&record.name) {
            if record.size <= MAX_INLINE_IMAGE_BYTES {
                let bytes = self
                    .broker()
                    .read_download(&session, &record, caller.user.as_deref())
                    .await?;
                let data = base64::engine::general_purpose::STANDARD.encode(bytes);
                return Ok(CallToolResult::success(vec![
                    ContentBlock::image(data, mime),
                    ContentBlock::text(about),
                ]));
            }
        } else if record.size <= MAX_INLINE_TEXT_BYTES {
            let bytes = self
                .broker()
                .read_download(&session, &record, caller.user.as_deref())
                .await?;
            if let Ok(text) = String::from_utf8(bytes) {
                return Ok(CallToolResult::success(vec![ContentBlock::text(text)]));
            }
        }
        Ok(CallToolResult::success(vec![ContentBlock::text(format!(
            "not shown inline (binary or large); download: {about}"
        ))]))
    }
}

impl CodeTools {
    /// A file of `session` as the file tools' structured content names it; a listing
    /// also says its content type.
    fn file_json(&self, session: &str, record: &FileRecord, with_type: bool) -> Value {
        let mut file = json!({
            "id": record.id,
            "name": record.name,
            "path": format!("/mnt/data/{}", record.name),
            "size": record.size,
            "url": download_url(self.public_url(), session, &record.id),
        });
        if with_type {
            let base = record.name.rsplit('/').next().unwrap_or(&record.name);
            file["contentType"] = json!(content_type(base));
        }
        file
    }
}

/// Base64 as models write it: standard or URL-safe alphabet, padded or not, line breaks
/// allowed, a `data:...;base64,` prefix tolerated.
fn decode_base64(text: &str) -> Result<Vec<u8>, Error> {
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
    let text = match text.split_once(";base64,") {
        Some((prefix, rest)) if prefix.starts_with("data:") => rest,
        _ => text,
    };
    let compact: String = text.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    [STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD]
        .iter()
        .find_map(|engine| engine.decode(&compact).ok())
        .ok_or_else(|| Error::BadRequest("content_base64 is not valid base64".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_variants() {
        assert_eq!(decode_base64("aGk=").ok(), Some(b"hi".to_vec()));
        assert_eq!(decode_base64("aGk").ok(), Some(b"hi".to_vec()));
        assert_eq!(
            decode_base64("data:text/plain;base64,aG\nk=").ok(),
            Some(b"hi".to_vec())
        );
        assert_eq!(decode_base64("-_8").ok(), Some(vec![0xfb, 0xff]));
        assert!(decode_base64("***").is_err());
    }
}
