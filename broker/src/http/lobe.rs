//! LobeChat plugin (docs/API.md, "LobeChat plugin"): `GET /lobe/manifest.json`, public, and
//! `POST /lobe/run`, which LobeChat's plugin gateway calls with the model's arguments as
//! the raw body (a string, so `text/plain`) and the user's plugin settings as JSON in the
//! `X-Lobe-Plugin-Settings` header. The answer is markdown the model reads.
//!
//! The manifest follows `pluginManifestSchema` of `@lobehub/chat-plugin-sdk` (zod): `api`
//! entries `{name, description, parameters: {type: "object", properties, required?}, url?}`,
//! `identifier`, `meta {avatar?, description?, tags?, title?}`, `settings` of the same
//! object-schema shape, optional `systemRole`, `type`, `author`, `homepage`, `version: "1"`.

use super::exec::ExecBody;
use super::{AppState, GatewayJson};
use crate::config::{AuthMode, Config};
use crate::http::auth::{key_tenant, require_auth, Caller, Tenant};
use crate::http::error::AppResult;
use crate::render::lobe_markdown;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use sandbox_runner::Language;
use serde_json::{json, Value};

/// The header LobeChat's gateway sends the user's plugin settings in.
const SETTINGS_HEADER: &str = "x-lobe-plugin-settings";
/// The settings field holding the broker's API key.
const SETTINGS_KEY_FIELD: &str = "apiKey";

/// The manifest (public) and the run route (its own auth: the settings key, or the usual).
pub(crate) fn router(state: &AppState) -> Router<AppState> {
    let run = Router::new().route("/lobe/run", post(run)).route_layer(
        axum::middleware::from_fn_with_state(state.clone(), lobe_auth),
    );
    Router::new()
        .route("/lobe/manifest.json", get(manifest))
        .merge(run)
}

/// Accepts the API key from the plugin settings header; without a matching one, the usual
/// credentials (`X-API-Key`, `Authorization`) are checked as on every other route.
async fn lobe_auth(State(state): State<AppState>, mut request: Request, next: Next) -> Response {
    let config = state.broker.config();
    if config.access.auth == AuthMode::None {
        request.extensions_mut().insert(Tenant::open());
        return next.run(request).await;
    }
    if let Some(tenant) = settings_key(request.headers()).and_then(|key| key_tenant(config, &key)) {
        request.extensions_mut().insert(tenant);
        return next.run(request).await;
    }
    require_auth(State(state), request, next).await
}

/// The API key in `X-Lobe-Plugin-Settings` (`{"apiKey": "..."}`), when there is one.
fn settings_key(headers: &HeaderMap) -> Option<String> {
    let raw = headers.get(SETTINGS_HEADER)?.to_str().ok()?;
    let settings: Value = serde_json::from_str(raw).ok()?;
    let key = settings.get(SETTINGS_KEY_FIELD)?.as_str()?.trim();
    (!key.is_empty()).then(|| key.to_string())
}

/// The plugin manifest, built from the configuration (URLs, whether a key is required).
pub(crate) fn manifest_json(config: &Config) -> Value {
    let public_url = config.public_url.trim_end_matches('/');
    let langs: Vec<&str> = Language::ALL.iter().map(|l| l.as_str()).collect();
    let mut settings = json!({
        "type": "object",
        "properties": {
            SETTINGS_KEY_FIELD: {
                "type": "string",
                "title": "API key",
                "description": "The codebroker API key (CODEBROKER_API_KEY of the broker)",
                "format": "password",
            }
        }
    });
    if config.access.auth == AuthMode::Key {
        settings["required"] = json!([SETTINGS_KEY_FIELD]);
    }
    json!({
        "identifier": "codebroker",
        "version": "1",
        "type": "default",
        "author": "codebroker",
        "homepage": public_url,
        "meta": {
            "title": "Code interpreter",
            "avatar": "🧑‍💻",
            "description": format!("Run code in a sandbox ({}, with plotting in Python): \
    output, images and files come back.", Language::titles()),
            "tags": ["code", "python", "interpreter", "sandbox"],
        },
        "systemRole": "runCode runs code in a sandbox without network. Files are read and \
    written in /mnt/data. Each answer names a session_id: pass it to the next runCode call to \
    keep variables and files. Show the images of the answer to the user with their markdown.",
        "api": [{
            "name": "runCode",
            "description": "Run code and get its stdout, stderr, images and file links as \
    markdown. Matplotlib figures shown with plt.show() come back as images. Pass the session_id \
    of the previous answer to keep variables and files.",
            "url": format!("{public_url}/lobe/run"),
            "parameters": {
                "type": "object",
                "properties": {
                    "lang": {
                        "type": "string",
                        "enum": langs,
                        "description": format!("The language: {}", Language::names_explained()),
                    },
                    "code": {
                        "type": "string",
                        "description": "The program; its working directory is /mnt/data",
                    },
                    "session_id": {
                        "type": "string",
                        "description": "The session_id of the previous answer, to keep its \
    variables and files; leave it out the first time",
                    },
                },
                "required": ["lang", "code"],
            },
        }],
        "settings": settings,
    })
}

/// The LobeChat plugin manifest. No auth.
#[utoipa::path(
    get,
    path = "/lobe/manifest.json",
    tag = "lobe",
    responses((status = 200, description = "The plugin manifest", content_type = "application/json"))
)]
async fn manifest(State(state): State<AppState>) -> Json<Value> {
    Json(manifest_json(state.broker.config()))
}

/// The model's arguments: what the manifest offers, and nothing that names a user, an
/// entity or other sessions' files. The body is written by the model, which a prompt
/// (or a file it reads) may steer; who the user is comes from the credentials only.
/// Other fields are ignored.
#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
pub(crate) struct LobeArgs {
    /// Language name or alias.
    lang: String,
    /// Source code.
    code: String,
    /// The session of an earlier answer.
    session_id: Option<String>,
}

/// Runs the plugin's arguments (`lang`, `code`, `session_id`) and answers markdown. The
/// key may also come as `apiKey` in `X-Lobe-Plugin-Settings`.
#[utoipa::path(
    post,
    path = "/lobe/run",
    tag = "lobe",
    security(("api_key" = []), ("bearer" = [])),
    request_body(content = LobeArgs, content_type = "application/json"),
    responses(
        (status = 200, description = "Output, images and file links as markdown", content_type = "text/markdown"),
        crate::http::openapi::BadExec,
        crate::http::openapi::Unauthorized,
        crate::http::openapi::WrongShape,
        crate::http::openapi::RateLimited,
    )
)]
async fn run(
    State(state): State<AppState>,
    caller: Caller,
    GatewayJson(args): GatewayJson<LobeArgs>,
) -> AppResult<Response> {
    let broker = state.broker.clone();
    // Under the key's whole scope (LobeChat names no user), the model may go back only
    // to sessions that name no user: a session id of a named user's session, leaked into
    // a chat, starts a new session instead.
    let session_id = broker.front_end_session_id(caller.user.as_deref(), args.session_id);
    let body = ExecBody {
        lang: args.lang,
        code: args.code,
        args: None,
        session_id,
        entity_id: None,
        user_id: None,
        runtime_session_hint: None,
        timeout: None,
        files: None,
    };
    let (choice, input) = body.into_parts(&caller)?;
    let output = broker
        .start_exec(&choice, input, Default::default())
        .await?
        .await?;
    let text = lobe_markdown(&output, &broker.config().public_url);
    Ok((
        [(header::CONTENT_TYPE, "text/markdown; charset=utf-8")],
        text,
    )
        .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_key_from_the_header() {
        let mut h = HeaderMap::new();
        assert_eq!(settings_key(&h), None);
        h.insert(SETTINGS_HEADER, r#"{"apiKey":" k1 "}"#.parse().unwrap());
        assert_eq!(settings_key(&h).as_deref(), Some("k1"));
        h.insert(SETTINGS_HEADER, r#"{"apiKey":""}"#.parse().unwrap());
        assert_eq!(settings_key(&h), None);
        h.insert(SETTINGS_HEADER, "not json".parse().unwrap());
        assert_eq!(settings_key(&h), None);
    }

    #[test]
    fn manifest_requires_a_key_only_under_key_auth() {
        let mut config = Config::for_tests("/tmp".into(), "t");
        let m = manifest_json(&config);
        assert!(m["settings"].get("required").is_none());
        assert_eq!(m["api"][0]["url"], "http://127.0.0.1:8000/lobe/run");
        config.access.auth = AuthMode::Key;
        let m = manifest_json(&config);
        assert_eq!(m["settings"]["required"], json!(["apiKey"]));
    }
}
