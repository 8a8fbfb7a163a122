//! The one error type of the HTTP layer, rendered as the JSON envelope of docs/API.md
//! `{"error": "<code>", "message": "<text>"}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::core::Error;

/// The challenge of a 401 to HTTP Basic credentials.
pub(crate) const BASIC_CHALLENGE: &str = "Basic realm=\"codebroker\", charset=\"UTF-8\"";

/// Everything a request can fail with: the core's errors, wrapped, and the few only HTTP
/// has (a body that does not parse, credentials, media types). Internal errors are logged
/// in full and shown to clients only as a generic message.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AppError {
    /// What the core failed with; its variant says the status and code.
    #[error(transparent)]
    Core(#[from] Error),
    /// A JSON body that parses but does not fit the request's shape: 422.
    #[error("{0}")]
    Unprocessable(String),
    #[error("missing or invalid credentials")]
    Unauthorized,
    /// HTTP Basic credentials that carry no key, and why (they never say which key was
    /// nearly right): 401 with a Basic challenge.
    #[error("{0}")]
    BadBasicCredentials(String),
    /// The client sent its request too slowly (an upload below its minimum rate): 408.
    #[error("{0}")]
    RequestTimeout(String),
    #[error("{0}")]
    UnsupportedMediaType(String),
}

impl From<anyhow::Error> for AppError {
    fn from(err: anyhow::Error) -> AppError {
        AppError::Core(Error::Internal(err))
    }
}

/// The core's errors by the names the handlers use.
impl AppError {
    pub(crate) fn internal(context: impl std::fmt::Display) -> AppError {
        AppError::Core(Error::internal(context))
    }

    pub(crate) fn bad_request(message: String) -> AppError {
        AppError::Core(Error::BadRequest(message))
    }

    pub(crate) fn unsupported_language(name: String) -> AppError {
        AppError::Core(Error::UnsupportedLanguage(name))
    }

    pub(crate) fn forbidden(message: String) -> AppError {
        AppError::Core(Error::Forbidden(message))
    }

    pub(crate) fn not_found(message: String) -> AppError {
        AppError::Core(Error::NotFound(message))
    }

    pub(crate) fn too_large(message: String) -> AppError {
        AppError::Core(Error::TooLarge(message))
    }

    pub(crate) fn unavailable(message: String) -> AppError {
        AppError::Core(Error::Unavailable(message))
    }

    fn status(&self) -> StatusCode {
        match self {
            AppError::Core(err) => match err {
                Error::BadRequest(_) | Error::UnsupportedLanguage(_) => StatusCode::BAD_REQUEST,
                Error::Forbidden(_) => StatusCode::FORBIDDEN,
                Error::NotFound(_) => StatusCode::NOT_FOUND,
                Error::Conflict(_) => StatusCode::CONFLICT,
                Error::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
                Error::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
                Error::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
                Error::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            },
            AppError::Unprocessable(_) => StatusCode::UNPROCESSABLE_ENTITY,
            AppError::Unauthorized | AppError::BadBasicCredentials(_) => StatusCode::UNAUTHORIZED,
            AppError::RequestTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            AppError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
        }
    }

    fn code(&self) -> &'static str {
        match self {
            AppError::Core(err) => match err {
                Error::BadRequest(_) => "bad_request",
                Error::UnsupportedLanguage(_) => "unsupported_language",
                Error::Forbidden(_) => "forbidden",
                Error::NotFound(_) => "not_found",
                Error::Conflict(_) => "conflict",
                Error::TooLarge(_) => "payload_too_large",
                Error::RateLimited { .. } => "rate_limited",
                Error::Unavailable(_) => "unavailable",
                Error::Internal(_) => "internal_error",
            },
            AppError::Unprocessable(_) => "invalid_request",
            AppError::Unauthorized | AppError::BadBasicCredentials(_) => "unauthorized",
            AppError::RequestTimeout(_) => "request_timeout",
            AppError::UnsupportedMediaType(_) => "unsupported_media_type",
        }
    }

    /// The JSON body clients get.
    pub(crate) fn body(&self) -> serde_json::Value {
        let message = match self {
            AppError::Core(err) => err.client_message(),
            other => other.to_string(),
        };
        let mut body = json!({ "error": self.code(), "message": message });
        if let Some(seconds) = self.retry_after() {
            body["retry_after_seconds"] = json!(seconds);
        }
        body
    }

    /// When a retry may succeed, for a rate or cap refusal.
    fn retry_after(&self) -> Option<u64> {
        match self {
            AppError::Core(Error::RateLimited {
                retry_after_seconds,
                ..
            }) => Some(*retry_after_seconds),
            _ => None,
        }
    }
}

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        let status = self.status();
        let body = self.body();
        let mut response = (status, Json(body)).into_response();
        // A client that sent Basic credentials is told the scheme and realm again (RFC 9110
        // asks a 401 for a challenge). Other 401s carry none: a browser shown a Basic
        // challenge would open a login dialog over the playground.
        if let AppError::BadBasicCredentials(_) = self {
            response.headers_mut().insert(
                axum::http::header::WWW_AUTHENTICATE,
                axum::http::HeaderValue::from_static(BASIC_CHALLENGE),
            );
        }
        // The standard header too, for clients that know it rather than the body field.
        if let Some(seconds) = self.retry_after() {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(seconds),
            );
        }
        response
    }
}

pub(crate) type AppResult<T> = Result<T, AppError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_errors_are_hidden() {
        let err = AppError::internal("docker said /var/lib/secret is missing");
        let body = err.body();
        assert_eq!(body["error"], "internal_error");
        assert!(!body["message"].as_str().unwrap_or("").contains("secret"));
    }

    #[test]
    fn rate_limited_has_the_wait_in_body_and_header() {
        let err = AppError::Core(Error::RateLimited {
            message: "slow down".into(),
            retry_after_seconds: 7,
        });
        assert_eq!(err.body()["retry_after_seconds"], 7);
        let response = err.into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            response.headers().get(axum::http::header::RETRY_AFTER),
            Some(&axum::http::HeaderValue::from(7u64))
        );
    }

    #[test]
    fn unsupported_language_envelope() {
        let body = AppError::unsupported_language("cobol".into()).body();
        assert_eq!(body["error"], "unsupported_language");
        assert_eq!(body["message"], "Unsupported language: cobol");
    }
}
