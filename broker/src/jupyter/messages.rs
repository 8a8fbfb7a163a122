//! Jupyter's messages (messaging protocol 5.3) as they travel on the kernel WebSocket: the
//! legacy framing (one JSON text frame per message, its `channel` a field) and the
//! `v1.kernel.websocket.jupyter.org` framing (one binary frame: offsets, the channel, then
//! header, parent header, metadata and content as JSON, then buffers).

use serde_json::{json, Map, Value};

/// The protocol version every header carries.
pub(super) const PROTOCOL_VERSION: &str = "5.3";

/// The binary framing jupyter_server offers as a WebSocket subprotocol.
pub(super) const V1_SUBPROTOCOL: &str = "v1.kernel.websocket.jupyter.org";

/// Most parts (channel, header, parent header, metadata, content, buffers) a v1 frame may
/// name: a bound on the offsets read before any is checked.
const MAX_V1_PARTS: u64 = 64;

/// How messages are framed on one socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Framing {
    /// JSON text frames (what Jupyter Server's gateway client and Open WebUI speak).
    Legacy,
    /// `v1.kernel.websocket.jupyter.org` binary frames.
    V1,
}

/// A frame to send: text or binary, by the socket's framing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Frame {
    Text(String),
    Binary(Vec<u8>),
}

/// One message, either way.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Message {
    /// `shell`, `control`, `iopub` or `stdin`.
    pub(super) channel: String,
    /// `msg_id`, `msg_type`, `session`, `username`, `date`, `version`.
    pub(super) header: Value,
    /// The header of the request this answers; `{}` for none.
    pub(super) parent_header: Value,
    pub(super) metadata: Value,
    pub(super) content: Value,
}

/// Why an incoming frame is not a message the kernel can answer; the reply names it.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Malformed {
    /// What was wrong, for the error reply.
    pub(super) reason: String,
    /// The header, when one could be read: the error reply is linked to it.
    pub(super) header: Option<Value>,
    /// The channel, when one could be read.
    pub(super) channel: Option<String>,
}

impl Malformed {
    fn new(reason: impl Into<String>) -> Malformed {
        Malformed {
            reason: reason.into(),
            header: None,
            channel: None,
        }
    }
}

impl Message {
    /// The request's `msg_type` (from its header).
    pub(super) fn msg_type(&self) -> &str {
        self.header["msg_type"].as_str().unwrap_or("")
    }

    /// A new message answering `parent` (or none: `{}`), on `channel`.
    pub(super) fn reply(
        parent: Option<&Value>,
        session: &str,
        channel: &str,
        msg_type: &str,
        content: Value,
    ) -> Message {
        Message {
            channel: channel.to_string(),
            header: json!({
                "msg_id": uuid::Uuid::new_v4().simple().to_string(),
                "msg_type": msg_type,
                "session": session,
                "username": "codebroker",
                "date": super::timestamp(crate::clock::now_ms()),
                "version": PROTOCOL_VERSION,
            }),
            parent_header: parent.cloned().unwrap_or_else(|| json!({})),
            metadata: json!({}),
            content,
        }
    }

    /// The message as one frame of `framing`. Legacy frames also carry `msg_type` and
    /// `msg_id` at the top, where Open WebUI reads them (as jupyter_server sends them).
    pub(super) fn to_frame(&self, framing: Framing) -> Frame {
        match framing {
            Framing::Legacy => {
                let value = json!({
                    "header": self.header,
                    "msg_id": self.header["msg_id"],
                    "msg_type": self.header["msg_type"],
                    "parent_header": self.parent_header,
                    "metadata": self.metadata,
                    "content": self.content,
                    "buffers": [],
                    "channel": self.channel,
                });
                Frame::Text(value.to_string())
            }
            Framing::V1 => {
                let parts: Vec<Vec<u8>> = [
                    &self.header,
                    &self.parent_header,
                    &self.metadata,
                    &self.content,
                ]
                .iter()
                .map(|v| v.to_string().into_bytes())
                .collect();
                Frame::Binary(v1_frame(self.channel.as_bytes(), &parts))
            }
        }
    }

    /// A legacy text frame as a message.
    pub(super) fn from_text(text: &str) -> Result<Message, Malformed> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| Malformed::new(format!("the message is not JSON: {e}")))?;
        let Value::Object(mut fields) = value else {
            return Err(Malformed::new("the message is not a JSON object"));
        };
        let channel = fields
            .get("channel")
            .and_then(Value::as_str)
            .map(str::to_string);
        let mut header = fields.remove("header").unwrap_or(Value::Null);
        // A client that put `msg_type` only at the top level (as the server's frames have it).
        if let (Value::Object(h), Some(t)) = (&mut header, fields.get("msg_type")) {
            h.entry("msg_type").or_insert_with(|| t.clone());
        }
        let take = |fields: &mut Map<String, Value>, name: &str| fields.remove(name);
        let parent = take(&mut fields, "parent_header");
        let metadata = take(&mut fields, "metadata");
        let content = take(&mut fields, "content");
        build(channel, header, parent, metadata, content)
    }

    /// A v1 binary frame as a message (its buffers are dropped: no request this kernel
    /// serves has any).
    pub(super) fn from_v1(frame: &[u8]) -> Result<Message, Malformed> {
        let parts = v1_parts(frame).map_err(Malformed::new)?;
        let [channel, header, parent, metadata, content, ..] = &parts[..] else {
            return Err(Malformed::new(
                "a v1 frame needs a channel, a header, a parent header, metadata and content",
            ));
        };
        let channel = std::str::from_utf8(channel)
            .map_err(|_| Malformed::new("the channel is not UTF-8"))?
            .to_string();
        let json = |bytes: &[u8], what: &str| -> Result<Value, Malformed> {
            serde_json::from_slice(bytes).map_err(|e| Malformed {
                reason: format!("the {what} is not JSON: {e}"),
                header: None,
                channel: Some(channel.clone()),
            })
        };
        let header = json(header, "header")?;
        build(
            Some(channel.clone()),
            header,
            Some(json(parent, "parent header")?),
            Some(json(metadata, "metadata")?),
            Some(json(content, "content")?),
        )
    }
}

/// A message from its parts, checked: a header object with a string `msg_id` and
/// `msg_type`, a known channel, a content object.
fn build(
    channel: Option<String>,
    header: Value,
    parent: Option<Value>,
    metadata: Option<Value>,
    content: Option<Value>,
) -> Result<Message, Malformed> {
    let fail = |reason: &str, header: Option<Value>| Malformed {
        reason: reason.to_string(),
        header,
        channel: channel.clone(),
    };
    let has_string = |h: &Value, k: &str| h.get(k).is_some_and(Value::is_string);
    if !header.is_object() || !has_string(&header, "msg_id") || !has_string(&header, "msg_type") {
        let partial = header
            .get("msg_id")
            .filter(|v| v.is_string())
            .map(|_| header.clone());
        return Err(fail(
            "the message needs a header with a string msg_id and msg_type",
            partial,
        ));
    }
    let Some(channel) = channel.clone() else {
        return Err(fail("the message names no channel", Some(header)));
    };
    if !matches!(channel.as_str(), "shell" | "control" | "stdin" | "iopub") {
        return Err(fail(
            &format!("unknown channel {:?}", super::clip(&channel)),
            Some(header),
        ));
    }
    let content = match content {
        None | Some(Value::Null) => json!({}),
        Some(c @ Value::Object(_)) => c,
        Some(_) => return Err(fail("the content is not a JSON object", Some(header))),
    };
    Ok(Message {
        channel,
        header,
        parent_header: parent.filter(Value::is_object).unwrap_or_else(|| json!({})),
        metadata: metadata
            .filter(Value::is_object)
            .unwrap_or_else(|| json!({})),
        content,
    })
}

/// A v1 frame: the count of offsets, the offsets (little-endian u64s), the channel, then
/// each part.
fn v1_frame(channel: &[u8], parts: &[Vec<u8>]) -> Vec<u8> {
    let count = parts.len() + 2;
    let mut offsets = Vec::with_capacity(count);
    offsets.push(8 * (1 + count));
    offsets.push(offsets[0] + channel.len());
    for part in parts {
        offsets.push(offsets[offsets.len() - 1] + part.len());
    }
    let total = offsets[offsets.len() - 1];
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(&(count as u64).to_le_bytes());
    for offset in &offsets {
        out.extend_from_slice(&(*offset as u64).to_le_bytes());
    }
    out.extend_from_slice(channel);
    for part in parts {
        out.extend_from_slice(part);
    }
    out
}

/// The parts of a v1 frame, the channel first; every offset checked against the frame.
fn v1_parts(frame: &[u8]) -> Result<Vec<&[u8]>, String> {
    let word = |i: usize| -> Option<u64> {
        let bytes = frame.get(8 * i..8 * i + 8)?;
        Some(u64::from_le_bytes(bytes.try_into().ok()?))
    };
    let count = word(0).ok_or("a v1 frame starts with its count of offsets")?;
    if !(2..=MAX_V1_PARTS).contains(&count) {
        return Err(format!("a v1 frame with {count} offsets"));
    }
    let count = count as usize;
    let mut offsets = Vec::with_capacity(count);
    for i in 1..=count {
        let offset = word(i).ok_or("a v1 frame shorter than its offsets")?;
        let offset = usize::try_from(offset).map_err(|_| "an offset out of range")?;
        if offset > frame.len() || offsets.last().is_some_and(|&last| offset < last) {
            return Err("a v1 frame whose offsets are out of order or past its end".into());
        }
        offsets.push(offset);
    }
    if offsets[0] < 8 * (count + 1) {
        return Err("a v1 frame whose first part overlaps its offsets".into());
    }
    Ok(offsets.windows(2).map(|w| &frame[w[0]..w[1]]).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(msg_type: &str) -> String {
        json!({
            "header": {"msg_id": "m1", "msg_type": msg_type, "session": "s", "username": "u",
                       "date": "", "version": "5.3"},
            "parent_header": {}, "metadata": {}, "content": {"code": "1"}, "channel": "shell",
        })
        .to_string()
    }

    #[test]
    fn a_legacy_request_parses_and_a_reply_links_to_it() {
        let msg = Message::from_text(&request("execute_request")).expect("parses");
        assert_eq!(msg.msg_type(), "execute_request");
        assert_eq!(msg.channel, "shell");
        let reply = Message::reply(Some(&msg.header), "k", "iopub", "status", json!({}));
        let Frame::Text(text) = reply.to_frame(Framing::Legacy) else {
            panic!("legacy frames are text")
        };
        let v: Value = serde_json::from_str(&text).expect("json");
        assert_eq!(v["msg_type"], "status");
        assert_eq!(v["parent_header"]["msg_id"], "m1");
        assert_eq!(v["header"]["version"], "5.3");
        assert_eq!(v["msg_id"], v["header"]["msg_id"]);
        assert_eq!(v["channel"], "iopub");
        assert_eq!(v["buffers"], json!([]));
        // Python's strptime("%Y-%m-%dT%H:%M:%S.%fZ") reads it.
        let date = v["header"]["date"].as_str().expect("date");
        assert_eq!(date.len(), "2026-12-05T07:14:15.123456Z".len(), "{date}");
    }

    #[test]
    fn malformed_requests_say_why_and_keep_what_could_be_read() {
        assert!(Message::from_text("not json").is_err());
        assert!(Message::from_text("[1]").is_err());
        let no_type = json!({"header": {"msg_id": "m2"}, "channel": "shell"}).to_string();
        let err = Message::from_text(&no_type).expect_err("no msg_type");
        assert_eq!(err.header.expect("partial header")["msg_id"], "m2");
        let bad_channel = request("kernel_info_request").replace("\"shell\"", "\"nowhere\"");
        let err = Message::from_text(&bad_channel).expect_err("bad channel");
        assert!(err.reason.contains("nowhere"));
        let bad_content = json!({"header": {"msg_id": "m", "msg_type": "x"}, "channel": "shell",
                                 "content": [1]})
        .to_string();
        assert!(Message::from_text(&bad_content).is_err());
    }

    #[test]
    fn the_top_level_msg_type_fills_a_header_without_one() {
        let text = json!({"header": {"msg_id": "m"}, "msg_type": "kernel_info_request",
                          "channel": "shell"})
        .to_string();
        let msg = Message::from_text(&text).expect("parses");
        assert_eq!(msg.msg_type(), "kernel_info_request");
        assert_eq!(msg.content, json!({}));
    }

    #[test]
    fn v1_frames_round_trip() {
        let msg = Message::reply(None, "k", "shell", "kernel_info_request", json!({"a": 1}));
        let Frame::Binary(bytes) = msg.to_frame(Framing::V1) else {
            panic!("v1 frames are binary")
        };
        // jupyter_server's layout: 6 offsets for channel + 4 parts.
        assert_eq!(u64::from_le_bytes(bytes[..8].try_into().unwrap()), 6);
        let back = Message::from_v1(&bytes).expect("parses");
        assert_eq!(back, msg);
    }

    #[test]
    fn hostile_v1_frames_are_refused_not_trusted() {
        assert!(Message::from_v1(&[]).is_err());
        assert!(Message::from_v1(&u64::MAX.to_le_bytes()).is_err());
        let mut lying = Vec::new();
        lying.extend_from_slice(&3u64.to_le_bytes());
        for offset in [32u64, 1 << 40, 40] {
            lying.extend_from_slice(&offset.to_le_bytes());
        }
        assert!(Message::from_v1(&lying).is_err());
        let good = Message::reply(None, "k", "shell", "x", json!({}));
        let Frame::Binary(mut bytes) = good.to_frame(Framing::V1) else {
            unreachable!()
        };
        bytes.truncate(bytes.len() - 1);
        assert!(Message::from_v1(&bytes).is_err());
    }
}
