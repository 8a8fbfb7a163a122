//! The broker's end of the attached stdio channel to a sandbox's runner.
//!
//! Frames are newline-delimited JSON `[job_id, message]`. One reader task demultiplexes the
//! runner's frames to the job that waits for them; writers take turns on the write half.
//! Everything read is untrusted: an oversized or unparseable frame closes the channel
//! (and so ends the sandbox), never the broker.

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
pub enum ChannelError {
    #[error("the sandbox is gone: {0}")]
    Closed(String),
    #[error("the runner answered with an unexpected message: {0}")]
    Unexpected(String),
    #[error("the runner refused the request: {0}")]
    Refused(String),
}

/// Output of the attached container, as bollard yields it: stdout bytes (frames) or
/// stderr bytes (the runner's own diagnostics).
pub enum AttachOutput {
    Stdout(bytes::Bytes),
    Stderr(bytes::Bytes),
}

type Waiters = Arc<Mutex<HashMap<JobId, mpsc::UnboundedSender<WorkerMessage>>>>;

/// A live channel to one runner.
pub struct RunnerChannel {
    /// The write half of the attach stream; one frame at a time.
    writer: tokio::sync::Mutex<Pin<Box<dyn AsyncWrite + Send>>>,
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
}

impl RunnerChannel {
    /// Starts demultiplexing `output` and returns the channel. `label` names the sandbox
    /// in logs.
    pub fn new<S>(label: String, output: S, input: Pin<Box<dyn AsyncWrite + Send>>) -> Self
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
            writer: tokio::sync::Mutex::new(input),
            waiters,
            // Jobs a runner still runs for an earlier channel (a broker that died) must not
            // be taken for this channel's: each channel numbers its jobs from a random
            // start, kept below 2^52 so the ids stay exact as JSON numbers.
            next_job: AtomicU64::new(rand::random_range(1..1u64 << 52)),
            closed,
            close_tx,
            reader,
        }
    }

    /// Whether the channel has closed (the runner exited, or a frame was bad).
    pub fn is_closed(&self) -> bool {
        self.closed.borrow().is_some()
    }

    /// Closes the channel from the broker's side; pending requests fail.
    pub fn close(&self, reason: &str) {
        close(&self.close_tx, &self.waiters, reason);
    }

    /// Sends a request and waits for the message that ends its job.
    pub async fn request<R>(
        &self,
        request: R,
        on_event: impl FnMut(WorkerMessage),
    ) -> Result<WorkerMessage, ChannelError>
    where
        R: Request,
    {
        self.request_as(self.new_job(), request, on_event).await
    }

    /// A fresh job id, for a caller that must know it before the request goes out (to
    /// cancel it).
    pub fn new_job(&self) -> JobId {
        self.next_job.fetch_add(1, Ordering::Relaxed)
    }

    /// Sends a request as job `job` and waits for the message that ends the job. Output
    /// Messages on the way (output chunks, tool calls, displays) are handed to `on_event`.
    pub async fn request_as<R>(
        &self,
        job: JobId,
        request: R,
        mut on_event: impl FnMut(WorkerMessage),
    ) -> Result<WorkerMessage, ChannelError>
    where
        R: Request,
    {
        let (tx, mut rx) = mpsc::unbounded_channel();
        self.lock_waiters().insert(job, tx);
        let _guard = WaiterGuard {
            waiters: &self.waiters,
            job,
        };
        self.send(job, request.into()).await?;
        let mut closed = self.closed.clone();
        loop {
            tokio::select! {
                msg = rx.recv() => match msg {
                    Some(msg @ (WorkerMessage::Output(_) | WorkerMessage::ToolCall(_) | WorkerMessage::Display(_))) => on_event(msg),
                    Some(WorkerMessage::Error(err)) => return Err(ChannelError::Refused(err.message)),
                    Some(other) => return Ok(other),
                    None => return Err(ChannelError::Closed(self.close_reason())),
                },
                _ = closed.wait_for(|c| c.is_some()) => {
                    // Messages that arrived before the close still count.
                    while let Ok(msg) = rx.try_recv() {
                        match msg {
                            msg @ (WorkerMessage::Output(_) | WorkerMessage::ToolCall(_) | WorkerMessage::Display(_)) => on_event(msg),
                            WorkerMessage::Error(err) => return Err(ChannelError::Refused(err.message)),
                            other => return Ok(other),
                        }
                    }
                    return Err(ChannelError::Closed(self.close_reason()));
                }
            }
        }
    }

    /// Asks the runner to stop the exec of `job`.
    pub async fn cancel(&self, job: JobId) -> Result<(), ChannelError> {
        self.send(job, CoordinatorMessage::Cancel).await
    }

    /// Answers a tool call of the exec of `job`.
    pub async fn tool_result(
        &self,
        job: JobId,
        result: sandbox_runner::ToolResult,
    ) -> Result<(), ChannelError> {
        self.send(job, CoordinatorMessage::ToolResult(result)).await
    }

    async fn send(&self, job: JobId, msg: CoordinatorMessage) -> Result<(), ChannelError> {
        let mut line = serde_json::to_vec(&Multiplexed(job, msg))
            .map_err(|e| ChannelError::Closed(format!("cannot encode frame: {e}")))?;
        line.push(b'\n');
        let mut writer = self.writer.lock().await;
        let written = async {
            writer.write_all(&line).await?;
            writer.flush().await
        }
        .await;
        drop(writer);
        if let Err(err) = written {
            let reason = format!("write to the runner failed: {err}");
            self.close(&reason);
            return Err(ChannelError::Closed(reason));
        }
        Ok(())
    }

    fn close_reason(&self) -> String {
        self.closed
            .borrow()
            .clone()
            .unwrap_or_else(|| "the channel closed".to_string())
    }

    fn lock_waiters(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<JobId, mpsc::UnboundedSender<WorkerMessage>>> {
        lock(&self.waiters)
    }
}

impl Drop for RunnerChannel {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// Removes a job's waiter however its request ends.
struct WaiterGuard<'a> {
    waiters: &'a Waiters,
    job: JobId,
}

impl Drop for WaiterGuard<'_> {
    fn drop(&mut self) {
        lock(self.waiters).remove(&self.job);
    }
}

fn lock(
    waiters: &Waiters,
) -> std::sync::MutexGuard<'_, HashMap<JobId, mpsc::UnboundedSender<WorkerMessage>>> {
    // A poisoned map still holds valid senders; keep going.
    waiters.lock().unwrap_or_else(|p| p.into_inner())
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
    lock(waiters).clear();
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
    let mut buf = BytesMut::new();
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
                buf.extend_from_slice(&bytes);
                if let Err(reason) = dispatch_lines(&mut buf, &waiters) {
                    break reason;
                }
            }
        }
    };
    tracing::debug!(sandbox = %label, %reason, "runner channel closed");
    close(&close_tx, &waiters, &reason);
}

/// Hands every complete line in `buf` to its job. Fails (closing the channel) on a frame
/// that is too long or not a frame at all.
fn dispatch_lines(buf: &mut BytesMut, waiters: &Waiters) -> Result<(), String> {
    while let Some(pos) = buf.iter().position(|&b| b == b'\n') {
        let line = buf.split_to(pos + 1);
        let line = &line[..pos];
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let Multiplexed(job, msg) = serde_json::from_slice::<Multiplexed<WorkerMessage>>(line)
            .map_err(|e| format!("bad frame from the runner: {e}"))?;
        let waiter = lock(waiters).get(&job).cloned();
        match waiter {
            Some(tx) => {
                let _ = tx.send(msg);
            }
            None => tracing::debug!(job, "frame for no waiting job: {msg:?}"),
        }
    }
    if buf.len() > MAX_FRAME_BYTES {
        return Err(format!("frame longer than {MAX_FRAME_BYTES} bytes"));
    }
    if buf.is_empty() && buf.capacity() > 1 << 20 {
        // Give back the memory of a large frame once it is handled.
        *buf = BytesMut::new();
    }
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
        let msg = chan
            .request_as(job, HelloRequest::default(), |_| {})
            .await
            .unwrap();
        assert!(matches!(msg, WorkerMessage::Hello(_)));
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
        let err = chan
            .request(HelloRequest::default(), |_| {})
            .await
            .unwrap_err();
        assert!(matches!(err, ChannelError::Closed(_)), "{err}");
        assert!(chan.is_closed());
    }

    fn tokio_stream_from(
        mut rx: mpsc::UnboundedReceiver<Result<AttachOutput, String>>,
    ) -> impl Stream<Item = Result<AttachOutput, String>> {
        futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
    }
}
