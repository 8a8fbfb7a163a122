//! Reading output in gathers: a pipe that just gave a short read is left alone for
//! [`GATHER`], so what the program writes meanwhile is read, and streamed, as one chunk
//! (not a frame per `write`), and its writes do not wake the runner one by one.
//!
//! A pipe read whole (a full buffer) is polled again at once, so a fast writer is never
//! held back. When anything else needs the worker (the other pipe, a tool call, a kernel
//! event), both pipes are read first, so output keeps its place before what follows it.

use std::time::{Duration, Instant};

/// How long a pipe is left alone after a short read: bounds how late a line followed by
/// silence is read (and streamed).
pub(super) const GATHER: Duration = Duration::from_millis(5);

/// When each of an exec's two output pipes (stdout, stderr) is polled again.
#[derive(Default)]
pub(super) struct Gather {
    /// Per pipe, when its rest ends; `None` while it is polled.
    resume: [Option<Instant>; 2],
}

impl Gather {
    /// Whether pipe `i` (0 stdout, 1 stderr) is to be polled at `now`.
    pub(super) fn polled(&self, i: usize, now: Instant) -> bool {
        self.resume[i].is_none_or(|t| now >= t)
    }

    /// The earliest end of a rest, for the poll's timeout.
    pub(super) fn next_resume(&self) -> Option<Instant> {
        self.resume.iter().flatten().min().copied()
    }

    /// Whether a rest has ended by `now`, so its pipe is to be read.
    pub(super) fn due(&self, now: Instant) -> bool {
        self.resume.iter().flatten().any(|&t| now >= t)
    }

    /// Records a read of pipe `i` that gave `n` bytes of at most `full`.
    pub(super) fn read(&mut self, i: usize, n: usize, full: usize, now: Instant) {
        self.resume[i] = (n > 0 && n < full).then(|| now + GATHER);
    }
}

/// The earlier of two poll timeouts (`None`: no limit).
pub(super) fn earlier(a: Option<Duration>, b: Option<Duration>) -> Option<Duration> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_read_rests_its_pipe_only() {
        let now = Instant::now();
        let mut g = Gather::default();
        assert!(g.polled(0, now) && g.polled(1, now));
        assert_eq!(g.next_resume(), None);
        g.read(0, 10, 100, now);
        assert!(!g.polled(0, now) && g.polled(1, now));
        assert_eq!(g.next_resume(), Some(now + GATHER));
        assert!(!g.due(now));
        assert!(g.due(now + GATHER));
        assert!(g.polled(0, now + GATHER));
    }

    #[test]
    fn a_full_read_or_nothing_keeps_the_pipe_polled() {
        let now = Instant::now();
        let mut g = Gather::default();
        g.read(1, 100, 100, now);
        assert!(g.polled(1, now));
        g.read(1, 5, 100, now);
        assert!(!g.polled(1, now));
        g.read(1, 0, 100, now);
        assert!(g.polled(1, now));
        assert!(!g.due(now));
    }

    #[test]
    fn timeouts_combine() {
        let ms = Duration::from_millis;
        assert_eq!(earlier(None, None), None);
        assert_eq!(earlier(Some(ms(3)), None), Some(ms(3)));
        assert_eq!(earlier(None, Some(ms(4))), Some(ms(4)));
        assert_eq!(earlier(Some(ms(5)), Some(ms(2))), Some(ms(2)));
    }
}
