//! A sealed memory file's bytes with a few bytes of the caller's just before them, as one
//! read-only range of addresses, without a copy of the file's bytes.
//!
//! Why: a framing that puts a small header right before a large payload (a safetensors
//! item is an 8-byte length, a JSON header, then the tensor's bytes) otherwise costs a
//! copy of the payload per frame. FLARE's download service serves a result one such
//! item per tensor and keeps each item it sent until a garbage collection: a copy of
//! the model in the job process during every upload (BENCHMARKS.md, "A result served
//! from its memory files"). With this, the item is the file's pages themselves.
//!
//! How: one reservation of a page plus the range (anonymous, private); the file's range
//! is mapped over all but its first page (`MAP_FIXED`, which replaces only pages of this
//! reservation, which no one else can be using); the prefix is written at the end of the
//! first page, which is then made read-only. The bytes seen are the prefix, then the
//! file's, contiguous.
//!
//! Caveats:
//! - The file must be sealed against writes and shrinking (checked: a writable file
//!   could change under the view, a shrunk one would fault), the offset a multiple of
//!   the page size, the prefix at most one page.
//! - The view costs one page of the process's own memory; the file's pages are shared
//!   with every other mapping of it, and the view keeps the file alive until dropped.
//! - The range is marked `MADV_DONTFORK`: a forked child (a DataLoader worker) does not
//!   inherit it, so it does not keep the file's memory for its life (a child that reads
//!   it faults).
//! - Dropped views are unmapped in place: with the file held elsewhere no page is freed
//!   by it. A copy of the value in a forked child (which has no such mapping) unmaps
//!   nothing: the pid is checked at the drop.
//! - The reservation is `PROT_NONE` and `MAP_NORESERVE` but for its first page, so it
//!   does not count against a strict commit limit. Should mapping the file over it fail
//!   (a descriptor not open for reading, a mapping limit reached), the range is
//!   reserved again where it is wholly free; where it is not (the failed call left the
//!   reservation, or another thread mapped into a hole it left) the reservation stays
//!   mapped for the life of the process, inaccessible and costing no memory, rather
//!   than being unmapped under someone else's mapping. For rankexec's own memory files,
//!   open for reading, that takes a kernel out of memory for mappings.

use std::ffi::c_void;
use std::io;
use std::os::fd::BorrowedFd;
use std::ptr::NonNull;

use rustix::fs::SealFlags;
use rustix::mm::{Advice, MapFlags, MprotectFlags, ProtFlags};

use super::memory::page_size;

/// Why a [`PrefixedMap`] could not be made.
#[derive(Debug, thiserror::Error)]
pub enum PrefixError {
    /// The file could change or shrink under the view.
    #[error("the memory file is not sealed against writes and shrinking")]
    NotSealed,
    /// The range does not start at a page of the file.
    #[error("offset {0} is not at a page boundary")]
    Unaligned(u64),
    /// The prefix does not fit in the one page before the range.
    #[error("a prefix of {len} bytes is longer than a page ({page})")]
    LongPrefix {
        /// The prefix's length.
        len: usize,
        /// The page size.
        page: usize,
    },
    /// The range is not all in the file.
    #[error("bytes {offset}..{end} are not all in the file's {size}")]
    PastEnd {
        /// Where the range starts.
        offset: u64,
        /// Where it ends.
        end: u64,
        /// The file's size.
        size: u64,
    },
    /// A system call failed.
    #[error("mapping the memory file")]
    Io(#[from] io::Error),
}

/// `prefix` followed by `len` bytes of a sealed memory file, read-only, at one range of
/// addresses (see the module docs).
#[derive(Debug)]
pub struct PrefixedMap {
    /// The reservation: one page, then the file's range rounded up to pages.
    base: NonNull<c_void>,
    total: usize,
    /// Where the prefix starts within the reservation, and the view's length.
    start: usize,
    len: usize,
    /// The process that mapped it: a forked child's copy unmaps nothing.
    pid: u32,
}

// SAFETY: the mapping is read-only for its whole life (the prefix page is made read-only
// before the value is returned, the file's pages are mapped read-only and sealed), so
// sharing or sending the pointer between threads cannot race on the bytes; only `Drop`
// unmaps it, and it has `&mut self`.
unsafe impl Send for PrefixedMap {}
// SAFETY: as for `Send`: nothing is ever written through the pointer.
unsafe impl Sync for PrefixedMap {}

impl PrefixedMap {
    /// Maps `prefix` then the bytes `offset..offset + len` of the memory file `fd`.
    pub fn new(
        fd: BorrowedFd<'_>,
        offset: u64,
        len: usize,
        prefix: &[u8],
    ) -> Result<PrefixedMap, PrefixError> {
        let page = page_size() as usize;
        if !offset.is_multiple_of(page as u64) {
            return Err(PrefixError::Unaligned(offset));
        }
        if prefix.len() > page {
            return Err(PrefixError::LongPrefix {
                len: prefix.len(),
                page,
            });
        }
        let seals = rustix::fs::fcntl_get_seals(fd).map_err(io::Error::from)?;
        if !seals.contains(SealFlags::WRITE | SealFlags::SHRINK) {
            return Err(PrefixError::NotSealed);
        }
        let size = rustix::fs::fstat(fd).map_err(io::Error::from)?.st_size as u64;
        let end = offset.saturating_add(len as u64);
        if end > size {
            return Err(PrefixError::PastEnd { offset, end, size });
        }
        let file_len = len.div_ceil(page) * page;
        let total = page + file_len;
        // SAFETY: a fresh anonymous private mapping at an address the kernel chooses:
        // it overlaps nothing that exists.
        let raw = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                total,
                ProtFlags::empty(),
                MapFlags::PRIVATE | MapFlags::NORESERVE,
            )
        }
        .map_err(io::Error::from)?;
        let base = NonNull::new(raw).ok_or_else(|| io::Error::other("mmap returned null"))?;
        // From here the reservation is ours: `Drop` unmaps it on every path below.
        let map = PrefixedMap {
            base,
            total,
            start: page - prefix.len(),
            len: prefix.len() + len,
            pid: std::process::id(),
        };
        // SAFETY: the reservation's first page, which only this value knows of.
        unsafe { rustix::mm::mprotect(raw, page, MprotectFlags::READ | MprotectFlags::WRITE) }
            .map_err(io::Error::from)?;
        if file_len > 0 {
            // SAFETY: `[base + page, base + total)` is inside the reservation made above,
            // which only this value knows of; MAP_FIXED replaces those pages of it and
            // nothing else. The file is sealed against writes and shrinking (checked
            // above) and holds the whole range but for the last page's tail, which reads
            // as zeros and is not part of the view.
            let file_at = unsafe { raw.cast::<u8>().add(page).cast::<c_void>() };
            // SAFETY: as above.
            let mapped = unsafe {
                rustix::mm::mmap(
                    file_at,
                    file_len,
                    ProtFlags::READ,
                    MapFlags::SHARED | MapFlags::FIXED,
                    fd,
                    offset,
                )
            };
            if let Err(e) = mapped {
                // A failed MAP_FIXED may have removed part of the reservation already,
                // and another thread's mapping may have landed in the hole since:
                // reserve the range again only where it is wholly free
                // (MAP_FIXED_NOREPLACE), so that the drop unmaps only ours; otherwise the
                // reservation is left in place, never unmapped (address space, no memory).
                // SAFETY: MAP_FIXED_NOREPLACE maps nothing over an existing mapping: it
                // fails instead.
                let again = unsafe {
                    rustix::mm::mmap_anonymous(
                        file_at,
                        file_len,
                        ProtFlags::empty(),
                        MapFlags::PRIVATE | MapFlags::NORESERVE | MapFlags::FIXED_NOREPLACE,
                    )
                };
                if again.is_err() {
                    std::mem::forget(map);
                }
                return Err(PrefixError::Io(e.into()));
            }
        }
        // SAFETY: the first page is the reservation's own, writable, and `start + prefix`
        // ends at its end (`prefix.len() <= page`, checked above).
        unsafe {
            std::ptr::copy_nonoverlapping(
                prefix.as_ptr(),
                raw.cast::<u8>().add(map.start),
                prefix.len(),
            );
        }
        // SAFETY: the first page of the reservation; made read-only, as the rest is.
        unsafe { rustix::mm::mprotect(raw, page, MprotectFlags::READ) }.map_err(io::Error::from)?;
        // SAFETY: advice on the reservation only; it changes no byte of it.
        unsafe { rustix::mm::madvise(raw, total, Advice::LinuxDontFork) }
            .map_err(io::Error::from)?;
        Ok(map)
    }

    /// The length of the prefix and the file's bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no bytes at all (no prefix, an empty range).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The prefix and the file's bytes. In a forked child the range is not mapped
    /// (`MADV_DONTFORK`): reading it there faults.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `[start, start + len)` lies within the reservation (the prefix ends at
        // the first page's end, the file's `len` bytes follow it), which is mapped
        // read-only for as long as `self` lives.
        unsafe {
            std::slice::from_raw_parts(self.base.as_ptr().cast::<u8>().add(self.start), self.len)
        }
    }
}

impl Drop for PrefixedMap {
    fn drop(&mut self) {
        if self.pid != std::process::id() {
            // A forked child's copy: the child has no such mapping (`MADV_DONTFORK`),
            // and the range may be something else of its own now.
            return;
        }
        // SAFETY: the reservation made in `new`, unmapped once, here, in the process
        // that made it; `as_slice`'s borrows of it have ended (they borrow `self`).
        if let Err(e) = unsafe { rustix::mm::munmap(self.base.as_ptr(), self.total) } {
            tracing::warn!(error = %e, "unmapping a prefixed view failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::os::page_mapped;
    use std::os::fd::{AsFd, OwnedFd};

    use rustix::fs::MemfdFlags;

    use super::*;

    fn memfd(bytes: &[u8], seals: SealFlags) -> OwnedFd {
        let fd = rustix::fs::memfd_create("prefixed-test", MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::io::write(&fd, bytes).unwrap();
        rustix::fs::fcntl_add_seals(&fd, seals).unwrap();
        fd
    }

    fn sealed(bytes: &[u8]) -> OwnedFd {
        memfd(
            bytes,
            SealFlags::WRITE | SealFlags::SHRINK | SealFlags::GROW,
        )
    }

    fn mapped_from(addr: usize) -> Option<String> {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        maps.lines().find_map(|l| {
            let (lo, hi) = l.split_whitespace().next()?.split_once('-')?;
            let (lo, hi) = (
                usize::from_str_radix(lo, 16).ok()?,
                usize::from_str_radix(hi, 16).ok()?,
            );
            (lo <= addr && addr < hi).then(|| l.to_owned())
        })
    }

    #[test]
    fn the_prefix_then_the_files_bytes_without_a_copy() {
        let page = page_size() as usize;
        let data: Vec<u8> = (0..3 * page + 100).map(|i| (i % 251) as u8).collect();
        let fd = sealed(&data);
        let m = PrefixedMap::new(fd.as_fd(), page as u64, 2 * page + 7, b"header!").unwrap();
        let s = m.as_slice();
        assert_eq!(&s[..7], b"header!");
        assert_eq!(&s[7..], &data[page..3 * page + 7]);
        // The payload is the file's own pages (a shared mapping of the memfd), the
        // prefix in an anonymous page right before it.
        let payload = mapped_from(s[7..].as_ptr() as usize).unwrap();
        assert!(payload.contains("/memfd:prefixed-test"), "{payload}");
        let head = mapped_from(s.as_ptr() as usize).unwrap();
        assert!(!head.contains("memfd"), "{head}");
        let addr = s.as_ptr() as usize;
        drop(m);
        assert!(mapped_from(addr).is_none(), "unmapped on drop");
    }

    #[test]
    fn a_whole_page_of_prefix_an_empty_range_and_refusals() {
        let page = page_size() as usize;
        let fd = sealed(&vec![7u8; 2 * page]);
        let full = vec![1u8; page];
        let m = PrefixedMap::new(fd.as_fd(), 0, page, &full).unwrap();
        assert_eq!(m.as_slice().len(), 2 * page);
        assert!(m.as_slice()[..page].iter().all(|&b| b == 1));
        assert!(m.as_slice()[page..].iter().all(|&b| b == 7));
        let empty = PrefixedMap::new(fd.as_fd(), page as u64, 0, b"h").unwrap();
        assert_eq!(empty.as_slice(), b"h");

        let long = vec![0u8; page + 1];
        assert!(matches!(
            PrefixedMap::new(fd.as_fd(), 0, 1, &long),
            Err(PrefixError::LongPrefix { .. })
        ));
        assert!(matches!(
            PrefixedMap::new(fd.as_fd(), 1, 1, b""),
            Err(PrefixError::Unaligned(1))
        ));
        assert!(matches!(
            PrefixedMap::new(fd.as_fd(), page as u64, page + 1, b""),
            Err(PrefixError::PastEnd { .. })
        ));
        // Mapping the file itself fails (a descriptor opened write-only cannot be mapped
        // for reading): an i/o error; the reservation is not unmapped blindly.
        let write_only = std::fs::OpenOptions::new()
            .write(true)
            .open(format!(
                "/proc/self/fd/{}",
                std::os::fd::AsRawFd::as_raw_fd(&fd)
            ))
            .unwrap();
        assert!(matches!(
            PrefixedMap::new(write_only.as_fd(), 0, page, b"h"),
            Err(PrefixError::Io(_))
        ));
        let writable = memfd(&[0u8; 64], SealFlags::empty());
        assert!(matches!(
            PrefixedMap::new(writable.as_fd(), 0, 64, b""),
            Err(PrefixError::NotSealed)
        ));
    }

    #[test]
    fn a_forked_child_does_not_inherit_it() {
        let page = page_size() as usize;
        let fd = sealed(&vec![3u8; page]);
        let m = PrefixedMap::new(fd.as_fd(), 0, page, b"x").unwrap();
        let (head, payload) = (
            m.as_slice().as_ptr() as usize,
            m.as_slice()[1..].as_ptr() as usize,
        );
        // SAFETY: between fork and `_exit` the child calls `mincore` and `mmap` and drops
        // its copy of `m` (a pid check): system calls only, no allocation and no lock
        // another thread may have held.
        match unsafe { nix::unistd::fork() }.unwrap() {
            nix::unistd::ForkResult::Child => {
                let mut code = i32::from(page_mapped(head) || page_mapped(payload));
                // The child's copy of the value must not unmap what is at its addresses
                // in the child now: a page of the child's own there stays mapped.
                let at = (head - head % page) as *mut c_void;
                // SAFETY: a system call mapping one anonymous page where nothing is
                // mapped in this child (checked just above); no allocation.
                let own = unsafe {
                    rustix::mm::mmap_anonymous(
                        at,
                        page,
                        ProtFlags::READ,
                        MapFlags::PRIVATE | MapFlags::FIXED_NOREPLACE,
                    )
                };
                drop(m);
                if own.is_err() || !page_mapped(head) {
                    code = 2;
                }
                // SAFETY: `_exit` ends the child at once, running nothing of the parent's.
                unsafe { nix::libc::_exit(code) }
            }
            nix::unistd::ForkResult::Parent { child } => {
                let status = nix::sys::wait::waitpid(child, None).unwrap();
                assert_eq!(
                    status,
                    nix::sys::wait::WaitStatus::Exited(child, 0),
                    "the child inherited the view"
                );
                assert!(
                    page_mapped(head) && page_mapped(payload),
                    "the parent's is intact"
                );
            }
        }
        drop(m);
    }
}
