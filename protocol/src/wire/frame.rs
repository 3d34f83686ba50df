//! Length-prefixed frames: a fixed prefix, an encoded header, then raw blob bytes.
//!
//! ```text
//! offset  size  field
//! 0       4     magic "RXF1"
//! 4       4     header length (u32 LE)
//! 8       8     body length   (u64 LE)  -- inline blob bytes, concatenated
//! 16      4     descriptor count (u32 LE) -- sealed memory files sent with SCM_RIGHTS
//! 20      ...   header, then body
//! ```
//!
//! Every length is checked against [`FrameLimits`] before anything is allocated, and
//! the body buffer grows with the bytes that actually arrive, so a peer that claims a huge
//! frame and sends little costs little. Descriptors arrive with the prefix; a count that
//! differs from what was passed is refused and the descriptors are closed.
//!
//! A frame is encoded once ([`OutFrame`]) and can be written to any number of
//! connections: fan-out writes the same buffers to N sockets.
//!
//! Sizes are checked on the sending side too: [`FrameLimits::check`] measures a frame
//! (header and inline body) against the receiver's limits before it is written, so a
//! sender learns "too large" as an error of its own instead of the receiver dropping
//! the connection.
//!
//! Passed memory files are not counted against the body limit: their pages exist
//! already (the sender made them, admitted against the host's memory, see
//! `os::memory`), and a receiver only maps them, so a model of any size that fits the
//! host travels with the default limit, which bounds what a peer can make the receiver
//! allocate (inline bytes).

use std::io::{self, IoSlice, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use std::sync::Arc;

use bytes::Bytes;

use super::codec::MAX_HEADER_BYTES;
use super::conn::Conn;
use crate::os;

/// The four bytes every frame starts with.
pub const MAGIC: [u8; 4] = *b"RXF1";
const PREFIX_LEN: usize = 20;

/// The most descriptors one frame may carry.
pub const MAX_FDS_PER_FRAME: u32 = 64;

/// The largest frame a reader accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameLimits {
    /// Largest header, in bytes.
    pub max_header: u32,
    /// Largest body (inline blobs), in bytes.
    pub max_body: u64,
    /// Most descriptors.
    pub max_fds: u32,
}

impl FrameLimits {
    /// Limits for unauthenticated peers: small headers, no body, no descriptors.
    pub const HANDSHAKE: FrameLimits = FrameLimits {
        max_header: 4096,
        max_body: 0,
        max_fds: 0,
    };

    /// Limits for an authenticated peer, from the configured maximum frame size.
    pub fn for_max_frame(max_frame_bytes: u64) -> FrameLimits {
        FrameLimits {
            max_header: u32::try_from(max_frame_bytes.min(MAX_HEADER_BYTES as u64))
                .unwrap_or(u32::MAX),
            max_body: max_frame_bytes,
            max_fds: MAX_FDS_PER_FRAME,
        }
    }
}

impl FrameLimits {
    /// Checks an outgoing frame against these limits: the header, then the inline body,
    /// then the descriptors.
    pub fn check(&self, frame: &OutFrame) -> Result<(), FrameError> {
        let header = (frame.head.len() - PREFIX_LEN) as u64;
        if header > u64::from(self.max_header) {
            return Err(FrameError::HeaderTooLarge {
                len: header,
                max: self.max_header.into(),
            });
        }
        let len = frame.inline_len();
        if len > self.max_body {
            return Err(FrameError::BodyTooLarge {
                len,
                max: self.max_body,
            });
        }
        if frame.fds.len() > self.max_fds as usize {
            return Err(FrameError::TooManyFds {
                count: u32::try_from(frame.fds.len()).unwrap_or(u32::MAX),
                max: self.max_fds,
            });
        }
        Ok(())
    }
}

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The peer closed the connection between frames.
    #[error("connection closed")]
    Closed,
    /// The peer closed the connection inside a frame.
    #[error("connection closed mid-frame after {got} of {expected} {part} bytes")]
    Truncated {
        /// Which part was being read.
        part: &'static str,
        /// Bytes expected.
        expected: u64,
        /// Bytes received.
        got: u64,
    },
    /// The frame does not start with [`MAGIC`].
    #[error("not a rankexec frame (starts with {found:02x?})")]
    BadMagic {
        /// The first four bytes.
        found: [u8; 4],
    },
    /// The header is larger than allowed.
    #[error("header of {len} bytes exceeds the limit of {max}")]
    HeaderTooLarge {
        /// Declared length.
        len: u64,
        /// Limit.
        max: u64,
    },
    /// The body is larger than allowed.
    #[error("frame body of {len} bytes exceeds the limit of {max}")]
    BodyTooLarge {
        /// Declared length.
        len: u64,
        /// Limit.
        max: u64,
    },
    /// More descriptors than allowed.
    #[error("frame declares {count} file descriptors, limit {max}")]
    TooManyFds {
        /// Declared count.
        count: u32,
        /// Limit.
        max: u32,
    },
    /// The descriptors received differ from the count declared.
    #[error("frame declares {declared} file descriptors but {received} arrived")]
    FdMismatch {
        /// Declared count.
        declared: u32,
        /// Received count.
        received: usize,
    },
    /// Descriptors cannot be sent on this connection.
    #[error("file descriptors cannot be sent over {0}")]
    FdsUnsupported(&'static str),
    /// Memory for the body could not be reserved.
    #[error("cannot allocate {len} bytes for a frame body")]
    OutOfMemory {
        /// The size that failed.
        len: u64,
    },
    /// The read or write deadline passed.
    #[error("timed out")]
    TimedOut,
    /// Another I/O error.
    #[error("i/o error")]
    Io(#[source] io::Error),
}

impl From<io::Error> for FrameError {
    fn from(e: io::Error) -> Self {
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => FrameError::TimedOut,
            _ => FrameError::Io(e),
        }
    }
}

/// An encoded frame, ready to be written to one or more connections.
#[derive(Debug, Clone)]
pub struct OutFrame {
    head: Vec<u8>,
    body: Vec<Bytes>,
    fds: Vec<Arc<OwnedFd>>,
}

impl OutFrame {
    /// A frame from an encoded header, body segments and descriptors to pass.
    pub fn new(header: &[u8], body: Vec<Bytes>, fds: Vec<Arc<OwnedFd>>) -> OutFrame {
        let body_len: u64 = body.iter().map(|b| b.len() as u64).sum();
        let mut head = Vec::with_capacity(PREFIX_LEN + header.len());
        head.extend_from_slice(&MAGIC);
        // Headers come from `codec::encode`, which refuses any over 64 MiB; a longer one
        // would be announced as `u32::MAX` and refused by every reader, never wrapped.
        head.extend_from_slice(
            &u32::try_from(header.len())
                .unwrap_or(u32::MAX)
                .to_le_bytes(),
        );
        head.extend_from_slice(&body_len.to_le_bytes());
        head.extend_from_slice(&(fds.len() as u32).to_le_bytes());
        head.extend_from_slice(header);
        OutFrame { head, body, fds }
    }

    /// A frame with only a header.
    pub fn header_only(header: &[u8]) -> OutFrame {
        OutFrame::new(header, Vec::new(), Vec::new())
    }

    /// Bytes on the wire (descriptors not counted).
    pub fn wire_len(&self) -> u64 {
        self.head.len() as u64 + self.body.iter().map(|b| b.len() as u64).sum::<u64>()
    }

    /// The inline blob bytes the frame carries (memory files not counted).
    pub fn inline_len(&self) -> u64 {
        self.body.iter().map(|b| b.len() as u64).sum()
    }

    /// The frame's bytes as a local socket carries them (descriptors not included):
    /// for tools and tests that play a peer.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = self.head.clone();
        for b in &self.body {
            out.extend_from_slice(b);
        }
        out
    }

    /// Whether the frame passes descriptors.
    pub fn has_fds(&self) -> bool {
        !self.fds.is_empty()
    }

    fn slices(&self) -> Vec<IoSlice<'_>> {
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(1 + self.body.len());
        slices.push(IoSlice::new(&self.head));
        slices.extend(
            self.body
                .iter()
                .filter(|b| !b.is_empty())
                .map(|b| IoSlice::new(b)),
        );
        slices
    }

    /// Writes the frame. Callers serialize writers on one connection.
    pub fn write_to(&self, conn: &Conn) -> Result<(), FrameError> {
        self.write_rest(conn, 0)
    }

    /// Tries to write the whole frame without blocking, descriptors included. Returns
    /// how many bytes went out: all, some, or none when the peer's buffer is full. Finish
    /// a partial write with [`write_rest`](Self::write_rest). This lets a single
    /// dispatcher thread send small frames to many peers without a thread hop, and hand
    /// only a stuck peer's frame to a writer thread.
    ///
    /// On TCP nothing goes out here (`Ok(0)`): bytes there travel in encrypted records,
    /// which are written whole by [`write_rest`](Self::write_rest).
    pub fn try_write_now(&self, conn: &Conn) -> Result<u64, FrameError> {
        if !self.fds.is_empty() && !conn.passes_fds() {
            return Err(FrameError::FdsUnsupported("tcp"));
        }
        if !conn.passes_fds() {
            return Ok(0);
        }
        let slices = self.slices();
        let fds: Vec<BorrowedFd<'_>> = self.fds.iter().map(|f| f.as_fd()).collect();
        Ok(os::send_nonblocking(conn.as_fd(), &slices, &fds)? as u64)
    }

    /// Writes the frame, skipping the first `written` bytes (already sent together with
    /// the descriptors).
    pub fn write_rest(&self, conn: &Conn, written: u64) -> Result<(), FrameError> {
        let mut slices = self.slices();
        let mut bufs: &mut [IoSlice<'_>] = &mut slices;
        IoSlice::advance_slices(&mut bufs, written as usize);
        if written == 0 && !self.fds.is_empty() {
            let Conn::Local(sock) = conn else {
                return Err(FrameError::FdsUnsupported("tcp"));
            };
            let fds: Vec<BorrowedFd<'_>> = self.fds.iter().map(|f| f.as_fd()).collect();
            // Only the prefix and header go with the descriptors; the kernel attaches
            // them to the first byte, where the reader's first recvmsg finds them.
            let n = os::send_with_fds(sock, &bufs[..1], &fds)?;
            if n == 0 {
                return Err(FrameError::Io(io::ErrorKind::WriteZero.into()));
            }
            IoSlice::advance_slices(&mut bufs, n);
        }
        let mut w = conn;
        while !bufs.is_empty() {
            match w.write_vectored(bufs) {
                Ok(0) => return Err(FrameError::Io(io::ErrorKind::WriteZero.into())),
                Ok(n) => IoSlice::advance_slices(&mut bufs, n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
}

/// A frame as read: header bytes, the body, and any passed descriptors.
#[derive(Debug)]
pub struct InFrame {
    /// The encoded header.
    pub header: Vec<u8>,
    /// The inline blob bytes.
    pub body: Bytes,
    /// Passed descriptors (closed when dropped).
    pub fds: Vec<OwnedFd>,
}

fn read_prefix(
    conn: &Conn,
    limits: &FrameLimits,
) -> Result<([u8; PREFIX_LEN], Vec<OwnedFd>), FrameError> {
    let mut prefix = [0u8; PREFIX_LEN];
    let mut fds = Vec::new();
    let mut got = 0;
    while got < PREFIX_LEN {
        let n = match conn {
            Conn::Local(sock) => {
                os::recv_with_fds(sock, &mut prefix[got..], limits.max_fds as usize, &mut fds)
            }
            Conn::Tcp(_) => (&mut &*conn).read(&mut prefix[got..]),
        };
        match n {
            Ok(0) if got == 0 => return Err(FrameError::Closed),
            Ok(0) => {
                return Err(FrameError::Truncated {
                    part: "prefix",
                    expected: PREFIX_LEN as u64,
                    got: got as u64,
                });
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            // recvmsg's way of saying "more descriptors than allowed" (local only; on
            // TCP the record layer uses this kind for a refused record).
            Err(e) if e.kind() == io::ErrorKind::InvalidData && conn.passes_fds() => {
                return Err(FrameError::TooManyFds {
                    count: u32::try_from(fds.len()).unwrap_or(u32::MAX),
                    max: limits.max_fds,
                });
            }
            // Reset, or declared dead by the kernel (`ETIMEDOUT` from TCP keepalive or
            // `TCP_USER_TIMEOUT`; a read timeout is `EAGAIN`, never this): the peer is
            // gone, as if it had closed.
            Err(e)
                if got == 0
                    && matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionReset | io::ErrorKind::TimedOut
                    ) =>
            {
                return Err(FrameError::Closed);
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok((prefix, fds))
}

fn read_exact_or_truncated(
    conn: &Conn,
    buf: &mut [u8],
    part: &'static str,
    expected: u64,
    already: u64,
) -> Result<(), FrameError> {
    let mut r = conn;
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => {
                return Err(FrameError::Truncated {
                    part,
                    expected,
                    got: already + got as u64,
                });
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Reads one frame, enforcing `limits`.
pub fn read_frame(conn: &Conn, limits: &FrameLimits) -> Result<InFrame, FrameError> {
    let (prefix, fds) = read_prefix(conn, limits)?;
    let word = |r: std::ops::Range<usize>| -> [u8; 4] {
        let mut w = [0u8; 4];
        w.copy_from_slice(&prefix[r]);
        w
    };
    let magic = word(0..4);
    if magic != MAGIC {
        return Err(FrameError::BadMagic { found: magic });
    }
    let header_len = u32::from_le_bytes(word(4..8));
    let mut body_word = [0u8; 8];
    body_word.copy_from_slice(&prefix[8..16]);
    let body_len = u64::from_le_bytes(body_word);
    let fd_count = u32::from_le_bytes(word(16..20));
    if header_len > limits.max_header {
        return Err(FrameError::HeaderTooLarge {
            len: header_len.into(),
            max: limits.max_header.into(),
        });
    }
    if body_len > limits.max_body {
        return Err(FrameError::BodyTooLarge {
            len: body_len,
            max: limits.max_body,
        });
    }
    if fd_count > limits.max_fds {
        return Err(FrameError::TooManyFds {
            count: fd_count,
            max: limits.max_fds,
        });
    }
    if fds.len() != fd_count as usize {
        return Err(FrameError::FdMismatch {
            declared: fd_count,
            received: fds.len(),
        });
    }
    let mut header = vec![0u8; header_len as usize];
    read_exact_or_truncated(conn, &mut header, "header", header_len.into(), 0)?;
    let body = read_body(conn, body_len)?;
    Ok(InFrame { header, body, fds })
}

/// Reads `len` body bytes. The buffer starts small and grows with the bytes that
/// actually arrive (std's `read_to_end` doubles it, fallibly, without zero-filling), so
/// the allocation follows what the peer really sent rather than what it claimed.
fn read_body(conn: &Conn, len: u64) -> Result<Bytes, FrameError> {
    if len == 0 {
        return Ok(Bytes::new());
    }
    const FIRST: u64 = 1 << 20;
    let mut buf: Vec<u8> = Vec::new();
    buf.try_reserve_exact(len.min(FIRST) as usize)
        .map_err(|_| FrameError::OutOfMemory { len })?;
    let mut r = conn;
    match Read::take(&mut r, len).read_to_end(&mut buf) {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::OutOfMemory => {
            return Err(FrameError::OutOfMemory { len });
        }
        Err(e) => return Err(e.into()),
    }
    if (buf.len() as u64) < len {
        return Err(FrameError::Truncated {
            part: "body",
            expected: len,
            got: buf.len() as u64,
        });
    }
    Ok(Bytes::from(buf))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> FrameLimits {
        FrameLimits::for_max_frame(1 << 20)
    }

    #[test]
    fn frame_round_trips_with_body_and_fds() {
        let (a, b) = Conn::pair().unwrap();
        let fd = Arc::new(os::sealed_memfd("t", &[b"zz"]).unwrap());
        let f = OutFrame::new(
            b"hdr",
            vec![Bytes::from_static(b"ab"), Bytes::from_static(b"cd")],
            vec![fd],
        );
        f.write_to(&a).unwrap();
        f.write_to(&a).unwrap();
        for _ in 0..2 {
            let got = read_frame(&b, &limits()).unwrap();
            assert_eq!(got.header, b"hdr");
            assert_eq!(&got.body[..], b"abcd");
            assert_eq!(got.fds.len(), 1);
        }
        drop(a);
        assert!(matches!(read_frame(&b, &limits()), Err(FrameError::Closed)));
    }

    #[test]
    fn nonblocking_write_then_rest_delivers_one_frame() {
        let (a, b) = Conn::pair().unwrap();
        let big = Bytes::from(vec![7u8; 4 << 20]);
        let f = OutFrame::new(b"h", vec![big.clone()], vec![]);
        // The socket buffer cannot hold 4 MiB: part goes now, the rest blocks later.
        let sent = f.try_write_now(&a).unwrap();
        assert!(sent > 0 && sent < f.wire_len(), "{sent}");
        let reader = std::thread::spawn(move || {
            let first = read_frame(&b, &limits_big()).unwrap();
            let second = read_frame(&b, &limits_big()).unwrap();
            (first, second)
        });
        f.write_rest(&a, sent).unwrap();
        let small = OutFrame::header_only(b"x");
        assert_eq!(small.try_write_now(&a).unwrap(), small.wire_len());
        let (first, second) = reader.join().unwrap();
        assert_eq!(first.body, big);
        assert_eq!(second.header, b"x");
    }

    fn limits_big() -> FrameLimits {
        FrameLimits::for_max_frame(1 << 30)
    }

    #[test]
    fn garbage_is_bad_magic() {
        let (a, b) = Conn::pair().unwrap();
        (&a).write_all(&[0xde; 32]).unwrap();
        assert!(matches!(
            read_frame(&b, &limits()),
            Err(FrameError::BadMagic { .. })
        ));
    }

    #[test]
    fn oversized_lengths_are_refused_before_allocation() {
        let (a, b) = Conn::pair().unwrap();
        let mut p = Vec::new();
        p.extend_from_slice(&MAGIC);
        p.extend_from_slice(&0u32.to_le_bytes());
        p.extend_from_slice(&u64::MAX.to_le_bytes());
        p.extend_from_slice(&0u32.to_le_bytes());
        (&a).write_all(&p).unwrap();
        assert!(matches!(
            read_frame(&b, &limits()),
            Err(FrameError::BodyTooLarge { .. })
        ));
    }

    #[test]
    fn truncated_body_is_reported() {
        let (a, b) = Conn::pair().unwrap();
        let mut p = Vec::new();
        p.extend_from_slice(&MAGIC);
        p.extend_from_slice(&1u32.to_le_bytes());
        p.extend_from_slice(&10u64.to_le_bytes());
        p.extend_from_slice(&0u32.to_le_bytes());
        p.extend_from_slice(b"h12345");
        (&a).write_all(&p).unwrap();
        drop(a);
        match read_frame(&b, &limits()) {
            Err(FrameError::Truncated {
                part: "body",
                expected: 10,
                got: 5,
            }) => {}
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn senders_and_readers_count_inline_bytes_not_memory_files() {
        let small = FrameLimits::for_max_frame(100);
        let fd = Arc::new(os::sealed_memfd("t", &[&[0u8; 4096]]).unwrap());
        // A memory file far over the limit passes: its pages exist already.
        let shared = OutFrame::new(b"h", vec![Bytes::from(vec![1u8; 30])], vec![fd.clone()]);
        assert_eq!(shared.inline_len(), 30);
        small.check(&shared).unwrap();
        let (a, b) = Conn::pair().unwrap();
        shared.write_to(&a).unwrap();
        let got = read_frame(&b, &small).unwrap();
        assert_eq!((got.body.len(), got.fds.len()), (30, 1));
        // Inline bytes over it are refused by the sender and by the reader.
        let inline = OutFrame::new(b"h", vec![Bytes::from(vec![1u8; 110])], vec![fd.clone()]);
        let err = small.check(&inline).unwrap_err();
        assert!(
            matches!(err, FrameError::BodyTooLarge { len: 110, max: 100 }),
            "{err}"
        );
        inline.write_to(&a).unwrap();
        let err = read_frame(&b, &small).unwrap_err();
        assert!(
            matches!(err, FrameError::BodyTooLarge { len: 110, max: 100 }),
            "{err}"
        );
        let err = small
            .check(&OutFrame::header_only(&[0u8; 101]))
            .unwrap_err();
        assert!(matches!(err, FrameError::HeaderTooLarge { .. }), "{err}");
    }

    #[test]
    fn descriptors_are_refused_when_not_allowed() {
        let (a, b) = Conn::pair().unwrap();
        let fd = Arc::new(os::sealed_memfd("t", &[b"zz"]).unwrap());
        OutFrame::new(b"h", vec![], vec![fd]).write_to(&a).unwrap();
        let err = read_frame(&b, &FrameLimits::HANDSHAKE).unwrap_err();
        assert!(matches!(err, FrameError::TooManyFds { .. }), "{err}");
    }
}
