//! Egress connections carried over the runner channel, for backends that cannot mount the
//! broker's proxy socket into the sandbox (Kubernetes): the runner's forwarder accepts a
//! connection on 127.0.0.1:3128 and, instead of connecting to a Unix socket, opens a
//! tunnel over the attached stdio; the broker serves the other end with the same proxy.
//!
//! The broker starts it once per sandbox with [`CoordinatorMessage::EgressListen`] under a
//! job of its own; every [`TunnelFrame`] of every connection, both ways, travels under that
//! job. Each direction of each connection is flow-controlled by credit: a side sends at
//! most [`TUNNEL_WINDOW`] bytes the other has not acknowledged ([`TunnelFrame::Ack`], sent
//! once the bytes were written on), so neither side buffers more than a window per
//! connection and a reader that stops never stalls the channel, which also carries the
//! exec's output.
//!
//! [`CoordinatorMessage::EgressListen`]: crate::CoordinatorMessage::EgressListen

use serde::{Deserialize, Serialize};

/// One connection's number, chosen by the runner, unique within its tunnel.
pub type ConnId = u64;

/// Bytes one side of one connection may send that the other has not acknowledged.
pub const TUNNEL_WINDOW: usize = 1024 * 1024;

/// Most bytes in one [`TunnelFrame::Data`].
pub const TUNNEL_CHUNK: usize = 128 * 1024;

/// Carry the sandbox's egress connections under this request's job.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EgressListenRequest {}

impl From<EgressListenRequest> for crate::CoordinatorMessage {
    fn from(r: EgressListenRequest) -> Self {
        crate::CoordinatorMessage::EgressListen(r)
    }
}

/// One step of one tunnelled connection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum TunnelFrame {
    /// A new connection (runner to broker only): what follows is its client's bytes.
    Open {
        /// Its number.
        conn: ConnId,
    },
    /// Bytes of the connection, in order.
    Data {
        /// The connection.
        conn: ConnId,
        /// At most [`TUNNEL_CHUNK`] bytes.
        #[serde(with = "crate::files::base64")]
        data: Vec<u8>,
    },
    /// The sender's side reached end of file (a half close): no more `Data` from it.
    End {
        /// The connection.
        conn: ConnId,
    },
    /// The receiver wrote this many more of the sender's bytes on: the sender may send as
    /// many more.
    Ack {
        /// The connection.
        conn: ConnId,
        /// How many bytes.
        bytes: u64,
    },
    /// The connection is over, in both directions, at once (an error, a refusal, a side
    /// gone); bytes on the way are dropped.
    Reset {
        /// The connection.
        conn: ConnId,
    },
}

impl TunnelFrame {
    /// The connection the frame is about.
    pub fn conn(&self) -> ConnId {
        match self {
            TunnelFrame::Open { conn }
            | TunnelFrame::Data { conn, .. }
            | TunnelFrame::End { conn }
            | TunnelFrame::Ack { conn, .. }
            | TunnelFrame::Reset { conn } => *conn,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CoordinatorMessage, Multiplexed, WorkerMessage};

    #[test]
    fn tunnel_frames_ride_in_both_directions_as_flat_json() {
        let up = Multiplexed(
            9,
            WorkerMessage::Egress(TunnelFrame::Data {
                conn: 3,
                data: b"GET".to_vec(),
            }),
        );
        let line = serde_json::to_string(&up).expect("encode");
        assert_eq!(
            line,
            r#"[9,{"type":"egress","op":"data","conn":3,"data":"R0VU"}]"#
        );
        let back: Multiplexed<WorkerMessage> = serde_json::from_str(&line).expect("decode");
        assert_eq!(back, up);

        let down = Multiplexed(
            9,
            CoordinatorMessage::Egress(TunnelFrame::Ack { conn: 3, bytes: 3 }),
        );
        let line = serde_json::to_string(&down).expect("encode");
        let back: Multiplexed<CoordinatorMessage> = serde_json::from_str(&line).expect("decode");
        assert_eq!(back, down);
        let listen: Multiplexed<CoordinatorMessage> =
            serde_json::from_str(r#"[9,{"type":"egress_listen"}]"#).expect("decode");
        assert_eq!(
            listen,
            Multiplexed(9, CoordinatorMessage::EgressListen(EgressListenRequest {}))
        );
    }
}
