//! Collecting an exec's output: capping each stream, decoding it as (lossy) UTF-8, and
//! cutting streamed chunks only at character boundaries.

use sandbox_runner::{Limit, Stream};

/// The largest cap honoured per stream. The final frame carries both streams; with lossy
/// decoding (up to 3 bytes per bad byte) and JSON escapes (up to 6 bytes per control
/// byte) two streams of this size still fit in one frame of `MAX_FRAME_BYTES`.
pub const MAX_CAP: usize = sandbox_runner::MAX_FRAME_BYTES / 16;

/// What was kept of one stream.
#[derive(Default)]
struct Side {
    /// The bytes kept so far (not streamed ones; those left already).
    kept: Vec<u8>,
    /// How many bytes were accepted under the cap, streamed or not.
    len: usize,
    /// Whether anything was dropped for the cap.
    over: bool,
    /// A streamed chunk's trailing incomplete UTF-8 sequence, held for the next chunk.
    carry: Vec<u8>,
    /// The last byte accepted, to know whether a note needs a newline before it.
    last: Option<u8>,
}

/// Both streams of one exec (or of one compiler run).
pub struct Capture {
    /// The per-stream cap in bytes.
    cap: usize,
    /// Whether output leaves as chunks while the code runs.
    streaming: bool,
    /// Standard output.
    out: Side,
    /// Standard error.
    err: Side,
}

impl Capture {
    /// An empty capture; `cap` is clamped to [`MAX_CAP`].
    pub fn new(cap: u64, streaming: bool) -> Self {
        Capture {
            cap: usize::try_from(cap).unwrap_or(usize::MAX).min(MAX_CAP),
            streaming,
            out: Side::default(),
            err: Side::default(),
        }
    }

    /// The per-stream cap in effect.
    pub fn cap(&self) -> usize {
        self.cap
    }

    fn side(&mut self, which: Stream) -> &mut Side {
        match which {
            Stream::Stdout => &mut self.out,
            Stream::Stderr => &mut self.err,
        }
    }

    /// Takes output; beyond the cap it is dropped. When streaming, returns the text to send
    /// now (possibly empty).
    pub fn push(&mut self, which: Stream, data: &[u8]) -> Option<String> {
        let cap = self.cap;
        let streaming = self.streaming;
        let side = self.side(which);
        let room = cap.saturating_sub(side.len);
        let take = room.min(data.len());
        if take < data.len() {
            side.over = true;
        }
        let data = &data[..take];
        side.len += take;
        if let Some(&b) = data.last() {
            side.last = Some(b);
        }
        if !streaming {
            side.kept.extend_from_slice(data);
            return None;
        }
        side.carry.extend_from_slice(data);
        let cut = complete_prefix_len(&side.carry);
        let text = String::from_utf8_lossy(&side.carry[..cut]).into_owned();
        side.carry.drain(..cut);
        Some(text)
    }

    /// The streamed text still held back (an incomplete character at the very end).
    pub fn flush(&mut self, which: Stream) -> String {
        let side = self.side(which);
        let text = String::from_utf8_lossy(&side.carry).into_owned();
        side.carry.clear();
        text
    }

    /// Records that a stream lost output to the cap elsewhere (in the compiler's capture).
    pub fn mark_over(&mut self, which: Stream) {
        self.side(which).over = true;
    }

    /// The kept bytes of one stream, as sent by a non-streaming exec.
    pub fn bytes(&self, which: Stream) -> &[u8] {
        match which {
            Stream::Stdout => &self.out.kept,
            Stream::Stderr => &self.err.kept,
        }
    }

    /// The output limits hit, in stdout, stderr order.
    pub fn limits(&self) -> Vec<Limit> {
        let mut l = Vec::new();
        if self.out.over {
            l.push(Limit::Stdout);
        }
        if self.err.over {
            l.push(Limit::Stderr);
        }
        l
    }

    /// Whether a note appended to stderr must start on a new line.
    pub fn stderr_needs_newline(&self) -> bool {
        self.err.last.is_some_and(|b| b != b'\n')
    }

    /// Both kept streams as text, for the final response. A stream cut at the cap loses
    /// its trailing partial character rather than gaining a replacement character.
    pub fn into_text(self) -> (String, String) {
        fn text(side: Side) -> String {
            let end = if side.over {
                complete_prefix_len(&side.kept)
            } else {
                side.kept.len()
            };
            String::from_utf8_lossy(&side.kept[..end]).into_owned()
        }
        (text(self.out), text(self.err))
    }
}

/// The length of the longest prefix of `b` that does not end inside a UTF-8 sequence that
/// more bytes could still complete.
pub fn complete_prefix_len(b: &[u8]) -> usize {
    let n = b.len();
    for back in 1..=n.min(3) {
        let c = b[n - back];
        if c & 0xC0 == 0x80 {
            continue; // a continuation byte: look further back for the lead byte
        }
        let need = match c {
            0xF0..=0xF7 => 4,
            0xE0..=0xEF => 3,
            0xC0..=0xDF => 2,
            _ => 1,
        };
        return if need > back { n - back } else { n };
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_boundaries() {
        let euro = "€".as_bytes(); // 3 bytes
        assert_eq!(complete_prefix_len(b"abc"), 3);
        assert_eq!(complete_prefix_len(&euro[..1]), 0);
        assert_eq!(complete_prefix_len(&euro[..2]), 0);
        assert_eq!(complete_prefix_len(euro), 3);
        let mut v = b"ab".to_vec();
        v.extend_from_slice(&euro[..2]);
        assert_eq!(complete_prefix_len(&v), 2);
        // Garbage is not held back forever: only a plausible sequence start is.
        assert_eq!(complete_prefix_len(&[0x80, 0x80, 0x80, 0x80]), 4);
        assert_eq!(complete_prefix_len(&[0xFF]), 1);
        assert_eq!(complete_prefix_len(b""), 0);
    }

    #[test]
    fn caps_each_stream_separately() {
        let mut c = Capture::new(5, false);
        assert_eq!(c.push(Stream::Stdout, b"hello world"), None);
        c.push(Stream::Stdout, b"more");
        c.push(Stream::Stderr, b"err");
        assert_eq!(c.limits(), vec![Limit::Stdout]);
        assert!(c.stderr_needs_newline());
        let (out, err) = c.into_text();
        assert_eq!(out, "hello");
        assert_eq!(err, "err");
    }

    #[test]
    fn cap_never_splits_a_character() {
        let mut c = Capture::new(4, false);
        c.push(Stream::Stdout, "ab€".as_bytes());
        assert_eq!(c.into_text().0, "ab");
    }

    #[test]
    fn streaming_holds_partial_characters() {
        let mut c = Capture::new(100, true);
        let euro = "€".as_bytes();
        assert_eq!(c.push(Stream::Stdout, &[b'a', euro[0]]).unwrap(), "a");
        assert_eq!(c.push(Stream::Stdout, &euro[1..]).unwrap(), "€");
        assert_eq!(c.push(Stream::Stdout, &[0xE2]).unwrap(), "");
        assert_eq!(c.flush(Stream::Stdout), "\u{FFFD}");
        assert!(c.bytes(Stream::Stdout).is_empty());
        assert!(c.limits().is_empty());
    }

    #[test]
    fn invalid_bytes_are_replaced() {
        let mut c = Capture::new(100, false);
        c.push(Stream::Stderr, b"a\xffb\n");
        assert!(!c.stderr_needs_newline());
        assert_eq!(c.into_text().1, "a\u{FFFD}b\n");
    }

    #[test]
    fn huge_caps_are_clamped() {
        assert_eq!(Capture::new(u64::MAX, false).cap(), MAX_CAP);
    }
}
