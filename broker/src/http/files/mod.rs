//! Files of a session: uploads, listings, object metadata, deletion and downloads
//! (docs/API.md, "Files"), for both contract generations.

pub(super) mod download;
pub(crate) use download::content_disposition;
mod guard;
pub(crate) mod upload;

use super::AppState;
use crate::http::auth::Caller;
use crate::http::error::{AppError, AppResult};
use crate::ids::is_valid_id;
use crate::render::content_type;
use crate::session::Session;
use crate::workspace::FileRecord;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;

pub(crate) fn router() -> Router<AppState> {
    Router::new()
        .route(
            "/upload",
            // Sizes are enforced per file while streaming, not by buffering the body; the
            // multipart structure and the body's rate are bounded as it comes (`guard`).
            post(upload::upload).layer(DefaultBodyLimit::disable()),
        )
        .route(
            "/upload/batch",
            post(upload::upload_batch).layer(DefaultBodyLimit::disable()),
        )
        .route("/files/{session_id}", get(list_files))
        .route(
            "/files/{session_id}/{file_id}",
            axum::routing::delete(delete_file),
        )
        .route(
            "/sessions/{session_id}/objects/{file_id}",
            get(object_info).delete(delete_object),
        )
        .route("/download/{session_id}/{file_id}", get(download::download))
}

/// The session `session_id` if the caller may read it: its own, or one shared in its
/// tenant (see [`Broker::readable_session`]).
///
/// [`Broker::readable_session`]: crate::core::Broker::readable_session
fn readable_session(
    state: &AppState,
    caller: &Caller,
    session_id: &str,
) -> AppResult<Arc<Session>> {
    Ok(state.broker.readable_session(
        caller.user.as_deref(),
        caller.tenant.as_deref(),
        session_id,
    )?)
}

/// The live record of `file_id` in a session the caller may read.
fn readable_record(
    state: &AppState,
    caller: &Caller,
    session_id: &str,
    file_id: &str,
) -> AppResult<(Arc<Session>, FileRecord)> {
    Ok(state.broker.readable_record(
        caller.user.as_deref(),
        caller.tenant.as_deref(),
        session_id,
        file_id,
    )?)
}

// ---------------------------------------------------------------------------------------
// Listing, metadata, deletion
// ---------------------------------------------------------------------------------------

/// Milliseconds since the epoch as ISO-8601 (RFC 3339, UTC).
pub(crate) fn iso8601(ms: u64) -> String {
    time::OffsetDateTime::from_unix_timestamp_nanos(ms as i128 * 1_000_000)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_default()
}

pub(super) fn base_name(name: &str) -> &str {
    name.rsplit('/').next().unwrap_or(name)
}

/// The session's current files; an unknown session is `[]`.
#[utoipa::path(
    get,
    path = "/files/{session_id}",
    tag = "files",
    security(("api_key" = []), ("bearer" = [])),
    params(
        ("session_id" = String, Path, description = "The session"),
        ("detail" = Option<String>, Query, description = "summary (default), full, simple or normalized"),
    ),
    responses(
        (status = 200, description = "The files, in the shape `detail` asks for", content_type = "application/json"),
        (status = 400, description = "Malformed session id", body = crate::http::openapi::ErrorBody),
        crate::http::openapi::Unauthorized,
    )
)]
async fn list_files(
    State(state): State<AppState>,
    caller: Caller,
    Path(session_id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> AppResult<Json<Value>> {
    if !is_valid_id(&session_id) {
        return Err(AppError::bad_request(format!(
            "invalid session id: {session_id:?}"
        )));
    }
    // An unknown session (or another user's, or another tenant's) is an empty list:
    // clients probe with old ids.
    let Ok(session) = readable_session(&state, &caller, &session_id) else {
        return Ok(Json(json!([])));
    };
    let records: Vec<FileRecord> = session
        .index()
        .files
        .iter()
        .filter(|r| r.current && !state.broker.is_expired(r))
        .cloned()
        .collect();
    let s = session.id();
    let detail = query.get("detail").map(String::as_str).unwrap_or("summary");
    let list: Vec<Value> = records
        .iter()
        .map(|r| {
            let modified = iso8601(r.created_ms);
            match detail {
                "full" => json!({
                    "name": format!("{s}/{}", r.id),
                    "id": r.id,
                    "session_id": s,
                    "storage_session_id": s,
                    "size": r.size,
                    "contentType": content_type(base_name(&r.name)),
                    "lastModified": modified,
                    "metadata": { "original-filename": r.name },
                }),
                "simple" => json!({
                    "id": r.id,
                    "name": r.name,
                    "size": r.size,
                    "lastModified": modified,
                }),
                "normalized" => json!({
                    "id": r.id,
                    "name": r.name,
                    "path": format!("/mnt/data/{}", r.name),
                    "session_id": s,
                    "storage_session_id": s,
                    "size": r.size,
                    "contentType": content_type(base_name(&r.name)),
                    "lastModified": modified,
                    "kind": r.kind,
                    "read_only": r.read_only,
                }),
                // `fileId` (and `id`): what LibreChat's liveness probe looks for
                // (`checkSessionsAlive`: `data.some(f => f.fileId === ref.file_id)`).
                _ => json!({
                    "name": format!("{s}/{}", r.id),
                    "fileId": r.id,
                    "id": r.id,
                    "lastModified": modified,
                }),
            }
        })
        .collect();
    Ok(Json(Value::Array(list)))
}

/// One file's metadata.
#[utoipa::path(
    get,
    path = "/sessions/{session_id}/objects/{file_id}",
    tag = "files",
    security(("api_key" = []), ("bearer" = [])),
    params(
        ("session_id" = String, Path, description = "The session"),
        ("file_id" = String, Path, description = "The file"),
    ),
    responses(
        (status = 200, description = "`{name, originalFilename, size, contentType, lastModified, readOnly}`", content_type = "application/json"),
        crate::http::openapi::FileLookup,
        crate::http::openapi::Unauthorized,
    )
)]
async fn object_info(
    State(state): State<AppState>,
    caller: Caller,
    Path((session_id, file_id)): Path<(String, String)>,
) -> AppResult<Json<Value>> {
    let (_, record) = readable_record(&state, &caller, &session_id, &file_id)?;
    // `originalFilename` is the name LibreChat puts a recovered file at in the sandbox
    // (`getCodeFileInfo`); `lastModified` decides whether its upload is still fresh.
    Ok(Json(json!({
        "name": record.name,
        "originalFilename": record.name,
        "size": record.size,
        "contentType": content_type(base_name(&record.name)),
        "lastModified": iso8601(record.created_ms),
        "readOnly": record.read_only,
    })))
}

/// Deletes a file (classic path).
#[utoipa::path(
    delete,
    path = "/files/{session_id}/{file_id}",
    tag = "files",
    security(("api_key" = []), ("bearer" = [])),
    params(
        ("session_id" = String, Path, description = "The session"),
        ("file_id" = String, Path, description = "The file"),
    ),
    responses(
        (status = 200, description = "`{message, session_id, fileId}`", content_type = "application/json"),
        crate::http::openapi::FileLookup,
        crate::http::openapi::Unauthorized,
        (status = 403, description = "A shared (skill or agent) file: read-only", body = crate::http::openapi::ErrorBody),
    )
)]
async fn delete_file(
    State(state): State<AppState>,
    caller: Caller,
    Path((session_id, file_id)): Path<(String, String)>,
) -> AppResult<Json<Value>> {
    let (session, _) = readable_record(&state, &caller, &session_id, &file_id)?;
    if session.is_shared() {
        return Err(AppError::forbidden(format!(
            "file {file_id} is a shared file (a skill's or an agent's): shared files are \
             read-only for everyone and expire after {} s; upload a new version instead",
            state.broker.config().lifecycle.file_ttl_secs
        )));
    }
    state
        .broker
        .delete_file(&session, &file_id, caller.user.as_deref())
        .await?;
    Ok(Json(json!({
        "message": "File deleted successfully",
        "session_id": session_id,
        "fileId": file_id,
    })))
}

/// Deletes a file (new contract generation's path).
#[utoipa::path(
    delete,
    path = "/sessions/{session_id}/objects/{file_id}",
    tag = "files",
    security(("api_key" = []), ("bearer" = [])),
    params(
        ("session_id" = String, Path, description = "The session"),
        ("file_id" = String, Path, description = "The file"),
    ),
    responses(
        (status = 200, description = "`{message, session_id, fileId}`", content_type = "application/json"),
        crate::http::openapi::FileLookup,
        crate::http::openapi::Unauthorized,
        (status = 403, description = "A shared (skill or agent) file: read-only", body = crate::http::openapi::ErrorBody),
    )
)]
async fn delete_object(
    state: State<AppState>,
    caller: Caller,
    path: Path<(String, String)>,
) -> AppResult<Json<Value>> {
    delete_file(state, caller, path).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_iso8601() {
        assert_eq!(iso8601(0), "1970-01-01T00:00:00Z");
        assert_eq!(iso8601(1_700_000_000_123), "2023-11-14T22:13:20.123Z");
    }
}
