//! `POST /exec`: run code in a session and answer with its output and files.

use super::{ApiJson, AppState};
use crate::core::{ExecHooks, ExecInput, ExecRun, InputFile, SessionChoice};
use crate::http::auth::Caller;
use crate::http::error::{AppError, AppResult};
use crate::ids::is_valid_id;
use crate::render::output_json;
use axum::body::Body;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use futures::StreamExt as _;
use sandbox_runner::{DisplayData, Language, Stream, WorkerMessage};
use serde::Deserialize;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::future::Future as _;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// How long a call may take before the answer switches to a stream that starts with
/// whitespace, so idle-socket timeouts of clients (LibreChat's is a few seconds) do not
/// fire during a long exec.
const KEEPALIVE_AFTER: Duration = Duration::from_secs(2);
/// How often the whitespace comes.
const KEEPALIVE_EVERY: Duration = Duration::from_secs(3);

pub(crate) fn router() -> Router<AppState> {
    Router::new()
        .route("/exec", post(exec))
        .route("/exec/stream", post(exec_stream))
}

/// The body of `POST /exec` (both contract generations). Unknown fields are ignored.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub(crate) struct ExecBody {
    /// Language name or alias.
    pub(crate) lang: String,
    /// Source code.
    pub(crate) code: String,
    /// Arguments: a list, or one string split at white space.
    #[serde(default)]
    pub(crate) args: Option<Args>,
    pub(crate) session_id: Option<String>,
    pub(crate) entity_id: Option<String>,
    pub(crate) user_id: Option<String>,
    pub(crate) runtime_session_hint: Option<String>,
    /// Wall-time limit in milliseconds.
    pub(crate) timeout: Option<f64>,
    /// Input files.
    #[serde(default)]
    pub(crate) files: Option<Vec<FileRef>>,
}

/// `args` as clients send it.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
pub(crate) enum Args {
    List(Vec<String>),
    Line(String),
}

/// An input file reference, classic `{id, session_id, name}` or new
/// `{id, resource_id, storage_session_id, name, kind, version}`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub(crate) struct FileRef {
    pub(crate) id: String,
    pub(crate) session_id: Option<String>,
    pub(crate) storage_session_id: Option<String>,
    #[serde(default)]
    pub(crate) name: String,
}

impl ExecBody {
    /// Checks the body and splits it into the session choice and the exec.
    pub(crate) fn into_parts(self, caller: &Caller) -> AppResult<(SessionChoice, ExecInput)> {
        let lang: Language = self
            .lang
            .parse()
            .map_err(|_| AppError::unsupported_language(self.lang.clone()))?;
        let args = match self.args {
            None => Vec::new(),
            Some(Args::List(list)) => list,
            Some(Args::Line(line)) => line.split_whitespace().map(str::to_string).collect(),
        };
        let refs = self.files.unwrap_or_default();
        crate::core::limits::check_input_refs(refs.len())?;
        let mut files = Vec::new();
        for f in refs {
            if !is_valid_id(&f.id) {
                return Err(AppError::bad_request(format!(
                    "invalid file id: {:?}",
                    f.id
                )));
            }
            let session_id = f
                .storage_session_id
                .or(f.session_id)
                .filter(|s| !s.is_empty())
                .unwrap_or_default();
            if !session_id.is_empty() && !is_valid_id(&session_id) {
                return Err(AppError::bad_request(format!(
                    "invalid session id in file ref: {session_id:?}"
                )));
            }
            files.push(InputFile {
                id: f.id,
                session_id,
                name: f.name,
            });
        }
        let timeout_ms = match self.timeout {
            Some(t) if !t.is_finite() || t < 0.0 => {
                return Err(AppError::Unprocessable(
                    "timeout must be a positive number of ms".into(),
                ))
            }
            Some(t) => Some(t as u64),
            None => None,
        };
        let choice = SessionChoice {
            user: caller.user_or(self.user_id.as_deref()),
            session_id: self.session_id,
            runtime_session_hint: self.runtime_session_hint,
            entity_id: self.entity_id,
            tenant: caller.tenant.clone(),
        };
        let input = ExecInput {
            lang,
            code: self.code,
            args,
            timeout_ms,
            files,
            tenant: caller.tenant.clone(),
        };
        Ok((choice, input))
    }
}

/// Runs code in a session and answers with its output and files. After 2 s the answer
/// becomes a 200 whose body starts with whitespace (keep-alive) and ends with the JSON.
#[utoipa::path(
    post,
    path = "/exec",
    tag = "exec",
    security(("api_key" = []), ("bearer" = [])),
    request_body = ExecBody,
    responses(
        (status = 200, description = "The exec's output", body = crate::http::openapi::ExecResponseDoc),
        (status = 400, description = "Malformed request or unsupported language", body = crate::http::openapi::ErrorBody),
        crate::http::openapi::Unauthorized,
        (status = 403, description = "An input file belongs to another user", body = crate::http::openapi::ErrorBody),
        crate::http::openapi::WrongShape,
        crate::http::openapi::RateLimited,
        (status = 503, description = "No sandbox can be started right now", body = crate::http::openapi::ErrorBody),
    )
)]
async fn exec(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(body): ApiJson<ExecBody>,
) -> AppResult<Response> {
    let (choice, input) = body.into_parts(&caller)?;
    // The exec runs in a task of its own, so a client that goes away does not leave the
    // session half-way through a call; it is told to stop instead (the run, dropped with
    // this handler or with the response body, cancels it), so its code does not run on
    // for nobody.
    let cancel = CancellationToken::new();
    let hooks = ExecHooks {
        cancel: Some(cancel.clone()),
        ..Default::default()
    };
    let mut run = state
        .broker
        .start_exec(&choice, input, hooks)
        .await?
        .cancel_on_drop(Some(&cancel));

    match tokio::time::timeout(KEEPALIVE_AFTER, &mut run).await {
        Ok(output) => Ok(axum::Json(output_json(&output?)).into_response()),
        Err(_) => Ok(keepalive_response(run)),
    }
}

/// A 200 whose body is whitespace every few seconds, then the JSON (JSON parsers skip
/// leading whitespace). An error after this point can only be told in the body. The body
/// holds the run: a client that disconnects stops the exec.
fn keepalive_response(run: ExecRun) -> Response {
    let stream = futures::stream::unfold(Some(run), |state| async move {
        let mut run = state?;
        tokio::select! {
            output = &mut run => {
                let body = match output {
                    Ok(output) => output_json(&output),
                    Err(err) => AppError::from(err).body(),
                };
                Some((Ok::<_, std::io::Error>(body.to_string().into_bytes()), None))
            }
            _ = tokio::time::sleep(KEEPALIVE_EVERY) => {
                Some((Ok(b" ".to_vec()), Some(run)))
            }
        }
    });
    let stream =
        futures::StreamExt::chain(futures::stream::once(async { Ok(b" ".to_vec()) }), stream);
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        Body::from_stream(stream),
    )
        .into_response()
}

/// One event of a streamed exec: its name (`stdout`, `stderr`, `display`, `result`,
/// `error`) and its payload.
#[derive(Debug)]
struct StreamEvent {
    name: &'static str,
    data: Value,
}

/// The NDJSON line a silent stream sends to keep proxies from cutting it: an event every
/// client dispatching on `event` passes over, as it does the ones it does not know.
const NDJSON_HEARTBEAT: &[u8] = b"{\"event\":\"heartbeat\",\"data\":null}\n";

/// The text of the SSE comment a silent stream sends (`: keep-alive`).
const SSE_KEEPALIVE: &str = "keep-alive";

impl StreamEvent {
    /// As SSE: `event:` the name, `data:` the payload (a string as is, JSON otherwise),
    /// one `data:` line per line. SSE cannot carry a carriage return (it ends a line
    /// there): `\r\n` and a lone `\r` become line breaks.
    fn sse(self) -> Event {
        let payload = match self.data {
            Value::String(s) => s,
            other => other.to_string(),
        };
        let payload = if payload.contains('\r') {
            payload.replace("\r\n", "\n").replace('\r', "\n")
        } else {
            payload
        };
        Event::default().event(self.name).data(payload)
    }

    /// As one NDJSON line, `{"event", "data"}`.
    fn ndjson(self) -> Bytes {
        let mut line = json!({ "event": self.name, "data": self.data }).to_string();
        line.push('\n');
        Bytes::from(line)
    }
}

/// `events` as `text/event-stream`, with an SSE comment after every `keepalive` of
/// silence.
fn sse_response(
    events: impl futures::Stream<Item = StreamEvent> + Send + 'static,
    keepalive: Duration,
) -> Response {
    let events = events.map(|e| Ok::<_, Infallible>(e.sse()));
    Sse::new(events)
        .keep_alive(KeepAlive::new().interval(keepalive).text(SSE_KEEPALIVE))
        .into_response()
}

/// `events` as NDJSON, with a heartbeat line after every `keepalive` of silence.
fn ndjson_response(
    events: impl futures::Stream<Item = StreamEvent> + Send + 'static,
    keepalive: Duration,
) -> Response {
    let lines = Heartbeat::new(events.map(StreamEvent::ndjson), keepalive, || {
        Bytes::from_static(NDJSON_HEARTBEAT)
    });
    (
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, "application/x-ndjson"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(lines.map(Ok::<_, Infallible>)),
    )
        .into_response()
}

/// A stream that yields `beat()` whenever `inner` has yielded nothing for `every`, and
/// ends with it (what `KeepAlive` does for SSE, for any item type).
struct Heartbeat<S, F> {
    inner: Pin<Box<S>>,
    /// Fires `every` after the last item or beat.
    timer: Pin<Box<tokio::time::Sleep>>,
    every: Duration,
    beat: F,
}

impl<S, F> Heartbeat<S, F> {
    fn new(inner: S, every: Duration, beat: F) -> Self {
        Heartbeat {
            inner: Box::pin(inner),
            timer: Box::pin(tokio::time::sleep(every)),
            every,
            beat,
        }
    }
}

impl<S: futures::Stream, F: Fn() -> S::Item + Unpin> futures::Stream for Heartbeat<S, F> {
    type Item = S::Item;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        let this = &mut *self;
        let item = match this.inner.as_mut().poll_next(cx) {
            Poll::Ready(item) => item,
            Poll::Pending => {
                std::task::ready!(this.timer.as_mut().poll(cx));
                Some((this.beat)())
            }
        };
        if item.is_some() {
            let next = tokio::time::Instant::now() + this.every;
            this.timer.as_mut().reset(next);
        }
        Poll::Ready(item)
    }
}

/// Largest image a `display` event carries inline.
const MAX_INLINE_DISPLAY_BYTES: u64 = 5 * 1024 * 1024;

/// Streams events of one exec wait in the channel to the response body; a client that
/// stops reading holds the exec back once these are queued.
const STREAM_QUEUE: usize = 8;

/// A `display` event: what the code showed, with the image inline when it is small and
/// fits in `inline_left`, the bytes of files the exec may still inline (a loop showing
/// one large file must not turn each small event into megabytes read and sent). Returns
/// the event and what is left.
async fn display_json(
    broker: &crate::core::Broker,
    session: &crate::session::Session,
    display: DisplayData,
    inline_left: u64,
) -> (Value, u64) {
    let mut out = json!({ "mime": display.mime });
    let mut left = inline_left;
    if let Some(name) = &display.name {
        out["name"] = json!(name);
        out["path"] = json!(format!("/mnt/data/{name}"));
        let cap = MAX_INLINE_DISPLAY_BYTES.min(inline_left);
        // The code may still be appending to it: never read past the cap.
        if let Some(bytes) = broker.display_bytes(session, name, cap).await {
            left -= bytes.len() as u64;
            use base64::Engine as _;
            out["data"] = json!(base64::engine::general_purpose::STANDARD.encode(bytes));
        }
    } else if let Some(data) = display.data {
        out["data"] = json!(data);
    }
    (out, left)
}

/// `POST /exec/stream`: the `/exec` request answered as `text/event-stream` (or NDJSON
/// with `Accept: application/x-ndjson`): `stdout`/`stderr` chunks as the code writes
/// them, `display` for figures, and a final `result` with the `/exec` response; after
/// each `CODEBROKER_STREAM_KEEPALIVE_SECS` of silence an SSE comment (NDJSON: a
/// `heartbeat` event), so proxies do not cut a quiet run. A client that disconnects
/// stops the exec; the session stays usable.
#[utoipa::path(
    post,
    path = "/exec/stream",
    tag = "exec",
    security(("api_key" = []), ("bearer" = [])),
    request_body = ExecBody,
    responses(
        (status = 200, description = "`stdout`, `stderr`, `display` events, then `result` (the /exec response) or `error` (the error envelope); NDJSON lines `{event, data}` with `Accept: application/x-ndjson`; a `: keep-alive` comment (NDJSON: `{\"event\":\"heartbeat\",\"data\":null}`) after each CODEBROKER_STREAM_KEEPALIVE_SECS (15) of silence", content_type = "text/event-stream"),
        (status = 400, description = "Malformed request or unsupported language", body = crate::http::openapi::ErrorBody),
        crate::http::openapi::Unauthorized,
        crate::http::openapi::WrongShape,
        crate::http::openapi::RateLimited,
    )
)]
async fn exec_stream(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    ApiJson(body): ApiJson<ExecBody>,
) -> AppResult<Response> {
    let ndjson = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/x-ndjson"));
    let (choice, input) = body.into_parts(&caller)?;
    let inline_left = state.broker.config().exec_limits.max_display_bytes;
    let keepalive = Duration::from_secs(state.broker.config().stream_keepalive_secs);
    let (tx, rx) = mpsc::channel(STREAM_QUEUE);
    let cancel = CancellationToken::new();
    let hooks = ExecHooks {
        events: Some(tx),
        tools: None,
        cancel: Some(cancel.clone()),
    };
    let run = state
        .broker
        .start_exec(&choice, input, hooks)
        .await?
        .cancel_on_drop(Some(&cancel));
    let files_of = run.session.clone();

    struct State {
        rx: mpsc::Receiver<WorkerMessage>,
        /// The exec; dropped with the body, so a client that goes away cancels it.
        run: Option<ExecRun>,
        /// The exec's session, whose files displays may inline.
        files_of: std::sync::Arc<crate::session::Session>,
        /// Through which those files are read.
        broker: std::sync::Arc<crate::core::Broker>,
        /// Bytes of files the displays of this exec may still inline.
        inline_left: u64,
    }
    let state = State {
        rx,
        run: Some(run),
        files_of,
        broker: state.broker.clone(),
        inline_left,
    };
    let events = futures::stream::unfold(state, move |mut st| async move {
        if let Some(msg) = st.rx.recv().await {
            let event = match msg {
                WorkerMessage::Output(chunk) => {
                    let name = match chunk.stream {
                        Stream::Stdout => "stdout",
                        Stream::Stderr => "stderr",
                    };
                    StreamEvent {
                        name,
                        data: Value::String(chunk.data),
                    }
                }
                WorkerMessage::Display(display) => {
                    let (data, left) =
                        display_json(&st.broker, &st.files_of, display, st.inline_left).await;
                    st.inline_left = left;
                    StreamEvent {
                        name: "display",
                        data,
                    }
                }
                _ => StreamEvent {
                    name: "ignored",
                    data: Value::Null,
                },
            };
            return Some((event, st));
        }
        let run = st.run.take()?;
        let (name, data) = match run.await {
            Ok(output) => ("result", output_json(&output)),
            Err(err) => ("error", AppError::from(err).body()),
        };
        Some((StreamEvent { name, data }, st))
    });
    Ok(if ndjson {
        ndjson_response(events, keepalive)
    } else {
        sse_response(events, keepalive)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::channel::mpsc::{unbounded, UnboundedSender};
    use http_body_util::BodyExt;
    use tokio::time::Instant;

    const EVERY: Duration = Duration::from_secs(15);

    /// The events a test stream is fed from.
    type Events = futures::channel::mpsc::UnboundedReceiver<StreamEvent>;

    /// The next chunk of `body` as text, and how long (paused) time it took to come;
    /// `None` at the end.
    async fn next_chunk(body: &mut Body) -> Option<(String, Duration)> {
        let started = Instant::now();
        let frame = body.frame().await?.expect("frame");
        let data = frame.into_data().expect("a data frame");
        Some((
            String::from_utf8(data.to_vec()).expect("utf-8"),
            started.elapsed(),
        ))
    }

    fn stdout(tx: &UnboundedSender<StreamEvent>, text: &str) {
        tx.unbounded_send(StreamEvent {
            name: "stdout",
            data: json!(text),
        })
        .expect("send");
    }

    /// Each silence of `EVERY` gets one keep-alive, counted from the last thing sent;
    /// events still come through as they are, and the stream ends when they do.
    async fn beats_on_silence(make: fn(Events, Duration) -> Response, beat: &str, first: &str) {
        let (tx, rx) = unbounded();
        let mut body = make(rx, EVERY).into_body();
        stdout(&tx, "step 1\n");
        let (text, waited) = next_chunk(&mut body).await.expect("the event");
        assert_eq!((text.as_str(), waited), (first, Duration::ZERO));
        for _ in 0..2 {
            let (text, waited) = next_chunk(&mut body).await.expect("a beat");
            assert_eq!((text.as_str(), waited), (beat, EVERY));
        }
        // Output 10 s into a silence: the next beat is 15 s after it, not 5.
        tokio::time::advance(Duration::from_secs(10)).await;
        stdout(&tx, "step 1\n");
        let (text, _) = next_chunk(&mut body).await.expect("the event");
        assert_eq!(text, first);
        let (text, waited) = next_chunk(&mut body).await.expect("a beat");
        assert_eq!((text.as_str(), waited), (beat, EVERY));
        drop(tx);
        assert_eq!(next_chunk(&mut body).await, None, "ends with the events");
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_sse_stream_gets_a_comment_every_interval() {
        beats_on_silence(
            sse_response,
            ": keep-alive\n\n",
            "event: stdout\ndata: step 1\ndata: \n\n",
        )
        .await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_ndjson_stream_gets_a_heartbeat_line_every_interval() {
        beats_on_silence(
            ndjson_response,
            "{\"event\":\"heartbeat\",\"data\":null}\n",
            "{\"data\":\"step 1\\n\",\"event\":\"stdout\"}\n",
        )
        .await;
    }

    #[test]
    fn sse_turns_carriage_returns_into_line_breaks() {
        let event = |data: &str| {
            StreamEvent {
                name: "stdout",
                data: json!(data),
            }
            .sse()
        };
        let bytes = |e: Event| {
            let body = Sse::new(futures::stream::iter([Ok::<_, Infallible>(e)])).into_response();
            futures::executor::block_on(body.into_body().collect())
                .expect("body")
                .to_bytes()
        };
        assert_eq!(
            bytes(event("a\r\nb\rc\n")),
            "event: stdout\ndata: a\ndata: b\ndata: c\ndata: \n\n"
        );
        let result = StreamEvent {
            name: "result",
            data: json!({"stdout": "x\r\n"}),
        };
        assert_eq!(
            bytes(result.sse()),
            "event: result\ndata: {\"stdout\":\"x\\r\\n\"}\n\n",
            "JSON escapes its own carriage returns"
        );
    }
}
