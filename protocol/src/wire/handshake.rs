//! Authentication of every connection: a mutual HMAC-SHA256 challenge-response over a
//! random per-launch secret.
//!
//! 1. parent → rank: `Challenge { version, nonce_p }`
//! 2. rank → parent: `Hello { version, who: Identity { channel, rank, ... }, nonce_r, mac }` where
//!    `mac = HMAC(secret, "rankexec/v1/hello" ‖ nonce_p ‖ nonce_r ‖ every Hello field)`
//! 3. parent → rank: `Welcome { HMAC(secret, "rankexec/v1/welcome" ‖ nonce_r ‖ nonce_p ‖ …) }`
//!    or `Refused { reason }`
//!
//! The secret itself never crosses the wire, and a recorded exchange cannot be replayed
//! (both nonces are fresh). The parent proves it holds the secret too, which matters for
//! TCP ranks that connect to an address they were told. The secret is generated for
//! each launch (never a constant, unlike FLARE's `CHILD_PASSWORD`), reaches ranks through
//! their environment (never argv), and its `Debug` output is redacted.
//!
//! Every step runs under one deadline, and handshake frames are limited to 4 KiB with
//! no body and no descriptors ([`FrameLimits::HANDSHAKE`]).

use std::fmt;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac as _};
use sha2::Sha256;

use super::codec::{self, CodecError};
use super::conn::Conn;
use super::frame::{FrameError, FrameLimits, OutFrame, read_frame};
use super::message::{Handshake, Hello, Identity, Mac, Nonce, PROTOCOL_VERSION};
use super::secure::Keys;

type HmacSha256 = Hmac<Sha256>;

/// The per-launch secret shared by a parent and its ranks.
///
/// ```
/// use rankexec_protocol::wire::Secret;
/// let s = Secret::generate().unwrap();
/// assert_eq!(format!("{s:?}"), "Secret(<redacted>)");
/// let again = Secret::from_hex(&s.to_hex()).unwrap();
/// assert!(again == s);
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct Secret([u8; 32]);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl Drop for Secret {
    fn drop(&mut self) {
        self.0.fill(0);
        std::hint::black_box(&self.0);
    }
}

/// A secret that does not parse.
#[derive(Debug, Clone, thiserror::Error)]
#[error("secret must be 64 hexadecimal characters")]
pub struct SecretParseError;

/// The system's random source failed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("random source failed: {0}")]
pub struct RandomError(String);

fn random_bytes() -> Result<[u8; 32], RandomError> {
    let mut b = [0u8; 32];
    getrandom::fill(&mut b).map_err(|e| RandomError(e.to_string()))?;
    Ok(b)
}

impl Secret {
    /// A fresh random secret.
    pub fn generate() -> Result<Secret, RandomError> {
        random_bytes().map(Secret)
    }

    /// Parses the hex form used in a rank's environment.
    pub fn from_hex(s: &str) -> Result<Secret, SecretParseError> {
        let s = s.trim();
        if s.len() != 64 {
            return Err(SecretParseError);
        }
        let mut out = [0u8; 32];
        for (i, chunk) in s.as_bytes().chunks(2).enumerate() {
            let hex = std::str::from_utf8(chunk).map_err(|_| SecretParseError)?;
            out[i] = u8::from_str_radix(hex, 16).map_err(|_| SecretParseError)?;
        }
        Ok(Secret(out))
    }

    /// The hex form, for a rank's environment only. Never log it.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn mac(&self, label: &[u8], parts: &[&[u8]]) -> HmacSha256 {
        // A 32-byte key is always a valid HMAC key.
        let mut m = match HmacSha256::new_from_slice(&self.0) {
            Ok(m) => m,
            Err(_) => unreachable!("HMAC accepts keys of any length"),
        };
        m.update(label);
        for p in parts {
            m.update(&(p.len() as u64).to_le_bytes());
            m.update(p);
        }
        m
    }
}

/// Why a handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// A frame could not be read or written.
    #[error("handshake transport")]
    Frame(#[from] FrameError),
    /// A frame did not decode.
    #[error("handshake message")]
    Codec(#[from] CodecError),
    /// The peer speaks another protocol version.
    #[error("protocol version {theirs} does not match {ours}")]
    VersionMismatch {
        /// Our version.
        ours: u32,
        /// Theirs.
        theirs: u32,
    },
    /// The peer's MAC does not verify: it does not hold the secret.
    #[error("authentication failed: the peer does not hold this launch's secret")]
    BadMac,
    /// The parent refused the connection.
    #[error("refused by the parent: {reason}")]
    Refused {
        /// The parent's reason.
        reason: String,
    },
    /// A different message arrived.
    #[error("expected {expected}, got {got}")]
    Unexpected {
        /// What was expected.
        expected: &'static str,
        /// What arrived.
        got: String,
    },
    /// The deadline passed.
    #[error("handshake did not complete within {0:?}")]
    TimedOut(Duration),
}

fn send(conn: &Conn, msg: &Handshake) -> Result<(), HandshakeError> {
    let bytes = codec::encode(msg)?;
    OutFrame::header_only(&bytes).write_to(conn)?;
    Ok(())
}

fn recv(conn: &Conn, deadline: Instant, total: Duration) -> Result<Handshake, HandshakeError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(HandshakeError::TimedOut(total));
    }
    conn.set_read_timeout(Some(left))
        .map_err(FrameError::from)?;
    let frame = match read_frame(conn, &FrameLimits::HANDSHAKE) {
        Err(FrameError::TimedOut) => return Err(HandshakeError::TimedOut(total)),
        other => other?,
    };
    Ok(codec::decode(&frame.header)?)
}

fn kind(m: &Handshake) -> String {
    match m {
        Handshake::Challenge { .. } => "Challenge".into(),
        Handshake::Hello(_) => "Hello".into(),
        Handshake::Welcome { .. } => "Welcome".into(),
        Handshake::Refused { .. } => "Refused".into(),
    }
}

fn hello_fields(h: &Hello) -> Vec<Vec<u8>> {
    let w = &h.who;
    vec![
        h.version.to_le_bytes().to_vec(),
        [w.channel.index() as u8].to_vec(),
        w.rank.to_le_bytes().to_vec(),
        w.world_size.to_le_bytes().to_vec(),
        w.launch_id.as_bytes().to_vec(),
        w.pid.to_le_bytes().to_vec(),
        w.pgid.to_le_bytes().to_vec(),
        w.host.as_bytes().to_vec(),
    ]
}

fn hello_mac(secret: &Secret, challenge: &Nonce, h: &Hello) -> HmacSha256 {
    let fields = hello_fields(h);
    let mut parts: Vec<&[u8]> = vec![challenge, &h.nonce];
    parts.extend(fields.iter().map(Vec::as_slice));
    secret.mac(b"rankexec/v1/hello", &parts)
}

fn welcome_mac(secret: &Secret, challenge: &Nonce, h: &Hello) -> HmacSha256 {
    secret.mac(
        b"rankexec/v1/welcome",
        &[
            &h.nonce,
            challenge,
            &[h.who.channel.index() as u8],
            &h.who.rank.to_le_bytes(),
            h.who.launch_id.as_bytes(),
        ],
    )
}

/// The record-layer keys of a TCP connection, from the secret and both nonces: one
/// key per direction, fresh for every connection.
fn record_keys(secret: &Secret, challenge: &Nonce, h: &Hello, server: bool) -> Keys {
    let key = |label: &[u8]| -> [u8; 32] {
        secret
            .mac(label, &[challenge, &h.nonce])
            .finalize()
            .into_bytes()
            .into()
    };
    let to_server = key(b"rankexec/v1/tcp-record/rank-to-parent");
    let to_rank = key(b"rankexec/v1/tcp-record/parent-to-rank");
    if server {
        Keys {
            send: to_rank,
            recv: to_server,
        }
    } else {
        Keys {
            send: to_server,
            recv: to_rank,
        }
    }
}

/// The parent's side. `admit` decides, after authentication, whether this rank and
/// channel are welcome (range, duplicates, start-up state); its error text is sent to
/// the peer and returned as [`HandshakeError::Refused`]. It is [`server_challenge`]
/// then [`server_finish`], under one deadline.
pub fn server_handshake(
    conn: &Conn,
    secret: &Secret,
    timeout: Duration,
    admit: impl FnOnce(&Identity) -> Result<(), String>,
) -> Result<Hello, HandshakeError> {
    let deadline = Instant::now() + timeout;
    let challenged = server_challenge(conn, timeout)?;
    let left = deadline.saturating_duration_since(Instant::now());
    server_finish(conn, secret, challenged, left, admit)
}

/// A connection the parent has challenged: what [`server_finish`] needs once the peer
/// answers.
#[derive(Debug)]
pub struct Challenged {
    nonce: Nonce,
}

/// The parent's first step: sends the `Challenge`. It is a few dozen bytes, which a
/// fresh connection's send buffer always takes, so this never waits for the peer: a
/// parent can challenge every connection at once and wait for all their answers
/// together (`poll`), holding no thread for a peer that never answers.
pub fn server_challenge(conn: &Conn, timeout: Duration) -> Result<Challenged, HandshakeError> {
    conn.set_write_timeout(Some(timeout))
        .map_err(FrameError::from)?;
    let nonce = random_bytes().map_err(|e| HandshakeError::Refused {
        reason: e.to_string(),
    })?;
    send(
        conn,
        &Handshake::Challenge {
            version: PROTOCOL_VERSION,
            nonce,
        },
    )?;
    Ok(Challenged { nonce })
}

/// The parent's second step: reads the peer's `Hello` (waiting at most `timeout`),
/// authenticates it, asks `admit`, and answers `Welcome` or `Refused`.
pub fn server_finish(
    conn: &Conn,
    secret: &Secret,
    challenged: Challenged,
    timeout: Duration,
    admit: impl FnOnce(&Identity) -> Result<(), String>,
) -> Result<Hello, HandshakeError> {
    let deadline = Instant::now() + timeout;
    conn.set_write_timeout(Some(timeout.max(Duration::from_millis(1))))
        .map_err(FrameError::from)?;
    let challenge = challenged.nonce;
    let hello = match recv(conn, deadline, timeout)? {
        Handshake::Hello(h) => h,
        other => {
            return Err(HandshakeError::Unexpected {
                expected: "Hello",
                got: kind(&other),
            });
        }
    };
    let refuse = |reason: String| {
        let _ = send(
            conn,
            &Handshake::Refused {
                reason: reason.clone(),
            },
        );
        reason
    };
    if hello.version != PROTOCOL_VERSION {
        refuse(format!(
            "protocol version {} does not match {PROTOCOL_VERSION}",
            hello.version
        ));
        return Err(HandshakeError::VersionMismatch {
            ours: PROTOCOL_VERSION,
            theirs: hello.version,
        });
    }
    if hello_mac(secret, &challenge, &hello)
        .verify_slice(&hello.mac)
        .is_err()
    {
        refuse("authentication failed".to_owned());
        return Err(HandshakeError::BadMac);
    }
    if let Err(reason) = admit(&hello.who) {
        return Err(HandshakeError::Refused {
            reason: refuse(reason),
        });
    }
    let mac: Mac = welcome_mac(secret, &challenge, &hello)
        .finalize()
        .into_bytes()
        .into();
    send(conn, &Handshake::Welcome { mac })?;
    conn.set_read_timeout(None).map_err(FrameError::from)?;
    conn.set_write_timeout(None).map_err(FrameError::from)?;
    // Everything after the Welcome is in authenticated, encrypted records (TCP).
    conn.secure(&record_keys(secret, &challenge, &hello, true));
    Ok(hello)
}

/// The rank's side.
pub fn client_handshake(
    conn: &Conn,
    secret: &Secret,
    who: &Identity,
    timeout: Duration,
) -> Result<(), HandshakeError> {
    let deadline = Instant::now() + timeout;
    conn.set_write_timeout(Some(timeout))
        .map_err(FrameError::from)?;
    let (version, challenge) = match recv(conn, deadline, timeout)? {
        Handshake::Challenge { version, nonce } => (version, nonce),
        other => {
            return Err(HandshakeError::Unexpected {
                expected: "Challenge",
                got: kind(&other),
            });
        }
    };
    let mut hello = Hello {
        version: PROTOCOL_VERSION,
        who: who.clone(),
        nonce: random_bytes().map_err(|e| HandshakeError::Refused {
            reason: e.to_string(),
        })?,
        mac: [0; 32],
    };
    hello.mac = hello_mac(secret, &challenge, &hello)
        .finalize()
        .into_bytes()
        .into();
    send(conn, &Handshake::Hello(hello.clone()))?;
    match recv(conn, deadline, timeout)? {
        Handshake::Welcome { mac } => {
            if welcome_mac(secret, &challenge, &hello)
                .verify_slice(&mac)
                .is_err()
            {
                return Err(HandshakeError::BadMac);
            }
        }
        Handshake::Refused { reason } => {
            if version != PROTOCOL_VERSION {
                return Err(HandshakeError::VersionMismatch {
                    ours: PROTOCOL_VERSION,
                    theirs: version,
                });
            }
            return Err(HandshakeError::Refused { reason });
        }
        other => {
            return Err(HandshakeError::Unexpected {
                expected: "Welcome",
                got: kind(&other),
            });
        }
    }
    conn.set_read_timeout(None).map_err(FrameError::from)?;
    conn.set_write_timeout(None).map_err(FrameError::from)?;
    conn.secure(&record_keys(secret, &challenge, &hello, false));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::message::Channel;

    fn who() -> Identity {
        Identity {
            channel: Channel::Exec,
            rank: 1,
            world_size: 2,
            launch_id: "L".into(),
            pid: 42,
            pgid: 42,
            host: "h".into(),
        }
    }

    fn run(
        server_secret: Secret,
        client_secret: Secret,
        admit: fn(&Identity) -> Result<(), String>,
    ) -> (Result<Hello, HandshakeError>, Result<(), HandshakeError>) {
        let (a, b) = Conn::pair().unwrap();
        let t = std::thread::spawn(move || {
            client_handshake(&b, &client_secret, &who(), Duration::from_secs(5))
        });
        let s = server_handshake(&a, &server_secret, Duration::from_secs(5), admit);
        (s, t.join().unwrap())
    }

    #[test]
    fn matching_secrets_authenticate_both_ways() {
        let secret = Secret::generate().unwrap();
        let (s, c) = run(secret.clone(), secret, |_| Ok(()));
        let hello = s.unwrap();
        assert_eq!((hello.who.rank, hello.who.channel), (1, Channel::Exec));
        c.unwrap();
    }

    #[test]
    fn wrong_secret_is_refused_on_both_sides() {
        let (s, c) = run(
            Secret::generate().unwrap(),
            Secret::generate().unwrap(),
            |_| Ok(()),
        );
        assert!(matches!(s, Err(HandshakeError::BadMac)));
        match c {
            Err(HandshakeError::Refused { reason }) => assert_eq!(reason, "authentication failed"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn admission_refusal_reaches_the_rank() {
        let secret = Secret::generate().unwrap();
        let (s, c) = run(secret.clone(), secret, |_| Err("duplicate rank 1".into()));
        assert!(matches!(s, Err(HandshakeError::Refused { .. })));
        match c {
            Err(HandshakeError::Refused { reason }) => assert_eq!(reason, "duplicate rank 1"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn challenge_first_then_finish_once_the_peer_answers() {
        let (a, b) = Conn::pair().unwrap();
        let secret = Secret::generate().unwrap();
        // Challenged before the peer reads anything: the challenge waits in its buffer.
        let challenged = server_challenge(&a, Duration::from_secs(5)).unwrap();
        let s = secret.clone();
        let t =
            std::thread::spawn(move || client_handshake(&b, &s, &who(), Duration::from_secs(5)));
        let hello =
            server_finish(&a, &secret, challenged, Duration::from_secs(5), |_| Ok(())).unwrap();
        assert_eq!((hello.who.rank, hello.who.channel), (1, Channel::Exec));
        t.join().unwrap().unwrap();
    }

    #[test]
    fn silent_peer_times_out() {
        let (a, _b) = Conn::pair().unwrap();
        let secret = Secret::generate().unwrap();
        let err = server_handshake(&a, &secret, Duration::from_millis(50), |_| Ok(())).unwrap_err();
        assert!(matches!(err, HandshakeError::TimedOut(_)), "{err}");
    }
}
