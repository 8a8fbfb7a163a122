//! envd's files: `GET /files` reads the live workspace, `POST /files` stores uploads
//! (multipart or octet-stream) through the core, so budgets, the audit log and file ids
//! apply; and the filesystem service (`Stat`, `ListDir`, `MakeDir`, `Remove`, `Move`),
//! each a short Bash exec in the sandbox, so it sees what the code sees, as its user.

use super::data::DataRequest;
use super::paths::{e2b_path, sandbox_path, workspace_relative};
use super::process::{read_message, run_script, shell_quote, unary_ok, RpcError};
use crate::core::files::{StagedFile, UploadOptions};
use crate::core::{Error, Verdict};
use crate::http::files::iso8601;
use crate::http::files::upload::read_form;
use crate::ids::new_id;
use axum::body::Body;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt as _;
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest as _, Sha256};
use std::path::PathBuf;
use tokio::io::AsyncWriteExt as _;

/// envd's REST error: `{"code": <status>, "message": ...}`.
fn rest_error(status: StatusCode, message: String) -> Response {
    (
        status,
        Json(json!({"code": status.as_u16(), "message": message})),
    )
        .into_response()
}

/// A core error as envd's REST answers it; a storage budget is envd's 507 ("not enough
/// disk space"), which the SDKs raise as their own error.
fn core_error(err: Error) -> Response {
    let status = match &err {
        Error::BadRequest(_) | Error::UnsupportedLanguage(_) => StatusCode::BAD_REQUEST,
        Error::Forbidden(_) => StatusCode::FORBIDDEN,
        Error::NotFound(_) => StatusCode::NOT_FOUND,
        Error::Conflict(_) => StatusCode::CONFLICT,
        Error::TooLarge(_) => StatusCode::INSUFFICIENT_STORAGE,
        Error::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
        Error::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        Error::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
    };
    rest_error(status, err.client_message())
}

/// The value of `name` in a raw query string, decoded.
pub(super) fn query_param(query: Option<&str>, name: &str) -> Option<String> {
    query?.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let decode = |s: &str| {
            percent_encoding::percent_decode_str(&s.replace('+', " "))
                .decode_utf8_lossy()
                .into_owned()
        };
        (decode(k) == name).then(|| decode(v))
    })
}

/// The workspace-relative file `path` names, or the answer refusing it.
fn file_path(path: Option<String>) -> Result<String, Box<Response>> {
    let Some(path) = path.filter(|p| !p.is_empty()) else {
        return Err(Box::new(rest_error(
            StatusCode::BAD_REQUEST,
            "path is required".to_string(),
        )));
    };
    match workspace_relative(&path) {
        Ok(relative) if relative.is_empty() => Err(Box::new(rest_error(
            StatusCode::BAD_REQUEST,
            format!("path '{path}' is a directory"),
        ))),
        Ok(relative) => Ok(relative),
        Err(why) => Err(Box::new(rest_error(StatusCode::FORBIDDEN, why))),
    }
}

/// `GET /files?path=`: the file's bytes.
pub(super) async fn read(request: DataRequest) -> Response {
    let relative = match file_path(query_param(request.query.as_deref(), "path")) {
        Ok(r) => r,
        Err(response) => return *response,
    };
    let broker = &request.state.broker;
    let cap = broker.config().caps.max_upload_mb * 1024 * 1024;
    match broker
        .read_live_file(&request.sandbox.session, &relative, cap)
        .await
    {
        Ok(bytes) => {
            let name = relative.rsplit('/').next().unwrap_or(&relative);
            (
                StatusCode::OK,
                [
                    (
                        header::CONTENT_TYPE,
                        crate::render::content_type(name).to_string(),
                    ),
                    (
                        header::CONTENT_DISPOSITION,
                        crate::http::files::content_disposition(name),
                    ),
                ],
                bytes,
            )
                .into_response()
        }
        Err(Error::NotFound(_)) => rest_error(
            StatusCode::NOT_FOUND,
            format!("path '{}' does not exist", e2b_path(&relative)),
        ),
        Err(err) => core_error(err),
    }
}

/// `POST /files`: multipart parts named `file` whose file names are their paths, or one
/// octet-stream body at `?path=`. Answers with an entry per file written.
pub(super) async fn write(request: DataRequest, body: Body) -> Response {
    let content_type = request
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    if request.headers.contains_key(header::CONTENT_ENCODING) {
        return rest_error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "codebroker takes uploads without Content-Encoding (gzip is not supported)".to_string(),
        );
    }
    let broker = request.state.broker.clone();
    let path = query_param(request.query.as_deref(), "path");
    let (staged, _guard) = if content_type.starts_with("multipart/") {
        // A part's file name is its path; without one it is `?path=`.
        let names = |name: &str| -> crate::core::Result<PathBuf> {
            let name = if name.is_empty() {
                path.clone().unwrap_or_default()
            } else {
                name.to_string()
            };
            match workspace_relative(&name) {
                Ok(r) if !r.is_empty() => Ok(PathBuf::from(r)),
                Ok(_) => Err(Error::BadRequest(format!("path '{name}' is a directory"))),
                Err(why) => Err(Error::Forbidden(why)),
            }
        };
        match read_form(&broker, &request.headers, body, true, &names).await {
            Ok((form, guard)) => (form.staged, Some(guard)),
            Err(err) => return err.into_response(),
        }
    } else {
        let relative = match file_path(path) {
            Ok(r) => r,
            Err(response) => return *response,
        };
        match stage_body(&broker, &relative, body).await {
            Ok(file) => (vec![file], None),
            Err(err) => return core_error(err),
        }
    };
    if staged.is_empty() {
        return rest_error(
            StatusCode::BAD_REQUEST,
            "no file in the request".to_string(),
        );
    }
    let temps: Vec<PathBuf> = staged.iter().map(|f| f.temp.clone()).collect();
    let stored = broker
        .store_uploads(&request.sandbox.session, staged, UploadOptions::default())
        .await;
    for temp in temps {
        let _ = tokio::fs::remove_file(temp).await;
    }
    match stored {
        Ok(records) => Json(
            records
                .iter()
                .map(|r| {
                    let name = r.name.rsplit('/').next().unwrap_or(&r.name);
                    json!({"path": e2b_path(&r.name), "name": name, "type": "file"})
                })
                .collect::<Vec<_>>(),
        )
        .into_response(),
        Err(err) => core_error(err),
    }
}

/// Stages an octet-stream body as the upload `relative`, bounded by the upload limit.
async fn stage_body(
    broker: &crate::core::Broker,
    relative: &str,
    body: Body,
) -> crate::core::Result<StagedFile> {
    let max_bytes = broker.config().caps.max_upload_mb * 1024 * 1024;
    broker.check_room_to_stage()?;
    let staging = broker.staging_dir();
    tokio::fs::create_dir_all(&staging)
        .await
        .map_err(|e| Error::internal(format!("cannot create staging dir: {e}")))?;
    let temp = staging.join(new_id());
    let result = async {
        let mut out = tokio::fs::File::create(&temp)
            .await
            .map_err(|e| Error::internal(format!("cannot stage upload: {e}")))?;
        let mut hasher = Sha256::new();
        let mut size = 0u64;
        let mut stream = body.into_data_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| Error::BadRequest(format!("upload interrupted: {e}")))?;
            size += chunk.len() as u64;
            if size > max_bytes {
                return Err(Error::TooLarge(format!(
                    "{relative} is larger than the upload limit of {} MiB",
                    broker.config().caps.max_upload_mb
                )));
            }
            hasher.update(&chunk);
            out.write_all(&chunk)
                .await
                .map_err(|e| Error::internal(format!("cannot stage upload: {e}")))?;
        }
        out.flush()
            .await
            .map_err(|e| Error::internal(format!("cannot stage upload: {e}")))?;
        Ok(StagedFile {
            name: PathBuf::from(relative),
            temp: temp.clone(),
            sha256: hex::encode(hasher.finalize()),
            size,
        })
    }
    .await;
    if result.is_err() {
        let _ = tokio::fs::remove_file(&temp).await;
    }
    result
}

/// What `find -printf` writes per entry: type (links followed), size, mode, owner,
/// group, mtime, link target, path; fields by tabs, entries by NUL.
const ENTRY_FORMAT: &str = r"'%Y\t%s\t%m\t%u\t%g\t%T@\t%l\t%p\0'";

/// Exit codes of the scripts below, for the answers they stand for.
const MISSING: i32 = 44;
const NOT_A_DIRECTORY: i32 = 45;
const EXISTS: i32 = 46;

/// A path of a filesystem request.
#[derive(Deserialize)]
struct PathRequest {
    #[serde(default)]
    path: String,
    #[serde(default)]
    depth: Option<u32>,
}

/// `MoveRequest`.
#[derive(Deserialize)]
struct MoveRequest {
    source: String,
    destination: String,
}

/// `filesystem.Filesystem/<method>`.
pub(super) async fn rpc(request: DataRequest, body: Body, method: &str) -> Response {
    let result = match method {
        "Stat" | "ListDir" | "MakeDir" | "Remove" => {
            match read_message::<PathRequest>(&request.headers, body).await {
                Ok(asked) => path_rpc(&request, method, asked).await,
                Err(e) => Err(e),
            }
        }
        "Move" => match read_message::<MoveRequest>(&request.headers, body).await {
            Ok(asked) => move_rpc(&request, asked).await,
            Err(e) => Err(e),
        },
        other => Err(RpcError::new(
            "unimplemented",
            format!("filesystem.Filesystem/{other} is not supported by codebroker"),
        )),
    };
    match result {
        Ok(message) => unary_ok(message),
        Err(error) => error.unary(),
    }
}

/// `path` below the workspace, or `permission_denied`.
fn rpc_path(path: &str) -> Result<String, RpcError> {
    workspace_relative(path).map_err(|why| RpcError::new("permission_denied", why))
}

async fn path_rpc(
    request: &DataRequest,
    method: &str,
    asked: PathRequest,
) -> Result<Value, RpcError> {
    let relative = rpc_path(&asked.path)?;
    let p = shell_quote(&sandbox_path(&relative));
    let script = match method {
        "Stat" => format!(
            "p={p}; [ -e \"$p\" ] || [ -L \"$p\" ] || exit {MISSING}\n\
             find \"$p\" -maxdepth 0 -printf {ENTRY_FORMAT}\n"
        ),
        "ListDir" => {
            let depth = asked.depth.unwrap_or(1).clamp(1, 64);
            format!(
                "p={p}; [ -e \"$p\" ] || exit {MISSING}; [ -d \"$p\" ] || exit {NOT_A_DIRECTORY}\n\
                 find \"$p\" -mindepth 1 -maxdepth {depth} -printf {ENTRY_FORMAT} 2>/dev/null; true\n"
            )
        }
        "MakeDir" => format!(
            "p={p}; [ -e \"$p\" ] && exit {EXISTS}; mkdir -p -- \"$p\" || exit 1\n\
             find \"$p\" -maxdepth 0 -printf {ENTRY_FORMAT}\n"
        ),
        _ => {
            if relative.is_empty() {
                return Err(RpcError::new(
                    "permission_denied",
                    "the workspace itself cannot be removed",
                ));
            }
            format!("rm -rf -- {p}\n")
        }
    };
    let run = run_script(request, script, None, None, None).await?;
    let shown = e2b_path(&relative);
    check_script(&run.verdict, &run.stderr, &shown)?;
    let entries = parse_entries(&run.stdout);
    Ok(match method {
        "ListDir" => json!({"entries": entries}),
        "Remove" => json!({}),
        _ => {
            json!({"entry": entries.into_iter().next().ok_or_else(|| RpcError::new("internal", "no entry"))?})
        }
    })
}

async fn move_rpc(request: &DataRequest, asked: MoveRequest) -> Result<Value, RpcError> {
    let (source, destination) = (rpc_path(&asked.source)?, rpc_path(&asked.destination)?);
    if source.is_empty() || destination.is_empty() {
        return Err(RpcError::new(
            "permission_denied",
            "the workspace itself cannot be moved",
        ));
    }
    let (s, d) = (
        shell_quote(&sandbox_path(&source)),
        shell_quote(&sandbox_path(&destination)),
    );
    let script = format!(
        "s={s}; d={d}; [ -e \"$s\" ] || [ -L \"$s\" ] || exit {MISSING}\n\
         mkdir -p -- \"$(dirname -- \"$d\")\" && mv -fT -- \"$s\" \"$d\" || exit 1\n\
         find \"$d\" -maxdepth 0 -printf {ENTRY_FORMAT}\n"
    );
    let run = run_script(request, script, None, None, None).await?;
    check_script(&run.verdict, &run.stderr, &e2b_path(&source))?;
    let entry = parse_entries(&run.stdout)
        .into_iter()
        .next()
        .ok_or_else(|| RpcError::new("internal", "no entry"))?;
    Ok(json!({"entry": entry}))
}

/// The error a filesystem script's verdict stands for.
fn check_script(verdict: &Verdict, stderr: &str, shown: &str) -> Result<(), RpcError> {
    match verdict {
        Verdict::Ok => Ok(()),
        Verdict::Failed(MISSING) => Err(RpcError::new(
            "not_found",
            format!("path '{shown}' does not exist"),
        )),
        Verdict::Failed(NOT_A_DIRECTORY) => Err(RpcError::new(
            "invalid_argument",
            format!("path '{shown}' is not a directory"),
        )),
        Verdict::Failed(EXISTS) => Err(RpcError::new(
            "already_exists",
            format!("path '{shown}' already exists"),
        )),
        _ => Err(RpcError::new(
            "internal",
            format!("the operation on '{shown}' failed: {}", stderr.trim()),
        )),
    }
}

/// `EntryInfo`s from the output of `find -printf ENTRY_FORMAT`.
fn parse_entries(output: &str) -> Vec<Value> {
    output
        .split('\0')
        .filter(|e| !e.is_empty())
        .filter_map(|entry| {
            let fields: Vec<&str> = entry.splitn(8, '\t').collect();
            let [kind, size, mode, owner, group, mtime, target, path] = fields[..] else {
                return None;
            };
            let relative = path
                .strip_prefix("/mnt/data")
                .map(|r| r.trim_start_matches('/'))?;
            let (file_type, type_char, dir_bit) = match kind {
                "d" => ("FILE_TYPE_DIRECTORY", 'd', 1u64 << 31),
                "f" => ("FILE_TYPE_FILE", '-', 0),
                // Broken links and special files: E2B's SDKs skip unknown types.
                _ => return None,
            };
            let perm = u64::from_str_radix(mode, 8).unwrap_or(0) & 0o7777;
            let seconds: f64 = mtime.parse().unwrap_or(0.0);
            let mut info = json!({
                "name": relative.rsplit('/').next().unwrap_or(relative),
                "type": file_type,
                "path": e2b_path(relative),
                "size": size,
                "mode": perm | dir_bit,
                "permissions": permissions(type_char, perm),
                "owner": owner,
                "group": group,
                "modifiedTime": iso8601((seconds * 1000.0) as u64),
            });
            if !target.is_empty() {
                info["symlinkTarget"] = json!(target);
            }
            Some(info)
        })
        .collect()
}

/// `ls -l`'s words for a mode: `drwxr-xr-x`.
fn permissions(type_char: char, perm: u64) -> String {
    let mut out = String::from(type_char);
    for shift in [6, 3, 0] {
        let bits = (perm >> shift) & 7;
        out.push(if bits & 4 != 0 { 'r' } else { '-' });
        out.push(if bits & 2 != 0 { 'w' } else { '-' });
        out.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn find_output_becomes_entry_infos() {
        let out = "f\t12\t644\tsandbox\tsandbox\t1700000000.5\t\t/mnt/data/a b.txt\0\
                   d\t4096\t755\tsandbox\tsandbox\t1700000000.0\t\t/mnt/data/dir\0\
                   N\t0\t777\tsandbox\tsandbox\t1700000000.0\tgone\t/mnt/data/broken\0";
        let entries = parse_entries(out);
        assert_eq!(entries.len(), 2, "{entries:?}");
        assert_eq!(entries[0]["name"], "a b.txt");
        assert_eq!(entries[0]["path"], "/home/user/a b.txt");
        assert_eq!(entries[0]["type"], "FILE_TYPE_FILE");
        assert_eq!(entries[0]["size"], "12");
        assert_eq!(entries[0]["permissions"], "-rw-r--r--");
        assert_eq!(entries[0]["modifiedTime"], "2023-11-14T22:13:20.5Z");
        assert_eq!(entries[1]["type"], "FILE_TYPE_DIRECTORY");
        assert_eq!(entries[1]["mode"], 0o755 | (1u64 << 31));
    }

    #[test]
    fn query_params_are_decoded() {
        let q = Some("path=%2Fhome%2Fuser%2Fa+b.txt&username=user");
        assert_eq!(
            query_param(q, "path").as_deref(),
            Some("/home/user/a b.txt")
        );
        assert_eq!(query_param(q, "username").as_deref(), Some("user"));
        assert_eq!(query_param(q, "other"), None);
    }
}
