//! How much memory a new memory file may take: the admission check every blob that is
//! copied into shared memory passes first.
//!
//! A memory file's pages are ordinary shared memory: writing one larger than what the
//! host can give does not fail cleanly, it wakes the OOM killer (which may pick the
//! FLARE client, the SuperNode, or a rank) or, inside a container, kills the cgroup.
//! So before a file of `len` bytes is created the bytes are checked against what the
//! kernel says is available: `MemAvailable` from `/proc/meminfo`, and, when this
//! process runs in a cgroup (v2) with a memory limit, that limit less what the cgroup
//! uses. A refusal names both sizes.
//!
//! Caveats: the figure is a snapshot (another process may take the memory a moment
//! later) and `MemAvailable` is the kernel's estimate; a host where neither file can
//! be read is not checked (the files exist on every Linux since 3.14).

use std::fs;

/// Why a memory file was not created.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "{needed} bytes ({needed_h}) of shared memory are needed but only {available} bytes ({available_h}) are available on this host"
)]
pub struct NoMemory {
    /// The bytes asked for.
    pub needed: u64,
    /// The bytes available (the smaller of `MemAvailable` and the cgroup's headroom).
    pub available: u64,
    needed_h: Human,
    available_h: Human,
}

impl NoMemory {
    fn new(needed: u64, available: u64) -> NoMemory {
        NoMemory {
            needed,
            available,
            needed_h: Human(needed),
            available_h: Human(available),
        }
    }
}

/// A byte count in GiB/MiB/KiB for messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Human(u64);

impl std::fmt::Display for Human {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let b = self.0 as f64;
        if self.0 >= 1 << 30 {
            write!(f, "{:.2} GiB", b / f64::from(1u32 << 30))
        } else if self.0 >= 1 << 20 {
            write!(f, "{:.1} MiB", b / f64::from(1u32 << 20))
        } else {
            write!(f, "{:.1} KiB", b / 1024.0)
        }
    }
}

/// The system's page size: offsets of blobs inside a shared memory file are multiples
/// of it, so that a receiver can map any one of them on its own.
pub(crate) fn page_size() -> u64 {
    rustix::param::page_size() as u64
}

/// `n` rounded up to a multiple of the page size (where a blob may start in a shared
/// memory file).
pub fn page_align(n: u64) -> u64 {
    let p = page_size();
    n.div_ceil(p).saturating_mul(p)
}

/// Whether two descriptors name the same file (device and inode).
pub(crate) fn same_file(a: &std::os::fd::OwnedFd, b: &std::os::fd::OwnedFd) -> bool {
    match (rustix::fs::fstat(a), rustix::fs::fstat(b)) {
        (Ok(x), Ok(y)) => x.st_dev == y.st_dev && x.st_ino == y.st_ino,
        _ => false,
    }
}

/// Bytes of memory a new memory file can take now, or None when it cannot be read.
pub fn available_memory() -> Option<u64> {
    let host = mem_available(&fs::read_to_string("/proc/meminfo").ok()?);
    let cgroup = cgroup_headroom();
    match (host, cgroup) {
        (Some(h), Some(c)) => Some(h.min(c)),
        (h, c) => h.or(c),
    }
}

/// Checks that `len` bytes of shared memory can be created now (every memory file
/// rankexec creates passes this first).
pub fn admit(len: u64) -> Result<(), NoMemory> {
    match available_memory() {
        Some(available) if len > available => Err(NoMemory::new(len, available)),
        _ => Ok(()),
    }
}

fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}

/// The cgroup v2 memory limit less current use, for this process's cgroup.
fn cgroup_headroom() -> Option<u64> {
    let own = fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = own.lines().find_map(|l| l.strip_prefix("0::"))?;
    let dir = format!("/sys/fs/cgroup{}", path.trim_end());
    let max = fs::read_to_string(format!("{dir}/memory.max")).ok()?;
    let max: u64 = max.trim().parse().ok()?; // "max" (no limit) does not parse
    let current: u64 = fs::read_to_string(format!("{dir}/memory.current"))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(max.saturating_sub(current))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_available_is_read_in_bytes() {
        let info = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   2048 kB\n";
        assert_eq!(mem_available(info), Some(2048 * 1024));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn this_host_reports_memory_and_refuses_more_than_it_has() {
        let avail = available_memory().expect("/proc/meminfo is readable on Linux");
        assert!(avail > 0);
        let e = admit(avail.saturating_mul(4).max(1 << 40)).unwrap_err();
        assert!(e.to_string().contains("are available on this host"), "{e}");
        assert!(admit(4096).is_ok());
    }

    #[test]
    fn offsets_are_page_aligned() {
        let p = page_size();
        assert_eq!(page_align(0), 0);
        assert_eq!(page_align(1), p);
        assert_eq!(page_align(p), p);
        assert_eq!(page_align(p + 1), 2 * p);
    }
}
