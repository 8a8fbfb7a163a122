//! Jupyter's REST API as Jupyter Server's gateway client and Open WebUI call it: the
//! version, kernel specs, kernels (create, list, get, delete, interrupt, restart) and
//! sessions. Errors are codebroker's envelope, whose `message` Jupyter's clients show.

use super::{Kernel, Kernels};
use crate::core::is_env_name;
use crate::http::auth::Caller;
use crate::http::error::{AppError, AppResult};
use crate::http::AppState;
use crate::sync::LockExt as _;
use axum::body::Bytes;
use axum::extract::Path;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// The kernel spec every kernel is made from: Python, the one language whose state lasts
/// from cell to cell (the others run each exec as a new program).
pub(super) const PYTHON3: &str = "python3";

/// The version `GET /api` reports: the jupyter_server API this one follows.
const API_VERSION: &str = "2.17.0";

/// Most environment variables a create may set, and most bytes of them all.
const MAX_ENV_VARS: usize = 256;
const MAX_ENV_BYTES: usize = 64 * 1024;

/// What a client may read without a token, as on jupyter_server: the API version.
pub(super) fn public_router() -> Router<AppState> {
    Router::new().route("/api", get(version))
}

pub(super) fn router() -> Router<AppState> {
    Router::new()
        .route("/api/status", get(status))
        .route("/api/kernelspecs", get(kernelspecs))
        .route("/api/kernelspecs/{name}", get(kernelspec))
        .route("/kernelspecs/{name}/{*path}", get(kernelspec_resource))
        .route("/api/kernels", get(list_kernels).post(create_kernel))
        .route("/api/kernels/{id}", get(get_kernel).delete(delete_kernel))
        .route("/api/kernels/{id}/interrupt", post(interrupt_kernel))
        .route("/api/kernels/{id}/restart", post(restart_kernel))
        .route("/api/sessions", get(list_sessions).post(create_session))
        .route(
            "/api/sessions/{id}",
            get(get_session).delete(delete_session),
        )
}

async fn version() -> Json<Value> {
    Json(json!({"version": API_VERSION}))
}

/// jupyter_server's `/api/status`: what a client checks before it starts kernels.
async fn status(Extension(kernels): Extension<Arc<Kernels>>, caller: Caller) -> Json<Value> {
    let visible = kernels.visible(&caller);
    let last = visible
        .iter()
        .map(|k| k.last_activity_ms.load(Ordering::SeqCst))
        .max()
        .unwrap_or_else(crate::clock::now_ms);
    Json(json!({
        "started": super::timestamp(kernels.started_ms),
        "last_activity": super::timestamp(last),
        "connections": visible.iter().map(|k| k.connections.load(Ordering::SeqCst)).sum::<usize>(),
        "kernels": visible.len(),
    }))
}

/// The `python3` kernel spec, as `/api/kernelspecs` lists it.
fn python3_spec() -> Value {
    json!({
        "name": PYTHON3,
        "spec": {
            "argv": ["python3", "/opt/codebroker/kernel.py"],
            "env": {},
            "display_name": "Python 3 (codebroker sandbox)",
            "language": "python",
            "interrupt_mode": "message",
            "metadata": {"codebroker": {"sandboxed": true}},
        },
        "resources": {},
    })
}

async fn kernelspecs() -> Json<Value> {
    Json(json!({
        "default": PYTHON3,
        "kernelspecs": {PYTHON3: python3_spec()},
    }))
}

async fn kernelspec(Path(name): Path<String>) -> AppResult<Json<Value>> {
    if name != PYTHON3 {
        return Err(no_such_spec(&name));
    }
    Ok(Json(python3_spec()))
}

/// Kernel spec resources (logos): none are shipped, so clients fall back to their own.
async fn kernelspec_resource(Path((name, path)): Path<(String, String)>) -> AppError {
    AppError::not_found(format!(
        "kernel spec {:?} has no resource {:?}",
        super::clip(&name),
        super::clip(&path)
    ))
}

fn no_such_spec(name: &str) -> AppError {
    AppError::not_found(format!(
        "no such kernel spec {:?}: codebroker serves {PYTHON3}",
        super::clip(name)
    ))
}

/// A kernel's model, as jupyter_server answers it.
fn kernel_json(kernel: &Kernel) -> Value {
    json!({
        "id": kernel.id,
        "name": kernel.name,
        "last_activity": super::timestamp(kernel.last_activity_ms.load(Ordering::SeqCst)),
        "execution_state": kernel.execution_state(),
        "connections": kernel.connections.load(Ordering::SeqCst),
    })
}

async fn list_kernels(
    Extension(kernels): Extension<Arc<Kernels>>,
    caller: Caller,
) -> Json<Vec<Value>> {
    Json(
        kernels
            .visible(&caller)
            .iter()
            .map(|k| kernel_json(k))
            .collect(),
    )
}

/// `POST /api/kernels` body: Jupyter Server's gateway client sends the name and the
/// `KERNEL_*` variables; Open WebUI sends nothing.
#[derive(Deserialize, Default)]
struct NewKernel {
    name: Option<String>,
    #[serde(default)]
    env: Option<BTreeMap<String, String>>,
}

/// A JSON body, or a 400 saying why not; an empty body is the default.
fn parse_body<T: for<'de> Deserialize<'de> + Default>(body: &Bytes) -> AppResult<T> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body)
        .map_err(|e| AppError::bad_request(format!("invalid request body: {e}")))
}

/// The variables a create asks for, checked: names a program can read, bounded in number
/// and size.
fn checked_env(env: BTreeMap<String, String>) -> AppResult<BTreeMap<String, String>> {
    if env.len() > MAX_ENV_VARS {
        return Err(AppError::bad_request(format!(
            "{} environment variables: at most {MAX_ENV_VARS}",
            env.len()
        )));
    }
    let bytes: usize = env.iter().map(|(k, v)| k.len() + v.len()).sum();
    if bytes > MAX_ENV_BYTES {
        return Err(AppError::bad_request(format!(
            "the environment variables take {bytes} bytes: at most {MAX_ENV_BYTES}"
        )));
    }
    if let Some(bad) = env.keys().find(|k| !is_env_name(k)) {
        return Err(AppError::bad_request(format!(
            "invalid environment variable name {:?}",
            super::clip(bad)
        )));
    }
    if let Some(bad) = env.iter().find(|(_, v)| v.contains('\0')) {
        return Err(AppError::bad_request(format!(
            "environment variable {} holds a NUL byte",
            bad.0
        )));
    }
    Ok(env)
}

/// Starts a kernel: a new session with a pooled sandbox.
async fn new_kernel(
    kernels: &Kernels,
    caller: &Caller,
    name: Option<String>,
    env: BTreeMap<String, String>,
) -> AppResult<Arc<Kernel>> {
    let name = name.filter(|n| !n.is_empty()).unwrap_or(PYTHON3.into());
    if name != PYTHON3 {
        return Err(no_such_spec(&name));
    }
    let env = checked_env(env)?;
    let user = caller.user_or(None);
    let session = kernels
        .broker
        .new_session(caller.tenant.as_deref(), user.as_deref(), None, true)
        .await?;
    let kernel = Arc::new(Kernel {
        id: uuid::Uuid::new_v4().to_string(),
        name,
        session,
        tenant: caller.tenant.clone(),
        user: caller.authoritative.then(|| caller.user.clone()).flatten(),
        kernel_session: uuid::Uuid::new_v4().simple().to_string(),
        env,
        env_in: Mutex::default(),
        last_activity_ms: AtomicU64::new(crate::clock::now_ms()),
        busy: AtomicBool::new(false),
        connections: AtomicUsize::new(0),
        execution_count: AtomicU64::new(0),
        running: Mutex::default(),
        turn: tokio::sync::Mutex::new(()),
        ended: kernels.shutdown.child_token(),
        subscribers: Mutex::default(),
    });
    kernels
        .kernels
        .locked()
        .insert(kernel.id.clone(), kernel.clone());
    tracing::debug!(kernel = %kernel.id, session = kernel.session.id(), "jupyter kernel started");
    Ok(kernel)
}

async fn create_kernel(
    Extension(kernels): Extension<Arc<Kernels>>,
    caller: Caller,
    body: Bytes,
) -> AppResult<Response> {
    let asked: NewKernel = parse_body(&body)?;
    let kernel = new_kernel(&kernels, &caller, asked.name, asked.env.unwrap_or_default()).await?;
    Ok((
        StatusCode::CREATED,
        [(
            header::LOCATION,
            format!("/jupyter/api/kernels/{}", kernel.id),
        )],
        Json(kernel_json(&kernel)),
    )
        .into_response())
}

/// The kernel `id` of the caller, or a 404.
fn find(kernels: &Kernels, caller: &Caller, id: &str) -> AppResult<Arc<Kernel>> {
    kernels
        .get(caller, id)
        .ok_or_else(|| AppError::not_found(format!("Kernel does not exist: {}", super::clip(id))))
}

async fn get_kernel(
    Extension(kernels): Extension<Arc<Kernels>>,
    caller: Caller,
    Path(id): Path<String>,
) -> AppResult<Json<Value>> {
    let kernel = find(&kernels, &caller, &id)?;
    Ok(Json(kernel_json(&kernel)))
}

async fn delete_kernel(
    Extension(kernels): Extension<Arc<Kernels>>,
    caller: Caller,
    Path(id): Path<String>,
) -> AppResult<StatusCode> {
    let kernel = find(&kernels, &caller, &id)?;
    kernels.delete(&kernel);
    Ok(StatusCode::NO_CONTENT)
}

async fn interrupt_kernel(
    Extension(kernels): Extension<Arc<Kernels>>,
    caller: Caller,
    Path(id): Path<String>,
) -> AppResult<StatusCode> {
    let kernel = find(&kernels, &caller, &id)?;
    kernel.interrupt();
    kernel.touch();
    Ok(StatusCode::NO_CONTENT)
}

/// Restarts a kernel: the running cell stops, the sandbox is replaced and the Python state
/// forgotten; files stay, and the execution count starts again.
async fn restart_kernel(
    Extension(kernels): Extension<Arc<Kernels>>,
    caller: Caller,
    Path(id): Path<String>,
) -> AppResult<Json<Value>> {
    let kernel = find(&kernels, &caller, &id)?;
    kernel.interrupt();
    super::channels::restart(&kernels, &kernel).await;
    Ok(Json(kernel_json(&kernel)))
}

/// A Jupyter session: a notebook (or console) bound to a kernel.
#[derive(Clone)]
pub(super) struct JupyterSession {
    /// Its id, a UUID.
    id: String,
    /// The notebook's path, name and type, as the client gave them.
    path: String,
    name: String,
    kind: String,
    /// The kernel it uses.
    pub(super) kernel_id: String,
}

/// `POST /api/sessions` body.
#[derive(Deserialize, Default)]
struct NewSession {
    #[serde(default)]
    path: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    kernel: Option<KernelRef>,
}

/// A session's kernel: an existing one by id, or a new one by spec name.
#[derive(Deserialize, Default)]
struct KernelRef {
    id: Option<String>,
    name: Option<String>,
}

fn session_json(session: &JupyterSession, kernel: &Kernel) -> Value {
    json!({
        "id": session.id,
        "path": session.path,
        "name": session.name,
        "type": session.kind,
        "kernel": kernel_json(kernel),
        "notebook": {"path": session.path, "name": session.name},
    })
}

async fn list_sessions(
    Extension(kernels): Extension<Arc<Kernels>>,
    caller: Caller,
) -> Json<Vec<Value>> {
    let sessions: Vec<JupyterSession> = kernels.sessions.locked().values().cloned().collect();
    let mut listed: Vec<Value> = sessions
        .iter()
        .filter_map(|s| {
            Some(session_json(
                s,
                kernels.get(&caller, &s.kernel_id)?.as_ref(),
            ))
        })
        .collect();
    listed.sort_by(|a, b| a["id"].as_str().cmp(&b["id"].as_str()));
    Json(listed)
}

/// Most bytes of a session's path, name or type.
const MAX_SESSION_TEXT: usize = 4096;

async fn create_session(
    Extension(kernels): Extension<Arc<Kernels>>,
    caller: Caller,
    body: Bytes,
) -> AppResult<Response> {
    let asked: NewSession = parse_body(&body)?;
    let text = |v: Option<String>, what: &str| -> AppResult<String> {
        let v = v.unwrap_or_default();
        if v.len() > MAX_SESSION_TEXT {
            return Err(AppError::bad_request(format!(
                "the session's {what} is over {MAX_SESSION_TEXT} bytes"
            )));
        }
        Ok(v)
    };
    let path = text(asked.path, "path")?;
    let name = text(asked.name, "name")?;
    let kind = text(asked.kind.or(Some("notebook".into())), "type")?;
    let wanted = asked.kernel.unwrap_or_default();
    let kernel = match wanted.id {
        Some(id) => find(&kernels, &caller, &id)?,
        None => new_kernel(&kernels, &caller, wanted.name, BTreeMap::new()).await?,
    };
    let session = JupyterSession {
        id: uuid::Uuid::new_v4().to_string(),
        path,
        name,
        kind,
        kernel_id: kernel.id.clone(),
    };
    kernels
        .sessions
        .locked()
        .insert(session.id.clone(), session.clone());
    Ok((StatusCode::CREATED, Json(session_json(&session, &kernel))).into_response())
}

/// The session `id` of the caller with its kernel, or a 404.
fn find_session(
    kernels: &Kernels,
    caller: &Caller,
    id: &str,
) -> AppResult<(JupyterSession, Arc<Kernel>)> {
    let missing = || AppError::not_found(format!("Session not found: {}", super::clip(id)));
    let session = kernels
        .sessions
        .locked()
        .get(id)
        .cloned()
        .ok_or_else(missing)?;
    let kernel = kernels
        .get(caller, &session.kernel_id)
        .ok_or_else(missing)?;
    Ok((session, kernel))
}

async fn get_session(
    Extension(kernels): Extension<Arc<Kernels>>,
    caller: Caller,
    Path(id): Path<String>,
) -> AppResult<Json<Value>> {
    let (session, kernel) = find_session(&kernels, &caller, &id)?;
    Ok(Json(session_json(&session, &kernel)))
}

/// Ends a session and its kernel, as jupyter_server does.
async fn delete_session(
    Extension(kernels): Extension<Arc<Kernels>>,
    caller: Caller,
    Path(id): Path<String>,
) -> AppResult<StatusCode> {
    let (_, kernel) = find_session(&kernels, &caller, &id)?;
    kernels.delete(&kernel);
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_names_and_sizes_are_checked() {
        let ok: BTreeMap<String, String> = [("KERNEL_USERNAME".into(), "ann".into())].into();
        assert!(checked_env(ok).is_ok());
        let bad: BTreeMap<String, String> = [("A B".into(), "x".into())].into();
        assert!(checked_env(bad).is_err());
        let nul: BTreeMap<String, String> = [("A".into(), "x\0y".into())].into();
        assert!(checked_env(nul).is_err());
        let many: BTreeMap<String, String> = (0..=MAX_ENV_VARS)
            .map(|i| (format!("V{i}"), String::new()))
            .collect();
        assert!(checked_env(many).is_err());
        let big: BTreeMap<String, String> = [("V".into(), "x".repeat(MAX_ENV_BYTES))].into();
        assert!(checked_env(big).is_err());
    }

    #[test]
    fn an_empty_body_is_the_default() {
        let asked: NewKernel = parse_body(&Bytes::new()).expect("empty is fine");
        assert!(asked.name.is_none());
        assert!(parse_body::<NewKernel>(&Bytes::from_static(b"{")).is_err());
        let asked: NewKernel = parse_body(&Bytes::from_static(
            br#"{"name":"python3","env":{"KERNEL_X":"1"}}"#,
        ))
        .expect("gateway body");
        assert_eq!(asked.name.as_deref(), Some("python3"));
    }
}
