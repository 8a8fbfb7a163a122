//! Jupyter's kernel protocol by hand, against the real broker and Docker: the REST API
//! (tokens, kernel specs, kernels, sessions, tenants) and the kernel WebSocket (messaging
//! protocol 5.3, legacy and v1 framing): exact message sequences, interrupts, restarts,
//! hostile input and size limits. Jupyter's own clients are tests/jupyter (Python).

mod common;

use base64::Engine as _;
use codebroker::config::{AuthMode, Config};
use common::TestBroker;
use futures::{SinkExt as _, StreamExt as _};
use reqwest::Method;
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::time::Duration;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::Message as Frame;

const KEY_A: &str = "key-of-tenant-a-0123456789";
const KEY_B: &str = "key-of-tenant-b-0123456789";

/// The binary framing jupyter_server offers as a WebSocket subprotocol.
const V1: &str = "v1.kernel.websocket.jupyter.org";

/// How long one request's messages may take (a cell on a fresh sandbox included).
const REPLY: Duration = Duration::from_secs(30);

/// How long an answer that must not wait for a running cell may take.
const PROMPT: Duration = Duration::from_secs(3);

async fn broker(tag: &str) -> TestBroker {
    broker_with(tag, |_| {}).await
}

/// A broker with two keys (each its own tenant) and one pooled sandbox.
async fn broker_with(tag: &str, adjust: impl FnOnce(&mut Config)) -> TestBroker {
    TestBroker::start_with(tag, |c| {
        c.access.auth = AuthMode::Key;
        c.access.api_key = vec![KEY_A.into(), KEY_B.into()];
        c.pool.pool_size = 1;
        adjust(c);
    })
    .await
}

// ---------------------------------------------------------------------------------------
// REST

/// A request to `/jupyter{path}` with `Authorization: token KEY`, as Jupyter's clients send.
fn api(b: &TestBroker, method: Method, path: &str, key: &str) -> reqwest::RequestBuilder {
    b.client
        .request(method, b.url(&format!("/jupyter{path}")))
        .header("authorization", format!("token {key}"))
}

/// A response's status and JSON body (`null` when it has none).
async fn answer(req: reqwest::RequestBuilder) -> (u16, Value) {
    let resp = req.send().await.expect("request");
    let status = resp.status().as_u16();
    let text = resp.text().await.expect("body");
    let body = if text.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).unwrap_or(Value::String(text))
    };
    (status, body)
}

/// Asserts codebroker's error envelope with a reason.
fn assert_error(body: &Value) {
    assert!(
        body["message"].as_str().is_some_and(|m| !m.is_empty()),
        "no error message: {body}"
    );
}

/// `POST /api/kernels` as Open WebUI sends it (no body, octet-stream); the kernel's model.
async fn create_kernel(b: &TestBroker, key: &str) -> Value {
    let (status, model) = answer(
        api(b, Method::POST, "/api/kernels", key)
            .header("content-type", "application/octet-stream"),
    )
    .await;
    assert_eq!(status, 201, "{model}");
    model
}

async fn new_kernel(b: &TestBroker, key: &str) -> String {
    id_of(&create_kernel(b, key).await)
}

fn id_of(model: &Value) -> String {
    model["id"].as_str().expect("an id").to_string()
}

/// The ids of the kernels `key` lists.
async fn listed(b: &TestBroker, key: &str) -> Vec<String> {
    let (status, list) = answer(api(b, Method::GET, "/api/kernels", key)).await;
    assert_eq!(status, 200, "{list}");
    list.as_array().expect("a list").iter().map(id_of).collect()
}

/// Whether `s` is written as `%Y-%m-%dT%H:%M:%S.%fZ` (what jupyter_server parses).
fn is_jupyter_time(s: &str) -> bool {
    let template = b"dddd-dd-ddTdd:dd:dd.ddddddZ";
    s.len() == template.len()
        && s.bytes().zip(template.iter()).all(|(c, t)| match t {
            b'd' => c.is_ascii_digit(),
            t => c == *t,
        })
}

/// Asserts a kernel model has exactly jupyter_server's fields.
fn assert_kernel_model(model: &Value, state: &str, connections: u64) {
    let fields: Vec<&str> = model
        .as_object()
        .expect("an object")
        .keys()
        .map(String::as_str)
        .collect();
    let mut fields = fields;
    fields.sort_unstable();
    assert_eq!(
        fields,
        [
            "connections",
            "execution_state",
            "id",
            "last_activity",
            "name"
        ],
        "{model}"
    );
    let id = model["id"].as_str().expect("id");
    let parsed = uuid::Uuid::parse_str(id).expect("the id is a UUID");
    assert_eq!(parsed.hyphenated().to_string(), id, "{model}");
    assert_eq!(model["name"], "python3", "{model}");
    assert!(
        is_jupyter_time(model["last_activity"].as_str().expect("last_activity")),
        "{model}"
    );
    assert_eq!(model["execution_state"], state, "{model}");
    assert_eq!(model["connections"], connections, "{model}");
}

// ---------------------------------------------------------------------------------------
// The WebSocket

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// One kernel socket, and the messages read from it that no one has taken yet.
struct Socket {
    ws: Ws,
    /// v1 binary framing, else the legacy JSON text frames.
    v1: bool,
    /// Jupyter's client session of the requests sent.
    session: String,
    /// Read, not taken yet, in the order they came.
    unread: VecDeque<Value>,
}

fn channels_url(b: &TestBroker, id: &str) -> String {
    format!(
        "{}/jupyter/api/kernels/{id}/channels",
        b.base.replacen("http://", "ws://", 1)
    )
}

/// Opens a socket on kernel `id`: the key as `?token=` (Open WebUI's way), v1 when
/// asked; the HTTP status when the server refuses the upgrade.
async fn try_open(b: &TestBroker, id: &str, key: &str, v1: bool) -> Result<Socket, u16> {
    let url = format!("{}?token={key}", channels_url(b, id));
    let mut request = url.into_client_request().expect("request");
    if v1 {
        request
            .headers_mut()
            .insert("sec-websocket-protocol", HeaderValue::from_static(V1));
    }
    open_request(request, v1).await
}

async fn open_request(
    request: tokio_tungstenite::tungstenite::handshake::client::Request,
    v1: bool,
) -> Result<Socket, u16> {
    let connect = tokio_tungstenite::connect_async(request);
    match tokio::time::timeout(REPLY, connect)
        .await
        .expect("handshake timed out")
    {
        Ok((ws, response)) => {
            let protocol = response
                .headers()
                .get("sec-websocket-protocol")
                .map(|v| v.to_str().expect("ascii").to_string());
            if v1 {
                assert_eq!(protocol.as_deref(), Some(V1), "the server selects v1");
            } else {
                assert_eq!(protocol, None, "no subprotocol was offered");
            }
            Ok(Socket {
                ws,
                v1,
                session: uuid::Uuid::new_v4().simple().to_string(),
                unread: VecDeque::new(),
            })
        }
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            Err(response.status().as_u16())
        }
        Err(err) => panic!("handshake failed: {err}"),
    }
}

/// A legacy socket on kernel `id`, served already (a kernel_info round trip: the server
/// has subscribed it to the kernel's iopub messages).
async fn connect(b: &TestBroker, id: &str, key: &str) -> Socket {
    let mut socket = try_open(b, id, key, false).await.expect("socket opens");
    socket.ready().await;
    socket
}

/// A message as jupyter_server's client writes it.
fn message(session: &str, channel: &str, msg_type: &str, content: Value) -> (String, Value) {
    let msg_id = uuid::Uuid::new_v4().to_string();
    let header = json!({
        "msg_id": msg_id,
        "msg_type": msg_type,
        "session": session,
        "username": "tester",
        "date": "2026-01-02T03:04:05.123456Z",
        "version": "5.3",
    });
    let msg = json!({
        "header": header,
        "parent_header": {},
        "metadata": {},
        "content": content,
        "buffers": [],
        "channel": channel,
    });
    (msg_id, msg)
}

/// jupyter_server's `serialize_msg_to_ws_v1`: the count of offsets, the offsets (u64 LE),
/// the channel, then header, parent header, metadata and content as JSON.
fn v1_encode(msg: &Value) -> Vec<u8> {
    let parts: Vec<Vec<u8>> = ["header", "parent_header", "metadata", "content"]
        .iter()
        .map(|k| msg[*k].to_string().into_bytes())
        .collect();
    let parts: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
    v1_frame(msg["channel"].as_str().expect("channel").as_bytes(), &parts)
}

/// A v1 frame of any parts, laid out as jupyter_server lays them out.
fn v1_frame(channel: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    let mut offsets = vec![8 * (1 + 1 + parts.len() as u64 + 1)];
    offsets.push(offsets[0] + channel.len() as u64);
    for part in parts {
        offsets.push(offsets[offsets.len() - 1] + part.len() as u64);
    }
    let mut out = (offsets.len() as u64).to_le_bytes().to_vec();
    for offset in &offsets {
        out.extend_from_slice(&offset.to_le_bytes());
    }
    out.extend_from_slice(channel);
    for part in parts {
        out.extend_from_slice(part);
    }
    out
}

/// jupyter_server's `deserialize_msg_from_ws_v1`, checking the layout as it goes.
fn v1_decode(frame: &[u8]) -> Value {
    let word = |i: usize| u64::from_le_bytes(frame[8 * i..8 * i + 8].try_into().expect("8"));
    let count = word(0) as usize;
    assert_eq!(count, 6, "channel, four parts and the end: {frame:?}");
    let offsets: Vec<usize> = (1..=count).map(|i| word(i) as usize).collect();
    assert_eq!(
        offsets[0],
        8 * (count + 1),
        "the channel follows the offsets"
    );
    assert_eq!(
        offsets[count - 1],
        frame.len(),
        "the last offset is the end"
    );
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");
    let part = |i: usize| &frame[offsets[i]..offsets[i + 1]];
    let json = |i: usize| -> Value { serde_json::from_slice(part(i)).expect("a JSON part") };
    json!({
        "channel": std::str::from_utf8(part(0)).expect("utf-8 channel"),
        "header": json(1),
        "parent_header": json(2),
        "metadata": json(3),
        "content": json(4),
    })
}

/// A message as `channel:msg_type` (`iopub:status:busy` for a status), to compare
/// sequences.
fn shape(m: &Value) -> String {
    let channel = m["channel"].as_str().unwrap_or("?");
    let msg_type = m["header"]["msg_type"].as_str().unwrap_or("?");
    if msg_type == "status" {
        let state = m["content"]["execution_state"].as_str().unwrap_or("?");
        format!("{channel}:status:{state}")
    } else {
        format!("{channel}:{msg_type}")
    }
}

fn shapes(messages: &[Value]) -> Vec<String> {
    messages.iter().map(shape).collect()
}

fn is_idle(m: &Value) -> bool {
    m["channel"] == "iopub"
        && m["header"]["msg_type"] == "status"
        && m["content"]["execution_state"] == "idle"
}

/// Asserts a message's envelope: the header of protocol 5.3, its parent, and (legacy
/// framing) `msg_type`, `msg_id` and `channel` at the top as jupyter_server sends them.
fn assert_envelope(m: &Value, parent: &str, v1: bool) {
    let header = &m["header"];
    assert_eq!(header["version"], "5.3", "{m}");
    assert!(
        header["msg_id"].as_str().is_some_and(|s| !s.is_empty()),
        "{m}"
    );
    assert!(
        header["msg_type"].as_str().is_some_and(|s| !s.is_empty()),
        "{m}"
    );
    assert!(
        header["session"].as_str().is_some_and(|s| !s.is_empty()),
        "{m}"
    );
    assert!(header["username"].is_string(), "{m}");
    assert!(
        is_jupyter_time(header["date"].as_str().unwrap_or("")),
        "{m}"
    );
    assert_eq!(m["parent_header"]["msg_id"], parent, "{m}");
    assert!(
        matches!(m["channel"].as_str(), Some("shell" | "control" | "iopub")),
        "{m}"
    );
    assert!(m["metadata"].is_object(), "{m}");
    assert!(m["content"].is_object(), "{m}");
    if !v1 {
        assert_eq!(m["msg_type"], header["msg_type"], "{m}");
        assert_eq!(m["msg_id"], header["msg_id"], "{m}");
    }
}

/// The one message of `msg_type` among `messages`.
fn one<'a>(messages: &'a [Value], msg_type: &str) -> &'a Value {
    let found: Vec<&Value> = messages
        .iter()
        .filter(|m| m["header"]["msg_type"] == msg_type)
        .collect();
    assert_eq!(found.len(), 1, "one {msg_type} in {messages:#?}");
    found[0]
}

/// Everything a cell printed on stdout.
fn stdout(messages: &[Value]) -> String {
    messages
        .iter()
        .filter(|m| m["header"]["msg_type"] == "stream" && m["content"]["name"] == "stdout")
        .map(|m| m["content"]["text"].as_str().unwrap_or(""))
        .collect()
}

/// `execute_request`'s content as notebooks send it.
fn cell(code: &str) -> Value {
    json!({"code": code, "silent": false, "store_history": true, "user_expressions": {},
           "allow_stdin": false, "stop_on_error": true})
}

/// The messages of a cell that printed `out` (one write) and ended well, checked.
fn assert_printed(messages: &[Value], out: &str, count: u64) {
    assert_eq!(
        shapes(messages),
        [
            "iopub:status:busy",
            "iopub:execute_input",
            "iopub:stream",
            "shell:execute_reply",
            "iopub:status:idle"
        ],
        "{messages:#?}"
    );
    assert_eq!(
        messages[1]["content"]["execution_count"], count,
        "{messages:#?}"
    );
    assert_eq!(
        messages[2]["content"],
        json!({"name": "stdout", "text": out})
    );
    assert_eq!(messages[3]["content"]["status"], "ok", "{messages:#?}");
    assert_eq!(
        messages[3]["content"]["execution_count"], count,
        "{messages:#?}"
    );
}

/// The messages of a cell that failed with `ename`, checked; its `execute_reply`.
fn assert_failed<'a>(messages: &'a [Value], ename: &str, count: u64) -> &'a Value {
    assert_eq!(
        shapes(messages),
        [
            "iopub:status:busy",
            "iopub:execute_input",
            "iopub:error",
            "shell:execute_reply",
            "iopub:status:idle"
        ],
        "{messages:#?}"
    );
    let error = &messages[2]["content"];
    assert_eq!(error["ename"], ename, "{messages:#?}");
    let traceback = error["traceback"].as_array().expect("a traceback list");
    assert!(!traceback.is_empty(), "{error}");
    assert!(traceback.iter().all(Value::is_string), "{error}");
    let reply = &messages[3]["content"];
    assert_eq!(reply["status"], "error", "{reply}");
    assert_eq!(reply["ename"], ename, "{reply}");
    assert_eq!(reply["evalue"], error["evalue"], "{reply}");
    assert_eq!(reply["execution_count"], count, "{reply}");
    reply
}

impl Socket {
    /// Sends a request; its msg_id.
    async fn send(&mut self, channel: &str, msg_type: &str, content: Value) -> String {
        let (msg_id, msg) = message(&self.session, channel, msg_type, content);
        self.send_message(&msg).await;
        msg_id
    }

    /// Sends a whole message in this socket's framing.
    async fn send_message(&mut self, msg: &Value) {
        let frame = if self.v1 {
            Frame::binary(v1_encode(msg))
        } else {
            Frame::text(msg.to_string())
        };
        self.send_frame(frame).await;
    }

    async fn send_frame(&mut self, frame: Frame) {
        tokio::time::timeout(REPLY, self.ws.send(frame))
            .await
            .expect("send timed out")
            .expect("send");
    }

    /// The next message off the socket, `None` past `until`; panics when it closes.
    async fn read(&mut self, until: Instant) -> Option<Value> {
        loop {
            let frame = match tokio::time::timeout_at(until, self.ws.next()).await {
                Err(_) => return None,
                Ok(None) => panic!("the socket ended; unread: {:#?}", self.unread),
                Ok(Some(Err(err))) => panic!("socket error {err}; unread: {:#?}", self.unread),
                Ok(Some(Ok(frame))) => frame,
            };
            match frame {
                Frame::Text(text) => {
                    assert!(!self.v1, "a text frame on a v1 socket: {text}");
                    return Some(serde_json::from_str(text.as_str()).expect("a JSON message"));
                }
                Frame::Binary(bytes) => {
                    assert!(self.v1, "a binary frame on a legacy socket");
                    return Some(v1_decode(&bytes));
                }
                Frame::Close(close) => {
                    panic!("the socket closed ({close:?}); unread: {:#?}", self.unread)
                }
                _ => continue,
            }
        }
    }

    /// Reads until a message `wanted` picks is unread (it may be already); its index.
    async fn wait_for(&mut self, wanted: impl Fn(&Value) -> bool, until: Instant) -> usize {
        loop {
            if let Some(i) = self.unread.iter().position(&wanted) {
                return i;
            }
            match self.read(until).await {
                Some(m) => self.unread.push_back(m),
                None => panic!("timed out; unread: {:#?}", self.unread),
            }
        }
    }

    /// The first message `wanted` picks; the others stay unread.
    async fn take(&mut self, wanted: impl Fn(&Value) -> bool, within: Duration) -> Value {
        let i = self.wait_for(wanted, Instant::now() + within).await;
        self.unread.remove(i).expect("index")
    }

    /// Every message answering `msg_id`, in order, through its iopub status idle; each
    /// envelope checked.
    async fn collect(&mut self, msg_id: &str, within: Duration) -> Vec<Value> {
        let until = Instant::now() + within;
        let mut got = Vec::new();
        loop {
            let i = self
                .wait_for(|m| m["parent_header"]["msg_id"] == msg_id, until)
                .await;
            let m = self.unread.remove(i).expect("index");
            assert_envelope(&m, msg_id, self.v1);
            let idle = is_idle(&m);
            got.push(m);
            if idle {
                return got;
            }
        }
    }

    /// Sends a request and collects its messages.
    async fn ask(&mut self, channel: &str, msg_type: &str, content: Value) -> Vec<Value> {
        let msg_id = self.send(channel, msg_type, content).await;
        self.collect(&msg_id, REPLY).await
    }

    /// Runs a cell; its messages.
    async fn execute(&mut self, code: &str) -> Vec<Value> {
        self.ask("shell", "execute_request", cell(code)).await
    }

    /// A kernel_info round trip.
    async fn ready(&mut self) {
        let got = self.ask("shell", "kernel_info_request", json!({})).await;
        assert_eq!(
            shapes(&got),
            [
                "iopub:status:busy",
                "shell:kernel_info_reply",
                "iopub:status:idle"
            ],
            "{got:#?}"
        );
    }

    /// Waits for the socket to end: the close code, or `None` when it ended without a
    /// close frame. Messages that came before stay unread.
    async fn closed(&mut self, within: Duration) -> Option<u16> {
        let until = Instant::now() + within;
        loop {
            match tokio::time::timeout_at(until, self.ws.next()).await {
                Err(_) => panic!("the socket stayed open; unread: {:#?}", self.unread),
                Ok(None) | Ok(Some(Err(_))) => return None,
                Ok(Some(Ok(Frame::Close(frame)))) => {
                    return Some(frame.map(|f| u16::from(f.code)).unwrap_or(1005))
                }
                Ok(Some(Ok(Frame::Text(text)))) if !self.v1 => {
                    let m = serde_json::from_str(text.as_str()).expect("a JSON message");
                    self.unread.push_back(m);
                }
                Ok(Some(Ok(Frame::Binary(bytes)))) if self.v1 => {
                    self.unread.push_back(v1_decode(&bytes));
                }
                Ok(Some(Ok(_))) => continue,
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// REST and auth

#[tokio::test]
async fn the_api_version_is_public_and_everything_else_needs_the_key() {
    let b = broker("jupyter-auth").await;
    let (status, version) = answer(b.client.get(b.url("/jupyter/api"))).await;
    assert_eq!(status, 200, "{version}");
    assert!(
        version["version"].as_str().is_some_and(|v| !v.is_empty()),
        "{version}"
    );
    let id = new_kernel(&b, KEY_A).await;
    let routes = [
        (Method::GET, "/api/status".to_string()),
        (Method::GET, "/api/kernelspecs".into()),
        (Method::GET, "/api/kernelspecs/python3".into()),
        (Method::GET, "/kernelspecs/python3/logo-64x64.png".into()),
        (Method::GET, "/api/kernels".into()),
        (Method::POST, "/api/kernels".into()),
        (Method::GET, format!("/api/kernels/{id}")),
        (Method::DELETE, format!("/api/kernels/{id}")),
        (Method::POST, format!("/api/kernels/{id}/interrupt")),
        (Method::POST, format!("/api/kernels/{id}/restart")),
        (Method::GET, "/api/sessions".into()),
        (Method::POST, "/api/sessions".into()),
    ];
    for (method, path) in &routes {
        let url = b.url(&format!("/jupyter{path}"));
        let no_key = b.client.request(method.clone(), &url);
        let wrong_query = b
            .client
            .request(method.clone(), format!("{url}?token=wrong-key"));
        let empty_query = b.client.request(method.clone(), format!("{url}?token="));
        let wrong_token = b
            .client
            .request(method.clone(), &url)
            .header("authorization", "token wrong-key");
        let wrong_header = b
            .client
            .request(method.clone(), &url)
            .header("x-api-key", "wrong-key");
        // Credentials in the headers are the ones checked: a right ?token= does not
        // rescue a wrong header.
        let header_wins = b
            .client
            .request(method.clone(), format!("{url}?token={KEY_A}"))
            .header("x-api-key", "wrong-key");
        for (what, req) in [
            ("no key", no_key),
            ("wrong ?token=", wrong_query),
            ("empty ?token=", empty_query),
            ("wrong Authorization: token", wrong_token),
            ("wrong X-API-Key", wrong_header),
            ("wrong X-API-Key, right ?token=", header_wins),
        ] {
            let (status, body) = answer(req).await;
            assert_eq!(status, 401, "{method} {path} with {what}: {body}");
            assert_error(&body);
        }
    }
    // The socket too.
    let url = channels_url(&b, &id);
    let bare = url.clone().into_client_request().expect("request");
    assert_eq!(open_request(bare, false).await.err(), Some(401));
    assert_eq!(try_open(&b, &id, "wrong-key", false).await.err(), Some(401));
    // Nothing the refused calls asked for happened: the kernel is there, alone.
    assert_eq!(listed(&b, KEY_A).await, [id.as_str()]);
    // Every way of sending the key works.
    let kernels = b.url("/jupyter/api/kernels");
    for (what, req) in [
        ("?token=", b.client.get(format!("{kernels}?token={KEY_A}"))),
        (
            "Authorization: token",
            b.client
                .get(&kernels)
                .header("authorization", format!("token {KEY_A}")),
        ),
        (
            "X-API-Key",
            b.client.get(&kernels).header("x-api-key", KEY_A),
        ),
        (
            "Authorization: Bearer",
            b.client
                .get(&kernels)
                .header("authorization", format!("Bearer {KEY_A}")),
        ),
    ] {
        let (status, list) = answer(req).await;
        assert_eq!(status, 200, "{what}: {list}");
        assert_eq!(list[0]["id"], id.as_str(), "{what}: {list}");
    }
    // Beside other parameters (jupyter_server's clients add session_id).
    let with_session = format!("{url}?session_id=abc&token={KEY_A}&x=1");
    let request = with_session.into_client_request().expect("request");
    let mut socket = open_request(request, false).await.expect("socket opens");
    socket.ready().await;
    // The socket with the token header (Jupyter Server's gateway client).
    let mut request = url.into_client_request().expect("request");
    request.headers_mut().insert(
        "authorization",
        HeaderValue::from_str(&format!("token {KEY_A}")).expect("header"),
    );
    let mut socket = open_request(request, false).await.expect("socket opens");
    socket.ready().await;
}

#[tokio::test]
async fn the_kernel_specs_name_python3_alone() {
    let b = broker("jupyter-specs").await;
    let (status, specs) = answer(api(&b, Method::GET, "/api/kernelspecs", KEY_A)).await;
    assert_eq!(status, 200, "{specs}");
    assert_eq!(specs["default"], "python3", "{specs}");
    let names: Vec<&String> = specs["kernelspecs"]
        .as_object()
        .expect("kernelspecs")
        .keys()
        .collect();
    assert_eq!(names, ["python3"], "{specs}");
    let spec = &specs["kernelspecs"]["python3"];
    assert_eq!(spec["name"], "python3");
    assert_eq!(spec["spec"]["language"], "python", "{spec}");
    assert!(spec["spec"]["display_name"].is_string(), "{spec}");
    assert!(spec["spec"]["argv"].is_array(), "{spec}");
    let (status, one) = answer(api(&b, Method::GET, "/api/kernelspecs/python3", KEY_A)).await;
    assert_eq!(status, 200, "{one}");
    assert_eq!(&one, spec);
    for path in [
        "/api/kernelspecs/ir",
        "/api/kernelspecs/python2",
        "/api/kernelspecs/..%2Fpython3",
        "/kernelspecs/python3/logo-64x64.png",
        "/kernelspecs/python3/kernel.js",
        "/kernelspecs/ir/logo-svg.svg",
    ] {
        let (status, body) = answer(api(&b, Method::GET, path, KEY_A)).await;
        assert_eq!(status, 404, "{path}: {body}");
        assert_error(&body);
    }
    let (status, again) = answer(api(&b, Method::GET, "/api/kernelspecs", KEY_A)).await;
    assert_eq!((status, &again), (200, &specs));
}

#[tokio::test]
async fn kernels_are_created_as_open_webui_and_jupyter_server_ask() {
    let b = broker("jupyter-create").await;
    // Open WebUI: no body, application/octet-stream.
    let resp = api(&b, Method::POST, "/api/kernels", KEY_A)
        .header("content-type", "application/octet-stream")
        .send()
        .await
        .expect("create");
    assert_eq!(resp.status(), 201);
    let location = resp.headers()["location"]
        .to_str()
        .expect("location")
        .to_string();
    let plain: Value = resp.json().await.expect("json");
    assert_kernel_model(&plain, "idle", 0);
    assert_eq!(
        location,
        format!("/jupyter/api/kernels/{}", plain["id"].as_str().unwrap())
    );
    // Jupyter Server's gateway client: the name and KERNEL_* variables.
    let (status, gateway) = answer(
        api(&b, Method::POST, "/api/kernels", KEY_A)
            .json(&json!({"name": "python3", "env": {"KERNEL_USERNAME": "ann"}})),
    )
    .await;
    assert_eq!(status, 201, "{gateway}");
    assert_kernel_model(&gateway, "idle", 0);
    assert_ne!(gateway["id"], plain["id"]);
    // Refused creates make nothing.
    for (body, want) in [
        (json!({"name": "ir"}).to_string(), 404),
        (json!({"name": "python3 "}).to_string(), 404),
        ("{not json".to_string(), 400),
        ("[]".to_string(), 400),
        (json!({"name": 3}).to_string(), 400),
        (json!({"env": {"A B": "x"}}).to_string(), 400),
        (json!({"env": {"1X": "x"}}).to_string(), 400),
        (json!({"env": {"": "x"}}).to_string(), 400),
        (json!({"env": {"A=B": "x"}}).to_string(), 400),
        (json!({"env": {"A": "x\u{0}y"}}).to_string(), 400),
        (json!({"env": {"A": 1}}).to_string(), 400),
        (json!({"env": ["A"]}).to_string(), 400),
    ] {
        let (status, answer_body) = answer(
            api(&b, Method::POST, "/api/kernels", KEY_A)
                .header("content-type", "application/json")
                .body(body.clone()),
        )
        .await;
        assert_eq!(status, want, "{body}: {answer_body}");
        assert_error(&answer_body);
    }
    let mut ids = vec![id_of(&plain), id_of(&gateway)];
    ids.sort();
    assert_eq!(listed(&b, KEY_A).await, ids);
    // The variable is there for the first cell.
    let mut socket = connect(&b, &id_of(&gateway), KEY_A).await;
    let got = socket
        .execute("import os\nprint(os.environ.get('KERNEL_USERNAME'))")
        .await;
    assert_printed(&got, "ann\n", 1);
    // And the next create works.
    let third = create_kernel(&b, KEY_A).await;
    assert_kernel_model(&third, "idle", 0);
}

#[tokio::test]
async fn kernels_are_listed_got_and_deleted_and_a_deleted_kernel_s_socket_closes() {
    let b = broker("jupyter-kernels").await;
    let first = new_kernel(&b, KEY_A).await;
    let second = new_kernel(&b, KEY_A).await;
    let mut both = vec![first.clone(), second.clone()];
    both.sort();
    assert_eq!(listed(&b, KEY_A).await, both);
    let mut socket = connect(&b, &first, KEY_A).await;
    let (status, info) = answer(api(&b, Method::GET, "/api/status", KEY_A)).await;
    assert_eq!(status, 200, "{info}");
    assert_eq!(
        (&info["kernels"], &info["connections"]),
        (&json!(2), &json!(1)),
        "{info}"
    );
    assert!(
        is_jupyter_time(info["started"].as_str().unwrap_or("")),
        "{info}"
    );
    assert!(
        is_jupyter_time(info["last_activity"].as_str().unwrap_or("")),
        "{info}"
    );
    // Two kernels are two Pythons.
    assert_printed(
        &socket.execute("only_first = 1\nprint(only_first)").await,
        "1\n",
        1,
    );
    let mut other = connect(&b, &second, KEY_A).await;
    let got = other.execute("print('only_first' in globals())").await;
    assert_printed(&got, "False\n", 1);
    drop(other);
    let (status, model) = answer(api(
        &b,
        Method::GET,
        &format!("/api/kernels/{first}"),
        KEY_A,
    ))
    .await;
    assert_eq!(status, 200, "{model}");
    assert_kernel_model(&model, "idle", 1);
    assert_eq!(model["id"], first.as_str());
    let (status, body) = answer(api(
        &b,
        Method::DELETE,
        &format!("/api/kernels/{first}"),
        KEY_A,
    ))
    .await;
    assert_eq!((status, body), (204, Value::Null));
    // Gone at once, for every route.
    assert_eq!(socket.closed(REPLY).await, Some(1001));
    for (method, path) in [
        (Method::GET, format!("/api/kernels/{first}")),
        (Method::DELETE, format!("/api/kernels/{first}")),
        (Method::POST, format!("/api/kernels/{first}/interrupt")),
        (Method::POST, format!("/api/kernels/{first}/restart")),
    ] {
        let (status, body) = answer(api(&b, method.clone(), &path, KEY_A)).await;
        assert_eq!(status, 404, "{method} {path}: {body}");
        assert_error(&body);
    }
    assert_eq!(try_open(&b, &first, KEY_A, false).await.err(), Some(404));
    assert_eq!(listed(&b, KEY_A).await, [second.as_str()]);
    // Unknown ids, and ids that are not ids.
    let unknown = uuid::Uuid::new_v4().to_string();
    for id in [unknown.as_str(), "not-a-uuid", "..", "%2e%2e%2fstatus"] {
        for (method, path) in [
            (Method::GET, format!("/api/kernels/{id}")),
            (Method::DELETE, format!("/api/kernels/{id}")),
            (Method::POST, format!("/api/kernels/{id}/interrupt")),
            (Method::POST, format!("/api/kernels/{id}/restart")),
        ] {
            let (status, body) = answer(api(&b, method.clone(), &path, KEY_A)).await;
            assert_eq!(status, 404, "{method} {path}: {body}");
        }
    }
    assert_eq!(try_open(&b, &unknown, KEY_A, false).await.err(), Some(404));
    // The other kernel works on.
    let mut socket = connect(&b, &second, KEY_A).await;
    assert_printed(
        &socket.execute("print('still here')").await,
        "still here\n",
        2,
    );
}

#[tokio::test]
async fn another_tenant_cannot_reach_a_kernel() {
    let b = broker("jupyter-tenants").await;
    let a = new_kernel(&b, KEY_A).await;
    let mut socket = connect(&b, &a, KEY_A).await;
    assert_printed(&socket.execute("x = 'mine'\nprint(x)").await, "mine\n", 1);
    assert_eq!(listed(&b, KEY_B).await, Vec::<String>::new());
    for (method, path) in [
        (Method::GET, format!("/api/kernels/{a}")),
        (Method::DELETE, format!("/api/kernels/{a}")),
        (Method::POST, format!("/api/kernels/{a}/interrupt")),
        (Method::POST, format!("/api/kernels/{a}/restart")),
    ] {
        let (status, body) = answer(api(&b, method.clone(), &path, KEY_B)).await;
        assert_eq!(status, 404, "{method} {path} as B: {body}");
        assert_error(&body);
    }
    assert_eq!(try_open(&b, &a, KEY_B, false).await.err(), Some(404));
    // Nor through a session naming the kernel.
    let (status, body) = answer(
        api(&b, Method::POST, "/api/sessions", KEY_B)
            .json(&json!({"path": "b.ipynb", "type": "notebook", "kernel": {"id": a}})),
    )
    .await;
    assert_eq!(status, 404, "{body}");
    let (status, sessions) = answer(api(&b, Method::GET, "/api/sessions", KEY_B)).await;
    assert_eq!((status, sessions), (200, json!([])));
    let (status, info) = answer(api(&b, Method::GET, "/api/status", KEY_B)).await;
    assert_eq!(status, 200, "{info}");
    assert_eq!(info["kernels"], 0, "{info}");
    // B's own kernel is B's alone.
    let own = new_kernel(&b, KEY_B).await;
    assert_eq!(listed(&b, KEY_B).await, [own.as_str()]);
    assert_eq!(listed(&b, KEY_A).await, [a.as_str()]);
    // A's kernel kept its state and its socket.
    let got = socket.execute("print(x)").await;
    assert_printed(&got, "mine\n", 2);
    let (status, model) = answer(api(&b, Method::GET, &format!("/api/kernels/{a}"), KEY_A)).await;
    assert_eq!(status, 200, "{model}");
    assert_kernel_model(&model, "idle", 1);
}

#[tokio::test]
async fn a_session_binds_a_notebook_to_a_kernel_and_its_delete_ends_both() {
    let b = broker("jupyter-sessions").await;
    let (status, created) = answer(api(&b, Method::POST, "/api/sessions", KEY_A).json(
        &json!({"path": "a.ipynb", "type": "notebook", "name": "", "kernel": {"name": "python3"}}),
    ))
    .await;
    assert_eq!(status, 201, "{created}");
    let session = created["id"].as_str().expect("id").to_string();
    uuid::Uuid::parse_str(&session).expect("a UUID");
    assert_eq!(created["path"], "a.ipynb", "{created}");
    assert_eq!(created["type"], "notebook", "{created}");
    assert_kernel_model(&created["kernel"], "idle", 0);
    let kernel = id_of(&created["kernel"]);
    let (status, list) = answer(api(&b, Method::GET, "/api/sessions", KEY_A)).await;
    assert_eq!(status, 200, "{list}");
    let list = list.as_array().expect("a list");
    assert_eq!(list.len(), 1, "{list:?}");
    assert_eq!(list[0]["id"], session.as_str());
    assert_eq!(list[0]["path"], "a.ipynb");
    assert_eq!(list[0]["kernel"]["id"], kernel.as_str());
    let (status, one) = answer(api(
        &b,
        Method::GET,
        &format!("/api/sessions/{session}"),
        KEY_A,
    ))
    .await;
    assert_eq!(status, 200, "{one}");
    assert_eq!(one["kernel"]["id"], kernel.as_str());
    assert_eq!(listed(&b, KEY_A).await, [kernel.as_str()]);
    // Its kernel runs cells.
    let mut socket = connect(&b, &kernel, KEY_A).await;
    assert_printed(&socket.execute("print(6 * 7)").await, "42\n", 1);
    // Refused bodies make nothing.
    for (body, want) in [
        ("{not json".to_string(), 400),
        (
            json!({"path": "b.ipynb", "kernel": {"name": "ir"}}).to_string(),
            404,
        ),
        (
            json!({"path": "b.ipynb", "kernel": {"id": uuid::Uuid::new_v4().to_string()}})
                .to_string(),
            404,
        ),
        (json!({"path": "x".repeat(5000)}).to_string(), 400),
    ] {
        let (status, answer_body) = answer(
            api(&b, Method::POST, "/api/sessions", KEY_A)
                .header("content-type", "application/json")
                .body(body.clone()),
        )
        .await;
        assert_eq!(
            status,
            want,
            "{}: {answer_body}",
            &body[..body.len().min(80)]
        );
    }
    let (status, list) = answer(api(&b, Method::GET, "/api/sessions", KEY_A)).await;
    assert_eq!((status, list.as_array().map(Vec::len)), (200, Some(1)));
    // A second session on the same kernel (a console beside the notebook).
    let (status, console) = answer(
        api(&b, Method::POST, "/api/sessions", KEY_A)
            .json(&json!({"path": "console-1", "type": "console", "kernel": {"id": kernel}})),
    )
    .await;
    assert_eq!(status, 201, "{console}");
    assert_eq!(console["kernel"]["id"], kernel.as_str(), "{console}");
    assert_eq!(console["type"], "console", "{console}");
    assert_ne!(console["id"], session.as_str());
    let (status, list) = answer(api(&b, Method::GET, "/api/sessions", KEY_A)).await;
    assert_eq!((status, list.as_array().map(Vec::len)), (200, Some(2)));
    assert_eq!(listed(&b, KEY_A).await, [kernel.as_str()]);
    // B sees none of it.
    let (status, body) = answer(api(
        &b,
        Method::GET,
        &format!("/api/sessions/{session}"),
        KEY_B,
    ))
    .await;
    assert_eq!(status, 404, "{body}");
    let (status, body) = answer(api(
        &b,
        Method::DELETE,
        &format!("/api/sessions/{session}"),
        KEY_B,
    ))
    .await;
    assert_eq!(status, 404, "{body}");
    // Deleting the session ends the kernel too.
    let (status, body) = answer(api(
        &b,
        Method::DELETE,
        &format!("/api/sessions/{session}"),
        KEY_A,
    ))
    .await;
    assert_eq!((status, body), (204, Value::Null));
    assert_eq!(socket.closed(REPLY).await, Some(1001));
    // Both sessions went with the kernel.
    let (status, list) = answer(api(&b, Method::GET, "/api/sessions", KEY_A)).await;
    assert_eq!((status, list), (200, json!([])));
    let (status, _) = answer(api(
        &b,
        Method::GET,
        &format!("/api/sessions/{session}"),
        KEY_A,
    ))
    .await;
    assert_eq!(status, 404);
    let (status, _) = answer(api(
        &b,
        Method::GET,
        &format!("/api/kernels/{kernel}"),
        KEY_A,
    ))
    .await;
    assert_eq!(status, 404);
    assert_eq!(listed(&b, KEY_A).await, Vec::<String>::new());
}

// ---------------------------------------------------------------------------------------
// The WebSocket: requests and cells

#[tokio::test]
async fn kernel_info_is_answered_between_busy_and_idle() {
    let b = broker("jupyter-info").await;
    let id = new_kernel(&b, KEY_A).await;
    let mut socket = try_open(&b, &id, KEY_A, false).await.expect("opens");
    let msg_id = socket.send("shell", "kernel_info_request", json!({})).await;
    let got = socket.collect(&msg_id, REPLY).await;
    assert_eq!(
        shapes(&got),
        [
            "iopub:status:busy",
            "shell:kernel_info_reply",
            "iopub:status:idle"
        ],
        "{got:#?}"
    );
    let info = &got[1]["content"];
    assert_eq!(info["status"], "ok", "{info}");
    assert_eq!(info["protocol_version"], "5.3", "{info}");
    assert_eq!(info["language_info"]["name"], "python", "{info}");
    assert!(info["implementation"].is_string(), "{info}");
    assert!(info["banner"].is_string(), "{info}");
    // The parent is the request's header, whole.
    assert_eq!(got[1]["parent_header"]["msg_type"], "kernel_info_request");
    assert_eq!(got[1]["parent_header"]["session"], socket.session.as_str());
    // One kernel session on every message, distinct message ids.
    let sessions: Vec<&Value> = got.iter().map(|m| &m["header"]["session"]).collect();
    assert!(sessions.iter().all(|s| *s == sessions[0]), "{got:#?}");
    let mut ids: Vec<&str> = got
        .iter()
        .map(|m| m["msg_id"].as_str().expect("msg_id"))
        .collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 3, "{got:#?}");
    assert!(socket.unread.is_empty(), "{:#?}", socket.unread);
    // On the control channel the reply comes on control.
    let got = socket
        .ask("control", "kernel_info_request", json!({}))
        .await;
    assert_eq!(
        shapes(&got),
        [
            "iopub:status:busy",
            "control:kernel_info_reply",
            "iopub:status:idle"
        ],
        "{got:#?}"
    );
}

#[tokio::test]
async fn a_print_gives_jupyter_s_exact_sequence() {
    let b = broker("jupyter-print").await;
    let id = new_kernel(&b, KEY_A).await;
    let mut socket = try_open(&b, &id, KEY_A, false).await.expect("opens");
    let msg_id = socket
        .send("shell", "execute_request", cell("print('hi')"))
        .await;
    let got = socket.collect(&msg_id, REPLY).await;
    assert_printed(&got, "hi\n", 1);
    assert_eq!(
        got[1]["content"],
        json!({"code": "print('hi')", "execution_count": 1})
    );
    let reply = &got[3]["content"];
    assert_eq!(reply["user_expressions"], json!({}), "{reply}");
    assert_eq!(reply["payload"], json!([]), "{reply}");
    assert!(socket.unread.is_empty(), "{:#?}", socket.unread);
    // stderr is its own stream; an empty cell still counts.
    let got = socket
        .execute("import sys\nsys.stderr.write('warn\\n'); sys.stderr.flush()")
        .await;
    assert_eq!(
        shapes(&got),
        [
            "iopub:status:busy",
            "iopub:execute_input",
            "iopub:stream",
            "shell:execute_reply",
            "iopub:status:idle"
        ],
        "{got:#?}"
    );
    assert_eq!(
        got[2]["content"],
        json!({"name": "stderr", "text": "warn\n"})
    );
    let got = socket.execute("").await;
    assert_eq!(
        shapes(&got),
        [
            "iopub:status:busy",
            "iopub:execute_input",
            "shell:execute_reply",
            "iopub:status:idle"
        ],
        "{got:#?}"
    );
    assert_eq!(got[2]["content"]["execution_count"], 3);
    // A silent cell: no execute_input, no result, not counted.
    let mut silent = cell("1 + 1");
    silent["silent"] = json!(true);
    let got = socket.ask("shell", "execute_request", silent).await;
    assert_eq!(
        shapes(&got),
        [
            "iopub:status:busy",
            "shell:execute_reply",
            "iopub:status:idle"
        ],
        "{got:#?}"
    );
    assert_eq!(got[1]["content"]["status"], "ok");
    assert_eq!(got[1]["content"]["execution_count"], 3);
    // Not stored in the history: shown, not counted.
    let mut unstored = cell("2 + 2");
    unstored["store_history"] = json!(false);
    let got = socket.ask("shell", "execute_request", unstored).await;
    assert_eq!(
        shapes(&got),
        [
            "iopub:status:busy",
            "iopub:execute_input",
            "iopub:execute_result",
            "shell:execute_reply",
            "iopub:status:idle"
        ],
        "{got:#?}"
    );
    assert_eq!(got[2]["content"]["data"], json!({"text/plain": "4"}));
    assert_eq!(got[3]["content"]["execution_count"], 3);
    assert_printed(&socket.execute("print('next')").await, "next\n", 4);
}

#[tokio::test]
async fn state_results_displays_and_figures_come_as_notebooks_show_them() {
    let b = broker("jupyter-rich").await;
    let id = new_kernel(&b, KEY_A).await;
    let mut socket = connect(&b, &id, KEY_A).await;
    let got = socket.execute("x = 41").await;
    assert_eq!(
        shapes(&got),
        [
            "iopub:status:busy",
            "iopub:execute_input",
            "shell:execute_reply",
            "iopub:status:idle"
        ],
        "{got:#?}"
    );
    assert_eq!(got[2]["content"]["execution_count"], 1);
    // A trailing expression is the cell's result.
    let got = socket.execute("x + 1").await;
    assert_eq!(
        shapes(&got),
        [
            "iopub:status:busy",
            "iopub:execute_input",
            "iopub:execute_result",
            "shell:execute_reply",
            "iopub:status:idle"
        ],
        "{got:#?}"
    );
    assert_eq!(
        got[2]["content"],
        json!({"execution_count": 2, "data": {"text/plain": "42"}, "metadata": {}})
    );
    assert_eq!(got[3]["content"]["execution_count"], 2);
    // display() sends display_data, in order with prints.
    let got = socket
        .execute("print('before')\ndisplay('x')\nprint('after')")
        .await;
    assert_eq!(
        shapes(&got),
        [
            "iopub:status:busy",
            "iopub:execute_input",
            "iopub:stream",
            "iopub:display_data",
            "iopub:stream",
            "shell:execute_reply",
            "iopub:status:idle"
        ],
        "{got:#?}"
    );
    assert_eq!(got[2]["content"]["text"], "before\n");
    assert_eq!(got[3]["content"]["data"], json!({"text/plain": "'x'"}));
    assert_eq!(got[4]["content"]["text"], "after\n");
    // An object with an HTML representation.
    let got = socket
        .execute(
            "class Bold:\n    def _repr_html_(self):\n        return '<b>hi</b>'\n    def __repr__(self):\n        return 'Bold()'\ndisplay(Bold())",
        )
        .await;
    let shown = one(&got, "display_data");
    assert_eq!(
        shown["content"]["data"],
        json!({"text/html": "<b>hi</b>", "text/plain": "Bold()"})
    );
    assert_eq!(got.last().map(is_idle), Some(true));
    assert_eq!(one(&got, "execute_reply")["content"]["status"], "ok");
    // A matplotlib figure.
    let got = socket
        .execute("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()")
        .await;
    assert_eq!(
        shapes(&got),
        [
            "iopub:status:busy",
            "iopub:execute_input",
            "iopub:display_data",
            "shell:execute_reply",
            "iopub:status:idle"
        ],
        "{got:#?}"
    );
    let png = got[2]["content"]["data"]["image/png"]
        .as_str()
        .expect("image/png");
    let png = base64::engine::general_purpose::STANDARD
        .decode(png)
        .expect("base64");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    assert!(png.len() > 1000, "a tiny PNG: {} bytes", png.len());
    // State carries on; so does the count.
    let got = socket.execute("print(x)").await;
    assert_printed(&got, "41\n", 6);
}

#[tokio::test]
async fn an_exception_is_an_error_message_and_an_error_reply() {
    let b = broker("jupyter-error").await;
    let id = new_kernel(&b, KEY_A).await;
    let mut socket = connect(&b, &id, KEY_A).await;
    let got = socket.execute("y = 1\n1 / 0").await;
    let reply = assert_failed(&got, "ZeroDivisionError", 1);
    assert_eq!(reply["evalue"], "division by zero", "{reply}");
    let traceback: Vec<&str> = reply["traceback"]
        .as_array()
        .expect("traceback")
        .iter()
        .map(|l| l.as_str().expect("a string"))
        .collect();
    assert_eq!(
        traceback.last().copied(),
        Some("ZeroDivisionError: division by zero"),
        "{traceback:?}"
    );
    assert_eq!(got[2]["content"]["traceback"], reply["traceback"]);
    // A syntax error, a raise of one's own.
    let got = socket.execute("def (:").await;
    assert_failed(&got, "SyntaxError", 2);
    let got = socket
        .execute("class Oops(Exception):\n    pass\nraise Oops('mine')")
        .await;
    let reply = assert_failed(&got, "Oops", 3);
    assert_eq!(reply["evalue"], "mine");
    // stdin is not served: input() fails at once.
    let asked = std::time::Instant::now();
    let got = socket.execute("input('name? ')").await;
    assert!(asked.elapsed() < PROMPT, "{:?}", asked.elapsed());
    assert_eq!(
        one(&got, "error")["content"]["ename"],
        "EOFError",
        "{got:#?}"
    );
    let reply = one(&got, "execute_reply");
    assert_eq!(reply["content"]["status"], "error", "{reply}");
    assert_eq!(reply["content"]["ename"], "EOFError", "{reply}");
    assert_eq!(reply["content"]["execution_count"], 4, "{reply}");
    // The kernel lives on, with what ran before the error.
    assert_printed(&socket.execute("print(y)").await, "1\n", 5);
}

#[tokio::test]
async fn a_cell_over_the_time_cap_ends_with_timeout_error_and_the_next_runs() {
    let b = broker_with("jupyter-timeout", |c| {
        c.exec_limits.exec_timeout_ms = 2000;
        c.exec_limits.max_exec_timeout_ms = 2000;
    })
    .await;
    let id = new_kernel(&b, KEY_A).await;
    let mut socket = connect(&b, &id, KEY_A).await;
    assert_printed(&socket.execute("x = 1\nprint(x)").await, "1\n", 1);
    let asked = std::time::Instant::now();
    let got = socket.execute("import time\ntime.sleep(20)").await;
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "{:?}",
        asked.elapsed()
    );
    // busy, execute_input, the error (and the runner's note on stderr), the reply, idle.
    let shown = shapes(&got);
    assert_eq!(
        shown[..2],
        ["iopub:status:busy", "iopub:execute_input"],
        "{got:#?}"
    );
    assert_eq!(
        shown[shown.len() - 2..],
        ["shell:execute_reply", "iopub:status:idle"],
        "{got:#?}"
    );
    assert!(
        shown[2..shown.len() - 2]
            .iter()
            .all(|s| s == "iopub:error" || s == "iopub:stream"),
        "{got:#?}"
    );
    let error = one(&got, "error");
    assert_eq!(error["content"]["ename"], "TimeoutError", "{got:#?}");
    let reply = &one(&got, "execute_reply")["content"];
    assert_eq!(reply["status"], "error", "{reply}");
    assert_eq!(reply["ename"], "TimeoutError", "{reply}");
    assert_eq!(
        reply["evalue"], "the cell exceeded codebroker's time limit of 2 s",
        "{reply}"
    );
    assert_eq!(reply["execution_count"], 2, "{reply}");
    // The next cell runs, with the state.
    let got = socket.execute("print('next', x)").await;
    assert_printed(&got, "next 1\n", 3);
}

/// The one session directory of a broker that serves one kernel: its session's id.
fn only_session(b: &TestBroker) -> String {
    let dirs: Vec<String> = std::fs::read_dir(b.data.join("sessions"))
        .expect("sessions")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    dirs[0].clone()
}

#[tokio::test]
async fn an_idle_kernel_s_sandbox_is_released_and_the_next_cell_has_its_state_and_env() {
    // No pool: the kernel's session is the only one with a directory.
    let b = broker_with("jupyter-idle", |c| {
        c.pool.pool_size = 0;
        c.lifecycle.idle_ttl_secs = 1;
        c.lifecycle.reap_interval_secs = 1;
    })
    .await;
    let (status, model) = answer(
        api(&b, Method::POST, "/api/kernels", KEY_A)
            .json(&json!({"name": "python3", "env": {"KERNEL_USERNAME": "ann"}})),
    )
    .await;
    assert_eq!(status, 201, "{model}");
    let id = id_of(&model);
    let mut socket = connect(&b, &id, KEY_A).await;
    let got = socket
        .execute("import os\nx = 5\nprint(x, os.environ.get('KERNEL_USERNAME'))")
        .await;
    assert_printed(&got, "5 ann\n", 1);
    // Idle, the sandbox goes with the state saved (polled: no event tells the client).
    let session = only_session(&b);
    let saved = b
        .data
        .join("sessions")
        .join(&session)
        .join("python-state.json");
    let label = format!("codebroker.session={session}");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !(saved.exists() && common::containers_matching(&b.instance, &[&label]).is_empty()) {
        assert!(
            std::time::Instant::now() < deadline,
            "the idle sandbox was not released"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The kernel and its socket stay; the next cell has the state and the variables.
    let got = socket
        .execute("print(x, os.environ.get('KERNEL_USERNAME'))")
        .await;
    assert_eq!(stdout(&got), "5 ann\n", "{got:#?}");
    let reply = one(&got, "execute_reply");
    assert_eq!(reply["content"]["status"], "ok", "{reply}");
    assert_eq!(reply["content"]["execution_count"], 2, "{reply}");
}

/// A cell that says it started, then sleeps; its msg_id once its `started` is read.
async fn start_sleeping(socket: &mut Socket) -> String {
    let code = "import time\nprint('started', flush=True)\ntime.sleep(60)";
    let msg_id = socket.send("shell", "execute_request", cell(code)).await;
    let until = Instant::now() + REPLY;
    socket
        .wait_for(
            |m| {
                m["parent_header"]["msg_id"] == msg_id.as_str()
                    && m["header"]["msg_type"] == "stream"
            },
            until,
        )
        .await;
    msg_id
}

/// The messages of an interrupted sleeping cell, checked.
fn assert_interrupted(got: &[Value], count: u64) {
    assert_eq!(
        shapes(got),
        [
            "iopub:status:busy",
            "iopub:execute_input",
            "iopub:stream",
            "iopub:error",
            "shell:execute_reply",
            "iopub:status:idle"
        ],
        "{got:#?}"
    );
    assert_eq!(got[2]["content"]["text"], "started\n");
    assert_eq!(got[3]["content"]["ename"], "KeyboardInterrupt", "{got:#?}");
    let reply = &got[4]["content"];
    assert_eq!(reply["status"], "error", "{reply}");
    assert_eq!(reply["ename"], "KeyboardInterrupt", "{reply}");
    assert_eq!(reply["execution_count"], count, "{reply}");
}

#[tokio::test]
async fn an_interrupt_on_the_control_channel_stops_the_cell_and_keeps_the_state() {
    let b = broker("jupyter-interrupt").await;
    let id = new_kernel(&b, KEY_A).await;
    let mut socket = connect(&b, &id, KEY_A).await;
    assert_eq!(
        shapes(&socket.execute("x = 5").await),
        [
            "iopub:status:busy",
            "iopub:execute_input",
            "shell:execute_reply",
            "iopub:status:idle"
        ]
    );
    let cell_id = start_sleeping(&mut socket).await;
    let sent = std::time::Instant::now();
    let interrupt = socket.send("control", "interrupt_request", json!({})).await;
    // Answered while the cell runs: the socket reads during a cell.
    let got = socket.collect(&interrupt, PROMPT).await;
    assert_eq!(
        shapes(&got),
        [
            "iopub:status:busy",
            "control:interrupt_reply",
            "iopub:status:idle"
        ],
        "{got:#?}"
    );
    assert_eq!(got[1]["content"], json!({"status": "ok"}));
    let got = socket.collect(&cell_id, Duration::from_secs(10)).await;
    assert!(
        sent.elapsed() < Duration::from_secs(10),
        "{:?}",
        sent.elapsed()
    );
    assert_interrupted(&got, 2);
    assert_printed(&socket.execute("print(x)").await, "5\n", 3);
    // An interrupt with no cell running is answered too, and harms nothing.
    let got = socket.ask("control", "interrupt_request", json!({})).await;
    assert_eq!(got[1]["content"], json!({"status": "ok"}), "{got:#?}");
    assert_printed(&socket.execute("print(x + 1)").await, "6\n", 4);
}

#[tokio::test]
async fn an_interrupt_over_rest_stops_the_cell_and_keeps_the_state() {
    let b = broker("jupyter-rest-interrupt").await;
    let id = new_kernel(&b, KEY_A).await;
    let mut socket = connect(&b, &id, KEY_A).await;
    socket.execute("x = 5").await;
    let cell_id = start_sleeping(&mut socket).await;
    let (status, model) = answer(api(&b, Method::GET, &format!("/api/kernels/{id}"), KEY_A)).await;
    assert_eq!(status, 200, "{model}");
    assert_kernel_model(&model, "busy", 1);
    let sent = std::time::Instant::now();
    let (status, body) = answer(api(
        &b,
        Method::POST,
        &format!("/api/kernels/{id}/interrupt"),
        KEY_A,
    ))
    .await;
    assert_eq!((status, body), (204, Value::Null));
    assert!(sent.elapsed() < PROMPT, "{:?}", sent.elapsed());
    let got = socket.collect(&cell_id, Duration::from_secs(10)).await;
    assert_interrupted(&got, 2);
    assert_printed(&socket.execute("print(x)").await, "5\n", 3);
    let (_, model) = answer(api(&b, Method::GET, &format!("/api/kernels/{id}"), KEY_A)).await;
    assert_kernel_model(&model, "idle", 1);
}

#[tokio::test]
async fn kernel_info_is_answered_while_a_cell_runs() {
    let b = broker("jupyter-info-busy").await;
    let id = new_kernel(&b, KEY_A).await;
    let mut socket = connect(&b, &id, KEY_A).await;
    let cell_id = start_sleeping(&mut socket).await;
    let asked = std::time::Instant::now();
    let info = socket.send("shell", "kernel_info_request", json!({})).await;
    let got = socket.collect(&info, PROMPT).await;
    assert!(asked.elapsed() < PROMPT, "{:?}", asked.elapsed());
    assert_eq!(
        shapes(&got),
        [
            "iopub:status:busy",
            "shell:kernel_info_reply",
            "iopub:status:idle"
        ],
        "{got:#?}"
    );
    // The other requests too.
    let got = socket
        .ask(
            "shell",
            "complete_request",
            json!({"code": "pri", "cursor_pos": 3}),
        )
        .await;
    assert_eq!(shapes(&got)[1], "shell:complete_reply", "{got:#?}");
    // The cell still runs until interrupted.
    assert!(
        !socket
            .unread
            .iter()
            .any(|m| m["parent_header"]["msg_id"] == cell_id.as_str() && is_idle(m)),
        "{:#?}",
        socket.unread
    );
    let got = socket.ask("control", "interrupt_request", json!({})).await;
    assert_eq!(got[1]["content"]["status"], "ok");
    let got = socket.collect(&cell_id, Duration::from_secs(10)).await;
    assert_interrupted(&got, 1);
}

#[tokio::test]
async fn a_rest_restart_during_a_cell_stops_it_forgets_the_state_and_keeps_files_and_env() {
    let b = broker("jupyter-restart").await;
    let (status, model) = answer(
        api(&b, Method::POST, "/api/kernels", KEY_A)
            .json(&json!({"name": "python3", "env": {"KERNEL_USERNAME": "ann"}})),
    )
    .await;
    assert_eq!(status, 201, "{model}");
    let id = id_of(&model);
    let mut socket = connect(&b, &id, KEY_A).await;
    let got = socket
        .execute("x = 5\nopen('/mnt/data/keep.txt', 'w').write('kept')\nprint(x)")
        .await;
    assert_printed(&got, "5\n", 1);
    let cell_id = start_sleeping(&mut socket).await;
    let asked = std::time::Instant::now();
    let (status, model) = answer(api(
        &b,
        Method::POST,
        &format!("/api/kernels/{id}/restart"),
        KEY_A,
    ))
    .await;
    assert!(
        asked.elapsed() < Duration::from_secs(15),
        "{:?}",
        asked.elapsed()
    );
    assert_eq!(status, 200, "{model}");
    assert_kernel_model(&model, "idle", 1);
    assert_eq!(model["id"], id.as_str());
    // The running cell was stopped.
    assert_interrupted(&socket.collect(&cell_id, REPLY).await, 2);
    // Every socket hears of the restart, linked to no request.
    let restarting = socket
        .take(|m| m["content"]["execution_state"] == "restarting", REPLY)
        .await;
    assert_eq!(restarting["parent_header"], json!({}), "{restarting}");
    let got = socket.execute("print(x)").await;
    let reply = assert_failed(&got, "NameError", 1);
    assert!(
        reply["evalue"].as_str().unwrap_or("").contains("'x'"),
        "{reply}"
    );
    assert_printed(
        &socket
            .execute("print(open('/mnt/data/keep.txt').read())")
            .await,
        "kept\n",
        2,
    );
    // The create's variables are set again in the new kernel.
    let got = socket
        .execute("import os\nprint(os.environ.get('KERNEL_USERNAME'))")
        .await;
    assert_printed(&got, "ann\n", 3);
}

#[tokio::test]
async fn deleting_a_kernel_during_a_cell_stops_it_and_closes_the_socket() {
    let b = broker("jupyter-delete-busy").await;
    let id = new_kernel(&b, KEY_A).await;
    let mut socket = connect(&b, &id, KEY_A).await;
    start_sleeping(&mut socket).await;
    let asked = std::time::Instant::now();
    let (status, body) = answer(api(
        &b,
        Method::DELETE,
        &format!("/api/kernels/{id}"),
        KEY_A,
    ))
    .await;
    assert_eq!((status, body), (204, Value::Null));
    assert!(asked.elapsed() < PROMPT, "{:?}", asked.elapsed());
    assert_eq!(socket.closed(Duration::from_secs(10)).await, Some(1001));
    let (status, _) = answer(api(&b, Method::GET, &format!("/api/kernels/{id}"), KEY_A)).await;
    assert_eq!(status, 404);
    // The next kernel works.
    let next = new_kernel(&b, KEY_A).await;
    let mut socket = connect(&b, &next, KEY_A).await;
    assert_printed(&socket.execute("print('next')").await, "next\n", 1);
}

#[tokio::test]
async fn a_restarting_shutdown_request_forgets_the_state_and_keeps_the_files() {
    let b = broker("jupyter-shutdown-restart").await;
    let id = new_kernel(&b, KEY_A).await;
    let mut socket = connect(&b, &id, KEY_A).await;
    socket
        .execute("x = 5\nopen('/mnt/data/keep.txt', 'w').write('kept')")
        .await;
    let got = socket
        .ask("control", "shutdown_request", json!({"restart": true}))
        .await;
    assert_eq!(
        shapes(&got),
        [
            "iopub:status:busy",
            "control:shutdown_reply",
            "iopub:status:idle"
        ],
        "{got:#?}"
    );
    assert_eq!(got[1]["content"], json!({"status": "ok", "restart": true}));
    let got = socket.execute("print(x)").await;
    assert_failed(&got, "NameError", 1);
    assert_printed(
        &socket
            .execute("print(open('/mnt/data/keep.txt').read())")
            .await,
        "kept\n",
        2,
    );
    let (status, model) = answer(api(&b, Method::GET, &format!("/api/kernels/{id}"), KEY_A)).await;
    assert_eq!(status, 200, "{model}");
}

#[tokio::test]
async fn a_shutdown_request_ends_the_kernel_and_closes_its_socket() {
    let b = broker("jupyter-shutdown").await;
    let id = new_kernel(&b, KEY_A).await;
    let mut socket = connect(&b, &id, KEY_A).await;
    let mut other = connect(&b, &id, KEY_A).await;
    let msg_id = socket
        .send("control", "shutdown_request", json!({"restart": false}))
        .await;
    // The socket closes after the reply and the idle that ends it.
    let code = socket.closed(REPLY).await;
    let got: Vec<Value> = socket
        .unread
        .iter()
        .filter(|m| m["parent_header"]["msg_id"] == msg_id.as_str())
        .cloned()
        .collect();
    assert_eq!(
        shapes(&got),
        [
            "iopub:status:busy",
            "control:shutdown_reply",
            "iopub:status:idle"
        ],
        "then closed with {code:?}: {got:#?}"
    );
    assert_eq!(got[1]["content"], json!({"status": "ok", "restart": false}));
    assert_eq!(code, Some(1001));
    assert_eq!(other.closed(REPLY).await, Some(1001));
    let (status, body) = answer(api(&b, Method::GET, &format!("/api/kernels/{id}"), KEY_A)).await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(try_open(&b, &id, KEY_A, false).await.err(), Some(404));
    assert_eq!(listed(&b, KEY_A).await, Vec::<String>::new());
}

#[tokio::test]
async fn cells_queued_behind_a_failure_are_aborted() {
    let b = broker("jupyter-abort").await;
    let id = new_kernel(&b, KEY_A).await;
    let mut socket = connect(&b, &id, KEY_A).await;
    let failing = socket
        .send(
            "shell",
            "execute_request",
            cell("import time\ntime.sleep(0.5)\n1 / 0"),
        )
        .await;
    let second = socket
        .send("shell", "execute_request", cell("print('second')"))
        .await;
    let third = socket
        .send("shell", "execute_request", cell("print('third')"))
        .await;
    assert_failed(
        &socket.collect(&failing, REPLY).await,
        "ZeroDivisionError",
        1,
    );
    for queued in [second, third] {
        let got = socket.collect(&queued, REPLY).await;
        assert_eq!(
            shapes(&got),
            [
                "iopub:status:busy",
                "shell:execute_reply",
                "iopub:status:idle"
            ],
            "{got:#?}"
        );
        assert_eq!(got[1]["content"]["status"], "aborted", "{got:#?}");
    }
    // Without stop_on_error the cells behind a failure run.
    let mut lenient = cell("1 / 0");
    lenient["stop_on_error"] = json!(false);
    let failing = socket.send("shell", "execute_request", lenient).await;
    let after = socket
        .send("shell", "execute_request", cell("print('ran')"))
        .await;
    assert_failed(
        &socket.collect(&failing, REPLY).await,
        "ZeroDivisionError",
        2,
    );
    assert_printed(&socket.collect(&after, REPLY).await, "ran\n", 3);
    assert!(socket.unread.is_empty(), "{:#?}", socket.unread);
}

#[tokio::test]
async fn cells_past_the_queue_are_refused_and_an_interrupt_aborts_the_queue() {
    let b = broker("jupyter-queue").await;
    let id = new_kernel(&b, KEY_A).await;
    let mut socket = connect(&b, &id, KEY_A).await;
    let running = start_sleeping(&mut socket).await;
    // 64 cells wait behind the running one; the rest are refused at once.
    let mut queued = Vec::new();
    for i in 0..70 {
        let code = format!("print({i})");
        queued.push(socket.send("shell", "execute_request", cell(&code)).await);
    }
    for refused in &queued[64..] {
        let got = socket.collect(refused, PROMPT).await;
        assert_eq!(
            shapes(&got),
            [
                "iopub:status:busy",
                "iopub:error",
                "shell:execute_reply",
                "iopub:status:idle"
            ],
            "{got:#?}"
        );
        assert_eq!(got[1]["content"]["ename"], "QueueFull", "{got:#?}");
        assert_eq!(got[2]["content"]["status"], "error", "{got:#?}");
        assert_eq!(got[2]["content"]["ename"], "QueueFull", "{got:#?}");
    }
    // Interrupted, the running cell fails; the queued ones are aborted.
    socket.ask("control", "interrupt_request", json!({})).await;
    assert_interrupted(&socket.collect(&running, Duration::from_secs(10)).await, 1);
    for waiting in &queued[..64] {
        let got = socket.collect(waiting, REPLY).await;
        assert_eq!(
            shapes(&got),
            [
                "iopub:status:busy",
                "shell:execute_reply",
                "iopub:status:idle"
            ],
            "{got:#?}"
        );
        assert_eq!(got[1]["content"]["status"], "aborted", "{got:#?}");
    }
    assert!(socket.unread.is_empty(), "{:#?}", socket.unread);
    assert_printed(&socket.execute("print('after')").await, "after\n", 2);
}

#[tokio::test]
async fn the_other_shell_requests_get_their_replies() {
    let b = broker("jupyter-requests").await;
    let id = new_kernel(&b, KEY_A).await;
    let mut socket = connect(&b, &id, KEY_A).await;
    for (msg_type, content, reply) in [
        (
            "complete_request",
            json!({"code": "import o", "cursor_pos": 8}),
            "complete_reply",
        ),
        (
            "inspect_request",
            json!({"code": "print", "cursor_pos": 5, "detail_level": 0}),
            "inspect_reply",
        ),
        (
            "is_complete_request",
            json!({"code": "for i in range(3):"}),
            "is_complete_reply",
        ),
        (
            "comm_info_request",
            json!({"target_name": "jupyter.widget"}),
            "comm_info_reply",
        ),
        (
            "history_request",
            json!({"output": false, "raw": true, "hist_access_type": "tail", "n": 10}),
            "history_reply",
        ),
    ] {
        let got = socket.ask("shell", msg_type, content).await;
        assert_eq!(
            shapes(&got),
            [
                "iopub:status:busy",
                &format!("shell:{reply}"),
                "iopub:status:idle"
            ],
            "{got:#?}"
        );
        let status = if msg_type == "is_complete_request" {
            "unknown"
        } else {
            "ok"
        };
        assert_eq!(got[1]["content"]["status"], status, "{got:#?}");
    }
    let got = socket
        .ask(
            "shell",
            "complete_request",
            json!({"code": "import o", "cursor_pos": 8}),
        )
        .await;
    let content = &got[1]["content"];
    assert_eq!(content["cursor_start"], 8);
    assert_eq!(content["cursor_end"], 8);
    assert!(content["matches"].is_array(), "{content}");
    // A comm to a target that does not exist is closed at once.
    let got = socket
        .ask(
            "shell",
            "comm_open",
            json!({"comm_id": "c1", "target_name": "nowhere", "data": {}}),
        )
        .await;
    assert_eq!(
        shapes(&got),
        ["iopub:status:busy", "iopub:comm_close", "iopub:status:idle"],
        "{got:#?}"
    );
    assert_eq!(got[1]["content"]["comm_id"], "c1");
    // Messages that are answers (a comm's traffic, an input reply) get nothing back.
    let comm = socket
        .send(
            "shell",
            "comm_msg",
            json!({"comm_id": "c1", "data": {"x": 1}}),
        )
        .await;
    let input = socket
        .send("stdin", "input_reply", json!({"value": "typed"}))
        .await;
    socket.ready().await;
    assert!(
        !socket.unread.iter().any(|m| {
            let parent = &m["parent_header"]["msg_id"];
            parent == comm.as_str() || parent == input.as_str()
        }),
        "{:#?}",
        socket.unread
    );
    assert_printed(&socket.execute("print('fine')").await, "fine\n", 1);
}

#[tokio::test]
async fn output_past_the_caps_is_cut_and_the_next_cell_runs() {
    let b = broker("jupyter-output").await;
    let id = new_kernel(&b, KEY_A).await;
    let mut socket = connect(&b, &id, KEY_A).await;
    let got = socket
        .execute("x = 1\nprint('h\\u00e9llo \\u2713 ' + chr(0x1F600))")
        .await;
    assert_printed(&got, "h\u{e9}llo \u{2713} \u{1F600}\n", 1);
    // stdout past CODEBROKER_MAX_OUTPUT_BYTES: cut at the cap, and the cell fails.
    let got = socket.execute("print('a' * 200000)").await;
    assert_eq!(
        stdout(&got),
        "a".repeat(64 * 1024),
        "{} bytes",
        stdout(&got).len()
    );
    assert_eq!(
        one(&got, "error")["content"]["ename"],
        "LimitError",
        "{got:#?}"
    );
    let reply = &one(&got, "execute_reply")["content"];
    assert_eq!(reply["status"], "error", "{reply}");
    assert_eq!(reply["ename"], "LimitError", "{reply}");
    assert_eq!(reply["execution_count"], 2, "{reply}");
    assert_eq!(got.last().map(is_idle), Some(true));
    assert_printed(&socket.execute("print(x)").await, "1\n", 3);
    // Display events past CODEBROKER_MAX_DISPLAY_EVENTS: the first 256 are shown.
    let got = socket.execute("for i in range(300):\n    display(i)").await;
    let shown: Vec<&Value> = got
        .iter()
        .filter(|m| m["header"]["msg_type"] == "display_data")
        .map(|m| &m["content"]["data"]["text/plain"])
        .collect();
    let expected: Vec<Value> = (0..256).map(|i| json!(i.to_string())).collect();
    assert_eq!(shown, expected.iter().collect::<Vec<_>>());
    assert_eq!(one(&got, "execute_reply")["content"]["status"], "ok");
    assert_printed(&socket.execute("print(x + 1)").await, "2\n", 5);
}

#[tokio::test]
async fn a_jwt_user_s_kernel_is_theirs_alone() {
    let b = broker_with("jupyter-jwt", |c| {
        c.access.jwt_public_keys = vec![common::jwt::lc_ed_public_key()];
    })
    .await;
    let (alice, bob) = (common::jwt::jwt("alice"), common::jwt::jwt("bob"));
    let bearer = |method: Method, path: &str, token: &str| {
        b.client
            .request(method, b.url(&format!("/jupyter{path}")))
            .header("authorization", format!("Bearer {token}"))
    };
    let (status, model) = answer(bearer(Method::POST, "/api/kernels", &alice)).await;
    assert_eq!(status, 201, "{model}");
    let id = id_of(&model);
    let (status, list) = answer(bearer(Method::GET, "/api/kernels", &bob)).await;
    assert_eq!((status, list), (200, json!([])));
    for (method, path) in [
        (Method::GET, format!("/api/kernels/{id}")),
        (Method::DELETE, format!("/api/kernels/{id}")),
        (Method::POST, format!("/api/kernels/{id}/interrupt")),
        (Method::POST, format!("/api/kernels/{id}/restart")),
    ] {
        let (status, body) = answer(bearer(method.clone(), &path, &bob)).await;
        assert_eq!(status, 404, "{method} {path} as bob: {body}");
    }
    // The JWT as ?token= is checked as a JWT.
    assert_eq!(try_open(&b, &id, &bob, false).await.err(), Some(404));
    let forged = format!("{}x", &alice[..alice.len() - 1]);
    assert_eq!(try_open(&b, &id, &forged, false).await.err(), Some(401));
    let mut socket = try_open(&b, &id, &alice, false)
        .await
        .expect("alice's socket");
    assert_printed(&socket.execute("print('alice')").await, "alice\n", 1);
}

// ---------------------------------------------------------------------------------------
// Hostile input and limits

/// The one iopub error a frame without a readable header gets (linked to nothing); its
/// content.
async fn unlinked_error(socket: &mut Socket) -> Value {
    let error = socket
        .take(|m| m["parent_header"] == json!({}), REPLY)
        .await;
    assert_eq!(shape(&error), "iopub:error", "{error}");
    error["content"].clone()
}

#[tokio::test]
async fn malformed_and_unknown_messages_get_errors_and_the_kernel_lives_on() {
    let b = broker("jupyter-malformed").await;
    let id = new_kernel(&b, KEY_A).await;
    let mut socket = connect(&b, &id, KEY_A).await;
    socket.execute("kept = 'yes'").await;
    // Frames that are no message at all.
    for text in [
        "not json",
        "",
        "[1, 2]",
        "null",
        "{\"header\": 5, \"channel\": \"shell\"}",
        "{\"channel\": \"shell\"}",
    ] {
        socket.send_frame(Frame::text(text)).await;
        let error = unlinked_error(&mut socket).await;
        assert_eq!(error["ename"], "MalformedMessage", "{text:?}: {error}");
        assert!(
            error["evalue"].as_str().is_some_and(|e| !e.is_empty()),
            "{error}"
        );
        assert!(error["traceback"].is_array(), "{error}");
        socket.ready().await;
    }
    // A binary frame on a legacy socket.
    socket
        .send_frame(Frame::binary(b"\x00\x01binary".to_vec()))
        .await;
    let error = unlinked_error(&mut socket).await;
    assert_eq!(error["ename"], "MalformedMessage", "{error}");
    socket.ready().await;
    // A header without msg_type: the error is linked to its msg_id.
    let (msg_id, mut msg) = message(&socket.session, "shell", "kernel_info_request", json!({}));
    msg["header"]
        .as_object_mut()
        .expect("header")
        .remove("msg_type");
    socket.send_message(&msg).await;
    let got = socket.collect(&msg_id, REPLY).await;
    assert_eq!(
        shapes(&got),
        ["iopub:status:busy", "iopub:error", "iopub:status:idle"],
        "{got:#?}"
    );
    assert_eq!(got[1]["content"]["ename"], "MalformedMessage");
    // An unknown channel, content that is not an object.
    let (msg_id, mut msg) = message(&socket.session, "nowhere", "kernel_info_request", json!({}));
    msg["channel"] = json!("nowhere");
    socket.send_message(&msg).await;
    let got = socket.collect(&msg_id, REPLY).await;
    assert_eq!(
        shapes(&got),
        ["iopub:status:busy", "iopub:error", "iopub:status:idle"],
        "{got:#?}"
    );
    assert_eq!(got[1]["content"]["ename"], "MalformedMessage");
    let (msg_id, mut msg) = message(&socket.session, "shell", "execute_request", json!({}));
    msg["content"] = json!(["print(1)"]);
    socket.send_message(&msg).await;
    let got = socket.collect(&msg_id, REPLY).await;
    assert_eq!(
        shapes(&got),
        ["iopub:status:busy", "iopub:error", "iopub:status:idle"],
        "{got:#?}"
    );
    // An unknown message type.
    let got = socket.ask("shell", "foo_request", json!({})).await;
    assert_eq!(
        shapes(&got),
        ["iopub:status:busy", "shell:foo_reply", "iopub:status:idle"],
        "{got:#?}"
    );
    let reply = &got[1]["content"];
    assert_eq!(reply["status"], "error", "{reply}");
    assert_eq!(reply["ename"], "UnknownMessageType", "{reply}");
    assert!(
        reply["evalue"]
            .as_str()
            .unwrap_or("")
            .contains("foo_request"),
        "{reply}"
    );
    // A cell without code.
    let got = socket
        .ask("shell", "execute_request", json!({"code": 5}))
        .await;
    assert_eq!(
        shapes(&got),
        [
            "iopub:status:busy",
            "iopub:error",
            "shell:execute_reply",
            "iopub:status:idle"
        ],
        "{got:#?}"
    );
    assert_eq!(got[2]["content"]["status"], "error");
    // Pings are answered by the server's WebSocket and are not messages.
    socket
        .send_frame(Frame::Ping(b"are you there".to_vec().into()))
        .await;
    // Through all of it the kernel kept its state.
    let got = socket.execute("print(kept)").await;
    assert_eq!(stdout(&got), "yes\n", "{got:#?}");
    assert_eq!(one(&got, "execute_reply")["content"]["status"], "ok");
    assert!(socket.unread.is_empty(), "{:#?}", socket.unread);
}

#[tokio::test]
async fn a_message_over_the_cap_is_refused_and_one_over_twice_closes_only_the_socket() {
    let b = broker_with("jupyter-large", |c| c.caps.max_body_mb = 1).await;
    let id = new_kernel(&b, KEY_A).await;
    let mut socket = connect(&b, &id, KEY_A).await;
    let mut other = connect(&b, &id, KEY_A).await;
    assert_printed(&socket.execute("y = 7\nprint(y)").await, "7\n", 1);
    // 1.5 MiB against 1 MiB: an error reply.
    let big = format!("z = 1\n#{}", "a".repeat(3 * 512 * 1024));
    let msg_id = socket.send("shell", "execute_request", cell(&big)).await;
    let got = socket.collect(&msg_id, REPLY).await;
    assert_eq!(
        shapes(&got),
        [
            "iopub:status:busy",
            "iopub:error",
            "shell:execute_reply",
            "iopub:status:idle"
        ],
        "{got:#?}"
    );
    assert_eq!(got[1]["content"]["ename"], "MessageTooLarge", "{got:#?}");
    let reply = &got[2]["content"];
    assert_eq!(reply["status"], "error", "{reply}");
    assert_eq!(reply["ename"], "MessageTooLarge", "{reply}");
    // The socket still works, and the refused cell did not run.
    let got = socket.execute("print('z' in globals(), y)").await;
    assert_eq!(stdout(&got), "False 7\n", "{got:#?}");
    // 3 MiB: past twice the cap the socket closes.
    let huge = format!("w = 1\n#{}", "a".repeat(3 * 1024 * 1024));
    let (_, msg) = message(&socket.session, "shell", "execute_request", cell(&huge));
    // The server may close before the whole frame is written.
    let _ = socket.ws.send(Frame::text(msg.to_string())).await;
    let code = socket.closed(REPLY).await;
    assert!(matches!(code, None | Some(1009)), "closed with {code:?}");
    // The kernel lives on, with its state: the other socket still answers, and a new
    // socket reaches it.
    other.ready().await;
    let mut socket = connect(&b, &id, KEY_A).await;
    let got = socket.execute("print('w' in globals(), y)").await;
    assert_eq!(stdout(&got), "False 7\n", "{got:#?}");
    let (status, model) = answer(api(&b, Method::GET, &format!("/api/kernels/{id}"), KEY_A)).await;
    assert_eq!(status, 200, "{model}");
    assert_kernel_model(&model, "idle", 2);
}

#[tokio::test]
async fn the_v1_subprotocol_frames_messages_in_binary() {
    let b = broker("jupyter-v1").await;
    let id = new_kernel(&b, KEY_A).await;
    let mut socket = try_open(&b, &id, KEY_A, true).await.expect("v1 opens");
    let got = socket.ask("shell", "kernel_info_request", json!({})).await;
    assert_eq!(
        shapes(&got),
        [
            "iopub:status:busy",
            "shell:kernel_info_reply",
            "iopub:status:idle"
        ],
        "{got:#?}"
    );
    assert_eq!(got[1]["content"]["protocol_version"], "5.3");
    let got = socket.execute("v = 'binary'\nprint(v)").await;
    assert_printed(&got, "binary\n", 1);
    // Hostile frames: lying offsets, too many, too few parts, parts that are not JSON.
    let good = v1_encode(&message(&socket.session, "shell", "kernel_info_request", json!({})).1);
    let mut past_end = good.clone();
    past_end[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let mut too_many = good.clone();
    too_many[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    let mut short = good.clone();
    short.truncate(good.len() - 1);
    let not_json = v1_frame(b"shell", &[b"{{{", b"{}", b"{}", b"{}"]);
    let bad_content = v1_frame(
        b"shell",
        &[
            json!({"msg_id": "m", "msg_type": "kernel_info_request"})
                .to_string()
                .as_bytes(),
            b"{}",
            b"{}",
            b"[",
        ],
    );
    let too_few = v1_frame(b"shell", &[b"{}", b"{}"]);
    for frame in [
        Vec::new(),
        vec![1, 2, 3],
        past_end,
        too_many,
        short,
        not_json,
        bad_content,
        too_few,
    ] {
        socket.send_frame(Frame::binary(frame.clone())).await;
        let error = unlinked_error(&mut socket).await;
        assert_eq!(error["ename"], "MalformedMessage", "{frame:?}: {error}");
        socket.ready().await;
    }
    let got = socket.execute("print(v)").await;
    assert_printed(&got, "binary\n", 2);
    assert!(socket.unread.is_empty(), "{:#?}", socket.unread);
}

#[tokio::test]
async fn a_second_socket_sees_the_iopub_messages_of_the_first() {
    let b = broker("jupyter-two").await;
    let id = new_kernel(&b, KEY_A).await;
    let mut first = connect(&b, &id, KEY_A).await;
    let mut second = connect(&b, &id, KEY_A).await;
    let (status, model) = answer(api(&b, Method::GET, &format!("/api/kernels/{id}"), KEY_A)).await;
    assert_eq!(status, 200, "{model}");
    assert_kernel_model(&model, "idle", 2);
    let msg_id = first
        .send(
            "shell",
            "execute_request",
            cell("shared = 3\nprint('both')"),
        )
        .await;
    assert_printed(&first.collect(&msg_id, REPLY).await, "both\n", 1);
    // The other socket sees the iopub side, not the reply.
    let seen = second.collect(&msg_id, REPLY).await;
    assert_eq!(
        shapes(&seen),
        [
            "iopub:status:busy",
            "iopub:execute_input",
            "iopub:stream",
            "iopub:status:idle"
        ],
        "{seen:#?}"
    );
    assert_eq!(seen[2]["content"]["text"], "both\n");
    // And the state is the kernel's: the second socket's cell sees it.
    assert_printed(&second.execute("print(shared)").await, "3\n", 2);
    let seen = first
        .take(|m| m["header"]["msg_type"] == "stream", REPLY)
        .await;
    assert_eq!(seen["content"]["text"], "3\n");
    // One socket's cell queues behind the other's, and either socket interrupts it.
    let sleeping = start_sleeping(&mut first).await;
    let waiting = second
        .send("shell", "execute_request", cell("print(shared * 2)"))
        .await;
    let got = second.ask("control", "interrupt_request", json!({})).await;
    assert_eq!(got[1]["content"]["status"], "ok", "{got:#?}");
    assert_interrupted(&first.collect(&sleeping, Duration::from_secs(10)).await, 3);
    assert_printed(&second.collect(&waiting, REPLY).await, "6\n", 4);
    // One socket closing leaves the other.
    second.ws.close(None).await.expect("close");
    second.closed(REPLY).await;
    let (status, model) = answer(api(&b, Method::GET, &format!("/api/kernels/{id}"), KEY_A)).await;
    assert_eq!(status, 200, "{model}");
    assert_kernel_model(&model, "idle", 1);
    let got = first.execute("print(shared + 1)").await;
    assert_printed(&got, "4\n", 5);
}

/// A connection to the broker from `source`, another loopback address than the test's
/// other clients, so the per-peer cap counts only this test's connections.
fn connect_from(source: [u8; 4], b: &TestBroker) -> std::net::TcpStream {
    let port: u16 = b
        .base
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("port");
    let socket =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    socket
        .bind(&std::net::SocketAddr::from((source, 0)).into())
        .expect("bind the source address");
    socket
        .connect_timeout(
            &std::net::SocketAddr::from(([127, 0, 0, 1], port)).into(),
            Duration::from_secs(5),
        )
        .expect("connect");
    socket.into()
}

/// `GET /jupyter/api` on a new connection from `source`: the status line.
async fn status_line_from(source: [u8; 4], b: &TestBroker) -> String {
    use std::io::{Read as _, Write as _};
    let mut s = connect_from(source, b);
    tokio::task::spawn_blocking(move || {
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        s.write_all(b"GET /jupyter/api HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            .expect("write");
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        answer.lines().next().unwrap_or("").to_string()
    })
    .await
    .expect("read")
}

#[tokio::test]
async fn open_sockets_keep_their_connections_under_the_per_peer_cap() {
    // An upgraded connection stays counted while it is open: kernel sockets cannot get
    // around CODEBROKER_MAX_CONNECTIONS_PER_PEER (nor the total cap, the same slots).
    let b = broker_with("jupyter-conncap", |c| c.caps.max_connections_per_peer = 2).await;
    let id = new_kernel(&b, KEY_A).await;
    let source = [127, 0, 0, 2];
    let mut sockets = Vec::new();
    for _ in 0..2 {
        let request = format!("{}?token={KEY_A}", channels_url(&b, &id))
            .into_client_request()
            .expect("request");
        let tcp = tokio::net::TcpStream::from_std({
            let s = connect_from(source, &b);
            s.set_nonblocking(true).expect("nonblocking");
            s
        })
        .expect("tokio stream");
        let (ws, _) = tokio_tungstenite::client_async(request, tcp)
            .await
            .expect("socket opens");
        sockets.push(ws);
    }
    // Both sockets open: a third connection from the address is refused at once.
    let line = status_line_from(source, &b).await;
    assert!(line.starts_with("HTTP/1.1 503"), "{line}");
    // One closes: the address is served again.
    let mut closing = sockets.pop().expect("a socket");
    closing.close(None).await.expect("close");
    drop(closing);
    let deadline = Instant::now() + REPLY;
    loop {
        let line = status_line_from(source, &b).await;
        if line.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(Instant::now() < deadline, "still refused: {line}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
