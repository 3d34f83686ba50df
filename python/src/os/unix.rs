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
//! Caveat: the kernel checks the write seal only against shared mappings; the private
//! mapping that replaces ours is what makes sealing possible with live views.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use bytes::Bytes;
use rankexec_protocol::Blob;
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

/// A memory file being filled through a writable shared mapping.
pub(crate) struct WritableFile {
    fd: OwnedFd,
    map: Option<memmap2::MmapMut>,
    len: usize,
}

impl WritableFile {
    /// A zero-filled memory file of `len` bytes, mapped writable.
    pub(crate) fn create(len: usize) -> io::Result<Self> {
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
            Some(unsafe {
                memmap2::MmapOptions::new()
                    .len(len)
                    .map_mut(fd.as_raw_fd())?
            })
        };
        Ok(WritableFile { fd, map, len })
    }

    /// The mapping's first byte (dangling but aligned when empty) and its length.
    pub(crate) fn raw(&mut self) -> (*mut u8, usize) {
        match self.map.as_mut() {
            Some(m) => (m.as_mut_ptr(), self.len),
            None => (std::ptr::NonNull::dangling().as_ptr(), 0),
        }
    }

    /// The file's inode (to prove two mappings share one file).
    pub(crate) fn inode(&self) -> io::Result<u64> {
        inode(self.fd.as_fd())
    }

    /// Seals the file and returns it as a blob, keeping our mapping valid (now private
    /// copy-on-write; see the module docs).
    pub(crate) fn seal(&mut self) -> io::Result<Blob> {
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
        rustix::fs::fcntl_add_seals(
            &self.fd,
            SealFlags::WRITE | SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL,
        )?;
        let fd = Arc::new(self.fd.try_clone()?);
        Ok(Blob::from_sealed_memfd(map_read_only(&fd, self.len)?, fd))
    }
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
    Ok(Bytes::from_owner(map))
}

/// A private copy-on-write mapping of `len` bytes of a sealed memory file.
pub(crate) fn private_copy(fd: BorrowedFd<'_>, len: usize) -> io::Result<memmap2::MmapMut> {
    // SAFETY: the file is sealed (the protocol checked F_SEAL_WRITE and F_SEAL_SHRINK
    // before the blob was mapped), so nobody can change or shrink it; writes to a
    // private mapping go to this process's own pages.
    unsafe {
        memmap2::MmapOptions::new()
            .len(len)
            .map_copy(fd.as_fd().as_raw_fd())
    }
}

/// The inode of a file descriptor.
pub(crate) fn inode(fd: BorrowedFd<'_>) -> io::Result<u64> {
    Ok(rustix::fs::fstat(fd)?.st_ino)
}
