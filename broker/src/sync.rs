//! Locks taken even when poisoned. The broker's mutexes guard maps, counters and queues
//! that no code leaves half-updated across a panic, so a panic in one request must not
//! turn every later use of the lock into another panic.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// [`Mutex::lock`] that takes a poisoned lock as it is.
pub(crate) trait LockExt<T> {
    /// The guard, poisoned or not.
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T> LockExt<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_is_still_taken() {
        let m = std::sync::Arc::new(Mutex::new(1));
        let poisoner = m.clone();
        let _ = std::thread::spawn(move || {
            let _guard = poisoner.lock().expect("lock");
            panic!("poison it");
        })
        .join();
        assert!(m.lock().is_err(), "poisoned");
        *m.locked() += 1;
        assert_eq!(*m.locked(), 2);
    }
}
