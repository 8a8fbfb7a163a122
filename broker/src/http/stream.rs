//! The stream machinery of `/exec/stream`: the events as SSE or NDJSON, a heartbeat on
//! silence so proxies do not cut a quiet run, and displays with their image inline.

use crate::core::Display;
use axum::body::{Body, Bytes};
use axum::http::{header, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt as _;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::future::Future as _;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

/// One event of a streamed exec: its name (`stdout`, `stderr`, `display`, `result`,
/// `error`) and its payload.
#[derive(Debug)]
pub(super) struct StreamEvent {
    pub(super) name: &'static str,
    pub(super) data: Value,
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
pub(super) fn sse_response(
    events: impl futures::Stream<Item = StreamEvent> + Send + 'static,
    keepalive: Duration,
) -> Response {
    let events = events.map(|e| Ok::<_, Infallible>(e.sse()));
    Sse::new(events)
        .keep_alive(KeepAlive::new().interval(keepalive).text(SSE_KEEPALIVE))
        .into_response()
}

/// `events` as NDJSON, with a heartbeat line after every `keepalive` of silence.
pub(super) fn ndjson_response(
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
pub(crate) struct Heartbeat<S, F> {
    inner: Pin<Box<S>>,
    /// Fires `every` after the last item or beat.
    timer: Pin<Box<tokio::time::Sleep>>,
    every: Duration,
    beat: F,
}

impl<S, F> Heartbeat<S, F> {
    pub(crate) fn new(inner: S, every: Duration, beat: F) -> Self {
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
pub(super) const STREAM_QUEUE: usize = 8;

/// A `display` event: what the code showed, with the image inline when it is small and
/// fits in `inline_left`, the bytes of files the exec may still inline (a loop showing
/// one large file must not turn each small event into megabytes read and sent). Returns
/// the event and what is left.
pub(super) async fn display_json(
    broker: &crate::core::Broker,
    session: &crate::session::Session,
    display: Display,
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
