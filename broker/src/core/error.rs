//! The one error type of the core: what choosing a session, running an exec or moving a
//! file can fail with. Front ends turn it into their own answer: `http/error.rs` into a
//! status and the JSON envelope, `mcp/` into the text a model reads.

/// Everything the core can fail with. Internal errors carry their full context for the
/// log; front ends show clients only a generic message for them.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    /// The request names something malformed (an id, a name).
    #[error("{0}")]
    BadRequest(String),
    /// A language name or alias the sandbox does not know.
    #[error("Unsupported language: {0}")]
    UnsupportedLanguage(String),
    /// The caller may not touch what it names.
    #[error("{0}")]
    Forbidden(String),
    /// What the request names does not exist (or is not visible to the caller).
    #[error("{0}")]
    NotFound(String),
    /// The request clashes with the state of the session (a name taken by a directory).
    #[error("{0}")]
    Conflict(String),
    /// Over a size budget (an upload, a session's or a user's storage).
    #[error("{0}")]
    TooLarge(String),
    /// Over a rate or a cap; worth retrying after `retry_after_seconds`.
    #[error("{message}")]
    RateLimited {
        /// What limit was hit, for the client.
        message: String,
        /// When a retry may succeed.
        retry_after_seconds: u64,
    },
    /// The broker cannot serve this now (disk full, image unreadable, too many sessions).
    #[error("{0}")]
    Unavailable(String),
    /// A fault of the broker or its engine; details stay in the log.
    #[error(transparent)]
    Internal(#[from] anyhow::Error),
}

impl Error {
    /// An internal error with its context.
    pub(crate) fn internal(context: impl std::fmt::Display) -> Error {
        Error::Internal(anyhow::anyhow!("{context}"))
    }

    /// The message a client may read: internal errors are logged in full and shown only
    /// as a generic message.
    pub(crate) fn client_message(&self) -> String {
        match self {
            Error::Internal(err) => {
                tracing::error!(error = ?err, "internal error");
                INTERNAL_MESSAGE.to_string()
            }
            other => other.to_string(),
        }
    }
}

/// What clients read instead of an internal error's details.
pub(crate) const INTERNAL_MESSAGE: &str = "internal error; see the broker's log";

/// A result of the core.
pub(crate) type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// How a failed spawned task (`what`: "upload", "harvest") becomes an error:
    /// `.map_err(Error::task("upload"))`.
    pub(crate) fn task(what: &'static str) -> impl FnOnce(tokio::task::JoinError) -> Error {
        move |err| Error::internal(format!("{what} task failed: {err}"))
    }
}

impl From<tokio::task::JoinError> for Error {
    /// A spawned task of the core that panicked or was cancelled.
    fn from(err: tokio::task::JoinError) -> Error {
        Error::internal(format!("task failed: {err}"))
    }
}
