//! Files of a session: downloads.

use super::AppState;
use crate::auth::Caller;
use crate::error::{AppError, AppResult};
use crate::ids::is_valid_id;
use crate::session::Session;
use crate::workspace::content_type;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use std::sync::Arc;

pub fn router() -> Router<AppState> {
    Router::new().route("/download/{session_id}/{file_id}", get(download))
}

/// Checks the ids' shape (400), finds the session (404) and checks the caller may see it
/// (404 too, so other users' sessions cannot be probed).
pub fn visible_session(
    state: &AppState,
    caller: &Caller,
    session_id: &str,
) -> AppResult<Arc<Session>> {
    if !is_valid_id(session_id) {
        return Err(AppError::BadRequest(format!(
            "invalid session id: {session_id:?}"
        )));
    }
    state
        .broker
        .registry
        .get(session_id)
        .filter(|s| s.visible_to(caller.user.as_deref()))
        .ok_or_else(|| AppError::NotFound(format!("session {session_id} not found")))
}

async fn download(
    State(state): State<AppState>,
    caller: Caller,
    Path((session_id, file_id)): Path<(String, String)>,
) -> AppResult<Response> {
    if !is_valid_id(&file_id) {
        return Err(AppError::BadRequest(format!(
            "invalid file id: {file_id:?}"
        )));
    }
    let session = visible_session(&state, &caller, &session_id)?;
    let not_found = || AppError::NotFound(format!("file {file_id} not found"));
    let record = session
        .index()
        .get(&file_id)
        .cloned()
        .ok_or_else(not_found)?;
    if !record.current {
        return Err(AppError::NotFound(format!(
            "file {file_id} was replaced by a newer version"
        )));
    }
    let workspace = session.workspace.clone();
    let name = record.name.clone();
    let (file, size) = tokio::task::spawn_blocking(move || workspace.open_file(&name))
        .await
        .map_err(|e| AppError::internal(format!("open task failed: {e}")))?
        .map_err(|_| not_found())?;
    // Streamed, so a large file is never held in memory.
    let stream = tokio_util::io::ReaderStream::new(tokio::fs::File::from_std(file));
    let base_name = record.name.rsplit('/').next().unwrap_or(&record.name);
    Ok((
        [
            (header::CONTENT_TYPE, content_type(base_name).to_string()),
            (header::CONTENT_LENGTH, size.to_string()),
            (header::CONTENT_DISPOSITION, content_disposition(base_name)),
        ],
        Body::from_stream(stream),
    )
        .into_response())
}

/// `attachment` with an ASCII fallback name and the exact name in RFC 5987 form.
pub fn content_disposition(name: &str) -> String {
    let fallback: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_graphic() && c != '"' && c != '\\' || c == ' ' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let mut encoded = String::new();
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            encoded.push(b as char);
        } else {
            encoded.push_str(&format!("%{b:02X}"));
        }
    }
    format!("attachment; filename=\"{fallback}\"; filename*=UTF-8''{encoded}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_filenames_use_rfc5987() {
        assert_eq!(
            content_disposition("données.csv"),
            "attachment; filename=\"donn_es.csv\"; filename*=UTF-8''donn%C3%A9es.csv"
        );
        assert_eq!(
            content_disposition("a \"b\".txt"),
            "attachment; filename=\"a _b_.txt\"; filename*=UTF-8''a%20%22b%22.txt"
        );
    }
}
