//! Locks taken even when poisoned, for the broker and the runner alike. Their mutexes guard
//! maps, counters and queues that no code leaves half-updated across a panic, so a panic in
//! one request (or one thread) must not turn every later use of the lock into another panic.

use std::sync::{LockResult, Mutex, MutexGuard, PoisonError};

/// [`Mutex::lock`] that takes a poisoned lock as it is.
pub trait LockExt<T> {
    /// The guard, poisoned or not.
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T> LockExt<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        unpoisoned(self.lock())
    }
}

/// The guard of a lock result (of a `lock` or a `Condvar` wait), poisoned or not.
pub fn unpoisoned<G>(result: LockResult<G>) -> G {
    result.unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Condvar};

    fn poisoned() -> Arc<Mutex<i32>> {
        let m = Arc::new(Mutex::new(1));
        let poisoner = m.clone();
        let _ = std::thread::spawn(move || {
            let _guard = poisoner.lock().expect("lock");
            panic!("poison it");
        })
        .join();
        assert!(m.lock().is_err(), "poisoned");
        m
    }

    #[test]
    fn a_poisoned_lock_is_still_taken() {
        let m = poisoned();
        *m.locked() += 1;
        assert_eq!(*m.locked(), 2);
    }

    #[test]
    fn a_wait_on_a_poisoned_lock_still_returns_the_guard() {
        let m = poisoned();
        let ready = Condvar::new();
        let guard = unpoisoned(ready.wait_while(m.locked(), |n| *n != 1));
        assert_eq!(*guard, 1);
    }
}
