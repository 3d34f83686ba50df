//! The TCP record layer: after the handshake, every byte on a TCP connection travels
//! in authenticated, encrypted records, so nobody on the path can read a model, inject
//! a frame (a forged `TaskResult` or `Init`) or replay one.
//!
//! ```text
//! record = u32 LE length | ChaCha20-Poly1305(key, nonce = 0u32 | seq u64 LE,
//!                                             aad = length, plaintext) (+16-byte tag)
//! ```
//!
//! Each direction has its own key and its own sequence number, starting at 0 and
//! rising by one per record. The keys are derived from the launch secret and both
//! handshake nonces (the parent's challenge and the rank's hello nonce), so every
//! connection has fresh keys that only holders of the secret can compute. A record
//! that does not authenticate (injected, altered, replayed, reordered or cut) makes
//! the connection fail for good: there is no resynchronising on a stream.
//!
//! The frame layer above is unchanged: it reads and writes bytes through
//! `Read`/`Write for &Conn`, which run this layer on TCP connections.
//!
//! # Caveats
//!
//! - The keys come from the launch secret, not from a Diffie-Hellman exchange: whoever
//!   learns a launch's secret can decrypt that launch's recorded traffic (no forward
//!   secrecy). The secret lives for one launch.
//! - The handshake itself is in the clear (it only proves knowledge of the secret).
//! - A read or write timeout that fires mid-record leaves the connection unusable;
//!   only the handshake uses timeouts, before this layer is on.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::{Mutex, PoisonError};

use chacha20poly1305::aead::{AeadInPlace, KeyInit};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce, Tag};

/// The largest plaintext in one record.
pub const MAX_RECORD: usize = 64 << 10;
const TAG_LEN: usize = 16;

/// The keys of one connection, one per direction.
pub(crate) struct Keys {
    pub(crate) send: [u8; 32],
    pub(crate) recv: [u8; 32],
}

struct Direction {
    cipher: ChaCha20Poly1305,
    seq: u64,
    /// Set once a record failed: the stream cannot be trusted after it.
    broken: bool,
}

impl Direction {
    fn new(key: &[u8; 32]) -> Self {
        Direction {
            cipher: ChaCha20Poly1305::new(Key::from_slice(key)),
            seq: 0,
            broken: false,
        }
    }

    fn nonce(&mut self) -> io::Result<Nonce> {
        let mut n = [0u8; 12];
        n[4..].copy_from_slice(&self.seq.to_le_bytes());
        self.seq = self
            .seq
            .checked_add(1)
            .ok_or_else(|| io::Error::other("record sequence exhausted"))?;
        Ok(*Nonce::from_slice(&n))
    }
}

struct Reader {
    dir: Direction,
    /// Decrypted bytes not yet handed out.
    plain: Vec<u8>,
    pos: usize,
}

/// The record layer's state, shared by every handle (`try_clone`) of one connection.
pub(crate) struct Channel {
    writer: Mutex<Direction>,
    reader: Mutex<Reader>,
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Channel(chacha20poly1305)")
    }
}

fn refused(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("record refused: {what}"),
    )
}

impl Channel {
    pub(crate) fn new(keys: &Keys) -> Channel {
        Channel {
            writer: Mutex::new(Direction::new(&keys.send)),
            reader: Mutex::new(Reader {
                dir: Direction::new(&keys.recv),
                plain: Vec::new(),
                pos: 0,
            }),
        }
    }

    /// Encrypts up to [`MAX_RECORD`] bytes of `buf` into one record and writes it whole.
    /// Returns the plaintext bytes consumed.
    pub(crate) fn write(&self, stream: &TcpStream, buf: &[u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let n = buf.len().min(MAX_RECORD);
        let mut w = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        if w.broken {
            return Err(refused("an earlier write failed"));
        }
        let len = ((n + TAG_LEN) as u32).to_le_bytes();
        let mut record = Vec::with_capacity(4 + n + TAG_LEN);
        record.extend_from_slice(&len);
        record.extend_from_slice(&buf[..n]);
        let nonce = w.nonce()?;
        let tag = w
            .cipher
            .encrypt_in_place_detached(&nonce, &len, &mut record[4..])
            .map_err(|_| io::Error::other("cannot encrypt a record"))?;
        record.extend_from_slice(&tag);
        let written = (&mut &*stream).write_all(&record);
        if written.is_err() {
            w.broken = true;
        }
        written.map(|()| n)
    }

    /// Reads decrypted bytes, reading and authenticating a record when none are left.
    /// `Ok(0)` only at a clean end of stream (between records).
    pub(crate) fn read(&self, stream: &TcpStream, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let mut r = self.reader.lock().unwrap_or_else(PoisonError::into_inner);
        if r.pos == r.plain.len() {
            if r.dir.broken {
                return Err(refused("an earlier record failed authentication"));
            }
            match read_record(&mut r.dir, stream) {
                Ok(Some(plain)) => {
                    r.plain = plain;
                    r.pos = 0;
                }
                Ok(None) => return Ok(0),
                Err(e) => {
                    r.dir.broken = true;
                    return Err(e);
                }
            }
        }
        let n = buf.len().min(r.plain.len() - r.pos);
        buf[..n].copy_from_slice(&r.plain[r.pos..r.pos + n]);
        r.pos += n;
        Ok(n)
    }
}

/// Reads one record; `None` at end of stream before its first byte.
fn read_record(dir: &mut Direction, stream: &TcpStream) -> io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match (&mut &*stream).read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(refused("stream cut inside a record length")),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let total = u32::from_le_bytes(len) as usize;
    if !(TAG_LEN + 1..=MAX_RECORD + TAG_LEN).contains(&total) {
        return Err(refused(&format!(
            "length {total} is not a record's (injected or corrupt)"
        )));
    }
    let mut data = vec![0u8; total];
    (&mut &*stream).read_exact(&mut data).map_err(|e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            refused("stream cut inside a record")
        } else {
            e
        }
    })?;
    let split = total - TAG_LEN;
    let tag = *Tag::from_slice(&data[split..]);
    data.truncate(split);
    let nonce = dir.nonce()?;
    dir.cipher
        .decrypt_in_place_detached(&nonce, &len, &mut data, &tag)
        .map_err(|_| refused("authentication failed (injected, altered, replayed or reordered)"))?;
    Ok(Some(data))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    fn channels() -> (Channel, Channel) {
        let (k1, k2) = ([1u8; 32], [2u8; 32]);
        (
            Channel::new(&Keys { send: k1, recv: k2 }),
            Channel::new(&Keys { send: k2, recv: k1 }),
        )
    }

    #[test]
    fn records_round_trip_across_sizes() {
        let (a, b) = pair();
        let (ca, cb) = channels();
        let data: Vec<u8> = (0..(MAX_RECORD * 2 + 5)).map(|i| i as u8).collect();
        let writer = std::thread::spawn(move || {
            let mut off = 0;
            while off < data.len() {
                off += ca.write(&a, &data[off..]).unwrap();
            }
            data
        });
        let mut got = Vec::new();
        let mut buf = [0u8; 1000];
        while got.len() < MAX_RECORD * 2 + 5 {
            let n = cb.read(&b, &mut buf).unwrap();
            got.extend_from_slice(&buf[..n]);
        }
        assert_eq!(got, writer.join().unwrap());
    }

    #[test]
    fn a_stream_cut_inside_a_record_is_refused() {
        let (a, b) = pair();
        let (ca, cb) = channels();
        let (tap_w, tap_r) = pair();
        ca.write(&tap_w, b"hello").unwrap();
        let mut record = vec![0u8; 4 + 5 + TAG_LEN];
        (&mut &tap_r).read_exact(&mut record).unwrap();
        (&mut &a).write_all(&record[..10]).unwrap();
        drop(a);
        let e = cb.read(&b, &mut [0u8; 16]).unwrap_err();
        assert!(e.to_string().contains("stream cut inside a record"), "{e}");
    }

    #[test]
    fn a_refused_record_is_never_handed_out_in_pieces() {
        // Read in pieces smaller than the record, and with room for all of it: a record
        // altered on the way is refused either way, and no byte of it is returned later.
        for piece in [7usize, 4096] {
            let (a, b) = pair();
            let (ca, cb) = channels();
            let (tap_w, tap_r) = pair();
            ca.write(&tap_w, &[9u8; 1000]).unwrap();
            let mut record = vec![0u8; 4 + 1000 + TAG_LEN];
            (&mut &tap_r).read_exact(&mut record).unwrap();
            record[100] ^= 1;
            (&mut &a).write_all(&record).unwrap();
            let mut buf = vec![0u8; piece];
            let e = cb.read(&b, &mut buf).unwrap_err();
            assert!(e.to_string().contains("authentication failed"), "{e}");
            for _ in 0..3 {
                assert!(cb.read(&b, &mut buf).is_err(), "the stream stays refused");
            }
        }
    }

    #[test]
    fn replayed_and_injected_records_are_refused() {
        let (a, b) = pair();
        let (ca, cb) = channels();
        // Capture the first record as it goes out, then send it twice.
        let (tap_w, tap_r) = pair();
        ca.write(&tap_w, b"hello").unwrap();
        let mut record = vec![0u8; 4 + 5 + TAG_LEN];
        (&mut &tap_r).read_exact(&mut record).unwrap();
        (&mut &a).write_all(&record).unwrap();
        (&mut &a).write_all(&record).unwrap();
        let mut buf = [0u8; 16];
        assert_eq!(cb.read(&b, &mut buf).unwrap(), 5);
        let e = cb.read(&b, &mut buf).unwrap_err();
        assert!(e.to_string().contains("authentication failed"), "{e}");
        assert!(cb.read(&b, &mut buf).is_err(), "the stream stays refused");
        // A plaintext frame injected into a fresh stream.
        let (a, b) = pair();
        let (_, cb) = channels();
        (&mut &a).write_all(b"RXF1\x05\0\0\0").unwrap();
        let e = cb.read(&b, &mut buf).unwrap_err();
        assert!(e.to_string().contains("record refused"), "{e}");
    }
}
