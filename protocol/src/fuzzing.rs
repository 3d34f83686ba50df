//! A pure entry point for fuzzing the frame reader and the header decoders.
//!
//! Every byte a rank or an unauthenticated peer sends goes through [`read_frame`], the
//! header codec and [`envelope::unpack`]; none of them may panic, hang or allocate
//! without bound on hostile input. [`decode_frame`] drives exactly that path from a
//! byte string, so that the `cargo fuzz` target in `fuzz/` and the corpus replay test
//! (`tests/fuzz_corpus.rs`, on stable) exercise the same code the executor runs. It is
//! not part of the public API.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use crate::os;
use crate::wire::codec;
use crate::wire::conn::Conn;
use crate::wire::envelope;
use crate::wire::frame::{FrameLimits, InFrame, read_frame};
use crate::wire::message::{Handshake, Message};

/// Longer inputs are truncated to this many bytes.
pub const MAX_INPUT: usize = 1 << 20;

/// The most memory files passed with the first frame.
const MAX_PASSED_FDS: u32 = 8;

/// Bytes per `sendmsg`.
const CHUNK: usize = 64 << 10;

/// How long either end waits before giving up (a safety net: a hang is a bug, but a
/// fuzzer should report it as a slow input, not stall).
const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// The frame prefix length (see [`frame`](crate::wire::frame)).
const PREFIX_LEN: usize = 20;

/// Feeds `data` (truncated to [`MAX_INPUT`]) to the frame reader as a peer would.
///
/// The bytes are written to one end of a [`Conn::pair`] (by a helper thread when they
/// exceed the socket buffer) and read as a stream of frames on the other end, twice:
/// once with [`FrameLimits::HANDSHAKE`] (an unauthenticated peer) and once with the
/// limits of an authenticated peer (`FrameLimits::for_max_frame(1 << 20)`). If the
/// input is at least a prefix long,
/// the first frame's declared descriptor count (bytes 16..20, capped at 8) is honoured:
/// that many memory files (file `i` holds `16 * i` bytes; every fourth is left
/// unsealed) are passed with the first 20 bytes, so the descriptor checks and
/// [`envelope::unpack`]'s mapping path are reached. Every frame's header is decoded as
/// a [`Handshake`] and as a [`Message`]; a message that describes a shareable is
/// unpacked with the frame's body and descriptors, any other checked with
/// [`envelope::expect_plain`]. The raw input is also decoded directly as both header
/// types, so the codec is reached without a valid prefix.
///
/// Errors are expected and ignored; the function must not panic or hang on any input.
pub fn decode_frame(data: &[u8]) {
    let data = &data[..data.len().min(MAX_INPUT)];
    let _ = codec::decode::<Handshake>(data);
    let _ = codec::decode::<Message>(data);
    let files = passed_files(data);
    let fds: Vec<BorrowedFd<'_>> = files.iter().map(|f| f.as_fd()).collect();
    for limits in [
        FrameLimits::HANDSHAKE,
        FrameLimits::for_max_frame(MAX_INPUT as u64),
    ] {
        let _ = feed(data, &fds, &limits);
    }
}

/// The memory files that go with the first frame, as its prefix declares.
fn passed_files(data: &[u8]) -> Vec<OwnedFd> {
    let Some(word) = data.get(16..PREFIX_LEN) else {
        return Vec::new();
    };
    let mut count = [0u8; 4];
    count.copy_from_slice(word);
    let count = u32::from_le_bytes(count).min(MAX_PASSED_FDS);
    (0..count).filter_map(|i| memory_file(i).ok()).collect()
}

/// Memory file `i`: `16 * i` bytes of `i`, sealed unless `i % 4 == 3`.
fn memory_file(i: u32) -> io::Result<OwnedFd> {
    let content = vec![i as u8; 16 * i as usize];
    if i % 4 == 3 {
        let fd = rustix::fs::memfd_create("fuzz", rustix::fs::MemfdFlags::CLOEXEC)?;
        rustix::fs::ftruncate(&fd, content.len() as u64)?;
        Ok(fd)
    } else {
        os::sealed_memfd("fuzz", &[&content])
    }
}

/// Writes `data` into a fresh connection pair and reads frames until the stream ends or
/// a frame is refused.
///
/// What fits in the socket buffer (every input of a few KiB) is written up front without
/// blocking, and the reader runs on this thread alone. Only the rest of a larger input
/// is written by a helper thread, so that a fuzzer does not pay for a thread per input.
fn feed(data: &[u8], fds: &[BorrowedFd<'_>], limits: &FrameLimits) -> io::Result<()> {
    let (writer, reader) = Conn::pair()?;
    writer.set_write_timeout(Some(IO_TIMEOUT))?;
    reader.set_read_timeout(Some(IO_TIMEOUT))?;
    let Conn::Local(sock) = &writer else {
        return Ok(());
    };
    sock.set_nonblocking(true)?;
    let sent = match send_from(sock, data, fds, 0) {
        Progress::Blocked(sent) => sent,
        Progress::Done | Progress::Failed => {
            // Dropping the writer ends the stream after what was sent.
            drop(writer);
            read_all(&reader, limits);
            return Ok(());
        }
    };
    sock.set_nonblocking(false)?;
    std::thread::scope(|scope| {
        // The writer owns its end and drops it when done, so the reader sees the end of
        // the stream. It never panics, and it stops at the first error: once the reader
        // shuts its end down, a blocked send fails with EPIPE (no SIGPIPE: MSG_NOSIGNAL).
        let spawned = std::thread::Builder::new()
            .name("fuzz-writer".to_owned())
            .spawn_scoped(scope, move || {
                if let Conn::Local(sock) = &writer {
                    send_from(sock, data, fds, sent);
                }
            });
        let Ok(handle) = spawned else {
            return;
        };
        read_all(&reader, limits);
        reader.shutdown();
        // Join explicitly: the scope's implicit join returns once the closure is done,
        // possibly before the thread has run its thread-local destructors, which leak
        // checkers (LeakSanitizer under libFuzzer) then report as a leak.
        let _ = handle.join();
    });
    Ok(())
}

/// Reads and inspects frames until one is refused or the stream ends.
fn read_all(reader: &Conn, limits: &FrameLimits) {
    while let Ok(frame) = read_frame(reader, limits) {
        inspect(frame);
    }
}

/// How far [`send_from`] got.
enum Progress {
    /// Everything was sent.
    Done,
    /// The socket buffer is full after this many bytes (non-blocking socket).
    Blocked(usize),
    /// The peer is gone or the socket failed.
    Failed,
}

/// Sends `data[sent..]`. The descriptors go with the first prefix-long chunk (when
/// starting from 0).
fn send_from(sock: &UnixStream, data: &[u8], fds: &[BorrowedFd<'_>], mut sent: usize) -> Progress {
    while sent < data.len() {
        let (end, attached) = if sent == 0 && !fds.is_empty() && data.len() >= PREFIX_LEN {
            (PREFIX_LEN, fds)
        } else {
            (data.len().min(sent + CHUNK), &[][..])
        };
        match os::send_with_fds(sock, &[io::IoSlice::new(&data[sent..end])], attached) {
            Ok(0) => return Progress::Failed,
            Ok(n) => sent += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Progress::Blocked(sent),
            Err(_) => return Progress::Failed,
        }
    }
    Progress::Done
}

/// Decodes one frame the way both ends of a connection would.
fn inspect(frame: InFrame) {
    let _ = codec::decode::<Handshake>(&frame.header);
    let Ok(msg) = envelope::decode(&frame) else {
        return;
    };
    // Encoding what was decoded must work too.
    let _ = codec::encode(&msg);
    let wire = match msg {
        Message::Execute(execute) => execute.input,
        Message::TaskResult {
            outcome: Ok(output),
            ..
        } => output.output,
        other => {
            let _ = envelope::expect_plain(other.kind(), &frame);
            return;
        }
    };
    if let Ok(shareable) = envelope::unpack(wire, &frame.body, frame.fds) {
        // Touch every byte: a mapping that faults would show up here.
        let sum = shareable
            .blobs()
            .values()
            .flat_map(|b| b.iter())
            .fold(0u8, |acc, b| acc.wrapping_add(*b));
        std::hint::black_box(sum);
    }
}
