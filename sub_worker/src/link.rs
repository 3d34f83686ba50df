//! One authenticated connection to the parent: read by one thread, written by many
//! under a lock.

use std::sync::{Mutex, PoisonError};

use rankexec_protocol::wire::{Conn, FrameError, Message, OutFrame, envelope};

/// A connection plus the lock that keeps frames from interleaving.
pub(crate) struct Link {
    pub(crate) conn: Conn,
    write: Mutex<()>,
}

/// A frame could not be sent.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SendError {
    #[error("cannot encode {0}")]
    Encode(
        &'static str,
        #[source] rankexec_protocol::wire::codec::CodecError,
    ),
    #[error("cannot send {0}")]
    Frame(&'static str, #[source] FrameError),
}

impl Link {
    pub(crate) fn new(conn: Conn) -> Self {
        Link {
            conn,
            write: Mutex::new(()),
        }
    }

    /// Writes an encoded frame.
    pub(crate) fn send_frame(&self, kind: &'static str, frame: &OutFrame) -> Result<(), SendError> {
        let _guard = self.write.lock().unwrap_or_else(PoisonError::into_inner);
        frame
            .write_to(&self.conn)
            .map_err(|e| SendError::Frame(kind, e))
    }

    /// Encodes and writes a message without blobs.
    pub(crate) fn send(&self, msg: &Message) -> Result<(), SendError> {
        let frame = envelope::plain(msg).map_err(|e| SendError::Encode(msg.kind(), e))?;
        self.send_frame(msg.kind(), &frame)
    }
}
