//! `GET /`: the playground, a page to try the broker in a browser (pick a language, run
//! with streamed output, upload files, see and download the session's files). Plain
//! HTML, CSS and JavaScript compiled into the binary: no build step, nothing from a CDN.
//! The page is public; the API calls it makes carry the key the user enters.

use super::AppState;
use crate::http::error::AppError;
use axum::extract::Path;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use sandbox_runner::language::LANGUAGES;
use serde_json::{json, Value};
use std::sync::LazyLock;

const INDEX_HTML: &str = include_str!("playground/index.html");
const APP_JS: &str = include_str!("playground/app.js");
const STYLE_CSS: &str = include_str!("playground/style.css");
/// The sample program of each language, from the language table, as
/// `[{"lang": "py", "code": "..."}, ...]`.
static SAMPLES_JSON: LazyLock<String> = LazyLock::new(|| {
    let samples: Vec<_> = LANGUAGES
        .iter()
        .map(|l| json!({ "lang": l.name, "code": l.hello }))
        .collect();
    Value::Array(samples).to_string()
});

/// The page only talks to its own origin; inline scripts and other hosts are refused.
const CSP: &str = "default-src 'self'; img-src 'self' data: blob:; style-src 'self'; \
                   script-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'; \
                   frame-ancestors 'none'";

pub(crate) fn router() -> Router<AppState> {
    Router::new()
        .route("/", get(page))
        .route("/playground/{asset}", get(asset))
}

/// The playground page.
#[utoipa::path(
    get,
    path = "/",
    tag = "playground",
    responses((status = 200, description = "The playground's HTML page", content_type = "text/html"))
)]
async fn page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        INDEX_HTML,
    )
        .into_response()
}

/// The playground's script, style sheet and sample programs.
#[utoipa::path(
    get,
    path = "/playground/{asset}",
    tag = "playground",
    params(("asset" = String, Path, description = "`app.js`, `style.css` or `samples.json`")),
    responses(
        (status = 200, description = "The asset"),
        (status = 404, description = "No such asset", body = crate::http::openapi::ErrorBody),
    )
)]
async fn asset(Path(asset): Path<String>) -> Result<Response, AppError> {
    let (content_type, body) = match asset.as_str() {
        "app.js" => ("text/javascript; charset=utf-8", APP_JS),
        "style.css" => ("text/css; charset=utf-8", STYLE_CSS),
        "samples.json" => ("application/json", SAMPLES_JSON.as_str()),
        _ => {
            return Err(AppError::not_found(format!(
                "no playground asset {asset:?}"
            )))
        }
    };
    Ok((
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response())
}
