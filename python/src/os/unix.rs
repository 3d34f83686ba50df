//! Memory files for blobs that Python fills in place or writes over privately.
//!
//! - [`WritableFile`]: a fresh `memfd` with a writable shared mapping that Python fills
//!   through the buffer protocol. [`WritableFile::seal`] turns it into a sealed
//!   [`Blob`] without a copy. `F_SEAL_WRITE` fails (`EBUSY`) while any writable shared
//!   mapping of the file exists, and Python may still hold views (numpy arrays) into
//!   ours, so we cannot unmap it. Instead the range is replaced in place, atomically,
//!   by a private copy-on-write mapping of the same file (`MAP_FIXED | MAP_PRIVATE`):
//!   every view stays valid and reads the same pages, a later write through an old view
//!   lands in a private page of this process (never in the sealed file), and the seal
//!   succeeds. The blob itself reads through its own read-only mapping.
//! - [`private_copy`]: a copy-on-write mapping of a sealed input file, for code that
//!   writes into its input (torch tensors made from it warn otherwise).
//!
//! - [`StagedFile`]: a memory file with its pages allocated and mapped writable, kept
//!   ready for the host's next input of that size (see `host::staging`).
//! - [`FileWriter`]: `pwrite` into a [`WritableFile`] (`SharedBuffer.write_at`): the
//!   kernel's shmem write path takes no page fault and zeroes no page, where a copy
//!   through the fresh mapping faults once per 4 KiB page (where the kernel gives huge
//!   pages only on request, each range is first allocated as huge pages, zeroed, through
//!   a short-lived mapping: the protocol's `os::huge`). A write and the seal exclude each
//!   other: a write lands before the seal or fails with `EPERM` after it.
//!
//! Fork safety: a `fork()` (PyTorch DataLoader workers, `multiprocessing`, `os.fork`)
//! would copy a writable shared mapping into the child, and the write seal then fails
//! with `EBUSY` for as long as the child lives. Every writable shared mapping made here
//! is marked `MADV_DONTFORK`, so children never get it (a child touching such an
//! address faults: it is not mapped there). When sealing still finds one (a child
//! forked between the mapping and the advice, or a mapping made by other code), the
//! bytes are copied into a fresh sealed memory file instead, which is then what is
//! sent (its inode differs from the buffer's).
//!
//! Caveat: the kernel checks the write seal only against shared mappings; the private
//! mapping that replaces ours is what makes sealing possible with live views.
//!
//! - [`trim_heap`]: gives the C heap's free pages back to the kernel once a large input
//!   has been released (glibc keeps freed chunks under its mmap threshold, up to 32 MiB
//!   each, in the process: a transformer's decoded tensors stay resident after they are
//!   freed).

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, PoisonError, RwLock};

use bytes::Bytes;
use rankexec_protocol::{Blob, HugeAllocator};
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::io::Errno;
use rustix::mm::{MapFlags, ProtFlags};

/// A memory file being filled through a writable shared mapping.
pub(crate) struct WritableFile {
    fd: OwnedFd,
    map: Option<memmap2::MmapMut>,
    len: usize,
    /// Huge pages for its `pwrite`s, where the kernel gives them on request.
    huge: Option<HugeAllocator>,
    /// Held (shared) by each [`FileWriter::write_at`] while it writes, and (exclusive) by
    /// [`WritableFile::seal`]: a write lands before the seal or fails after it, never
    /// into a file the seal has already copied (see `seal`'s fallback).
    writes: Arc<RwLock<()>>,
}

impl WritableFile {
    /// A zero-filled memory file of `len` bytes, mapped writable.
    pub(crate) fn create(len: usize) -> io::Result<Self> {
        rankexec_protocol::admit_shared_memory(len as u64).map_err(io::Error::other)?;
        let fd = rustix::fs::memfd_create(
            "rankexec-py-blob",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )?;
        rustix::fs::ftruncate(&fd, len as u64)?;
        let map = if len == 0 {
            None
        } else {
            // SAFETY: the file was created just above and is shared with nobody: no other
            // process can truncate it or map it while this mapping exists. Until it is
            // sealed, only this process (through this mapping) writes it.
            let map = unsafe {
                memmap2::MmapOptions::new()
                    .len(len)
                    .map_mut(fd.as_raw_fd())?
            };
            keep_from_children(&map)?;
            // Its faults allocate huge pages where the kernel allows them on request.
            rankexec_protocol::advise_huge(&map);
            Some(map)
        };
        Ok(WritableFile {
            fd,
            map,
            len,
            huge: HugeAllocator::for_file(len as u64),
            writes: Arc::new(RwLock::new(())),
        })
    }

    /// The mapping's first byte (dangling but aligned when empty) and its length.
    pub(crate) fn raw(&mut self) -> (*mut u8, usize) {
        match self.map.as_mut() {
            Some(m) => (m.as_mut_ptr(), self.len),
            None => (std::ptr::NonNull::dangling().as_ptr(), 0),
        }
    }

    /// A writer holding its own descriptor of the file ([`FileWriter::write_at`]), so
    /// that a write can run without any lock on `self` (one after the seal fails with
    /// `EPERM`).
    pub(crate) fn writer(&self) -> io::Result<FileWriter> {
        Ok(FileWriter {
            fd: self.fd.try_clone()?,
            len: self.len,
            huge: self.huge,
            writes: self.writes.clone(),
        })
    }

    /// The file's inode (to prove two mappings share one file).
    pub(crate) fn inode(&self) -> io::Result<u64> {
        inode(self.fd.as_fd())
    }

    /// Seals the file and returns it as a blob, keeping our mapping valid (now private
    /// copy-on-write; see the module docs).
    pub(crate) fn seal(&mut self) -> io::Result<Blob> {
        // Writes in flight finish first (each is one bounded `pwrite`); later ones fail.
        let writes = self.writes.clone();
        let _no_writes = writes.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(m) = self.map.as_mut() {
            let addr = m.as_mut_ptr().cast::<std::ffi::c_void>();
            // SAFETY: `addr..addr+len` is exactly our own mapping (held by `self.map`,
            // which unmaps it on drop by address and length). MAP_FIXED replaces it in
            // one step with a mapping of the same file, same length, same protection,
            // so every pointer into the range (Python views) stays valid and keeps
            // reading the same contents: the pages come from the same file.
            let got = unsafe {
                rustix::mm::mmap(
                    addr,
                    self.len,
                    ProtFlags::READ | ProtFlags::WRITE,
                    MapFlags::PRIVATE | MapFlags::FIXED,
                    &self.fd,
                    0,
                )
            }?;
            if got != addr {
                return Err(io::Error::other("the kernel moved a MAP_FIXED mapping"));
            }
        }
        match rustix::fs::fcntl_add_seals(&self.fd, ALL_SEALS) {
            Ok(()) => {}
            Err(Errno::BUSY) => {
                // A writable shared mapping of the file lives elsewhere (a child forked
                // before the advice, or one made by other code): send a sealed copy.
                let (ptr, len) = self.raw();
                // SAFETY: `ptr..ptr+len` is our own mapping (now private), valid while
                // `self` is borrowed; the copy reads it once.
                let src = unsafe { std::slice::from_raw_parts(ptr.cast_const(), len) };
                return Blob::shared_with(len, |dst| dst.copy_from_slice(src));
            }
            Err(e) => return Err(e.into()),
        }
        let fd = Arc::new(self.fd.try_clone()?);
        Ok(Blob::from_sealed_memfd(map_read_only(&fd, self.len)?, fd))
    }
}

/// A descriptor of a [`WritableFile`] for `pwrite`s (see [`WritableFile::writer`]).
pub(crate) struct FileWriter {
    fd: OwnedFd,
    len: usize,
    huge: Option<HugeAllocator>,
    writes: Arc<RwLock<()>>,
}

impl FileWriter {
    /// Writes `bytes` at `offset` with `pwrite`, not through a mapping: the kernel's
    /// shmem write path allocates each page without a page fault and without zeroing
    /// it first (about twice as fast as a copy into a fresh mapping on this project's
    /// VM), and every mapping of the file sees the same pages. Refused past the end.
    pub(crate) fn write_at(&self, offset: usize, mut bytes: &[u8]) -> io::Result<()> {
        if offset
            .checked_add(bytes.len())
            .is_none_or(|end| end > self.len)
        {
            return Err(io::Error::other(format!(
                "{} bytes at {offset} do not fit a buffer of {} bytes",
                bytes.len(),
                self.len
            )));
        }
        let mut at = offset as u64;
        let _writing = self.writes.read().unwrap_or_else(PoisonError::into_inner);
        // Huge pages first where the kernel gives them only on request (the protocol's
        // `os::huge`); the `pwrite` then fills them.
        if let Some(h) = &self.huge {
            h.allocate(self.fd.as_fd(), at, bytes.len() as u64);
        }
        while !bytes.is_empty() {
            match rustix::io::pwrite(&self.fd, bytes, at) {
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
}

/// A memory file of a fixed size with its pages allocated and mapped writable, ready
/// to take one payload.
pub(crate) struct StagedFile {
    fd: OwnedFd,
    map: memmap2::MmapMut,
}

impl StagedFile {
    /// A memory file of `len` (> 0) bytes with every page allocated (`MAP_POPULATE`, or
    /// `MADV_HUGEPAGE` then `MADV_POPULATE_WRITE` where the kernel gives huge pages only
    /// on request), admitted against the host's available memory first.
    pub(crate) fn new(len: usize) -> io::Result<StagedFile> {
        rankexec_protocol::admit_shared_memory(len as u64).map_err(io::Error::other)?;
        let fd = rustix::fs::memfd_create(
            "rankexec-staged",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )?;
        rustix::fs::ftruncate(&fd, len as u64)?;
        // Where the kernel gives huge pages on request, the pages are allocated after the
        // mapping is marked for them (`MADV_POPULATE_WRITE`, Linux 5.14); elsewhere, and
        // where that advice is refused, with the mapping (`MAP_POPULATE`).
        let huge = HugeAllocator::for_file(len as u64).is_some();
        let mut options = memmap2::MmapOptions::new();
        options.len(len);
        if !huge {
            options.populate();
        }
        // SAFETY: the file was created just above and is not shared with anyone: no
        // other mapping, writer or truncation can exist while this mapping lives. It is
        // dropped before the file is sealed (sealing needs no writable mapping left).
        let mut map = unsafe { options.map_mut(fd.as_raw_fd())? };
        keep_from_children(&map)?;
        if huge {
            rankexec_protocol::advise_huge(&map);
            if let Err(e) = map.advise(memmap2::Advice::PopulateWrite) {
                tracing::debug!(error = %e, "MADV_POPULATE_WRITE refused; MAP_POPULATE instead");
                drop(map);
                // SAFETY: as above: the file is still ours alone, and the mapping before
                // this one is gone.
                map = unsafe { options.populate().map_mut(fd.as_raw_fd())? };
                keep_from_children(&map)?;
            }
        }
        Ok(StagedFile { fd, map })
    }

    /// Its size in bytes.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Copies each `(offset, bytes)` part in (the parts fit the file and do not
    /// overlap), seals the file, maps it read-only and returns one blob per part, in
    /// order. A file that cannot be sealed (see the module docs) is left behind and the
    /// parts go to a fresh sealed file instead.
    pub(crate) fn fill(mut self, parts: &[(usize, &[u8])]) -> io::Result<Vec<Blob>> {
        let len = self.map.len();
        for (at, src) in parts {
            let end = at
                .checked_add(src.len())
                .filter(|&e| e <= len)
                .ok_or_else(|| io::Error::other("a staged file filled past its end"))?;
            self.map[*at..end].copy_from_slice(src);
        }
        let StagedFile { fd, map } = self;
        drop(map);
        match rustix::fs::fcntl_add_seals(&fd, ALL_SEALS) {
            Ok(()) => {}
            Err(Errno::BUSY) => {
                let lens: Vec<usize> = parts.iter().map(|(_, s)| s.len()).collect();
                return Blob::shared_many(&lens, |bufs| {
                    for (buf, (_, src)) in bufs.iter_mut().zip(parts) {
                        buf.copy_from_slice(src);
                    }
                });
            }
            Err(e) => return Err(e.into()),
        }
        let fd = Arc::new(fd);
        let whole = map_read_only(&fd, len)?;
        Ok(parts
            .iter()
            .map(|(at, src)| {
                Blob::from_sealed_memfd_at(
                    whole.slice(*at..*at + src.len()),
                    fd.clone(),
                    *at as u64,
                )
            })
            .collect())
    }
}

/// The seals a memory file carries before it is sent.
const ALL_SEALS: SealFlags = SealFlags::WRITE
    .union(SealFlags::SHRINK)
    .union(SealFlags::GROW)
    .union(SealFlags::SEAL);

/// Marks a writable shared mapping `MADV_DONTFORK` (see the module docs).
fn keep_from_children(map: &memmap2::MmapMut) -> io::Result<()> {
    map.advise(memmap2::Advice::DontFork)
}

/// Maps `len` bytes of a sealed file read-only.
fn map_read_only(fd: &Arc<OwnedFd>, len: usize) -> io::Result<Bytes> {
    if len == 0 {
        return Ok(Bytes::new());
    }
    // SAFETY: the file is sealed against writes, shrinking and growing (just above, or
    // checked by the protocol before the input blob was mapped), so its contents cannot
    // change and it cannot shrink under the mapping.
    let map = unsafe { memmap2::MmapOptions::new().len(len).map(fd.as_raw_fd())? };
    // Unmapped on the protocol's `unmap` thread once dropped (see its `os::release`).
    Ok(rankexec_protocol::mapping_bytes(map))
}

/// A private copy-on-write mapping of `len` bytes of a sealed memory file from `offset`
/// (a multiple of the page size, as every blob's offset in its file is).
pub(crate) fn private_copy(
    fd: BorrowedFd<'_>,
    offset: u64,
    len: usize,
) -> io::Result<memmap2::MmapMut> {
    // SAFETY: the file is sealed (the protocol checked F_SEAL_WRITE and F_SEAL_SHRINK
    // before the blob was mapped), so nobody can change or shrink it; writes to a
    // private mapping go to this process's own pages.
    unsafe {
        memmap2::MmapOptions::new()
            .offset(offset)
            .len(len)
            .map_copy(fd.as_fd().as_raw_fd())
    }
}

/// The inode of a file descriptor.
pub(crate) fn inode(fd: BorrowedFd<'_>) -> io::Result<u64> {
    Ok(rustix::fs::fstat(fd)?.st_ino)
}

/// Returns the C heap's free pages to the kernel (glibc's `malloc_trim(0)`: the top of
/// each arena is released, and free pages inside it are `MADV_DONTNEED`ed). A state dict
/// decoded by FLARE or Flower is mostly tensors of 1-32 MiB; glibc serves those from its
/// heap once its dynamic mmap threshold has risen (after the first large free), and a
/// freed heap chunk stays in the process's resident memory. Called after a task's input
/// is released (`RankGroup.execute(consume=True)`) and by `rankexec._rankexec.trim_heap`.
/// Returns whether any memory was released. A no-op off glibc.
pub(crate) fn trim_heap() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim takes no pointer and no caller state: it walks glibc's own
        // arenas, each under its own lock, so any thread may call it at any time, with
        // or without other threads allocating.
        unsafe { libc::malloc_trim(0) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}
