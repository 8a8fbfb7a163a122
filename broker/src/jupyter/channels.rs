//! A kernel's WebSocket (`/api/kernels/{id}/channels`): the shell, control, iopub and
//! stdin channels multiplexed on one socket, as jupyter_server serves them. Cells queue and
//! run one at a time; every other request is answered at once, even while a cell runs, so
//! an interrupt or a `kernel_info_request` is never stuck behind one. Bad input (not a
//! message, an unknown type, too large) gets an error reply and the socket stays open.

use super::cell::{self, CellEnd, CellError};
use super::messages::{Frame, Framing, Malformed, Message, V1_SUBPROTOCOL};
use super::{Kernel, Kernels};
use crate::http::auth::Caller;
use crate::http::error::AppError;
use crate::http::AppState;
use crate::sync::LockExt as _;
use axum::extract::ws::{self, CloseFrame, WebSocket, WebSocketUpgrade};
use axum::extract::Path;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Router};
use futures::{SinkExt as _, StreamExt as _};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// Messages queued for one socket's writer: a client that does not read holds the cell
/// back (its output waits) instead of piling messages up here.
const OUTGOING: usize = 256;

/// Cells one socket may queue behind the running one; more are refused with an error
/// reply.
const MAX_QUEUED_CELLS: usize = 64;

/// How often an idle socket is pinged and its kernel checked (a session the core expired
/// closes the socket).
const HEARTBEAT: Duration = Duration::from_secs(30);

pub(super) fn router() -> Router<AppState> {
    Router::new().route("/api/kernels/{id}/channels", get(connect))
}

/// One socket's way to its client, for the iopub messages of cells other sockets run.
pub(super) struct Subscriber {
    /// The socket's number.
    id: u64,
    /// Its writer's queue.
    tx: mpsc::Sender<Message>,
}

/// Where the messages of one socket's requests go: replies to the socket alone, iopub
/// messages to every socket of the kernel (waiting for this one, never for the others,
/// whose full queues drop them).
#[derive(Clone)]
pub(super) struct Outbox {
    /// The socket's number.
    socket: u64,
    /// Its writer's queue.
    own: mpsc::Sender<Message>,
    /// The kernel, whose other sockets see the iopub messages.
    kernel: Arc<Kernel>,
}

impl Outbox {
    /// A reply (shell, control) to the requesting socket.
    pub(super) async fn reply(&self, message: Message) {
        let _ = self.own.send(message).await;
    }

    /// An iopub message to every socket of the kernel.
    pub(super) async fn publish(&self, message: Message) {
        broadcast(&self.kernel, &message, Some(self.socket));
        let _ = self.own.send(message).await;
    }
}

/// `message` to every socket of `kernel` but `except`, dropped where a queue is full.
fn broadcast(kernel: &Kernel, message: &Message, except: Option<u64>) {
    let others: Vec<mpsc::Sender<Message>> = kernel
        .subscribers
        .locked()
        .iter()
        .filter(|s| Some(s.id) != except)
        .map(|s| s.tx.clone())
        .collect();
    for tx in others {
        let _ = tx.try_send(message.clone());
    }
}

/// The next socket's number.
fn next_socket() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::SeqCst)
}

async fn connect(
    Extension(kernels): Extension<Arc<Kernels>>,
    caller: Caller,
    Path(id): Path<String>,
    upgrade: WebSocketUpgrade,
) -> Response {
    let Some(kernel) = kernels.get(&caller, &id) else {
        return AppError::not_found(format!("Kernel does not exist: {}", super::clip(&id)))
            .into_response();
    };
    // Up to twice the answered size is read, so a message a little too large gets an
    // error reply; past that the socket closes (1009) and the kernel stays.
    let hard_cap = kernels.max_message_bytes.saturating_mul(2);
    upgrade
        .protocols([V1_SUBPROTOCOL])
        .max_message_size(hard_cap)
        .max_frame_size(hard_cap)
        .on_upgrade(move |socket| serve(kernels, kernel, socket))
}

/// Serves one socket until the client closes it, the kernel is deleted or the server
/// stops. The socket counts against the connection caps while it is open: the server's
/// slots go with the connection, upgraded or not (`http/server.rs`).
async fn serve(kernels: Arc<Kernels>, kernel: Arc<Kernel>, socket: WebSocket) {
    let framing = match socket.protocol() {
        Some(p) if p.as_bytes() == V1_SUBPROTOCOL.as_bytes() => Framing::V1,
        _ => Framing::Legacy,
    };
    let socket_id = next_socket();
    let (mut sink, mut stream) = socket.split();
    let (own, mut queued) = mpsc::channel::<Message>(OUTGOING);
    kernel.subscribers.locked().push(Subscriber {
        id: socket_id,
        tx: own.clone(),
    });
    kernel.connections.fetch_add(1, Ordering::SeqCst);
    kernel.touch();
    let out = Outbox {
        socket: socket_id,
        own,
        kernel: kernel.clone(),
    };
    let (pings, mut ping_rx) = mpsc::channel::<()>(1);
    let (closing, mut close_rx) = mpsc::channel::<CloseFrame>(1);
    tokio::spawn(async move {
        loop {
            let frame = tokio::select! {
                message = queued.recv() => match message {
                    Some(message) => to_ws(message.to_frame(framing)),
                    None => break,
                },
                Some(()) = ping_rx.recv() => ws::Message::Ping(Default::default()),
                Some(frame) = close_rx.recv() => {
                    // What was queued before the close (a shutdown's reply) goes first.
                    while let Ok(message) = queued.try_recv() {
                        if sink.send(to_ws(message.to_frame(framing))).await.is_err() {
                            return;
                        }
                    }
                    let _ = sink.send(ws::Message::Close(Some(frame))).await;
                    break;
                }
            };
            if sink.send(frame).await.is_err() {
                return;
            }
        }
        // Completes the closing handshake (the answer to the client's close frame).
        let _ = sink.close().await;
    });
    let (cells, cells_rx) = mpsc::channel::<Message>(MAX_QUEUED_CELLS);
    tokio::spawn(run_cells(
        kernels.clone(),
        kernel.clone(),
        cells_rx,
        out.clone(),
    ));
    let mut heartbeat = tokio::time::interval(HEARTBEAT);
    heartbeat.tick().await;
    let close = loop {
        let frame = tokio::select! {
            frame = stream.next() => frame,
            () = kernel.ended.cancelled() => break Some(close_frame(1001, "the kernel was shut down")),
            _ = heartbeat.tick() => {
                if kernels.live(kernel.clone()).is_none() {
                    break Some(close_frame(1001, "the kernel's session ended"));
                }
                let _ = pings.try_send(());
                continue;
            }
        };
        let received = match frame {
            None | Some(Ok(ws::Message::Close(_))) => break None,
            Some(Err(err)) => {
                // Past the hard cap, or not WebSocket: nothing more can be read.
                tracing::debug!(error = %err, "jupyter socket ended");
                break Some(close_frame(1009, "the message is too large"));
            }
            Some(Ok(ws::Message::Text(text))) => {
                let size = text.len();
                (Message::from_text(text.as_str()), size)
            }
            Some(Ok(ws::Message::Binary(bytes))) => {
                let size = bytes.len();
                let parsed = match framing {
                    Framing::V1 => Message::from_v1(&bytes),
                    Framing::Legacy => Err(Malformed {
                        reason: "binary frames need the v1.kernel.websocket.jupyter.org \
                                 subprotocol; send messages as JSON text"
                            .into(),
                        header: None,
                        channel: None,
                    }),
                };
                (parsed, size)
            }
            Some(Ok(_)) => continue,
        };
        kernel.touch();
        match received {
            (Ok(message), size) if size > kernels.max_message_bytes => {
                let reason = format!(
                    "the message is {size} bytes: at most {} (CODEBROKER_MAX_BODY_MB)",
                    kernels.max_message_bytes
                );
                refuse(
                    &out,
                    Some(&message.header),
                    &message.channel,
                    Some(message.msg_type()),
                    "MessageTooLarge",
                    &reason,
                )
                .await;
            }
            (Ok(message), _) => handle(&kernels, &kernel, message, &out, &cells).await,
            (Err(malformed), _) => {
                let channel = malformed.channel.as_deref().unwrap_or("shell");
                refuse(
                    &out,
                    malformed.header.as_ref(),
                    channel,
                    None,
                    "MalformedMessage",
                    &malformed.reason,
                )
                .await;
            }
        }
    };
    kernel.subscribers.locked().retain(|s| s.id != socket_id);
    kernel.connections.fetch_sub(1, Ordering::SeqCst);
    if let Some(frame) = close {
        let _ = closing.try_send(frame);
    }
    // The writer ends once the cell under way (which runs on, as in a Jupyter kernel)
    // and this loop have dropped their senders.
}

fn to_ws(frame: Frame) -> ws::Message {
    match frame {
        Frame::Text(text) => ws::Message::Text(text.into()),
        Frame::Binary(bytes) => ws::Message::Binary(bytes.into()),
    }
}

fn close_frame(code: u16, reason: &str) -> CloseFrame {
    CloseFrame {
        code,
        reason: reason.into(),
    }
}

/// Runs the socket's cells in order; after a cell that failed with `stop_on_error`, the
/// cells queued behind it are aborted, as a Jupyter kernel does.
async fn run_cells(
    kernels: Arc<Kernels>,
    kernel: Arc<Kernel>,
    mut cells: mpsc::Receiver<Message>,
    out: Outbox,
) {
    while let Some(request) = cells.recv().await {
        if kernel.ended.is_cancelled() {
            break;
        }
        let end = cell::run(&kernels, &kernel, &request, &out).await;
        let stop_on_error = request.content["stop_on_error"].as_bool().unwrap_or(true);
        if end == CellEnd::Failed && stop_on_error {
            while let Ok(queued) = cells.try_recv() {
                abort(&kernel, &queued, &out).await;
            }
        }
    }
}

/// Answers a queued cell that will not run: busy, `execute_reply` aborted, idle.
async fn abort(kernel: &Kernel, request: &Message, out: &Outbox) {
    let parent = Some(&request.header);
    let msg = |channel: &str, msg_type: &str, content: Value| {
        Message::reply(parent, &kernel.kernel_session, channel, msg_type, content)
    };
    out.publish(msg("iopub", "status", json!({"execution_state": "busy"})))
        .await;
    out.reply(msg(
        &request.channel,
        "execute_reply",
        json!({"status": "aborted", "execution_count": kernel.execution_count.load(Ordering::SeqCst)}),
    ))
    .await;
    out.publish(msg("iopub", "status", json!({"execution_state": "idle"})))
        .await;
}

/// The reply type of a request type: `x_request` is answered by `x_reply`.
fn reply_type(msg_type: &str) -> String {
    format!(
        "{}_reply",
        msg_type.strip_suffix("_request").unwrap_or(msg_type)
    )
}

/// Answers a request it cannot serve: `<type>_reply` with status error when the request
/// has a type, else an iopub `error`, between busy and idle when it has a header to link
/// them to (clients wait for that idle).
async fn refuse(
    out: &Outbox,
    parent: Option<&Value>,
    channel: &str,
    msg_type: Option<&str>,
    ename: &str,
    evalue: &str,
) {
    let session = &out.kernel.kernel_session;
    let msg = |channel: &str, msg_type: &str, content: Value| {
        Message::reply(parent, session, channel, msg_type, content)
    };
    let error = CellError::new(ename, evalue);
    let channel = match channel {
        "shell" | "control" => channel,
        _ => "shell",
    };
    if parent.is_some() {
        out.publish(msg("iopub", "status", json!({"execution_state": "busy"})))
            .await;
    }
    match msg_type {
        Some(t) => {
            let mut content = error.content();
            content["status"] = json!("error");
            if t == "execute_request" {
                content["execution_count"] =
                    json!(out.kernel.execution_count.load(Ordering::SeqCst));
                out.publish(msg("iopub", "error", error.content())).await;
            }
            out.reply(msg(channel, &reply_type(t), content)).await;
        }
        None => out.publish(msg("iopub", "error", error.content())).await,
    }
    if parent.is_some() {
        out.publish(msg("iopub", "status", json!({"execution_state": "idle"})))
            .await;
    }
}

/// Serves one request: cells go to the queue, the rest are answered now.
async fn handle(
    kernels: &Arc<Kernels>,
    kernel: &Arc<Kernel>,
    request: Message,
    out: &Outbox,
    cells: &mpsc::Sender<Message>,
) {
    let msg_type = request.msg_type().to_string();
    if msg_type == "execute_request" {
        if let Err(mpsc::error::TrySendError::Full(request)) = cells.try_send(request) {
            let reason = format!("{MAX_QUEUED_CELLS} cells are queued already; wait for them");
            refuse(
                out,
                Some(&request.header),
                &request.channel,
                Some("execute_request"),
                "QueueFull",
                &reason,
            )
            .await;
        }
        return;
    }
    // Replies without status messages: a client's answer to an input request (none is
    // sent: stdin is not served) and comm traffic to targets that do not exist.
    if matches!(msg_type.as_str(), "input_reply" | "comm_msg" | "comm_close") {
        return;
    }
    let parent = Some(&request.header);
    let msg = |channel: &str, msg_type: &str, content: Value| {
        Message::reply(parent, &kernel.kernel_session, channel, msg_type, content)
    };
    let content = &request.content;
    let reply = match msg_type.as_str() {
        "kernel_info_request" => Some(kernel_info()),
        "complete_request" => {
            let cursor = content["cursor_pos"].as_u64().unwrap_or(0);
            Some(
                json!({"status": "ok", "matches": [], "cursor_start": cursor,
                        "cursor_end": cursor, "metadata": {}}),
            )
        }
        "inspect_request" => {
            Some(json!({"status": "ok", "found": false, "data": {}, "metadata": {}}))
        }
        "is_complete_request" => Some(json!({"status": "unknown"})),
        "comm_info_request" => Some(json!({"status": "ok", "comms": {}})),
        "history_request" => Some(json!({"status": "ok", "history": []})),
        "interrupt_request" => {
            kernel.interrupt();
            Some(json!({"status": "ok"}))
        }
        "shutdown_request" | "comm_open" => None,
        _ => {
            let reason = format!(
                "codebroker's kernel does not serve {:?} messages",
                super::clip(&msg_type)
            );
            refuse(
                out,
                parent,
                &request.channel,
                Some(&msg_type),
                "UnknownMessageType",
                &reason,
            )
            .await;
            return;
        }
    };
    let channel = match request.channel.as_str() {
        "control" => "control",
        _ => "shell",
    };
    out.publish(msg("iopub", "status", json!({"execution_state": "busy"})))
        .await;
    if let Some(reply) = reply {
        out.reply(msg(channel, &reply_type(&msg_type), reply)).await;
    } else if msg_type == "comm_open" {
        // No comm targets: the comm is closed at once, as ipykernel does.
        let comm_id = content["comm_id"].clone();
        out.publish(msg(
            "iopub",
            "comm_close",
            json!({"comm_id": comm_id, "data": {}}),
        ))
        .await;
    }
    if msg_type == "shutdown_request" {
        let restarting = content["restart"].as_bool().unwrap_or(false);
        if restarting {
            restart(kernels, kernel).await;
        }
        out.reply(msg(
            channel,
            "shutdown_reply",
            json!({"status": "ok", "restart": restarting}),
        ))
        .await;
        out.publish(msg("iopub", "status", json!({"execution_state": "idle"})))
            .await;
        if !restarting {
            // The kernel's process would exit: the kernel ends, its sockets close.
            kernels.delete(kernel);
        }
        return;
    }
    out.publish(msg("iopub", "status", json!({"execution_state": "idle"})))
        .await;
}

/// `kernel_info_reply`'s content.
fn kernel_info() -> Value {
    json!({
        "status": "ok",
        "protocol_version": super::messages::PROTOCOL_VERSION,
        "implementation": "codebroker",
        "implementation_version": env!("CARGO_PKG_VERSION"),
        "language_info": {
            "name": "python",
            "version": "3",
            "mimetype": "text/x-python",
            "file_extension": ".py",
            "pygments_lexer": "ipython3",
            "codemirror_mode": {"name": "ipython", "version": 3},
            "nbconvert_exporter": "python",
        },
        "banner": "Python 3 in a codebroker sandbox (no network; files in /mnt/data)",
        "help_links": [],
        "debugger": false,
    })
}

/// Restarts a kernel after the cell under way (interrupted first): its sandbox is
/// replaced, the Python state and the execution count start again, files stay. Every
/// socket sees `restarting`, then `idle`.
pub(super) async fn restart(kernels: &Kernels, kernel: &Kernel) {
    kernel.interrupt();
    let _turn = kernel.turn.lock().await;
    let status = |state: &str| {
        Message::reply(
            None,
            &kernel.kernel_session,
            "iopub",
            "status",
            json!({"execution_state": state}),
        )
    };
    broadcast(kernel, &status("restarting"), None);
    kernels.broker.restart_sandbox(&kernel.session).await;
    kernel.execution_count.store(0, Ordering::SeqCst);
    *kernel.env_in.locked() = None;
    kernel.touch();
    broadcast(kernel, &status("idle"), None);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_answered_by_their_reply_type() {
        assert_eq!(reply_type("kernel_info_request"), "kernel_info_reply");
        assert_eq!(reply_type("bogus"), "bogus_reply");
    }
}
