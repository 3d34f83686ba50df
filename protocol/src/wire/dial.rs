//! A rank's way in: connect and authenticate, retrying what a busy parent causes.
//!
//! A parent starting a large group (or one being flooded with connections) may close
//! a connection before it has authenticated, or not accept it in time, and a full
//! listen backlog refuses or stalls `connect`. Those are transient: [`dial`] retries
//! them with a doubling, jittered back-off until its deadline (a last attempt is made
//! at the deadline). What retrying cannot fix is returned at once: a wrong secret,
//! another protocol version, a refusal with a reason (another launch, a duplicate rank,
//! start-up over), or a local socket nobody listens on any more (the parent has ended
//! start-up or died: a rank whose host is SIGKILLed while it starts leaves at once
//! instead of dialing a dead socket until its deadline).

use std::time::{Duration, Instant};

use super::conn::{Conn, Endpoint};
use super::frame::FrameError;
use super::handshake::{HandshakeError, Secret, client_handshake};
use super::message::Identity;

/// The first pause between attempts; it doubles up to [`MAX_BACKOFF`].
pub const FIRST_BACKOFF: Duration = Duration::from_millis(5);
/// The longest pause between attempts.
pub const MAX_BACKOFF: Duration = Duration::from_millis(500);

/// Why a rank could not get in.
#[derive(Debug, thiserror::Error)]
pub enum DialError {
    /// The endpoint could not be reached before the deadline.
    #[error("cannot connect (after {attempts} attempts)")]
    Connect {
        /// Attempts made.
        attempts: u32,
        /// The last failure.
        #[source]
        source: std::io::Error,
    },
    /// The handshake failed for good, or kept failing until the deadline.
    #[error("handshake failed (after {attempts} attempts)")]
    Handshake {
        /// Attempts made.
        attempts: u32,
        /// The last failure.
        #[source]
        source: HandshakeError,
    },
}

/// Whether a handshake failure is worth another attempt: the parent dropped or stalled
/// the connection (busy), rather than refusing us for a reason.
pub fn retryable(e: &HandshakeError) -> bool {
    matches!(
        e,
        HandshakeError::Frame(
            FrameError::Closed
                | FrameError::Truncated { .. }
                | FrameError::Io(_)
                | FrameError::TimedOut
        ) | HandshakeError::TimedOut(_)
    )
}

/// Whether a failed `connect` says nobody listens on a local socket any more: its file
/// is gone, or no process holds it open (`ECONNREFUSED`; a busy listener makes a local
/// `connect` wait, or fail with `EAGAIN`, never this). The parent binds before it
/// starts any rank and never binds again, so retrying cannot help. Over TCP a refusal
/// may come from anything on the path and is retried.
fn listener_gone(endpoint: &Endpoint, e: &std::io::Error) -> bool {
    matches!(endpoint, Endpoint::Local(_))
        && matches!(
            e.kind(),
            std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
        )
}

fn jitter(d: Duration) -> Duration {
    // Up to +50 %, so ranks turned away together do not come back together.
    let r = getrandom::u32().unwrap_or(0) % 512;
    d + d * r / 1024
}

/// Connects to `endpoint` and authenticates as `who`, retrying transient failures
/// with back-off until `timeout` has passed.
pub fn dial(
    endpoint: &Endpoint,
    secret: &Secret,
    who: &Identity,
    timeout: Duration,
) -> Result<Conn, DialError> {
    let deadline = Instant::now() + timeout;
    let mut pause = FIRST_BACKOFF;
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let left = deadline.saturating_duration_since(Instant::now());
        let failure = match endpoint.connect(left.max(Duration::from_millis(1))) {
            Err(e) if listener_gone(endpoint, &e) => {
                return Err(DialError::Connect {
                    attempts,
                    source: e,
                });
            }
            Ok(conn) => match client_handshake(&conn, secret, who, left) {
                Ok(()) => return Ok(conn),
                Err(e) if retryable(&e) => DialError::Handshake {
                    attempts,
                    source: e,
                },
                Err(e) => {
                    return Err(DialError::Handshake {
                        attempts,
                        source: e,
                    });
                }
            },
            Err(e) => DialError::Connect {
                attempts,
                source: e,
            },
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(failure);
        }
        // The last pause ends at the deadline, for one more attempt there.
        let wait = jitter(pause).min(left);
        tracing::debug!(
            attempts,
            "parent busy: {}; retrying in {wait:?}",
            crate::error_chain(&failure)
        );
        std::thread::sleep(wait);
        pause = (pause * 2).min(MAX_BACKOFF);
    }
}
