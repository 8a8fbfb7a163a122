//! Locks taken even when poisoned: the helper the broker shares with the runner.

pub(crate) use sandbox_runner::sync::LockExt;
