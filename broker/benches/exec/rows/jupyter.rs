//! Jupyter's protocol as Open WebUI drives it: every code call creates a kernel, runs one
//! cell over the kernel WebSocket, waits for `status: idle` and deletes the kernel. The
//! round trip with `print(1)` (the goal) and with what models write first (pandas
//! and a plot), paced as a chat is, beside codebroker's own `/exec` of the same code in a
//! new session; and a warm cell against a warm `/exec`.

use super::chat::PANDAS_PLOT;
use crate::table::{p50, Row};
use crate::{timed, Bench, Scale};
use futures::{SinkExt as _, StreamExt as _};
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio_tungstenite::tungstenite::Message as WsMessage;

type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// How far apart the paced round trips start: one chat turn a second.
const PACE: Duration = Duration::from_millis(1000);

/// `POST /jupyter/api/kernels` with no body, as Open WebUI sends it; the kernel id.
async fn create(bench: &Bench) -> String {
    let resp = bench
        .client
        .post(bench.url("/jupyter/api/kernels"))
        .send()
        .await
        .expect("create");
    assert_eq!(resp.status(), 201);
    let v: Value = resp.json().await.expect("json");
    v["id"].as_str().expect("id").to_string()
}

async fn open(bench: &Bench, id: &str) -> Socket {
    let url = bench
        .url(&format!("/jupyter/api/kernels/{id}/channels"))
        .replacen("http", "ws", 1);
    tokio_tungstenite::connect_async(url).await.expect("ws").0
}

/// One `execute_request` as Open WebUI sends it; its stdout, read until the `idle` that
/// answers it.
async fn cell(socket: &mut Socket, code: &str) -> String {
    let msg_id = uuid::Uuid::new_v4().simple().to_string();
    let request = json!({
        "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "user",
                   "session": uuid::Uuid::new_v4().simple().to_string(), "date": "",
                   "version": "5.3"},
        "parent_header": {}, "metadata": {},
        "content": {"code": code, "silent": false, "store_history": true,
                    "user_expressions": {}, "allow_stdin": false, "stop_on_error": true},
        "channel": "shell",
    });
    socket
        .send(WsMessage::Text(request.to_string().into()))
        .await
        .expect("send");
    let mut stdout = String::new();
    while let Some(frame) = socket.next().await {
        let WsMessage::Text(text) = frame.expect("frame") else {
            continue;
        };
        let m: Value = serde_json::from_str(&text).expect("json");
        if m["parent_header"]["msg_id"] != msg_id.as_str() {
            continue;
        }
        match m["msg_type"].as_str() {
            Some("stream") if m["content"]["name"] == "stdout" => {
                stdout.push_str(m["content"]["text"].as_str().unwrap_or(""))
            }
            Some("error") => panic!("cell failed: {m}"),
            Some("status") if m["content"]["execution_state"] == "idle" => break,
            _ => {}
        }
    }
    stdout
}

async fn delete(bench: &Bench, id: &str) {
    let resp = bench
        .client
        .delete(bench.url(&format!("/jupyter/api/kernels/{id}")))
        .send()
        .await
        .expect("delete");
    assert_eq!(resp.status(), 204);
}

/// Open WebUI's whole call: create, one cell, close, delete; its stdout.
async fn round_trip(bench: &Bench, code: &str) -> String {
    let id = create(bench).await;
    let mut socket = open(bench, &id).await;
    let out = cell(&mut socket, code).await;
    let _ = socket.close(None).await;
    delete(bench, &id).await;
    out
}

/// `n` round trips of `code`, one every [`PACE`], alternating with a new-session `/exec`
/// of the same code, so both see the same host and pool.
async fn paced(
    bench: &Bench,
    n: usize,
    code: &str,
    expect: &str,
) -> (Vec<Duration>, Vec<Duration>) {
    let (mut jupyter, mut exec) = (Vec::new(), Vec::new());
    let mut next = Instant::now();
    for _ in 0..n {
        tokio::time::sleep_until(next.into()).await;
        next += PACE;
        let (took, out) = timed(round_trip(bench, code)).await;
        assert_eq!(out, expect);
        jupyter.push(took);
        tokio::time::sleep_until(next.into()).await;
        next += PACE;
        let (took, r) = timed(bench.exec(json!({"lang": "py", "code": code}))).await;
        assert_eq!(r["stdout"], expect, "{r}");
        exec.push(took);
    }
    (jupyter, exec)
}

pub(crate) async fn rows(scale: Scale, data: &std::path::Path, rows: &mut Vec<Row>) {
    let bench = Bench::start("jupyter", data, |c| c.pool.pool_size = 2).await;
    bench.wait_pool(2).await;
    // The pool's kernels get the time a pool has between chat turns.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (print, print_exec) = paced(&bench, scale.pick(30, 4), "print(1)", "1\n").await;
    let (pandas, pandas_exec) = paced(&bench, scale.pick(20, 3), PANDAS_PLOT, "285\n").await;

    let id = create(&bench).await;
    let mut socket = open(&bench, &id).await;
    let session = bench.exec(json!({"lang": "py", "code": "print(1)"})).await["session_id"]
        .as_str()
        .expect("session")
        .to_string();
    for _ in 0..20 {
        cell(&mut socket, "print(1)").await;
        bench
            .exec(json!({"lang": "py", "code": "print(1)", "session_id": session}))
            .await;
    }
    let (mut warm, mut warm_exec) = (Vec::new(), Vec::new());
    for _ in 0..scale.pick(300, 30) {
        let (took, out) = timed(cell(&mut socket, "print(1)")).await;
        assert_eq!(out, "1\n");
        warm.push(took);
        let (took, r) =
            timed(bench.exec(json!({"lang": "py", "code": "print(1)", "session_id": session})))
                .await;
        assert_eq!(r["stdout"], "1\n");
        warm_exec.push(took);
    }
    let _ = socket.close(None).await;
    delete(&bench, &id).await;
    bench.stop().await;

    let beside = |samples: &[Duration]| format!("/exec in the same run: p50 {:.1}", p50(samples));
    rows.push(
        Row::timed(
            "Open WebUI call print(1): create kernel, cell, delete (1/s)",
            print,
            "p50<=150",
            &format!("new-session {}", beside(&print_exec)),
        )
        .on_idle_cpu(),
    );
    rows.push(
        Row::timed(
            "Open WebUI call pandas + plot, fresh kernel (1/s)",
            pandas,
            "",
            &format!("new-session {}", beside(&pandas_exec)),
        )
        .on_idle_cpu(),
    );
    rows.push(Row::timed(
        "Jupyter warm cell print(1) over the WebSocket",
        warm,
        "p50<=5",
        &beside(&warm_exec),
    ));
}
