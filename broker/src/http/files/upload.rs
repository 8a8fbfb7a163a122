//! `POST /upload` and `POST /upload/batch`: multipart files streamed to staging, then
//! stored in a session.

use super::guard::{BodyCut, CutReason, GuardedBody};
use crate::core::files::{StagedFile, UploadOptions};
use crate::core::Broker;
use crate::http::auth::Caller;
use crate::http::error::{AppError, AppResult};
use crate::http::AppState;
use crate::ids::{is_valid_id, new_id};
use crate::session::Session;
use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap};
use axum::Json;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;

/// Most files one upload request may carry.
const MAX_FILES_PER_UPLOAD: usize = 100;

/// Largest non-file form field (`session_id`, `entity_id`, `kind`, ...): they hold ids and
/// short words, and are kept in memory.
const MAX_TEXT_FIELD_BYTES: usize = 8 * 1024;

/// Most non-file form fields one upload may carry.
const MAX_TEXT_FIELDS: usize = 64;

/// What a multipart upload carried.
pub(crate) struct UploadForm {
    /// Files staged on disk, in order.
    pub(crate) staged: Vec<StagedFile>,
    /// Files refused, with the reason (batch uploads report them per file).
    pub(crate) refused: Vec<(String, AppError)>,
    /// The text fields.
    pub(crate) fields: HashMap<String, String>,
}

/// Removes staged files that never reached a session.
pub(crate) struct StagingGuard(pub(crate) Vec<PathBuf>);

impl Drop for StagingGuard {
    fn drop(&mut self) {
        for path in &self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// How often, in staged bytes, the free space of the data volume is looked at again while
/// a file is staged.
const FREE_DISK_CHECK_BYTES: u64 = 8 * 1024 * 1024;

/// Reads the multipart body, streaming each file into the staging area. With `strict`,
/// the first bad file fails the request; without, it is listed in `refused`.
///
/// The body is bounded as it comes ([`GuardedBody`]): a preamble or part headers past
/// 16 KiB are a 400, a body that stalls a 408. What is staged is bounded too: the files
/// of one upload together never more than the session storage budget (each is kept and
/// placed, so more could never be stored), and never while the data volume is below
/// CODEBROKER_MIN_FREE_DISK.
///
/// `names` turns a part's file name into its path below `/mnt/data` (a front end with
/// paths of its own maps them here).
pub(crate) async fn read_form(
    broker: &Broker,
    headers: &HeaderMap,
    body: Body,
    strict: bool,
    names: &(dyn Fn(&str) -> crate::core::Result<PathBuf> + Sync),
) -> AppResult<(UploadForm, StagingGuard)> {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let boundary = multer::parse_boundary(content_type)
        .map_err(|e| AppError::bad_request(format!("expected a multipart/form-data body: {e}")))?;
    let cut = CutReason::default();
    let stall = Duration::from_secs(broker.config().caps.upload_stall_secs);
    let body = GuardedBody::new(body.into_data_stream(), &boundary, stall, cut.clone());
    let mut multipart = multer::Multipart::new(body, boundary);
    // A cut body is answered with why it was cut; multer only passes the error on.
    let failed = |context: &str, e: multer::Error| {
        cut.get()
            .map(BodyCut::to_error)
            .unwrap_or_else(|| AppError::bad_request(format!("{context}: {e}")))
    };
    let mut form = UploadForm {
        staged: Vec::new(),
        refused: Vec::new(),
        fields: HashMap::new(),
    };
    let mut guard = StagingGuard(Vec::new());
    let staging = broker.staging_dir();
    tokio::fs::create_dir_all(&staging)
        .await
        .map_err(|e| AppError::internal(format!("cannot create staging dir: {e}")))?;
    let max_bytes = broker.config().caps.max_upload_mb * 1024 * 1024;
    let budget = broker.upload_budget();
    let mut staged_bytes = 0u64;
    let mut text_fields = 0usize;
    while let Some(mut field) = multipart
        .next_field()
        .await
        .map_err(|e| failed("malformed multipart body", e))?
    {
        let field_name = field.name().unwrap_or("").to_string();
        let Some(file_name) = field.file_name().map(str::to_string) else {
            text_fields += 1;
            if text_fields > MAX_TEXT_FIELDS {
                return Err(AppError::bad_request(format!(
                    "at most {MAX_TEXT_FIELDS} form fields besides files per upload"
                )));
            }
            let text = read_text_field(&mut field, &field_name, &failed).await?;
            form.fields.insert(field_name, text);
            continue;
        };
        if form.staged.len() + form.refused.len() >= MAX_FILES_PER_UPLOAD {
            return Err(AppError::bad_request(format!(
                "at most {MAX_FILES_PER_UPLOAD} files per upload"
            )));
        }
        let name = match names(&file_name) {
            Ok(n) => n,
            Err(err) if strict => return Err(err.into()),
            Err(err) => {
                form.refused.push((file_name, err.into()));
                continue;
            }
        };
        broker.check_room_to_stage()?;
        let temp = staging.join(new_id());
        guard.0.push(temp.clone());
        let mut out = tokio::fs::File::create(&temp)
            .await
            .map_err(|e| AppError::internal(format!("cannot stage upload: {e}")))?;
        let mut hasher = Sha256::new();
        let mut size = 0u64;
        let mut too_large = false;
        let mut next_disk_check = FREE_DISK_CHECK_BYTES;
        while let Some(chunk) = field
            .chunk()
            .await
            .map_err(|e| failed("upload interrupted", e))?
        {
            size += chunk.len() as u64;
            if size > max_bytes {
                too_large = true;
                break;
            }
            staged_bytes += chunk.len() as u64;
            if let Some(budget) = budget.filter(|b| staged_bytes > b.limit) {
                return Err(AppError::too_large(format!(
                    "the files of this upload together are over {}: each is kept, and \
                     placed in /mnt/data, and both copies count",
                    budget.describe()
                )));
            }
            if size >= next_disk_check {
                next_disk_check += FREE_DISK_CHECK_BYTES;
                broker.check_room_to_stage()?;
            }
            hasher.update(&chunk);
            out.write_all(&chunk)
                .await
                .map_err(|e| AppError::internal(format!("cannot stage upload: {e}")))?;
        }
        out.flush()
            .await
            .map_err(|e| AppError::internal(format!("cannot stage upload: {e}")))?;
        if too_large {
            let err = AppError::too_large(format!(
                "{file_name} is larger than the upload limit of {} MiB",
                broker.config().caps.max_upload_mb
            ));
            if strict {
                return Err(err);
            }
            // Skip the rest of this part so the next one can be read.
            while let Ok(Some(_)) = field.chunk().await {}
            if let Some(why) = cut.get() {
                return Err(why.to_error());
            }
            form.refused.push((file_name, err));
            continue;
        }
        form.staged.push(StagedFile {
            name,
            temp,
            sha256: hex::encode(hasher.finalize()),
            size,
        });
    }
    Ok((form, guard))
}

/// A non-file form field as text, read chunk by chunk and refused (413) past
/// [`MAX_TEXT_FIELD_BYTES`] without reading the rest.
async fn read_text_field(
    field: &mut multer::Field<'_>,
    name: &str,
    failed: &impl Fn(&str, multer::Error) -> AppError,
) -> AppResult<String> {
    let mut bytes = Vec::new();
    while let Some(chunk) = field
        .chunk()
        .await
        .map_err(|e| failed(&format!("malformed form field {name:?}"), e))?
    {
        if bytes.len() + chunk.len() > MAX_TEXT_FIELD_BYTES {
            return Err(AppError::too_large(format!(
                "form field {name:?} is over {} KiB",
                MAX_TEXT_FIELD_BYTES / 1024
            )));
        }
        bytes.extend_from_slice(&chunk);
    }
    String::from_utf8(bytes)
        .map_err(|_| AppError::bad_request(format!("form field {name:?} is not UTF-8")))
}

/// The session an upload goes to. Shared files (see [`shares_in_tenant`]) get a new
/// session of the caller's tenant, each upload its own. Others: `session_id` when visible,
/// else the session of `entity_id`, else a new one (with no sandbox until code runs in it).
async fn upload_session(
    state: &AppState,
    user: Option<&str>,
    tenant: Option<&str>,
    fields: &HashMap<String, String>,
) -> AppResult<Arc<Session>> {
    let broker = &state.broker;
    let field = |k: &str| fields.get(k).map(|v| v.trim()).filter(|v| !v.is_empty());
    if let (true, Some(tenant)) = (shares_in_tenant(fields), tenant) {
        if let Some(id) = field("session_id").or(field("storage_session_id")) {
            if !is_valid_id(id) {
                return Err(AppError::bad_request(format!("invalid session_id: {id:?}")));
            }
        }
        return Ok(broker
            .new_shared_session(user, tenant, field("entity_id"))
            .await?);
    }
    let session_id = field("session_id").or(field("storage_session_id"));
    if let Some(id) = session_id.filter(|id| !is_valid_id(id)) {
        return Err(AppError::bad_request(format!("invalid session_id: {id:?}")));
    }
    Ok(broker
        .session_for_upload(tenant, user, session_id, field("entity_id"))
        .await?)
}

/// Whether an upload's files are shared in the caller's tenant: `kind` `skill` or `agent`
/// (LibreChat v0.8.5+: a skill's files, an agent's files), or, without a `kind`, an
/// `entity_id` (classic LibreChat: an agent's or assistant's files). Chat attachments
/// (`kind=user`, or neither field) stay the user's.
fn shares_in_tenant(fields: &HashMap<String, String>) -> bool {
    let field = |k: &str| fields.get(k).map(|v| v.trim()).filter(|v| !v.is_empty());
    match field("kind") {
        Some(kind) => matches!(kind, "skill" | "agent"),
        None => field("entity_id").is_some(),
    }
}

fn upload_options(fields: &HashMap<String, String>, by: Option<&str>) -> UploadOptions {
    let read_only = fields
        .get("read_only")
        .map(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "true" | "1" | "yes"))
        .unwrap_or(false);
    UploadOptions {
        read_only,
        kind: fields
            .get("kind")
            .map(|k| k.trim().to_string())
            .filter(|k| !k.is_empty()),
        by: by.map(str::to_string),
    }
}

/// Uploads one file (multipart field `file`) to a session.
#[utoipa::path(
    post,
    path = "/upload",
    tag = "files",
    security(("api_key" = []), ("bearer" = [])),
    request_body(content_type = "multipart/form-data", content = crate::http::openapi::UploadFormDoc),
    responses(
        (status = 200, description = "`{message, session_id, storage_session_id, files[{fileId, filename, id, size}]}`", content_type = "application/json"),
        (status = 400, description = "No file, or a bad name", body = crate::http::openapi::ErrorBody),
        crate::http::openapi::Unauthorized,
        (status = 408, description = "The body came slower than 64 KiB per CODEBROKER_UPLOAD_STALL_SECS", body = crate::http::openapi::ErrorBody),
        (status = 413, description = "Larger than CODEBROKER_MAX_UPLOAD_MB, or the files together over the storage budget", body = crate::http::openapi::ErrorBody),
        (status = 503, description = "The data volume is below CODEBROKER_MIN_FREE_DISK", body = crate::http::openapi::ErrorBody),
    )
)]
pub(super) async fn upload(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    body: Body,
) -> AppResult<Json<Value>> {
    let (mut form, guard) = read_form(
        &state.broker,
        &headers,
        body,
        true,
        &Broker::check_upload_name,
    )
    .await?;
    if form.staged.is_empty() {
        return Err(AppError::bad_request(
            "no file in the upload: send multipart field `file`".into(),
        ));
    }
    let user = caller.user_or(form.fields.get("user_id").map(String::as_str));
    let session = upload_session(
        &state,
        user.as_deref(),
        caller.tenant.as_deref(),
        &form.fields,
    )
    .await?;
    let staged = std::mem::take(&mut form.staged);
    let records = state
        .broker
        .store_uploads(
            &session,
            staged,
            upload_options(&form.fields, user.as_deref()),
        )
        .await?;
    drop(guard);
    let files: Vec<Value> = records
        .iter()
        .map(|r| json!({ "fileId": r.id, "filename": r.name, "id": r.id, "size": r.size }))
        .collect();
    Ok(Json(json!({
        "message": "success",
        "session_id": session.id(),
        "storage_session_id": session.id(),
        "files": files,
    })))
}

/// Uploads several files (multipart fields `file`); bad ones are reported per file.
#[utoipa::path(
    post,
    path = "/upload/batch",
    tag = "files",
    security(("api_key" = []), ("bearer" = [])),
    request_body(content_type = "multipart/form-data", content = crate::http::openapi::UploadFormDoc),
    responses(
        (status = 200, description = "`{message: success | partial_success | error, session_id, files[{status, fileId?, filename, error?}], succeeded, failed}`", content_type = "application/json"),
        (status = 400, description = "No file in the upload", body = crate::http::openapi::ErrorBody),
        crate::http::openapi::Unauthorized,
    )
)]
pub(super) async fn upload_batch(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    body: Body,
) -> AppResult<Json<Value>> {
    let (mut form, guard) = read_form(
        &state.broker,
        &headers,
        body,
        false,
        &Broker::check_upload_name,
    )
    .await?;
    if form.staged.is_empty() && form.refused.is_empty() {
        return Err(AppError::bad_request(
            "no file in the upload: send multipart fields `file`".into(),
        ));
    }
    let user = caller.user_or(form.fields.get("user_id").map(String::as_str));
    let session = upload_session(
        &state,
        user.as_deref(),
        caller.tenant.as_deref(),
        &form.fields,
    )
    .await?;
    let staged = std::mem::take(&mut form.staged);
    let records = if staged.is_empty() {
        Vec::new()
    } else {
        state
            .broker
            .store_uploads(
                &session,
                staged,
                upload_options(&form.fields, user.as_deref()),
            )
            .await?
    };
    drop(guard);
    let mut files: Vec<Value> = records
        .iter()
        .map(|r| json!({ "status": "success", "fileId": r.id, "filename": r.name, "size": r.size }))
        .collect();
    files.extend(form.refused.iter().map(
        |(name, err)| json!({ "status": "error", "filename": name, "error": err.to_string() }),
    ));
    let (succeeded, failed) = (records.len(), form.refused.len());
    let message = match (succeeded, failed) {
        (_, 0) => "success",
        (0, _) => "error",
        _ => "partial_success",
    };
    Ok(Json(json!({
        "message": message,
        "session_id": session.id(),
        "storage_session_id": session.id(),
        "files": files,
        "succeeded": succeeded,
        "failed": failed,
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn skills_agents_and_classic_entities_are_shared_chat_files_are_not() {
        assert!(shares_in_tenant(&fields(&[
            ("kind", "skill"),
            ("id", "s1"),
            ("version", "3")
        ])));
        assert!(shares_in_tenant(&fields(&[
            ("kind", "agent"),
            ("id", "agent_1")
        ])));
        assert!(shares_in_tenant(&fields(&[("entity_id", "asst_1")])));
        assert!(!shares_in_tenant(&fields(&[
            ("kind", "user"),
            ("id", "u1")
        ])));
        assert!(!shares_in_tenant(&fields(&[
            ("kind", "user"),
            ("entity_id", "asst_1")
        ])));
        assert!(!shares_in_tenant(&fields(&[("entity_id", " ")])));
        assert!(!shares_in_tenant(&fields(&[])));
        assert!(!shares_in_tenant(&fields(&[("kind", "other")])));
    }
}
