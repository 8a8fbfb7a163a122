//! Reading frames from the broker and writing frames back.

use crate::sys;
use sandbox_runner::sync::LockExt as _;
use sandbox_runner::{CoordinatorMessage, JobId, Multiplexed, WorkerMessage, UNSOLICITED};
use std::io::{self, BufRead};
use std::sync::Mutex;

/// One line read from the channel.
#[derive(Debug, PartialEq, Eq)]
pub enum Line {
    /// A complete line, without its newline.
    Frame(Vec<u8>),
    /// A line longer than the limit; its content was dropped except the first bytes,
    /// which may still name the job.
    TooLong(Vec<u8>),
    /// The broker closed the channel.
    Eof,
}

/// How many leading bytes of an overlong line are kept to recover its job id.
const PREFIX: usize = 64;

/// Reads one line of at most `max` bytes without ever buffering more than that.
pub fn read_line(r: &mut impl BufRead, max: usize) -> io::Result<Line> {
    let mut buf = Vec::new();
    let mut too_long = false;
    loop {
        let avail = match r.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if avail.is_empty() {
            return Ok(match (too_long, buf.is_empty()) {
                (true, _) => Line::TooLong(buf),
                (false, true) => Line::Eof,
                (false, false) => Line::Frame(buf),
            });
        }
        let (chunk, used, end) = match avail.iter().position(|&b| b == b'\n') {
            Some(i) => (&avail[..i], i + 1, true),
            None => (avail, avail.len(), false),
        };
        if !too_long && buf.len() + chunk.len() > max {
            too_long = true;
            buf.truncate(PREFIX);
        }
        if too_long {
            let room = PREFIX.saturating_sub(buf.len()).min(chunk.len());
            buf.extend_from_slice(&chunk[..room]);
        } else {
            buf.extend_from_slice(chunk);
        }
        r.consume(used);
        if end {
            return Ok(if too_long {
                Line::TooLong(buf)
            } else {
                Line::Frame(buf)
            });
        }
    }
}

/// A parsed frame, or why it could not be parsed and which job to blame.
#[derive(Debug)]
pub enum Parsed {
    /// A well-formed request.
    Msg(JobId, CoordinatorMessage),
    /// A frame that is not a valid request; the error goes to this job.
    Bad(JobId, String),
}

/// Parses one frame; on failure, recovers the job id from the frame's start if it can.
pub fn parse(line: &[u8]) -> Parsed {
    match serde_json::from_slice::<Multiplexed<CoordinatorMessage>>(line) {
        Ok(Multiplexed(job, msg)) => Parsed::Msg(job, msg),
        Err(e) => {
            let mut msg = format!("bad frame: {e}");
            truncate(&mut msg, 300);
            Parsed::Bad(job_id_prefix(line).unwrap_or(UNSOLICITED), msg)
        }
    }
}

/// Shortens `s` to at most `max` bytes on a character boundary.
pub fn truncate(s: &mut String, max: usize) {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
}

/// The job id of a frame that starts like `[123,` even if the rest is broken.
pub fn job_id_prefix(line: &[u8]) -> Option<JobId> {
    let s = line
        .trim_ascii_start()
        .strip_prefix(b"[")?
        .trim_ascii_start();
    let digits = s.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 || !s[digits..].trim_ascii_start().starts_with(b",") {
        return None;
    }
    std::str::from_utf8(&s[..digits]).ok()?.parse().ok()
}

/// The write side of the channel: whole frames, one at a time.
pub struct Channel {
    /// Serialises writers (the reader thread answers hellos while the worker streams), so
    /// lines never interleave.
    lock: Mutex<()>,
    /// Where frames go: stdout, or a pipe in tests.
    fd: std::os::fd::RawFd,
}

impl Channel {
    /// The channel on the runner's stdout.
    pub fn stdout() -> Self {
        Channel {
            lock: Mutex::new(()),
            fd: libc::STDOUT_FILENO,
        }
    }

    /// A channel writing to `fd` (a test's pipe), which must outlive it.
    #[cfg(test)]
    pub fn to_fd(fd: std::os::fd::RawFd) -> Self {
        Channel {
            lock: Mutex::new(()),
            fd,
        }
    }

    /// Sends one frame. A broken channel is not fatal: the broker may re-attach.
    pub fn send(&self, job: JobId, msg: &WorkerMessage) {
        let mut line = match serde_json::to_vec(&Multiplexed(job, msg)) {
            Ok(l) => l,
            Err(e) => {
                eprintln!("sandbox-runner: cannot encode a frame: {e}");
                return;
            }
        };
        line.push(b'\n');
        let _guard = self.lock.locked();
        let _ = sys::write_all_raw(self.fd, &line);
    }

    /// Sends an error message for `job`.
    pub fn error(&self, job: JobId, message: impl Into<String>) {
        let msg = WorkerMessage::Error(sandbox_runner::WorkerError {
            message: message.into(),
        });
        self.send(job, &msg);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(input: &[u8], max: usize) -> Vec<Line> {
        let mut r = io::BufReader::with_capacity(4, input);
        let mut out = Vec::new();
        loop {
            let l = read_line(&mut r, max).unwrap();
            let eof = l == Line::Eof;
            out.push(l);
            if eof {
                return out;
            }
        }
    }

    #[test]
    fn splits_lines_and_bounds_them() {
        let long = format!("[9,\"{}\"]", "x".repeat(100));
        let input = format!("[1,2]\n{long}\n\nlast");
        let got = lines(input.as_bytes(), 20);
        assert_eq!(got[0], Line::Frame(b"[1,2]".to_vec()));
        match &got[1] {
            Line::TooLong(prefix) => {
                assert!(prefix.len() <= PREFIX);
                assert_eq!(job_id_prefix(prefix), Some(9));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(got[2], Line::Frame(Vec::new()));
        assert_eq!(got[3], Line::Frame(b"last".to_vec()));
        assert_eq!(got[4], Line::Eof);
    }

    #[test]
    fn parses_requests_and_blames_the_right_job() {
        match parse(br#"[4,{"type":"hello","start_kernel":true}]"#) {
            Parsed::Msg(4, CoordinatorMessage::Hello(h)) => {
                assert!(h.start_kernel);
                assert!(h.preload.is_empty(), "an older broker preloads nothing");
            }
            other => panic!("{other:?}"),
        }
        match parse(
            br#"[4,{"type":"hello","start_kernel":true,"preload":["numpy","matplotlib.pyplot"]}]"#,
        ) {
            Parsed::Msg(4, CoordinatorMessage::Hello(h)) => {
                assert_eq!(h.preload, ["numpy", "matplotlib.pyplot"]);
            }
            other => panic!("{other:?}"),
        }
        match parse(br#"[5,{"type":"bogus"}]"#) {
            Parsed::Bad(5, msg) => assert!(msg.contains("bogus"), "{msg}"),
            other => panic!("{other:?}"),
        }
        match parse(b"not json") {
            Parsed::Bad(0, _) => {}
            other => panic!("{other:?}"),
        }
        match parse(
            br#"[7,{"type":"exec","lang":"cobol","code":"","timeout_ms":1,"max_output_bytes":1}]"#,
        ) {
            Parsed::Bad(7, _) => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn job_ids_from_prefixes() {
        assert_eq!(job_id_prefix(b" [ 12 , {"), Some(12));
        assert_eq!(job_id_prefix(b"[12x,"), None);
        assert_eq!(job_id_prefix(b"[,"), None);
        assert_eq!(job_id_prefix(b"[99999999999999999999999,"), None);
        assert_eq!(job_id_prefix(b"{}"), None);
    }

    #[test]
    fn truncates_on_char_boundary() {
        let mut s = "aé".to_string();
        truncate(&mut s, 2);
        assert_eq!(s, "a");
    }
}
