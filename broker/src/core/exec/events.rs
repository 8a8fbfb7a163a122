//! What an exec shows while it runs, as front ends receive it, and the router that turns
//! the runner's wire messages into it.

use sandbox_runner::{Admit, DisplayBudget, ToolCall, ToolResult, WorkerMessage};
use std::collections::HashSet;
use tokio::sync::mpsc;

/// Which of the code's streams a piece of output came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OutputStream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// One event of a running exec, as every front end receives it: the core's own type, so
/// no front end depends on the runner's protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ExecEvent {
    /// Output as the code writes it.
    Output {
        /// The stream written to.
        stream: OutputStream,
        /// The text.
        text: String,
    },
    /// Something the code displayed: a figure, a rich value.
    Display(Display),
}

/// A value the code displayed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Display {
    /// Its MIME type, e.g. `image/png`.
    pub(crate) mime: String,
    /// The file under `/mnt/data` holding it, when it is one (read it with
    /// `Broker::display_bytes`).
    pub(crate) name: Option<String>,
    /// The value itself, when it is small text.
    pub(crate) data: Option<String>,
}

/// Routes the messages a running exec sends: tool calls to the exec's tools (calls to
/// tools it was not given are refused here, never sent on), displays within the exec's
/// display budget, output to the front end and into the final result.
pub(crate) struct EventRouter {
    /// The names of the tools the code was given.
    known: HashSet<String>,
    /// Where calls to those go; `None` when it was given none.
    calls: Option<mpsc::UnboundedSender<ToolCall>>,
    /// Where refusals of other calls go, to be answered to the runner.
    refusals: mpsc::UnboundedSender<ToolResult>,
    /// The display events the exec may still send (the runner keeps the same budget;
    /// this one holds whatever the sandbox sends).
    displays: DisplayBudget,
    /// Output streamed so far, which also goes into the final result.
    pub(crate) streamed_out: String,
    /// The same for stderr.
    pub(crate) streamed_err: String,
}

impl EventRouter {
    pub(crate) fn new(
        known: HashSet<String>,
        calls: Option<mpsc::UnboundedSender<ToolCall>>,
        refusals: mpsc::UnboundedSender<ToolResult>,
        displays: DisplayBudget,
    ) -> EventRouter {
        EventRouter {
            known,
            calls,
            refusals,
            displays,
            streamed_out: String::new(),
            streamed_err: String::new(),
        }
    }

    /// What the front end is sent for `msg`, if anything.
    pub(crate) fn route(&mut self, msg: WorkerMessage) -> Option<ExecEvent> {
        let event = match msg {
            WorkerMessage::ToolCall(call) => {
                match &self.calls {
                    Some(tx) if self.known.contains(&call.name) => {
                        let _ = tx.send(call);
                    }
                    _ => {
                        let _ = self.refusals.send(ToolResult {
                            error_message: Some(format!("Unknown tool: '{}'", call.name)),
                            call_id: call.call_id,
                            result: serde_json::Value::Null,
                            is_error: true,
                        });
                    }
                }
                return None;
            }
            WorkerMessage::Display(display) => match self.displays.admit(&display) {
                Admit::Keep => ExecEvent::Display(Display {
                    mime: display.mime,
                    name: display.name,
                    data: display.data,
                }),
                // Said once, as streamed stderr, so every front end shows it.
                Admit::DropFirst(note) => ExecEvent::Output {
                    stream: OutputStream::Stderr,
                    text: format!("{note}\n"),
                },
                Admit::Drop => return None,
            },
            WorkerMessage::Output(chunk) => ExecEvent::Output {
                stream: match chunk.stream {
                    sandbox_runner::Stream::Stdout => OutputStream::Stdout,
                    sandbox_runner::Stream::Stderr => OutputStream::Stderr,
                },
                text: chunk.data,
            },
            // The channel passes only the three above to a router.
            _ => return None,
        };
        if let ExecEvent::Output { stream, text } = &event {
            match stream {
                OutputStream::Stdout => self.streamed_out.push_str(text),
                OutputStream::Stderr => self.streamed_err.push_str(text),
            }
        }
        Some(event)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandbox_runner::{DisplayData, ExecRequest, Language, OutputChunk, Stream};

    fn router(
        tools: &[&str],
        max_display_events: u32,
    ) -> (
        EventRouter,
        mpsc::UnboundedReceiver<ToolCall>,
        mpsc::UnboundedReceiver<ToolResult>,
    ) {
        let (calls_tx, calls_rx) = mpsc::unbounded_channel();
        let (refusals_tx, refusals_rx) = mpsc::unbounded_channel();
        let request = ExecRequest {
            lang: Language::Py,
            code: String::new(),
            args: Vec::new(),
            timeout_ms: 1000,
            max_output_bytes: 1024,
            stream: true,
            tools: Vec::new(),
            max_display_events,
            max_display_bytes: 1 << 20,
            rich: false,
            stdin: false,
        };
        let known = tools.iter().map(|t| t.to_string()).collect();
        let router = EventRouter::new(
            known,
            Some(calls_tx),
            refusals_tx,
            DisplayBudget::of(&request),
        );
        (router, calls_rx, refusals_rx)
    }

    fn call(name: &str) -> WorkerMessage {
        WorkerMessage::ToolCall(ToolCall {
            call_id: format!("id-{name}"),
            name: name.to_string(),
            input: serde_json::json!({}),
            batch: None,
        })
    }

    fn png(name: &str) -> WorkerMessage {
        WorkerMessage::Display(DisplayData {
            mime: "image/png".into(),
            name: Some(name.into()),
            data: None,
        })
    }

    #[test]
    fn calls_to_given_tools_go_on_and_others_are_refused_here() {
        let (mut router, mut calls, mut refusals) = router(&["search"], 8);
        assert_eq!(router.route(call("search")), None);
        assert_eq!(router.route(call("rm_rf")), None);
        assert_eq!(calls.try_recv().expect("forwarded").name, "search");
        assert!(calls.try_recv().is_err(), "only the known call goes on");
        let refused = refusals.try_recv().expect("refused");
        assert_eq!(refused.call_id, "id-rm_rf");
        assert!(refused.is_error);
        assert_eq!(
            refused.error_message.as_deref(),
            Some("Unknown tool: 'rm_rf'")
        );
    }

    #[test]
    fn output_is_passed_on_and_kept_for_the_result() {
        let (mut router, _, _) = router(&[], 8);
        let out = router.route(WorkerMessage::Output(OutputChunk {
            stream: Stream::Stdout,
            data: "a".into(),
        }));
        assert_eq!(
            out,
            Some(ExecEvent::Output {
                stream: OutputStream::Stdout,
                text: "a".into()
            })
        );
        router.route(WorkerMessage::Output(OutputChunk {
            stream: Stream::Stderr,
            data: "b".into(),
        }));
        assert_eq!(
            (router.streamed_out.as_str(), router.streamed_err.as_str()),
            ("a", "b")
        );
    }

    #[test]
    fn displays_past_the_budget_are_dropped_with_one_note() {
        let (mut router, _, _) = router(&[], 1);
        assert!(matches!(
            router.route(png("a.png")),
            Some(ExecEvent::Display(Display { ref name, .. })) if name.as_deref() == Some("a.png")
        ));
        let note = router.route(png("b.png"));
        assert!(
            matches!(
                note,
                Some(ExecEvent::Output {
                    stream: OutputStream::Stderr,
                    ..
                })
            ),
            "{note:?}"
        );
        assert_eq!(router.route(png("c.png")), None, "said once");
        assert!(
            !router.streamed_err.is_empty(),
            "the note is in the result too"
        );
    }
}
