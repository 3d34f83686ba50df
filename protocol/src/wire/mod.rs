//! The wire protocol between an executor and its ranks.
//!
//! - [`message`]: what crosses the wire, per channel and direction.
//! - [`codec`]: header encoding (bincode 2.0.1, behind this one module).
//! - [`frame`]: length-prefixed frames with raw blob bodies and passed descriptors.
//! - [`envelope`]: shareables in and out of frames (inline or sealed memory files).
//! - [`handshake`]: mutual HMAC authentication of every connection.
//! - [`secure`]: the TCP record layer (encryption and authentication after the handshake).
//! - [`conn`]: local and TCP connections, endpoints and listeners.
//! - [`dial`](mod@dial): a rank connecting and authenticating, with back-off while the parent is busy.

pub mod codec;
pub mod conn;
pub mod dial;
pub mod envelope;
pub mod frame;
pub mod handshake;
pub mod message;
pub mod secure;

pub use conn::{Conn, Endpoint, EndpointParseError, Listener, TcpConn, effective_uid};
pub use dial::{DialError, dial};
pub use envelope::{BlobPolicy, PackError, UnpackError};
pub use frame::{FrameError, FrameLimits, InFrame, OutFrame};
pub use handshake::{
    Challenged, HandshakeError, Secret, client_handshake, server_challenge, server_finish,
    server_handshake,
};
pub use message::{Channel, Identity, Message, PROTOCOL_VERSION};
