//! The groups of rows, each run when `BENCH_ROWS` names it (or names none): `warm`,
//! `new`, `chat`, `runsc`, `burst`, `files`, `idle`, `churn`, `e2b`, `jupyter`.

pub(crate) mod burst;
pub(crate) mod chat;
pub(crate) mod churn;
pub(crate) mod e2b;
pub(crate) mod files;
pub(crate) mod idle;
pub(crate) mod jupyter;
pub(crate) mod new_session;
pub(crate) mod warm;
