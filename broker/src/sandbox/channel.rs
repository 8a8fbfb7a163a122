// Over 600 lines: nearly half of it is the tests of the demultiplexer.
//! The broker's end of the attached stdio channel to a sandbox's runner.
//!
//! Frames are newline-delimited JSON `[job_id, message]`. One reader task demultiplexes the
//! runner's frames to the job that waits for them; writers take turns on the write half.
//! Everything read is untrusted: an oversized or unparseable frame closes the channel
//! (and so ends the sandbox), never the broker.
//!
//! Each job's messages go through a small bounded queue, and the reader waits for room:
//! a job whose consumer stops (a stream client that does not read) stops the reading of
//! this sandbox's output, so the runner's writes block and the code with them, instead of
//! the broker's memory growing. Other sandboxes have readers of their own.

use crate::sync::LockExt as _;
use bytes::BytesMut;
use futures::{Stream, StreamExt};
use sandbox_runner::{
    CoordinatorMessage, JobId, Multiplexed, Request, WorkerMessage, MAX_FRAME_BYTES,
};
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, watch};

/// Why a request over the channel failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ChannelError {
    #[error("the sandbox is gone: {0}")]
    Closed(String),
    #[error("the runner answered with an unexpected message: {0}")]
    Unexpected(String),
    #[error("the runner refused the request: {0}")]
    Refused(String),
}

/// Output of the attached container, as bollard yields it: stdout bytes (frames) or
/// stderr bytes (the runner's own diagnostics).
pub(crate) enum AttachOutput {
    Stdout(bytes::Bytes),
    Stderr(bytes::Bytes),
}

type Waiters = Arc<Mutex<HashMap<JobId, mpsc::Sender<WorkerMessage>>>>;

/// Messages queued per job before the reader waits. Small: each may be a frame of up to
/// `MAX_FRAME_BYTES`.
const JOB_QUEUE: usize = 2;

/// Messages queued for a standing job (the egress tunnel's) before the reader waits. Its
/// consumer never blocks on them (flow control is the tunnel's own), so this only smooths
/// bursts.
const STANDING_QUEUE: usize = 64;

/// Writes whole frames on a runner's channel; cloned by whoever sends without waiting for
/// an answer (the heartbeat, the egress tunnel).
#[derive(Clone)]
pub(crate) struct FrameSender {
    /// The write half of the attach stream; one frame at a time.
    writer: Arc<tokio::sync::Mutex<Pin<Box<dyn AsyncWrite + Send>>>>,
    /// Set when a write fails, which closes the channel.
    close_tx: Arc<watch::Sender<Option<String>>>,
    /// Cleared with the close.
    waiters: Waiters,
}

impl FrameSender {
    /// Sends one frame; a failed write closes the channel. The frame is written whole even
    /// when the caller stops waiting (a `select!` that took another branch, a dropped
    /// request): the write runs in a task of its own, since a frame cut short would run
    /// into the next one and the runner would read neither.
    pub(crate) async fn send(
        &self,
        job: JobId,
        msg: CoordinatorMessage,
    ) -> Result<(), ChannelError> {
        let mut line = serde_json::to_vec(&Multiplexed(job, msg))
            .map_err(|e| ChannelError::Closed(format!("cannot encode frame: {e}")))?;
        line.push(b'\n');
        let writer = self.writer.clone();
        let written = tokio::spawn(async move {
            let mut writer = writer.lock_owned().await;
            writer.write_all(&line).await?;
            writer.flush().await
        })
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e)));
        if let Err(err) = written {
            let reason = format!("write to the runner failed: {err}");
            close(&self.close_tx, &self.waiters, &reason);
            return Err(ChannelError::Closed(reason));
        }
        Ok(())
    }
}

/// A job that stays open: what the runner sends under it, until the receiver is dropped
/// (which ends the job here) or the channel closes.
pub(crate) struct StandingJob {
    /// The job's id, for the frames sent under it.
    pub(crate) job: JobId,
    /// The runner's messages under the job.
    pub(crate) messages: mpsc::Receiver<WorkerMessage>,
    /// Where frames under the job (and any other) are written.
    pub(crate) sender: FrameSender,
    /// Removes the job's waiter when dropped.
    _waiter: OwnedWaiter,
}

/// Removes a standing job's waiter however its consumer ends.
struct OwnedWaiter {
    waiters: Waiters,
    job: JobId,
}

impl Drop for OwnedWaiter {
    fn drop(&mut self) {
        self.waiters.locked().remove(&self.job);
    }
}

/// A live channel to one runner.
pub(crate) struct RunnerChannel {
    /// The write half of the attach stream; one frame at a time (shared with the
    /// heartbeat task).
    writer: Arc<tokio::sync::Mutex<Pin<Box<dyn AsyncWrite + Send>>>>,
    /// Jobs waiting for their messages, by job id.
    waiters: Waiters,
    /// Source of job ids; 0 is reserved for unsolicited messages.
    next_job: AtomicU64,
    /// Becomes `Some(reason)` when the channel is closed, so waiters can stop.
    closed: watch::Receiver<Option<String>>,
    /// Held so `close()` can end the channel from this side too.
    close_tx: Arc<watch::Sender<Option<String>>>,
    /// The reader task; aborted on drop so a forgotten channel holds no connection.
    reader: tokio::task::JoinHandle<()>,
    /// The heartbeat task, if one was started; aborted on drop with the reader.
    heartbeat: Option<tokio::task::JoinHandle<()>>,
}

impl RunnerChannel {
    /// Starts demultiplexing `output` and returns the channel. `label` names the sandbox
    /// in logs.
    pub(crate) fn new<S>(label: String, output: S, input: Pin<Box<dyn AsyncWrite + Send>>) -> Self
    where
        S: Stream<Item = Result<AttachOutput, String>> + Send + 'static,
    {
        let waiters: Waiters = Arc::default();
        let (close_tx, closed) = watch::channel(None);
        let close_tx = Arc::new(close_tx);
        let reader = tokio::spawn(read_frames(
            label,
            output,
            waiters.clone(),
            close_tx.clone(),
        ));
        RunnerChannel {
            writer: Arc::new(tokio::sync::Mutex::new(input)),
            waiters,
            // Jobs a runner still runs for an earlier channel (a broker that died) must not
            // be taken for this channel's: each channel numbers its jobs from a random
            // start, kept below 2^52 so the ids stay exact as JSON numbers.
            next_job: AtomicU64::new(rand::random_range(1..1u64 << 52)),
            closed,
            close_tx,
            reader,
            heartbeat: None,
        }
    }

    /// Sends a [`CoordinatorMessage::Heartbeat`] every `every` while the channel is open,
    /// so that a runner started with an unattended limit knows a broker is still here.
    pub(crate) fn with_heartbeat(mut self, every: std::time::Duration) -> Self {
        let writer = self.writer.clone();
        let mut closed = self.closed.clone();
        let mut line = serde_json::to_vec(&Multiplexed(
            sandbox_runner::UNSOLICITED,
            CoordinatorMessage::Heartbeat,
        ))
        .unwrap_or_default();
        line.push(b'\n');
        self.heartbeat = Some(tokio::spawn(async move {
            let mut ticks = tokio::time::interval(every);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = ticks.tick() => {}
                    _ = closed.wait_for(|c| c.is_some()) => return,
                }
                let mut writer = writer.lock().await;
                let written = async {
                    writer.write_all(&line).await?;
                    writer.flush().await
                }
                .await;
                if written.is_err() {
                    // The next request finds the channel broken and closes it.
                    return;
                }
            }
        }));
        self
    }

    /// Whether the channel has closed (the runner exited, or a frame was bad).
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.borrow().is_some()
    }

    /// Closes the channel from the broker's side; pending requests fail.
    pub(crate) fn close(&self, reason: &str) {
        close(&self.close_tx, &self.waiters, reason);
    }

    /// Sends a request and waits for the message that ends its job, narrowed to the
    /// request's response; messages on the way are dropped.
    pub(crate) async fn request<R>(&self, request: R) -> Result<R::Response, ChannelError>
    where
        R: Request,
    {
        self.request_as(self.new_job(), request, |_| None::<WorkerMessage>, None)
            .await
    }

    /// A fresh job id, for a caller that must know it before the request goes out (to
    /// cancel it).
    pub(crate) fn new_job(&self) -> JobId {
        self.next_job.fetch_add(1, Ordering::Relaxed)
    }

    /// Sends a request as job `job` and waits for the message that ends the job, narrowed
    /// to the request's response (any other answer is [`ChannelError::Unexpected`]).
    /// Messages on the way (output chunks, tool calls, displays) are handed to `on_event`;
    /// what it gives back goes on to `sink`. While the sink is full, the job's next
    /// messages wait in the runner (see the module doc).
    pub(crate) async fn request_as<R, E>(
        &self,
        job: JobId,
        request: R,
        mut on_event: impl FnMut(WorkerMessage) -> Option<E>,
        sink: Option<&mpsc::Sender<E>>,
    ) -> Result<R::Response, ChannelError>
    where
        R: Request,
    {
        let (tx, mut rx) = mpsc::channel(JOB_QUEUE);
        self.lock_waiters().insert(job, tx);
        let _guard = WaiterGuard {
            waiters: &self.waiters,
            job,
        };
        self.send(job, request.into()).await?;
        let mut closed = self.closed.clone();
        loop {
            // Picks the next message first: the close watch's guard must not live across
            // `on_event`'s await (it is not `Send`).
            let msg = tokio::select! {
                msg = rx.recv() => msg,
                // Messages that arrived before the close still count; the next turn
                // takes the one after.
                _ = closed.wait_for(|c| c.is_some()) => rx.try_recv().ok(),
            };
            match msg {
                Some(
                    msg @ (WorkerMessage::Output(_)
                    | WorkerMessage::ToolCall(_)
                    | WorkerMessage::Display(_)),
                ) => {
                    if let (Some(onward), Some(sink)) = (on_event(msg), sink) {
                        // Fails at once when the consumer is gone; the exec goes on.
                        let _ = sink.send(onward).await;
                    }
                }
                Some(WorkerMessage::Error(err)) => return Err(ChannelError::Refused(err.message)),
                Some(other) => {
                    return R::Response::try_from(other)
                        .map_err(|other| ChannelError::Unexpected(describe(&other)))
                }
                None => return Err(ChannelError::Closed(self.close_reason())),
            }
        }
    }

    /// Asks the runner to stop the exec of `job`.
    pub(crate) async fn cancel(&self, job: JobId) -> Result<(), ChannelError> {
        self.send(job, CoordinatorMessage::Cancel).await
    }

    /// Answers a tool call of the exec of `job`.
    pub(crate) async fn tool_result(
        &self,
        job: JobId,
        result: sandbox_runner::ToolResult,
    ) -> Result<(), ChannelError> {
        self.send(job, CoordinatorMessage::ToolResult(result)).await
    }

    /// Sends a piece of the stdin of `job`'s program.
    pub(crate) async fn stdin(
        &self,
        job: JobId,
        chunk: sandbox_runner::StdinChunk,
    ) -> Result<(), ChannelError> {
        self.send(job, CoordinatorMessage::Stdin(chunk)).await
    }

    async fn send(&self, job: JobId, msg: CoordinatorMessage) -> Result<(), ChannelError> {
        self.sender().send(job, msg).await
    }

    /// A handle that writes frames on this channel.
    pub(crate) fn sender(&self) -> FrameSender {
        FrameSender {
            writer: self.writer.clone(),
            close_tx: self.close_tx.clone(),
            waiters: self.waiters.clone(),
        }
    }

    /// Sends `request` as a new job that stays open: the runner's messages under it come
    /// to the returned [`StandingJob`] until that is dropped.
    pub(crate) async fn standing_job(
        &self,
        request: impl Into<CoordinatorMessage>,
    ) -> Result<StandingJob, ChannelError> {
        let job = self.new_job();
        let (tx, messages) = mpsc::channel(STANDING_QUEUE);
        self.lock_waiters().insert(job, tx);
        let standing = StandingJob {
            job,
            messages,
            sender: self.sender(),
            _waiter: OwnedWaiter {
                waiters: self.waiters.clone(),
                job,
            },
        };
        standing.sender.send(job, request.into()).await?;
        Ok(standing)
    }

    fn close_reason(&self) -> String {
        self.closed
            .borrow()
            .clone()
            .unwrap_or_else(|| "the channel closed".to_string())
    }

    fn lock_waiters(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<JobId, mpsc::Sender<WorkerMessage>>> {
        self.waiters.locked()
    }
}

impl Drop for RunnerChannel {
    fn drop(&mut self) {
        self.reader.abort();
        if let Some(heartbeat) = &self.heartbeat {
            heartbeat.abort();
        }
    }
}

/// A message for an error: its kind only, as a hostile runner's payload may be large.
fn describe(msg: &WorkerMessage) -> String {
    serde_json::to_value(msg)
        .ok()
        .and_then(|v| v.get("type").and_then(|t| t.as_str()).map(str::to_string))
        .unwrap_or_else(|| "an unknown message".to_string())
}

/// Removes a job's waiter however its request ends.
struct WaiterGuard<'a> {
    waiters: &'a Waiters,
    job: JobId,
}

impl Drop for WaiterGuard<'_> {
    fn drop(&mut self) {
        self.waiters.locked().remove(&self.job);
    }
}

fn close(close_tx: &watch::Sender<Option<String>>, waiters: &Waiters, reason: &str) {
    close_tx.send_if_modified(|c| {
        if c.is_none() {
            *c = Some(reason.to_string());
            true
        } else {
            false
        }
    });
    waiters.locked().clear();
}

async fn read_frames<S>(
    label: String,
    output: S,
    waiters: Waiters,
    close_tx: Arc<watch::Sender<Option<String>>>,
) where
    S: Stream<Item = Result<AttachOutput, String>> + Send + 'static,
{
    let mut output = std::pin::pin!(output);
    let mut lines = Lines::default();
    let mut stderr_logged = 0usize;
    let reason = loop {
        let Some(item) = output.next().await else {
            break "the runner's output ended".to_string();
        };
        match item {
            Err(err) => break format!("reading from the runner failed: {err}"),
            Ok(AttachOutput::Stderr(bytes)) => {
                // The runner's own notes; bounded so a flood cannot fill the log.
                if stderr_logged < 64 * 1024 {
                    stderr_logged += bytes.len();
                    tracing::debug!(sandbox = %label, "runner: {}", String::from_utf8_lossy(&bytes).trim_end());
                }
            }
            Ok(AttachOutput::Stdout(bytes)) => {
                lines.push(&bytes);
                if let Err(reason) = dispatch_lines(&mut lines, &waiters).await {
                    break reason;
                }
            }
        }
    };
    tracing::debug!(sandbox = %label, %reason, "runner channel closed");
    close(&close_tx, &waiters, &reason);
}

/// The runner's stdout as it arrives, cut into lines. Each byte is examined once however
/// the frame is chunked: a frame of F bytes in chunks of C costs F, not F²/C.
#[derive(Default)]
struct Lines {
    /// Bytes not yet handed out as lines.
    buf: BytesMut,
    /// How much of `buf` is known to hold no newline.
    scanned: usize,
    /// Bytes examined for a newline so far, to show the scan stays linear.
    #[cfg(test)]
    examined: u64,
}

impl Lines {
    fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next complete line, without its newline.
    fn next_line(&mut self) -> Option<BytesMut> {
        let rest = &self.buf[self.scanned..];
        let found = memchr::memchr(b'\n', rest);
        #[cfg(test)]
        {
            self.examined += found.map_or(rest.len(), |i| i + 1) as u64;
        }
        match found {
            Some(i) => {
                let mut line = self.buf.split_to(self.scanned + i + 1);
                line.truncate(line.len() - 1);
                self.scanned = 0;
                Some(line)
            }
            None => {
                self.scanned = self.buf.len();
                None
            }
        }
    }

    /// Bytes of the line still incomplete.
    fn pending(&self) -> usize {
        self.buf.len()
    }

    /// Gives back the memory of a large frame once it is handled.
    fn shrink(&mut self) {
        if self.buf.is_empty() && self.buf.capacity() > 1 << 20 {
            self.buf = BytesMut::new();
        }
    }
}

/// Hands every complete line to its job, waiting while the job's queue is full. Fails
/// (closing the channel) on a frame that is too long or not a frame at all.
async fn dispatch_lines(lines: &mut Lines, waiters: &Waiters) -> Result<(), String> {
    while let Some(line) = lines.next_line() {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let Multiplexed(job, msg) = serde_json::from_slice::<Multiplexed<WorkerMessage>>(&line)
            .map_err(|e| format!("bad frame from the runner: {e}"))?;
        drop(line);
        let waiter = waiters.locked().get(&job).cloned();
        match waiter {
            Some(tx) => {
                // A job that stopped waiting dropped its receiver: the send fails at once.
                let _ = tx.send(msg).await;
            }
            None => tracing::debug!(job, "frame for no waiting job: {msg:?}"),
        }
    }
    if lines.pending() > MAX_FRAME_BYTES {
        return Err(format!("frame longer than {MAX_FRAME_BYTES} bytes"));
    }
    lines.shrink();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandbox_runner::{HelloRequest, HelloResponse};

    fn hello_frame(job: JobId) -> String {
        let msg = WorkerMessage::Hello(HelloResponse {
            runner_version: "t".into(),
            kernel_running: false,
            running_job: None,
            preloading: false,
        });
        format!(
            "{}\n",
            serde_json::to_string(&Multiplexed(job, msg)).unwrap()
        )
    }

    #[tokio::test]
    async fn answers_reach_their_job_even_split_across_chunks() {
        let (out_tx, out_rx) = mpsc::unbounded_channel::<Result<AttachOutput, String>>();
        let (input, _sink) = tokio::io::duplex(1 << 16);
        let chan = RunnerChannel::new("t".into(), tokio_stream_from(out_rx), Box::pin(input));
        let job = chan.new_job();
        let frame = hello_frame(job);
        let (a, b) = frame.split_at(5);
        out_tx
            .send(Ok(AttachOutput::Stdout(a.to_string().into())))
            .unwrap();
        out_tx
            .send(Ok(AttachOutput::Stdout(b.to_string().into())))
            .unwrap();
        let hello = chan
            .request_as(
                job,
                HelloRequest::default(),
                |_| None::<WorkerMessage>,
                None,
            )
            .await
            .unwrap();
        assert_eq!(hello.runner_version, "t");
    }

    #[tokio::test]
    async fn an_answer_of_another_type_is_unexpected() {
        let (out_tx, out_rx) = mpsc::unbounded_channel::<Result<AttachOutput, String>>();
        let (input, _sink) = tokio::io::duplex(1 << 16);
        let chan = RunnerChannel::new("t".into(), tokio_stream_from(out_rx), Box::pin(input));
        let job = chan.new_job();
        // A hello answered with a file list: narrowed away, not taken for a hello.
        let msg = WorkerMessage::FileList(sandbox_runner::FileList::default());
        let frame = format!(
            "{}\n",
            serde_json::to_string(&Multiplexed(job, msg)).unwrap()
        );
        out_tx.send(Ok(AttachOutput::Stdout(frame.into()))).unwrap();
        let err = chan
            .request_as(
                job,
                HelloRequest::default(),
                |_| None::<WorkerMessage>,
                None,
            )
            .await
            .unwrap_err();
        assert!(
            matches!(&err, ChannelError::Unexpected(kind) if kind == "file_list"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_send_given_up_half_way_still_writes_its_whole_frame() {
        use tokio::io::AsyncBufReadExt as _;
        let (_out_tx, out_rx) = mpsc::unbounded_channel::<Result<AttachOutput, String>>();
        // A pipe far smaller than the frame: its write waits for the reader.
        let (input, sink) = tokio::io::duplex(64);
        let chan = RunnerChannel::new("t".into(), tokio_stream_from(out_rx), Box::pin(input));
        let big = CoordinatorMessage::WriteFile(sandbox_runner::WriteFileRequest {
            name: "f".into(),
            offset: 0,
            data: vec![7; 64 * 1024],
            create: true,
            read_only: false,
        });
        let sender = chan.sender();
        // Given up while the frame is still being written.
        let given_up = tokio::time::timeout(
            std::time::Duration::from_millis(50),
            sender.send(1, big.clone()),
        )
        .await;
        assert!(given_up.is_err(), "the write had to wait for the reader");
        let reader = tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(sink).lines();
            let mut frames = Vec::new();
            while frames.len() < 2 {
                let line = lines.next_line().await.expect("read").expect("a line");
                frames.push(
                    serde_json::from_str::<Multiplexed<CoordinatorMessage>>(&line)
                        .expect("a whole frame"),
                );
            }
            frames
        });
        sender
            .send(2, CoordinatorMessage::Cancel)
            .await
            .expect("send");
        let frames = reader.await.expect("reader");
        assert_eq!(frames[0], Multiplexed(1, big));
        assert_eq!(frames[1], Multiplexed(2, CoordinatorMessage::Cancel));
    }

    #[tokio::test]
    async fn channels_number_their_jobs_apart() {
        // A runner may still run a job of an earlier channel (a broker that died); a new
        // channel's ids must not meet it.
        let open = || {
            let (_tx, rx) = mpsc::unbounded_channel::<Result<AttachOutput, String>>();
            let (input, _sink) = tokio::io::duplex(64);
            RunnerChannel::new("t".into(), tokio_stream_from(rx), Box::pin(input))
        };
        let (a, b) = (open(), open());
        let (first_a, first_b) = (a.new_job(), b.new_job());
        assert_ne!(first_a, first_b);
        assert!(
            first_a < 1 << 52 && first_b < 1 << 52,
            "ids stay exact in JSON"
        );
        assert_eq!(a.new_job(), first_a + 1);
    }

    #[tokio::test]
    async fn garbage_closes_the_channel_and_fails_waiters() {
        let (out_tx, out_rx) = mpsc::unbounded_channel::<Result<AttachOutput, String>>();
        let (input, _sink) = tokio::io::duplex(1 << 16);
        let chan = RunnerChannel::new("t".into(), tokio_stream_from(out_rx), Box::pin(input));
        out_tx
            .send(Ok(AttachOutput::Stdout("not json\n".into())))
            .unwrap();
        let err = chan.request(HelloRequest::default()).await.unwrap_err();
        assert!(matches!(err, ChannelError::Closed(_)), "{err}");
        assert!(chan.is_closed());
    }

    #[test]
    fn a_large_frame_in_small_chunks_is_scanned_once() {
        // A 4 MiB frame in 32 KiB chunks: scanning the whole buffer after each chunk
        // examined about 256 MB; each byte is examined once now.
        const FRAME: usize = 4 << 20;
        const CHUNK: usize = 32 << 10;
        let mut frame = vec![b'a'; FRAME - 1];
        frame.push(b'\n');
        let mut lines = Lines::default();
        let mut got = Vec::new();
        for chunk in frame.chunks(CHUNK) {
            lines.push(chunk);
            while let Some(line) = lines.next_line() {
                got.push(line.len());
            }
        }
        assert_eq!(got, [FRAME - 1]);
        assert!(
            lines.examined <= FRAME as u64,
            "examined {} bytes for a frame of {FRAME}",
            lines.examined
        );
        // Several lines in one chunk, and one split over two.
        lines.push(b"x\nyy\nzz");
        lines.push(b"z\n");
        let mut rest = Vec::new();
        while let Some(line) = lines.next_line() {
            rest.push(String::from_utf8(line.to_vec()).unwrap());
        }
        assert_eq!(rest, ["x", "yy", "zzz"]);
    }

    #[tokio::test]
    async fn a_stalled_consumer_stops_the_reading_and_a_gone_one_frees_it() {
        // A runner that sends display frames without end, counting what is read of it
        // (the attach stream holds one frame at a time).
        let (out_tx, out_rx) = mpsc::channel::<Result<AttachOutput, String>>(1);
        let output = futures::stream::unfold(out_rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        });
        let (input, _sink) = tokio::io::duplex(1 << 16);
        let chan = Arc::new(RunnerChannel::new("t".into(), output, Box::pin(input)));
        let job = chan.new_job();
        let pulled = Arc::new(AtomicU64::new(0));
        let producer = {
            let pulled = pulled.clone();
            async move {
                let msg = WorkerMessage::Display(sandbox_runner::DisplayData {
                    mime: "text/plain".into(),
                    name: None,
                    data: Some("x".repeat(1000)),
                });
                let mut line = serde_json::to_vec(&Multiplexed(job, msg)).unwrap();
                line.push(b'\n');
                let line = bytes::Bytes::from(line);
                while out_tx
                    .send(Ok(AttachOutput::Stdout(line.clone())))
                    .await
                    .is_ok()
                {
                    pulled.fetch_add(1, Ordering::SeqCst);
                }
            }
        };
        // A consumer that takes nothing: its queue of 4 fills and stays full.
        let (sink_tx, sink_rx) = mpsc::channel::<WorkerMessage>(4);
        let request = {
            let chan = chan.clone();
            tokio::spawn(async move {
                chan.request_as(job, HelloRequest::default(), Some, Some(&sink_tx))
                    .await
            })
        };
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let producer = tokio::spawn(producer);
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        let stalled = pulled.load(Ordering::SeqCst);
        assert!(
            stalled <= 16,
            "{stalled} frames read for a consumer that took none"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        assert_eq!(pulled.load(Ordering::SeqCst), stalled, "reading went on");
        // The consumer goes away: the reading goes on, the request is not stuck.
        drop(sink_rx);
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        assert!(pulled.load(Ordering::SeqCst) > stalled + 100);
        request.abort();
        producer.abort();
    }

    #[tokio::test]
    async fn heartbeats_go_out_until_the_channel_closes() {
        use tokio::io::AsyncBufReadExt;
        let (out_tx, out_rx) = mpsc::unbounded_channel::<Result<AttachOutput, String>>();
        let (input, sink) = tokio::io::duplex(1 << 16);
        let chan = RunnerChannel::new("t".into(), tokio_stream_from(out_rx), Box::pin(input))
            .with_heartbeat(std::time::Duration::from_millis(20));
        let mut lines = tokio::io::BufReader::new(sink).lines();
        for _ in 0..3 {
            let line = tokio::time::timeout(std::time::Duration::from_secs(5), lines.next_line())
                .await
                .expect("a heartbeat in time")
                .expect("read")
                .expect("a line");
            assert_eq!(line, r#"[0,{"type":"heartbeat"}]"#);
        }
        drop(out_tx);
        chan.close("done");
        // Once closed, the task ends and drops its end of the writer: the sink sees EOF
        // after whatever was in flight.
        drop(chan);
        let rest = tokio::time::timeout(std::time::Duration::from_secs(5), async {
            while lines.next_line().await.expect("read").is_some() {}
        })
        .await;
        assert!(rest.is_ok(), "heartbeats went on after the channel closed");
    }

    fn tokio_stream_from(
        mut rx: mpsc::UnboundedReceiver<Result<AttachOutput, String>>,
    ) -> impl Stream<Item = Result<AttachOutput, String>> {
        futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
    }
}
