//! One authenticated connection to the parent: read by one thread, written by many
//! under a lock.
//!
//! Every frame is checked against the parent's limit before it is written
//! (`Init.max_frame_bytes`, memory files included): a frame the parent would refuse
//! is an error here, for the sender, and never reaches the wire. A task result over
//! the limit becomes an error result ([`Link::send_task_result`]), so the task fails
//! with a clear reason and the rank lives on.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use rankexec_protocol::ErrorClass;
use rankexec_protocol::wire::message::{RankError, TaskOutput};
use rankexec_protocol::wire::{Conn, FrameError, FrameLimits, Message, OutFrame, envelope};

/// A packed task output: its description, inline body and memory files.
pub(crate) type PackedOutput = (TaskOutput, Vec<Bytes>, Vec<Arc<std::os::fd::OwnedFd>>);

/// A connection plus the lock that keeps frames from interleaving.
pub(crate) struct Link {
    pub(crate) conn: Conn,
    write: Mutex<()>,
    /// The parent's frame limit (from `Init`); `u64::MAX` until then.
    max_frame: AtomicU64,
}

/// A frame could not be sent.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SendError {
    #[error("cannot encode {0}")]
    Encode(
        &'static str,
        #[source] rankexec_protocol::wire::codec::CodecError,
    ),
    #[error("{0} is larger than the parent accepts")]
    TooLarge(&'static str, #[source] FrameError),
    #[error("cannot send {0}")]
    Frame(&'static str, #[source] FrameError),
}

impl Link {
    pub(crate) fn new(conn: Conn) -> Self {
        Link {
            conn,
            write: Mutex::new(()),
            max_frame: AtomicU64::new(u64::MAX),
        }
    }

    /// Records the parent's frame limit (`Init.max_frame_bytes`).
    pub(crate) fn set_max_frame(&self, bytes: u64) {
        self.max_frame.store(bytes, Ordering::Relaxed);
    }

    /// Writes an encoded frame, if the parent would accept it.
    pub(crate) fn send_frame(&self, kind: &'static str, frame: &OutFrame) -> Result<(), SendError> {
        FrameLimits::for_max_frame(self.max_frame.load(Ordering::Relaxed))
            .check(frame)
            .map_err(|e| SendError::TooLarge(kind, e))?;
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

    /// Sends a task's result. One that cannot be encoded or is over the parent's limit
    /// is replaced by an error result (class protocol) saying why: the parent gets a
    /// clear failure for the task instead of a frame it would refuse, and the rank is
    /// not torn down for it.
    pub(crate) fn send_task_result(
        &self,
        task_id: u64,
        outcome: Result<PackedOutput, RankError>,
    ) -> Result<(), SendError> {
        let (outcome, body, fds) = match outcome {
            Ok((out, body, fds)) => (Ok(out), body, fds),
            Err(e) => (Err(e), Vec::new(), Vec::new()),
        };
        let msg = Message::TaskResult { task_id, outcome };
        let sent = envelope::frame(&msg, body, fds)
            .map_err(|e| SendError::Encode("TaskResult", e))
            .and_then(|f| self.send_frame("TaskResult", &f));
        match sent {
            Err(e @ (SendError::Encode(..) | SendError::TooLarge(..))) => {
                let message = rankexec_protocol::error_chain(&e);
                tracing::warn!("task result refused before sending: {message}");
                self.send(&Message::TaskResult {
                    task_id,
                    outcome: Err(RankError {
                        class: ErrorClass::Protocol,
                        message,
                    }),
                })
            }
            other => other,
        }
    }
}
