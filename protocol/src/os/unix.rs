//! Linux and Unix specifics: file-descriptor passing, peer credentials and sealed
//! memory files.
//!
//! - Descriptors travel with `sendmsg`/`recvmsg` and `SCM_RIGHTS`
//!   ([unix(7)](https://man7.org/linux/man-pages/man7/unix.7.html)). They are received
//!   with `MSG_CMSG_CLOEXEC`, so a rank's children never inherit them, and a truncated
//!   control message (`MSG_CTRUNC`: more descriptors than allowed) is an error.
//! - Large blobs live in memory files from `memfd_create`
//!   ([memfd_create(2)](https://man7.org/linux/man-pages/man2/memfd_create.2.html)),
//!   sealed with `F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL` before they
//!   are sent. A receiver maps a file only after checking that the write, shrink and
//!   grow seals are set: a peer that could still shrink the file could make every
//!   reader fault with `SIGBUS`, and one that could grow it could outgrow the size the
//!   frame reader counted against its limit.
//! - A memory file filled through a writable shared mapping is sealed only once no such
//!   mapping remains anywhere (`F_SEAL_WRITE` fails with `EBUSY` otherwise), and a
//!   `fork()` copies the mapping into the child (PyTorch DataLoader workers,
//!   `multiprocessing`, `os.fork`). Every such mapping is marked `MADV_DONTFORK`
//!   ([`keep_from_children`]) so that children never hold it; when sealing still finds
//!   one (a child forked between the mapping and the advice, or a mapping made by other
//!   code), the bytes go to a fresh memory file, filled with `write` (no mapping at
//!   all), which is sealed instead ([`seal_or_copy`]). A child that touches such an
//!   address faults: the range is not mapped in children.
//! - The launch secret reaches a rank we spawn through an inherited pipe: the rank
//!   takes the descriptor once, checks it is a pipe, reads to end of file and closes it.

use std::fs::File;
use std::io::{self, IoSlice, IoSliceMut, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use bytes::Bytes;
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::io::Errno;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

/// Sends `bufs` with `fds` attached to their first byte. Returns the bytes sent, which
/// may be fewer than asked; the descriptors always go with the first call.
pub(crate) fn send_with_fds(
    sock: &UnixStream,
    bufs: &[IoSlice<'_>],
    fds: &[BorrowedFd<'_>],
) -> io::Result<usize> {
    send_msg(sock.as_fd(), bufs, fds, SendFlags::NOSIGNAL)
}

/// Sends `bufs` (and `fds`, attached to the first byte) without blocking. Returns the
/// bytes sent; 0 when the peer's buffer is full.
pub(crate) fn send_nonblocking(
    sock: BorrowedFd<'_>,
    bufs: &[IoSlice<'_>],
    fds: &[BorrowedFd<'_>],
) -> io::Result<usize> {
    match send_msg(sock, bufs, fds, SendFlags::NOSIGNAL | SendFlags::DONTWAIT) {
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
        other => other,
    }
}

/// One `sendmsg` with `fds` as `SCM_RIGHTS`, retried on `EINTR`.
fn send_msg(
    sock: BorrowedFd<'_>,
    bufs: &[IoSlice<'_>],
    fds: &[BorrowedFd<'_>],
    flags: SendFlags,
) -> io::Result<usize> {
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(fds.len().max(1)))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::other("control buffer too small for descriptors"));
    }
    loop {
        match rustix::net::sendmsg(sock, bufs, &mut control, flags) {
            Ok(n) => return Ok(n),
            Err(Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Receives into `buf`, appending any passed descriptors to `fds`. More than `max_fds`
/// descriptors is an error (they are closed).
pub(crate) fn recv_with_fds(
    sock: &UnixStream,
    buf: &mut [u8],
    max_fds: usize,
    fds: &mut Vec<OwnedFd>,
) -> io::Result<usize> {
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(max_fds.max(1)))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let msg = loop {
        let mut iov = [IoSliceMut::new(buf)];
        match rustix::net::recvmsg(sock, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC) {
            Ok(m) => break m,
            Err(Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = m {
            fds.extend(received);
        }
    }
    // CMSG_SPACE rounds up, so the kernel may deliver more than `max_fds` without
    // truncating: count them as well.
    if msg.flags.contains(ReturnFlags::CTRUNC) || fds.len() > max_fds {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("peer passed more than {max_fds} file descriptors"),
        ));
    }
    Ok(msg.bytes)
}

/// The peer's process id and user id.
pub(crate) fn peer_creds(sock: &UnixStream) -> io::Result<(u32, u32)> {
    let cred = rustix::net::sockopt::socket_peercred(sock)?;
    Ok((cred.pid.as_raw_nonzero().get() as u32, cred.uid.as_raw()))
}

/// Our effective user id.
pub(crate) fn effective_uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Writes `parts` into a new memory file, one after the other, and seals it against any
/// change.
pub(crate) fn sealed_memfd(name: &str, parts: &[&[u8]]) -> io::Result<OwnedFd> {
    let mut at = 0u64;
    let placed: Vec<(u64, &[u8])> = parts
        .iter()
        .map(|p| {
            let here = at;
            at += p.len() as u64;
            (here, *p)
        })
        .collect();
    sealed_memfd_at(name, at, &placed)
}

/// Writes each `(offset, bytes)` part into a new memory file of `len` bytes with
/// `pwrite` (never through a mapping) and seals it against any change; the bytes no
/// part covers read as zeros. The file is admitted against the host's available memory
/// first.
///
/// Why `pwrite` and not a writable mapping: the kernel's shmem write path allocates
/// each page and copies into it without zeroing it first, and takes no page fault,
/// where filling a fresh mapping faults once per 4 KiB page (allocation, zeroing,
/// then the copy). On this project's test VM 1 GiB took 530-770 ms with `pwrite`
/// against 1130-1440 ms through a mapping (`MAP_POPULATE` does not help: it takes the
/// same faults up front). That difference was `rankexec bench`'s fan-out regression
/// from 0.98x to 1.8x one memcpy. Where the kernel gives memory files huge pages only
/// on request, each part's range is first allocated through a short-lived mapping
/// (`os::huge`); a child forked in the moment before that mapping is kept from children
/// could keep the file from being sealed, so the seal falls back to a copy
/// ([`seal_or_copy`]).
pub(crate) fn sealed_memfd_at(name: &str, len: u64, parts: &[(u64, &[u8])]) -> io::Result<OwnedFd> {
    for (at, bytes) in parts {
        if at
            .checked_add(bytes.len() as u64)
            .is_none_or(|end| end > len)
        {
            return Err(io::Error::other(
                "a part of a memory file lies past its end",
            ));
        }
    }
    super::admit(len).map_err(io::Error::other)?;
    let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
    // Size the file first: writes never extend it, and gaps read as zeros.
    rustix::fs::ftruncate(&fd, len)?;
    // Huge pages first where the kernel gives them only on request (`os::huge`).
    let huge = super::HugeAllocator::for_file(len);
    for (at, bytes) in parts {
        if let Some(h) = &huge {
            h.allocate(fd.as_fd(), *at, bytes.len() as u64);
        }
        pwrite_all(fd.as_fd(), bytes, *at)?;
    }
    seal_or_copy(fd, name, len)
}

/// `pwrite` until every byte is written, retried on `EINTR`.
fn pwrite_all(fd: BorrowedFd<'_>, mut bytes: &[u8], mut at: u64) -> io::Result<()> {
    while !bytes.is_empty() {
        match rustix::io::pwrite(fd, bytes, at) {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
            Ok(n) => {
                bytes = &bytes[n..];
                at += n as u64;
            }
            Err(Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Creates a memory file of `len` bytes, lets `fill` write it in place through a
/// writable mapping, then seals it: the producer writes its bytes once and every rank
/// maps the same pages.
pub(crate) fn sealed_memfd_with(
    name: &str,
    len: usize,
    fill: impl FnOnce(&mut [u8]),
) -> io::Result<OwnedFd> {
    super::admit(len as u64).map_err(io::Error::other)?;
    let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
    rustix::fs::ftruncate(&fd, len as u64)?;
    if len > 0 {
        // SAFETY: the file was created just above and has not been shared: no other
        // mapping, writer or truncation can exist while this mapping lives. The mapping
        // is dropped before the file is sealed (F_SEAL_WRITE requires that no writable
        // shared mapping remains) and before anyone else can see the file.
        let mut map = unsafe {
            memmap2::MmapOptions::new()
                .len(len)
                .map_mut(fd.as_raw_fd())?
        };
        keep_from_children(&map)?;
        super::advise_huge(&map);
        fill(&mut map);
        drop(map);
    }
    seal_or_copy(fd, name, len as u64)
}

/// Marks a writable shared mapping `MADV_DONTFORK`: a process forked later does not
/// inherit it, so it cannot keep the file from being sealed.
pub fn keep_from_children(map: &memmap2::MmapMut) -> io::Result<()> {
    map.advise(memmap2::Advice::DontFork)
}

/// Seals `fd` (`len` bytes) against any change. If a writable shared mapping of it
/// still exists (`EBUSY`: a child forked before [`keep_from_children`], or a mapping
/// made by other code), returns a fresh memory file holding a copy of its bytes,
/// sealed, instead.
pub fn seal_or_copy(fd: OwnedFd, name: &str, len: u64) -> io::Result<OwnedFd> {
    match rustix::fs::fcntl_add_seals(&fd, ALL_SEALS) {
        Ok(()) => Ok(fd),
        Err(Errno::BUSY) => {
            tracing::debug!(
                name,
                len,
                "a writable mapping outlives the memory file's writer (a forked child?); sealing a copy"
            );
            sealed_copy(&fd, name, len)
        }
        Err(e) => Err(e.into()),
    }
}

/// The seals every memory file carries before it is sent.
const ALL_SEALS: SealFlags = SealFlags::WRITE
    .union(SealFlags::SHRINK)
    .union(SealFlags::GROW)
    .union(SealFlags::SEAL);

/// A sealed memory file holding the first `len` bytes of `src`, copied with
/// `pread`/`write` (never mapped, so nothing can keep it from being sealed).
fn sealed_copy(src: &OwnedFd, name: &str, len: u64) -> io::Result<OwnedFd> {
    let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
    rustix::fs::ftruncate(&fd, len)?;
    let mut out = File::from(fd);
    let mut buf = vec![0u8; (1 << 20).min(len as usize)];
    let mut offset = 0u64;
    while offset < len {
        let want = buf.len().min((len - offset) as usize);
        let n = match rustix::io::pread(src, &mut buf[..want], offset) {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
            Ok(n) => n,
            Err(Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        };
        out.write_all(&buf[..n])?;
        offset += n as u64;
    }
    let fd = OwnedFd::from(out);
    rustix::fs::fcntl_add_seals(&fd, ALL_SEALS)?;
    Ok(fd)
}

/// Why a received memory file was refused.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    /// The file is not sealed against writes, shrinking and growing.
    #[error("shared blob is not sealed against writes, shrinking and growing (seals {seals:#x})")]
    NotSealed {
        /// The seals found.
        seals: u32,
    },
    /// The file is shorter than the header says.
    #[error("shared blob has {actual} bytes but the header says {declared}")]
    TooShort {
        /// What the file holds.
        actual: u64,
        /// What the header claimed.
        declared: u64,
    },
    /// A system call failed.
    #[error("shared blob i/o")]
    Io(#[from] io::Error),
}

/// Maps `len` bytes of a sealed memory file read-only.
pub(crate) fn map_sealed(fd: OwnedFd, len: u64) -> Result<(Bytes, Arc<OwnedFd>), ShmError> {
    let seals = rustix::fs::fcntl_get_seals(&fd).map_err(io::Error::from)?;
    if !seals.contains(SealFlags::WRITE | SealFlags::SHRINK | SealFlags::GROW) {
        return Err(ShmError::NotSealed {
            seals: seals.bits(),
        });
    }
    let actual = rustix::fs::fstat(&fd).map_err(io::Error::from)?.st_size as u64;
    if actual < len {
        return Err(ShmError::TooShort {
            actual,
            declared: len,
        });
    }
    let fd = Arc::new(fd);
    if len == 0 {
        return Ok((Bytes::new(), fd));
    }
    let map_len = usize::try_from(len).map_err(|_| io::Error::other("blob too large to map"))?;
    // SAFETY: memmap2 marks mapping unsafe because another process could modify or
    // truncate the file under us (undefined behaviour for `&[u8]`, SIGBUS on access
    // past the end). The checks above guarantee neither can happen: F_SEAL_WRITE
    // forbids every write (and writable shared mappings), F_SEAL_SHRINK forbids
    // truncation, seals can never be removed, and the file holds at least `len` bytes.
    // The mapping is read-only and private to this process.
    let map = unsafe {
        memmap2::MmapOptions::new()
            .len(map_len)
            .map(fd.as_raw_fd())
            .map_err(ShmError::Io)?
    };
    Ok((super::mapping_bytes(map), fd))
}

/// Whether the inherited secret descriptor was taken already.
static SECRET_FD_TAKEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Reads at most `limit` bytes from the pipe inherited at descriptor `fd`, then closes
/// it. Takes the descriptor at most once per process; refuses one that is not open or
/// not a pipe (and leaves it alone).
pub(crate) fn take_inherited_pipe(fd: i32, limit: usize) -> io::Result<Vec<u8>> {
    use std::io::Read as _;
    if fd < 3 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("descriptor {fd} is a standard stream"),
        ));
    }
    // SAFETY: only borrowed for the two checks below, while this call runs; `fstat` on
    // a closed number fails with EBADF and touches nothing.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    let stat = rustix::fs::fstat(borrowed)?;
    if rustix::fs::FileType::from_raw_mode(stat.st_mode) != rustix::fs::FileType::Fifo {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("descriptor {fd} is not a pipe"),
        ));
    }
    if SECRET_FD_TAKEN.swap(true, std::sync::atomic::Ordering::SeqCst) {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "the inherited descriptor was taken already",
        ));
    }
    // SAFETY: the executor passes this number for this one purpose: the read end of a
    // pipe made for this process alone (checked to be an open pipe above), which no
    // other code of the process knows of. The guard above makes this the only owner,
    // so closing it on drop closes nobody else's descriptor. Exercised by the
    // `secret_pipe` integration test.
    let owned = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let mut out = Vec::new();
    File::from(owned).take(limit as u64).read_to_end(&mut out)?;
    Ok(out)
}

/// How long a TCP peer may stay silent before its connection is declared dead:
/// unacknowledged data for [`TCP_DEAD_AFTER`] (`TCP_USER_TIMEOUT`), or an idle
/// connection whose keepalive probes (after `TCP_KEEPIDLE`, every `TCP_KEEPINTVL`,
/// `TCP_KEEPCNT` of them) go unanswered. Without these a vanished host (cable pulled,
/// node powered off) is noticed only after the kernel's retransmission limit, about
/// 15 minutes, and an idle connection never.
pub(crate) const TCP_DEAD_AFTER: std::time::Duration = std::time::Duration::from_secs(10);

/// Sets keepalive and `TCP_USER_TIMEOUT` on a TCP socket (see [`TCP_DEAD_AFTER`]).
pub(crate) fn tcp_liveness(sock: &std::net::TcpStream) -> io::Result<()> {
    use rustix::net::sockopt;
    use std::time::Duration;
    sockopt::set_socket_keepalive(sock, true)?;
    sockopt::set_tcp_keepidle(sock, Duration::from_secs(4))?;
    sockopt::set_tcp_keepintvl(sock, Duration::from_secs(2))?;
    sockopt::set_tcp_keepcnt(sock, 3)?;
    sockopt::set_tcp_user_timeout(sock, TCP_DEAD_AFTER.as_millis() as u32)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn tcp_sockets_are_watched_for_a_vanished_peer() {
        use rustix::net::sockopt;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let s = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        assert!(!sockopt::socket_keepalive(&s).unwrap());
        tcp_liveness(&s).unwrap();
        // What the kernel now holds for this socket.
        assert!(sockopt::socket_keepalive(&s).unwrap());
        assert_eq!(sockopt::tcp_user_timeout(&s).unwrap(), 10_000);
        assert_eq!(sockopt::tcp_keepcnt(&s).unwrap(), 3);
        assert_eq!(
            sockopt::tcp_keepidle(&s).unwrap(),
            std::time::Duration::from_secs(4)
        );
    }

    #[test]
    fn sealed_memfd_maps_and_reads_back() {
        let fd = sealed_memfd("t", &[b"hello ", b"world"]).unwrap();
        let (bytes, _fd) = map_sealed(fd, 11).unwrap();
        assert_eq!(&bytes[..], b"hello world");
    }

    #[test]
    fn parts_written_at_offsets_leave_zeros_between_and_are_sealed() {
        let fd = sealed_memfd_at("t", 8192 + 3, &[(0, b"ab"), (8192, b"xyz")]).unwrap();
        let seals = rustix::fs::fcntl_get_seals(&fd).unwrap();
        assert!(seals.contains(ALL_SEALS));
        // Sealed: no writer can change it any more.
        assert!(rustix::io::pwrite(&fd, b"q", 0).is_err());
        let (bytes, _fd) = map_sealed(fd, 8195).unwrap();
        assert_eq!(&bytes[..2], b"ab");
        assert!(
            bytes[2..8192].iter().all(|&b| b == 0),
            "a hole reads as zeros"
        );
        assert_eq!(&bytes[8192..], b"xyz");
        let past = sealed_memfd_at("t", 4, &[(2, b"abc")]).unwrap_err();
        assert!(past.to_string().contains("past its end"), "{past}");
        assert!(sealed_memfd_at("t", 4, &[(u64::MAX, b"a")]).is_err());
    }

    #[test]
    fn memfd_filled_in_place_is_sealed_and_maps() {
        let fd = sealed_memfd_with("t", 5, |b| b.copy_from_slice(b"abcde")).unwrap();
        let seals = rustix::fs::fcntl_get_seals(&fd).unwrap();
        assert!(seals.contains(SealFlags::WRITE | SealFlags::SHRINK | SealFlags::SEAL));
        let (bytes, _fd) = map_sealed(fd, 5).unwrap();
        assert_eq!(&bytes[..], b"abcde");
    }

    #[test]
    fn a_file_still_mapped_writable_elsewhere_is_sealed_as_a_copy() {
        // A second writable shared mapping of the file, as a child forked before the
        // advice would hold, makes F_SEAL_WRITE fail with EBUSY.
        let fd =
            rustix::fs::memfd_create("t", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
        let len = (3 << 20) + 5; // more than one copy chunk, not a multiple of it
        rustix::fs::ftruncate(&fd, len as u64).unwrap();
        // SAFETY: test-only mapping of a file created just above; nothing else maps,
        // writes or truncates it while the mapping lives.
        let mut other = unsafe {
            memmap2::MmapOptions::new()
                .len(len)
                .map_mut(fd.as_raw_fd())
                .unwrap()
        };
        for (i, b) in other.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        let err = rustix::fs::fcntl_add_seals(&fd, ALL_SEALS).unwrap_err();
        assert_eq!(err, Errno::BUSY, "the scenario must provoke EBUSY");
        let original = rustix::fs::fstat(&fd).unwrap().st_ino;

        let sealed = seal_or_copy(fd, "t", len as u64).unwrap();
        assert_ne!(rustix::fs::fstat(&sealed).unwrap().st_ino, original);
        let (bytes, _fd) = map_sealed(sealed, len as u64).unwrap();
        assert!(bytes.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8));
        // The copy is what was sealed: later writes through the old mapping stay out.
        other[0] = 99;
        assert_eq!(bytes[0], 0);
    }

    #[test]
    fn sealing_succeeds_in_place_while_a_forked_child_lives() {
        // A child forked while the file is mapped writable does not inherit the mapping
        // (MADV_DONTFORK), so the parent seals the file itself, not a copy.
        let fd =
            rustix::fs::memfd_create("t", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::fs::ftruncate(&fd, 4096).unwrap();
        // SAFETY: test-only mapping of a file created just above.
        let mut map = unsafe {
            memmap2::MmapOptions::new()
                .len(4096)
                .map_mut(fd.as_raw_fd())
                .unwrap()
        };
        keep_from_children(&map).unwrap();
        map[0] = 1;
        let (gate_r, gate_w) = std::io::pipe().unwrap();
        // SAFETY: the child only blocks in `read` on a pipe and leaves with `_exit`:
        // both async-signal-safe; it allocates nothing and takes no lock after the fork.
        let fork = unsafe { nix::unistd::fork() }.unwrap();
        let child = match fork {
            nix::unistd::ForkResult::Child => {
                drop(gate_w); // close(2) only: the end of file must come from the parent
                let mut b = [0u8; 1];
                let _ = rustix::io::read(&gate_r, &mut b);
                // SAFETY: `_exit` ends the child at once, running nothing of the parent's.
                unsafe { nix::libc::_exit(0) }
            }
            nix::unistd::ForkResult::Parent { child } => child,
        };
        drop(gate_r);
        drop(map);
        let ino = rustix::fs::fstat(&fd).unwrap().st_ino;
        let sealed = seal_or_copy(fd, "t", 4096);
        drop(gate_w); // the child reads end of file and exits
        nix::sys::wait::waitpid(child, None).unwrap();
        let sealed = sealed.unwrap();
        assert_eq!(rustix::fs::fstat(&sealed).unwrap().st_ino, ino);
    }

    #[test]
    fn unsealed_memfd_is_refused() {
        let fd = rustix::fs::memfd_create("t", MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, 16).unwrap();
        let err = map_sealed(fd, 16).unwrap_err();
        assert!(matches!(err, ShmError::NotSealed { .. }), "{err}");
    }

    #[test]
    fn short_memfd_is_refused() {
        let fd = sealed_memfd("t", &[b"abc"]).unwrap();
        let err = map_sealed(fd, 4).unwrap_err();
        assert!(
            matches!(
                err,
                ShmError::TooShort {
                    actual: 3,
                    declared: 4
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn descriptors_travel_and_excess_is_refused() {
        let (a, b) = UnixStream::pair().unwrap();
        let f1 = sealed_memfd("x", &[b"1"]).unwrap();
        let f2 = sealed_memfd("y", &[b"2"]).unwrap();
        send_with_fds(&a, &[IoSlice::new(b"ab")], &[f1.as_fd(), f2.as_fd()]).unwrap();
        let mut buf = [0u8; 2];
        let mut fds = Vec::new();
        assert_eq!(recv_with_fds(&b, &mut buf, 4, &mut fds).unwrap(), 2);
        assert_eq!(fds.len(), 2);

        send_with_fds(&a, &[IoSlice::new(b"cd")], &[f1.as_fd(), f2.as_fd()]).unwrap();
        let mut fds = Vec::new();
        let err = recv_with_fds(&b, &mut buf, 1, &mut fds).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }
}
