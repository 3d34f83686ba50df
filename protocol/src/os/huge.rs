//! Huge pages for memory files, where the host's kernel allows them.
//!
//! A memory file's pages are 4 KiB unless the kernel's transparent huge pages for shared
//! memory are on (`/sys/kernel/mm/transparent_hugepage/shmem_enabled`, the host
//! administrator's setting; [`ShmemHugePages`]). With 4 KiB pages every process that
//! maps a model takes a page fault per 64 KiB (the kernel's fault-around): about 32,000
//! for 2 GiB, 130-500 ms per reader on this project's 2-core VM, paid by every rank that
//! reads its input and by the host that reads a result. With 2 MiB pages a reader takes
//! one fault per 2 MiB (the page is mapped whole): 1,024 faults, 12-66 ms there, and the
//! copy into the file allocates 512 pages per GiB instead of 262,144.
//!
//! What each setting needs from us:
//! - `always`, `within_size`, `force`: nothing. The kernel's write path (`pwrite`, what
//!   every copy into a memory file here uses) allocates huge pages by itself.
//! - `advise`: only a mapping marked `MADV_HUGEPAGE` gets them, and `pwrite` has no
//!   mapping. So a [`HugeAllocator`] first allocates the ranges about to be written
//!   through such a mapping (`MADV_POPULATE_WRITE`), and the `pwrite` that follows finds
//!   its pages in place. Writable mappings that code fills in place
//!   (`Blob::shared_with`, Python's `SharedBuffer`) are marked `MADV_HUGEPAGE` too
//!   ([`advise_huge`]), so their faults allocate huge pages.
//! - `never` (most distributions' default), `deny`: 4 KiB pages; nothing changes here.
//!
//! Caveats: the setting is read once per new memory file (a few small sysfs reads; an
//! administrator's change applies to the next file); a PMD size other than 2 MiB is read
//! from `hpage_pmd_size`. The allocating mapping is shared and writable for a moment,
//! so a `fork()` on another thread before its `MADV_DONTFORK` can leave a child holding
//! it: sealing then fails with `EBUSY`, and callers fall back to sealing a copy, as for
//! any mapping (`os::unix`). A file's last part shorter than a huge page stays in 4 KiB
//! pages (a mapping cannot map it whole), and is not allocated ahead. Of the per-size settings (`hugepages-*kB/shmem_enabled`,
//! Linux 6.11), only the PMD size's is read, `inherit` meaning the global one.
//! Allocation is best effort: a kernel without `MADV_POPULATE_WRITE` (before 5.14), a
//! range the kernel cannot back with huge pages (memory too fragmented), or a refused
//! mapping leaves the `pwrite` to allocate 4 KiB pages as before, and the error (which
//! the `pwrite` will meet again if it is real, such as no memory) is logged at debug.
//! Populating zeroes the pages before the `pwrite` fills them: a second pass over the
//! memory, cheaper than the faults it saves.

use std::os::fd::{AsRawFd, BorrowedFd};

const ROOT: &str = "/sys/kernel/mm/transparent_hugepage";

/// The kernel's policy for huge pages in memory files (`shmem_enabled`, the value its
/// brackets select).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShmemHugePages {
    /// Every memory file large enough gets huge pages.
    Always,
    /// Huge pages where the file's size covers them.
    WithinSize,
    /// Only ranges mapped with `MADV_HUGEPAGE` get them.
    Advise,
    /// None (most distributions' default).
    Never,
    /// None, not even for mounts that ask (an emergency setting).
    Deny,
    /// Every mount gets them, even one that asked for none (a testing setting).
    Force,
    /// No such setting (a kernel without transparent huge pages), or one not understood.
    Unknown,
}

impl ShmemHugePages {
    /// The setting in effect now for PMD-size pages: the per-size one where it is not
    /// `inherit`, the global one otherwise.
    pub fn current() -> ShmemHugePages {
        let per_size = pmd_size_kib()
            .and_then(|kib| read(&format!("{ROOT}/hugepages-{kib}kB/shmem_enabled")))
            .filter(|s| s != "inherit");
        match per_size.or_else(|| read(&format!("{ROOT}/shmem_enabled"))) {
            Some(s) => Self::parse(&s),
            None => ShmemHugePages::Unknown,
        }
    }

    /// The setting named `s` (what the kernel prints between brackets).
    pub fn parse(s: &str) -> ShmemHugePages {
        match s {
            "always" => ShmemHugePages::Always,
            "within_size" => ShmemHugePages::WithinSize,
            "advise" => ShmemHugePages::Advise,
            "never" => ShmemHugePages::Never,
            "deny" => ShmemHugePages::Deny,
            "force" => ShmemHugePages::Force,
            _ => ShmemHugePages::Unknown,
        }
    }
}

/// The selected value of a sysfs setting (`a [b] c` → `b`).
fn read(path: &str) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let (_, rest) = text.split_once('[')?;
    let (value, _) = rest.split_once(']')?;
    Some(value.to_owned())
}

/// The PMD page size in KiB (2048 on x86-64 and 4 KiB-page arm64).
fn pmd_size_kib() -> Option<u64> {
    std::fs::read_to_string(format!("{ROOT}/hpage_pmd_size"))
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()
        .map(|b| b >> 10)
}

/// The PMD page size in bytes: `hpage_pmd_size` where it reads as a power of two of
/// 4 KiB or more, 2 MiB otherwise.
fn pmd_size() -> u64 {
    pmd_size_kib()
        .map(|k| k << 10)
        .filter(|b| b.is_power_of_two() && *b >= 4096)
        .unwrap_or(2 << 20)
}

/// Allocates ranges of one new memory file as huge pages ahead of their `pwrite`, where
/// the kernel gives memory files huge pages only on request (`advise`). Made once per
/// file ([`HugeAllocator::for_file`]: the setting is read then), used for each range.
#[derive(Debug, Clone, Copy)]
pub struct HugeAllocator {
    huge: u64,
    /// The file's length rounded down to whole huge pages: no range is allocated past
    /// it (a shorter tail cannot be one huge page).
    whole: u64,
}

impl HugeAllocator {
    /// An allocator for a new memory file of `file_len` bytes: `None` under any setting
    /// but `advise` or for a file smaller than one huge page (nothing to do then).
    pub fn for_file(file_len: u64) -> Option<HugeAllocator> {
        let huge = pmd_size();
        if file_len < huge || ShmemHugePages::current() != ShmemHugePages::Advise {
            return None;
        }
        Some(HugeAllocator {
            huge,
            whole: file_len - file_len % huge,
        })
    }

    /// Allocates the pages of `fd` (the writable memory file this allocator was made
    /// for) under `offset..offset + len`, rounded out to whole huge pages within the
    /// file, as huge pages. Rounded out, because a model's small tensors (norms, biases)
    /// lie between its large ones: a 4 KiB write allocates the huge page around it, which
    /// the writes next to it then fill, where a 4 KiB page of its own would keep that
    /// 2 MiB from ever being one huge page. Returns whether anything was allocated so; a
    /// refusal is logged at debug (see the module docs).
    pub fn allocate(&self, fd: BorrowedFd<'_>, offset: u64, len: u64) -> bool {
        let huge = self.huge;
        if len == 0 {
            return false;
        }
        let start = offset - offset % huge;
        let end = offset
            .saturating_add(len)
            .div_ceil(huge)
            .saturating_mul(huge)
            .min(self.whole);
        if end <= start {
            return false;
        }
        let populate = || -> std::io::Result<()> {
            let map = memmap2::MmapOptions::new()
                .offset(start)
                .len(usize::try_from(end - start).map_err(std::io::Error::other)?)
                .map_raw(fd.as_raw_fd())?;
            // Never inherited: a child forked while it lives would keep the file from
            // being sealed (see the module docs for the moment before this advice).
            map.advise(memmap2::Advice::DontFork)?;
            map.advise(memmap2::Advice::HugePage)?;
            map.advise(memmap2::Advice::PopulateWrite)
        };
        match populate() {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!(offset, len, error = %e, "huge pages not allocated");
                false
            }
        }
    }
}

/// Marks a writable mapping of a memory file `MADV_HUGEPAGE`, so that its faults
/// allocate huge pages under `advise`; elsewhere the advice changes nothing. Best
/// effort: a refusal is logged at debug.
pub fn advise_huge(map: &memmap2::MmapMut) {
    if map.len() as u64 >= pmd_size()
        && let Err(e) = map.advise(memmap2::Advice::HugePage)
    {
        tracing::debug!(error = %e, "MADV_HUGEPAGE refused");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bracketed_value_is_the_setting() {
        assert_eq!(
            ShmemHugePages::parse("advise"),
            ShmemHugePages::Advise,
            "parse"
        );
        assert_eq!(ShmemHugePages::parse("madvise"), ShmemHugePages::Unknown);
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("shmem_enabled");
        std::fs::write(&p, "always within_size advise [never] deny force\n").unwrap();
        assert_eq!(read(p.to_str().unwrap()).as_deref(), Some("never"));
        std::fs::write(&p, "no brackets\n").unwrap();
        assert_eq!(read(p.to_str().unwrap()), None);
    }

    #[test]
    fn a_small_file_or_a_setting_other_than_advise_gets_no_allocator() {
        assert!(
            HugeAllocator::for_file(1 << 20).is_none(),
            "under one huge page"
        );
        let advised = ShmemHugePages::current() == ShmemHugePages::Advise;
        assert_eq!(HugeAllocator::for_file(64 << 20).is_some(), advised);
        let a = HugeAllocator {
            huge: 2 << 20,
            whole: 4 << 20,
        };
        let fd = rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, (5 << 20) + 4096).unwrap();
        use std::os::fd::AsFd;
        assert!(!a.allocate(fd.as_fd(), 0, 0), "an empty range");
        assert!(
            !a.allocate(fd.as_fd(), 4 << 20, 4096),
            "in the tail past the whole pages"
        );
        // The range is allocated (as huge pages or not: that is the kernel's setting),
        // rounded out to whole huge pages and no further than the whole ones.
        assert!(a.allocate(fd.as_fd(), (1 << 20) + 4096, 4096));
        assert_eq!(rustix::fs::fstat(&fd).unwrap().st_blocks * 512, 2 << 20);
        assert!(a.allocate(fd.as_fd(), (3 << 20) + 1, 2 << 20));
        assert_eq!(rustix::fs::fstat(&fd).unwrap().st_blocks * 512, 4 << 20);
    }
}
