//! The wire protocol between the codebroker broker and the runner inside each sandbox.
//!
//! The broker attaches to the container's stdin/stdout (no TTY) and both sides exchange
//! newline-delimited JSON frames. Every frame is a [`Multiplexed`] pair of a job id and a
//! message, so that later requests (a cancel, a tool result) can be matched to the job they
//! concern. Requests flow as [`CoordinatorMessage`], answers as [`WorkerMessage`]; each
//! request type names its response type through [`Request::Response`].
//!
//! This crate's library holds the protocol and the one lock helper both sides use
//! ([`sync`]); the binary is the runner itself.

pub mod files;
pub mod installs;
pub mod language;
pub mod protocol;
pub mod state;
pub mod sync;
pub mod tunnel;

pub use files::*;
pub use installs::*;
pub use language::Language;
pub use protocol::*;
pub use state::*;
pub use tunnel::*;
