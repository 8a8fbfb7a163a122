//! `pods/attach` over WebSocket, as the API server and kubelet serve it: the
//! `v5.channel.k8s.io` or `v4.channel.k8s.io` subprotocol, every binary message one
//! channel byte and its data (0 stdin, 1 stdout, 2 stderr, 3 a `Status` when the
//! container ends; in v5, 255 closes a channel), mapped onto Docker's attach of the pod's
//! container.

use crate::cluster::{ApiError, Cluster};
use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use bollard::container::{AttachContainerResults, LogOutput};
use bollard::query_parameters::{AttachContainerOptions, InspectContainerOptions};
use futures::{SinkExt, StreamExt};
use hyper_util::rt::TokioIo;
use serde_json::json;
use std::sync::Arc;
use tokio::io::AsyncWriteExt;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

/// The subprotocols served, preferred first.
const PROTOCOLS: [&str; 2] = ["v5.channel.k8s.io", "v4.channel.k8s.io"];

/// The channel byte of a v5 close (its data: the channel closed).
const CLOSE_CHANNEL: u8 = 255;

/// Which of the container's streams an attach asked for.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Streams {
    pub(crate) stdin: bool,
    pub(crate) stdout: bool,
    pub(crate) stderr: bool,
}

/// Attaches to Docker's container `id`, then answers the WebSocket upgrade and carries
/// the streams until either side ends.
pub(crate) async fn upgrade(
    cluster: Arc<Cluster>,
    id: String,
    streams: Streams,
    mut request: Request,
) -> Result<Response, ApiError> {
    let headers = request.headers();
    let key = headers
        .get(header::SEC_WEBSOCKET_KEY)
        .ok_or_else(|| ApiError::bad_request("the attach is not a WebSocket upgrade"))?;
    let accept = derive_accept_key(key.as_bytes());
    let offered = headers
        .get(header::SEC_WEBSOCKET_PROTOCOL)
        .and_then(|p| p.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let offered: Vec<&str> = offered.split(',').map(str::trim).collect();
    let Some(protocol) = PROTOCOLS.into_iter().find(|p| offered.contains(p)) else {
        return Err(ApiError::bad_request(format!(
            "the stand-in speaks {PROTOCOLS:?}; offered: {offered:?}"
        )));
    };
    let on_upgrade = request
        .extensions_mut()
        .remove::<hyper::upgrade::OnUpgrade>()
        .ok_or_else(|| ApiError::bad_request("the connection cannot be upgraded"))?;
    let options = AttachContainerOptions {
        stdin: streams.stdin,
        stdout: streams.stdout,
        stderr: streams.stderr,
        stream: true,
        logs: false,
        detach_keys: None,
    };
    let attached = cluster
        .docker()
        .attach_container(&id, Some(options))
        .await
        .map_err(|e| ApiError {
            code: 500,
            reason: "InternalError",
            message: format!("error attaching to container: {e}"),
            name: None,
        })?;
    let v5 = protocol.starts_with("v5");
    tokio::spawn(async move {
        let Ok(upgraded) = on_upgrade.await else {
            return;
        };
        let ws = WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Server, None).await;
        carry(&cluster, &id, ws, attached, v5).await;
    });
    let mut response = Response::new(axum::body::Body::empty());
    *response.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = response.headers_mut();
    h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    h.insert(
        header::SEC_WEBSOCKET_ACCEPT,
        HeaderValue::from_str(&accept).map_err(|_| ApiError::bad_request("bad key"))?,
    );
    h.insert(
        header::SEC_WEBSOCKET_PROTOCOL,
        HeaderValue::from_static(protocol),
    );
    Ok(response)
}

/// Carries stdin from the WebSocket to the container and its output back, until the
/// client goes (the container's stdin stays open, as `stdinOnce: false` says) or the
/// container's output ends (then the error channel says how it ended).
async fn carry<S>(
    cluster: &Cluster,
    id: &str,
    ws: WebSocketStream<S>,
    attached: AttachContainerResults,
    v5: bool,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let (mut to_client, mut from_client) = ws.split();
    let AttachContainerResults {
        mut output,
        mut input,
    } = attached;
    loop {
        tokio::select! {
            message = from_client.next() => match message {
                Some(Ok(Message::Binary(data))) if data.first() == Some(&0) => {
                    if input.write_all(&data[1..]).await.is_err() || input.flush().await.is_err() {
                        break;
                    }
                }
                Some(Ok(Message::Binary(data))) if v5 && data[..] == [CLOSE_CHANNEL, 0] => {
                    let _ = input.shutdown().await;
                }
                Some(Ok(Message::Close(_))) | Some(Err(_)) | None => return,
                Some(Ok(_)) => {}
            },
            chunk = output.next() => {
                let (channel, message) = match chunk {
                    Some(Ok(LogOutput::StdOut { message } | LogOutput::Console { message })) => (1u8, message),
                    Some(Ok(LogOutput::StdErr { message })) => (2u8, message),
                    Some(Ok(LogOutput::StdIn { .. })) => continue,
                    Some(Err(_)) | None => break,
                };
                let mut frame = Vec::with_capacity(message.len() + 1);
                frame.push(channel);
                frame.extend_from_slice(&message);
                if to_client.send(Message::Binary(frame.into())).await.is_err() {
                    return;
                }
            }
        }
    }
    // The container's output ended: say how the container did, as the kubelet does.
    let exit = cluster
        .docker()
        .inspect_container(id, None::<InspectContainerOptions>)
        .await
        .ok()
        .and_then(|c| c.state)
        .and_then(|s| s.exit_code)
        .unwrap_or(0);
    let status = if exit == 0 {
        json!({"metadata": {}, "status": "Success"})
    } else {
        json!({"metadata": {}, "status": "Failure",
               "message": format!("command terminated with non-zero exit code: exit status {exit}"),
               "reason": "NonZeroExitCode",
               "details": {"causes": [{"reason": "ExitCode", "message": exit.to_string()}]}})
    };
    let mut frame = vec![3u8];
    frame.extend(serde_json::to_vec(&status).unwrap_or_default());
    let _ = to_client.send(Message::Binary(frame.into())).await;
    let _ = to_client.send(Message::Close(None)).await;
}
