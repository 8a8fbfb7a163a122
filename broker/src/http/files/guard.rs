//! The body of a multipart upload, bounded before multer reads it. multer keeps the bytes
//! before the first boundary, and a part's headers, in memory until it finds their end,
//! and searches all of them again at every chunk: a body that never gets there would grow
//! the broker's memory and pin a core. Here each byte is looked at once, and more than
//! [`MAX_MULTIPART_HEAD`] of either is refused. The body must also keep coming: less than
//! [`UPLOAD_MIN_BYTES`] within CODEBROKER_UPLOAD_STALL_SECS cuts it.

use crate::http::error::AppError;
use bytes::Bytes;
use futures::Stream;
use memchr::memmem::Finder;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::time::{Instant, Sleep};

/// Most bytes a multipart body may carry before its first boundary, and most bytes of one
/// part's headers: real clients send none before the boundary and a few hundred bytes of
/// headers.
pub(crate) const MAX_MULTIPART_HEAD: usize = 16 * 1024;

/// Bytes an upload's body must bring within each stall window (CODEBROKER_UPLOAD_STALL_SECS).
pub(crate) const UPLOAD_MIN_BYTES: u64 = 64 * 1024;

/// Why an upload's body was cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodyCut {
    /// More than [`MAX_MULTIPART_HEAD`] came before the first boundary.
    Preamble,
    /// A part's headers ran past [`MAX_MULTIPART_HEAD`].
    PartHeaders,
    /// Less than [`UPLOAD_MIN_BYTES`] came within the stall window of `secs`.
    Stalled {
        /// The window, in seconds.
        secs: u64,
    },
}

impl BodyCut {
    /// The answer the client gets.
    pub(crate) fn to_error(self) -> AppError {
        let head_kib = MAX_MULTIPART_HEAD / 1024;
        match self {
            BodyCut::Preamble => AppError::bad_request(format!(
                "malformed multipart body: more than {head_kib} KiB before the first boundary"
            )),
            BodyCut::PartHeaders => AppError::bad_request(format!(
                "malformed multipart body: a part's headers run past {head_kib} KiB"
            )),
            BodyCut::Stalled { secs } => AppError::RequestTimeout(format!(
                "upload too slow: less than {} KiB of the body came in {secs} s \
                 (CODEBROKER_UPLOAD_STALL_SECS)",
                UPLOAD_MIN_BYTES / 1024
            )),
        }
    }
}

/// Where the guard leaves why it cut the body, for the handler: multer passes a stream's
/// error on only as text.
#[derive(Debug, Clone, Default)]
pub(crate) struct CutReason(Arc<OnceLock<BodyCut>>);

impl CutReason {
    /// Why the body was cut, if it was.
    pub(crate) fn get(&self) -> Option<BodyCut> {
        self.0.get().copied()
    }
}

/// The stall window of an upload.
struct Stall {
    /// How long the body may take to bring [`UPLOAD_MIN_BYTES`].
    window: Duration,
    /// The end of the current window.
    deadline: Pin<Box<Sleep>>,
    /// Bytes that came in the current window.
    bytes: u64,
}

/// A request body that fails once it breaks a multipart bound or stalls (see the module
/// doc). After the failure it ends.
pub(crate) struct GuardedBody<S> {
    /// The request body.
    inner: S,
    /// Where the body is in the multipart structure.
    scan: MultipartScan,
    /// The stall window; `None` when CODEBROKER_UPLOAD_STALL_SECS is 0.
    stall: Option<Stall>,
    /// Why the body was cut, for the handler.
    cut: CutReason,
    /// Cut: nothing more is read.
    done: bool,
}

impl<S> GuardedBody<S> {
    /// Guards `inner`, a multipart body with `boundary`, with a stall window of `stall`
    /// (zero: none), leaving the reason of a cut in `cut`.
    pub(crate) fn new(inner: S, boundary: &str, stall: Duration, cut: CutReason) -> Self {
        let stall = (!stall.is_zero()).then(|| Stall {
            window: stall,
            deadline: Box::pin(tokio::time::sleep(stall)),
            bytes: 0,
        });
        GuardedBody {
            inner,
            scan: MultipartScan::new(boundary),
            stall,
            cut,
            done: false,
        }
    }

    fn fail(&mut self, why: BodyCut) -> Poll<Option<Result<Bytes, std::io::Error>>> {
        let _ = self.cut.0.set(why);
        self.done = true;
        Poll::Ready(Some(Err(std::io::Error::other(format!("{why:?}")))))
    }
}

impl<S, E> Stream for GuardedBody<S>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_next(cx) {
            Poll::Ready(Some(Ok(chunk))) => {
                if let Err(why) = this.scan.feed(&chunk) {
                    return this.fail(why);
                }
                if let Some(stall) = &mut this.stall {
                    stall.bytes += chunk.len() as u64;
                    let now = Instant::now();
                    if stall.bytes >= UPLOAD_MIN_BYTES {
                        stall.bytes = 0;
                        stall.deadline.as_mut().reset(now + stall.window);
                    } else if now >= stall.deadline.deadline() {
                        let secs = stall.window.as_secs();
                        return this.fail(BodyCut::Stalled { secs });
                    }
                }
                Poll::Ready(Some(Ok(chunk)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(std::io::Error::other(e)))),
            Poll::Ready(None) => {
                this.done = true;
                Poll::Ready(None)
            }
            Poll::Pending => {
                if let Some(stall) = &mut this.stall {
                    if stall.deadline.as_mut().poll(cx).is_ready() {
                        let secs = stall.window.as_secs();
                        return this.fail(BodyCut::Stalled { secs });
                    }
                }
                Poll::Pending
            }
        }
    }
}

/// Where a multipart body is, as far as its bounds go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Before the first `--boundary`.
    Preamble,
    /// Just after a boundary: two bytes tell a part (`\r\n`) from the end (`--`).
    AfterBoundary,
    /// A part's headers, up to `\r\n\r\n`.
    Headers,
    /// A part's content, up to `\r\n--boundary`.
    Content,
    /// After the closing boundary: nothing more is bounded here.
    Epilogue,
}

/// Follows a multipart body chunk by chunk, each byte looked at once, and fails when the
/// preamble or a part's headers run past [`MAX_MULTIPART_HEAD`].
struct MultipartScan {
    /// Where the body is.
    phase: Phase,
    /// Bytes of the current preamble or headers so far.
    run: usize,
    /// `--boundary`: the first delimiter.
    first: Finder<'static>,
    /// `\r\n--boundary`: every later one.
    next: Finder<'static>,
    /// `\r\n\r\n`: the end of a part's headers.
    headers_end: Finder<'static>,
    /// The last bytes seen, fewer than the pattern looked for: a pattern may start in
    /// one chunk and end in the next.
    tail: Vec<u8>,
}

impl MultipartScan {
    fn new(boundary: &str) -> Self {
        MultipartScan {
            phase: Phase::Preamble,
            run: 0,
            first: Finder::new(format!("--{boundary}").as_bytes()).into_owned(),
            next: Finder::new(format!("\r\n--{boundary}").as_bytes()).into_owned(),
            headers_end: Finder::new(b"\r\n\r\n").into_owned(),
            tail: Vec::new(),
        }
    }

    /// Takes the next chunk of the body.
    fn feed(&mut self, chunk: &[u8]) -> Result<(), BodyCut> {
        let mut data = chunk;
        while !data.is_empty() {
            match self.phase {
                Phase::Epilogue => return Ok(()),
                Phase::Preamble | Phase::Headers => {
                    let finder = if self.phase == Phase::Preamble {
                        &self.first
                    } else {
                        &self.headers_end
                    };
                    match find(finder, &mut self.tail, data) {
                        Some(end) => {
                            self.phase = if self.phase == Phase::Preamble {
                                Phase::AfterBoundary
                            } else {
                                Phase::Content
                            };
                            self.run = 0;
                            data = &data[end..];
                        }
                        None => {
                            self.run += data.len();
                            if self.run > MAX_MULTIPART_HEAD {
                                return Err(if self.phase == Phase::Preamble {
                                    BodyCut::Preamble
                                } else {
                                    BodyCut::PartHeaders
                                });
                            }
                            return Ok(());
                        }
                    }
                }
                Phase::AfterBoundary => {
                    // Up to two bytes, kept as the start of the headers: a part without
                    // headers ends them at once (`\r\n\r\n`).
                    let take = (2 - self.tail.len()).min(data.len());
                    self.tail.extend_from_slice(&data[..take]);
                    data = &data[take..];
                    if self.tail.len() == 2 {
                        if self.tail == b"--" {
                            self.phase = Phase::Epilogue;
                            self.tail.clear();
                        } else {
                            self.phase = Phase::Headers;
                            self.run = 2;
                        }
                    }
                }
                Phase::Content => match find(&self.next, &mut self.tail, data) {
                    Some(end) => {
                        self.phase = Phase::AfterBoundary;
                        data = &data[end..];
                    }
                    None => return Ok(()),
                },
            }
        }
        Ok(())
    }
}

/// Where `finder`'s pattern ends in `data` (an offset into `data`), also when it began in
/// the bytes before (`tail`). `tail` is left holding what a match in the next chunk may
/// start with, or nothing after a match.
fn find(finder: &Finder<'_>, tail: &mut Vec<u8>, data: &[u8]) -> Option<usize> {
    let len = finder.needle().len();
    if !tail.is_empty() {
        // Only a match that crosses into `data`: at most `len - 1` bytes of each side.
        let mut joined = std::mem::take(tail);
        let from_tail = joined.len();
        joined.extend_from_slice(&data[..data.len().min(len - 1)]);
        if let Some(at) = finder.find(&joined) {
            return Some(at + len - from_tail);
        }
        joined.truncate(from_tail);
        *tail = joined;
    }
    if let Some(at) = finder.find(data) {
        tail.clear();
        return Some(at + len);
    }
    let keep = len - 1;
    if data.len() >= keep {
        tail.clear();
        tail.extend_from_slice(&data[data.len() - keep..]);
    } else {
        tail.extend_from_slice(data);
        let excess = tail.len().saturating_sub(keep);
        tail.drain(..excess);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A well-formed body: a text field, a file with `content`, the closing boundary and
    /// an epilogue.
    fn body(content: &[u8], epilogue: usize) -> Vec<u8> {
        let mut b = b"--XyZ\r\nContent-Disposition: form-data; name=\"session_id\"\r\n\r\nabc\r\n\
--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.bin\"\r\n\
Content-Type: application/octet-stream\r\n\r\n"
            .to_vec();
        b.extend_from_slice(content);
        b.extend_from_slice(b"\r\n--XyZ\r\n\r\nno headers\r\n--XyZ--\r\n");
        b.extend(std::iter::repeat_n(b'e', epilogue));
        b
    }

    fn feed_in_chunks(data: &[u8], size: usize) -> Result<Phase, BodyCut> {
        let mut scan = MultipartScan::new("XyZ");
        for chunk in data.chunks(size) {
            scan.feed(chunk)?;
        }
        Ok(scan.phase)
    }

    #[test]
    fn a_well_formed_body_passes_whatever_its_chunks() {
        // Content that looks like a boundary without being one, and is long.
        let mut content = b"a--XyZ b\r\n--XyQ \r\n-XyZ ".repeat(10);
        content.extend(std::iter::repeat_n(b'c', 100_000));
        let data = body(&content, 100_000);
        for size in [1, 2, 3, 5, 7, 64, 1000, 65536, data.len()] {
            assert_eq!(
                feed_in_chunks(&data, size),
                Ok(Phase::Epilogue),
                "chunks of {size}"
            );
        }
    }

    #[test]
    fn a_preamble_or_a_header_past_the_bound_is_refused() {
        let mut preamble = vec![b'A'; MAX_MULTIPART_HEAD];
        assert_eq!(feed_in_chunks(&preamble, 4096), Ok(Phase::Preamble));
        // A short preamble is allowed (RFC 2046), a long one is not.
        preamble.push(b'A');
        assert_eq!(feed_in_chunks(&preamble, 4096), Err(BodyCut::Preamble));
        let mut header = b"--XyZ\r\nContent-Disposition: form-data; name=\"x\"".to_vec();
        header.extend(std::iter::repeat_n(b'A', MAX_MULTIPART_HEAD));
        assert_eq!(feed_in_chunks(&header, 1000), Err(BodyCut::PartHeaders));
        assert_eq!(feed_in_chunks(&header, 7), Err(BodyCut::PartHeaders));
        // The second part's headers are bounded too.
        let mut second = body(b"x", 0);
        second.truncate(second.len() - b"\r\n\r\nno headers\r\n--XyZ--\r\n".len());
        second.extend(std::iter::repeat_n(b'h', MAX_MULTIPART_HEAD + 1));
        assert_eq!(feed_in_chunks(&second, 512), Err(BodyCut::PartHeaders));
    }

    #[test]
    fn each_byte_is_looked_at_once() {
        // 64 MiB without a boundary in 1-byte chunks would take minutes if each chunk
        // searched everything before it; here it is refused after the bound.
        let mut scan = MultipartScan::new("XyZ");
        let started = std::time::Instant::now();
        let mut refused_at = None;
        for i in 0..(64 * 1024 * 1024) {
            if scan.feed(b"A").is_err() {
                refused_at = Some(i);
                break;
            }
        }
        assert_eq!(refused_at, Some(MAX_MULTIPART_HEAD));
        assert!(started.elapsed() < Duration::from_secs(5));
        // A part's content is scanned in one pass, never kept.
        let mut scan = MultipartScan::new("XyZ");
        scan.feed(b"--XyZ\r\nContent-Disposition: form-data; name=\"f\"\r\n\r\n")
            .unwrap();
        let chunk = vec![b'c'; 64 * 1024];
        for _ in 0..1024 {
            scan.feed(&chunk).unwrap();
        }
        assert_eq!(scan.phase, Phase::Content);
        assert!(scan.tail.len() < 16);
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_stalls_is_cut() {
        use futures::StreamExt;
        let (tx, rx) = futures::channel::mpsc::unbounded::<Result<Bytes, std::io::Error>>();
        let cut = CutReason::default();
        let mut body = GuardedBody::new(rx, "XyZ", Duration::from_secs(2), cut.clone());
        tx.unbounded_send(Ok(Bytes::from_static(b"--XyZ\r\n\r\n")))
            .unwrap();
        assert!(body.next().await.unwrap().is_ok());
        // 100 KiB within the window: a new window starts.
        tokio::time::advance(Duration::from_millis(1500)).await;
        tx.unbounded_send(Ok(Bytes::from(vec![b'c'; 100 * 1024])))
            .unwrap();
        assert!(body.next().await.unwrap().is_ok());
        // Then a byte a second: cut when the window ends.
        tokio::time::advance(Duration::from_millis(1000)).await;
        tx.unbounded_send(Ok(Bytes::from_static(b"c"))).unwrap();
        assert!(body.next().await.unwrap().is_ok());
        let next = body.next().await.expect("an error, not the end");
        assert!(next.is_err());
        assert_eq!(cut.get(), Some(BodyCut::Stalled { secs: 2 }));
        assert!(body.next().await.is_none(), "nothing after the cut");
        assert!(matches!(
            cut.get().unwrap().to_error(),
            AppError::RequestTimeout(_)
        ));
    }
}
