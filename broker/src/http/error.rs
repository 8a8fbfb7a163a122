//! The one error type of the HTTP layer, rendered as the JSON envelope of docs/API.md
//! `{"error": "<code>", "message": "<text>"}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

/// The challenge of a 401 to HTTP Basic credentials.
pub(crate) const BASIC_CHALLENGE: &str = "Basic realm=\"codebroker\", charset=\"UTF-8\"";

/// Everything a request can fail with. Internal errors are logged in full and shown to
/// clients only as a generic message.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AppError {
    #[error("{0}")]
    BadRequest(String),
    #[error("Unsupported language: {0}")]
    UnsupportedLanguage(String),
    #[error("{0}")]
    Unprocessable(String),
    #[error("missing or invalid credentials")]
    Unauthorized,
    /// HTTP Basic credentials that carry no key, and why (they never say which key was
    /// nearly right): 401 with a Basic challenge.
    #[error("{0}")]
    BadBasicCredentials(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    PayloadTooLarge(String),
    /// The client sent its request too slowly (an upload below its minimum rate): 408.
    #[error("{0}")]
    RequestTimeout(String),
    #[error("{0}")]
    UnsupportedMediaType(String),
    #[error("{message}")]
    RateLimited {
        message: String,
        retry_after_seconds: u64,
    },
    #[error("{0}")]
    Unavailable(String),
    #[error(transparent)]
    Internal(#[from] anyhow::Error),
}

impl AppError {
    pub(crate) fn internal(context: impl std::fmt::Display) -> AppError {
        AppError::Internal(anyhow::anyhow!("{context}"))
    }

    fn status(&self) -> StatusCode {
        match self {
            AppError::BadRequest(_) | AppError::UnsupportedLanguage(_) => StatusCode::BAD_REQUEST,
            AppError::Unprocessable(_) => StatusCode::UNPROCESSABLE_ENTITY,
            AppError::Unauthorized | AppError::BadBasicCredentials(_) => StatusCode::UNAUTHORIZED,
            AppError::Forbidden(_) => StatusCode::FORBIDDEN,
            AppError::NotFound(_) => StatusCode::NOT_FOUND,
            AppError::Conflict(_) => StatusCode::CONFLICT,
            AppError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            AppError::RequestTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            AppError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            AppError::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            AppError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            AppError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn code(&self) -> &'static str {
        match self {
            AppError::BadRequest(_) => "bad_request",
            AppError::UnsupportedLanguage(_) => "unsupported_language",
            AppError::Unprocessable(_) => "invalid_request",
            AppError::Unauthorized | AppError::BadBasicCredentials(_) => "unauthorized",
            AppError::Forbidden(_) => "forbidden",
            AppError::NotFound(_) => "not_found",
            AppError::Conflict(_) => "conflict",
            AppError::PayloadTooLarge(_) => "payload_too_large",
            AppError::RequestTimeout(_) => "request_timeout",
            AppError::UnsupportedMediaType(_) => "unsupported_media_type",
            AppError::RateLimited { .. } => "rate_limited",
            AppError::Unavailable(_) => "unavailable",
            AppError::Internal(_) => "internal_error",
        }
    }

    /// The JSON body clients get.
    pub(crate) fn body(&self) -> serde_json::Value {
        let message = match self {
            AppError::Internal(err) => {
                tracing::error!(error = ?err, "internal error");
                crate::core::error::INTERNAL_MESSAGE.to_string()
            }
            other => other.to_string(),
        };
        let mut body = json!({ "error": self.code(), "message": message });
        if let AppError::RateLimited {
            retry_after_seconds,
            ..
        } = self
        {
            body["retry_after_seconds"] = json!(retry_after_seconds);
        }
        body
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
        if let AppError::RateLimited {
            retry_after_seconds,
            ..
        } = self
        {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(retry_after_seconds),
            );
        }
        response
    }
}

pub(crate) type AppResult<T> = Result<T, AppError>;

impl From<crate::core::Error> for AppError {
    /// The core's errors as the API answers them: each has its own status and code.
    fn from(err: crate::core::Error) -> AppError {
        use crate::core::Error;
        match err {
            Error::BadRequest(m) => AppError::BadRequest(m),
            Error::UnsupportedLanguage(m) => AppError::UnsupportedLanguage(m),
            Error::Forbidden(m) => AppError::Forbidden(m),
            Error::NotFound(m) => AppError::NotFound(m),
            Error::Conflict(m) => AppError::Conflict(m),
            Error::TooLarge(m) => AppError::PayloadTooLarge(m),
            Error::RateLimited {
                message,
                retry_after_seconds,
            } => AppError::RateLimited {
                message,
                retry_after_seconds,
            },
            Error::Unavailable(m) => AppError::Unavailable(m),
            Error::Internal(err) => AppError::Internal(err),
        }
    }
}

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
        let err = AppError::RateLimited {
            message: "slow down".into(),
            retry_after_seconds: 7,
        };
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
        let body = AppError::UnsupportedLanguage("cobol".into()).body();
        assert_eq!(body["error"], "unsupported_language");
        assert_eq!(body["message"], "Unsupported language: cobol");
    }
}
