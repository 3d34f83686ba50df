//! Large read-only mappings are unmapped on a thread of their own, not by whoever drops
//! them last.
//!
//! Why: undoing a mapping whose pages were read costs the kernel a walk of its page
//! tables, and when the mapping holds the last reference to its memory file, freeing
//! every page of the file too: about 250 ms for 1 GiB on this project's 2-core VM. A
//! rank lets go of a large input inside its task (sub_worker's `run_task`: a model's
//! memory is given back as soon as the executor is done with it, not after the result
//! is sent), so that cost fell between the task's end and its result, on every task's
//! critical path: `rankexec bench`'s 1 GiB fan-out measured 1.4-1.5x one memcpy with it
//! and 1.05-1.16x without it (BENCHMARKS.md, "The 1 GiB fan-out"). A mapping of at least
//! [`DEFER_FROM`] bytes is therefore handed to one background thread (`unmap`), which
//! drops the mappings in the order they come.
//!
//! Caveats:
//! - The memory goes back a moment after the drop, not during it. Code that checks
//!   `/proc/PID/maps` right after a drop must wait for the mapping to go.
//! - At most [`BACKLOG`] mappings wait at once; past that, and whenever the thread
//!   cannot be started, the dropping thread unmaps in place. Nothing blocks.
//! - In a forked child (a DataLoader worker) the thread does not exist: the pid is
//!   checked at every drop, and a child unmaps in place without touching the channel.
//!   A mapping waiting in the queue is marked `MADV_DONTFORK`, so a child forked in
//!   that moment does not inherit it (and keep its file's pages for its whole life).
//! - The thread is never joined: at process exit the kernel undoes what is left.

use std::sync::OnceLock;
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};

use bytes::Bytes;
use memmap2::Mmap;

/// Mappings of at least this many bytes are unmapped on the `unmap` thread.
pub const DEFER_FROM: usize = 16 << 20;

/// How many mappings may wait for the `unmap` thread before drops unmap in place.
pub const BACKLOG: usize = 64;

/// The `unmap` thread's queue, and the pid of the process that started it.
struct Releaser {
    pid: u32,
    queue: SyncSender<Mmap>,
}

static RELEASER: OnceLock<Option<Releaser>> = OnceLock::new();

fn releaser() -> Option<&'static Releaser> {
    RELEASER
        .get_or_init(|| {
            let (queue, rx) = sync_channel::<Mmap>(BACKLOG);
            let started = std::thread::Builder::new()
                .name("unmap".into())
                .spawn(move || {
                    // Each mapping is dropped (munmap) as it comes; the loop ends only
                    // if every sender is gone, which a static's never is.
                    for map in rx {
                        drop(map);
                    }
                });
            match started {
                Ok(_) => Some(Releaser {
                    pid: std::process::id(),
                    queue,
                }),
                Err(e) => {
                    tracing::debug!(error = %e, "no unmap thread: large mappings are unmapped in place");
                    None
                }
            }
        })
        .as_ref()
}

/// A read-only mapping whose drop hands it to the `unmap` thread when it is large.
struct Mapping(Option<Mmap>);

impl AsRef<[u8]> for Mapping {
    fn as_ref(&self) -> &[u8] {
        match &self.0 {
            Some(map) => map,
            None => &[],
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        let Some(map) = self.0.take() else { return };
        if map.len() < DEFER_FROM {
            return; // `map` is unmapped here
        }
        let Some(r) = releaser() else { return };
        if r.pid != std::process::id() {
            return; // a forked child: no thread behind the queue
        }
        // A child forked while the mapping waits (a DataLoader worker) must not inherit
        // it: it would keep the file's pages for the child's life. Best effort: a
        // mapping the advice fails on is unmapped all the same.
        let _ = map.advise(memmap2::Advice::DontFork);
        match r.queue.try_send(map) {
            Ok(()) => {}
            // Unmapped in place: the backlog is full, or the thread is gone.
            Err(TrySendError::Full(map) | TrySendError::Disconnected(map)) => drop(map),
        }
    }
}

/// The bytes of a read-only mapping, unmapped on the `unmap` thread once the last
/// reference to them is dropped (in place below 16 MiB; see the `os::release` module).
pub fn mapping_bytes(map: Mmap) -> Bytes {
    Bytes::from_owner(Mapping(Some(map)))
}

#[cfg(test)]
mod tests {
    use crate::os::page_mapped;
    use std::os::fd::AsRawFd;
    use std::time::{Duration, Instant};

    use super::*;

    fn mapped(addr: usize) -> bool {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        maps.lines().any(|l| {
            let range = l.split_whitespace().next().unwrap();
            let (lo, hi) = range.split_once('-').unwrap();
            let (lo, hi) = (
                usize::from_str_radix(lo, 16).unwrap(),
                usize::from_str_radix(hi, 16).unwrap(),
            );
            lo <= addr && addr < hi
        })
    }

    fn map_of(len: usize) -> Mmap {
        let f = tempfile::tempfile().unwrap();
        f.set_len(len as u64).unwrap();
        // SAFETY: test-only mapping of a private temporary file nobody else can reach;
        // it is not written or truncated while mapped.
        unsafe {
            memmap2::MmapOptions::new()
                .len(len)
                .map(f.as_raw_fd())
                .unwrap()
        }
    }

    #[test]
    fn a_large_mapping_is_unmapped_by_the_unmap_thread_soon_after_its_drop() {
        let bytes = mapping_bytes(map_of(DEFER_FROM));
        let addr = bytes.as_ptr() as usize;
        assert_eq!(bytes.len(), DEFER_FROM);
        assert!(bytes.iter().step_by(4096).all(|b| *b == 0));
        assert!(mapped(addr));
        let copy = bytes.clone();
        drop(bytes);
        assert!(mapped(addr), "a clone still holds the mapping");
        drop(copy);
        let deadline = Instant::now() + Duration::from_secs(10);
        while mapped(addr) {
            assert!(
                Instant::now() < deadline,
                "still mapped 10 s after the drop"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let name = std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.unwrap().path().join("comm")).ok())
            .any(|c| c.trim() == "unmap");
        assert!(name, "the unmap thread runs in this process");
    }

    #[test]
    fn a_forked_child_unmaps_a_large_mapping_in_place() {
        // The thread exists in this process (started by a first large drop)...
        drop(mapping_bytes(map_of(DEFER_FROM)));
        assert!(releaser().is_some());
        let map = map_of(DEFER_FROM);
        let addr = map.as_ptr() as usize;
        // SAFETY: between fork and `_exit` the child drops a `Mapping` (a pid check,
        // the already initialised `OnceLock`, `munmap`) and calls `mincore`: system
        // calls only, no allocation and no lock another thread may have held.
        let fork = unsafe { nix::unistd::fork() }.unwrap();
        match fork {
            nix::unistd::ForkResult::Child => {
                // ...but not in the child: queued there, the mapping would stay.
                drop(Mapping(Some(map)));
                let code = if page_mapped(addr) { 1 } else { 0 };
                // SAFETY: `_exit` ends the child at once, running nothing of the parent's.
                unsafe { nix::libc::_exit(code) }
            }
            nix::unistd::ForkResult::Parent { child } => {
                let status = nix::sys::wait::waitpid(child, None).unwrap();
                assert_eq!(
                    status,
                    nix::sys::wait::WaitStatus::Exited(child, 0),
                    "the child's drop left its mapping in place"
                );
                assert!(page_mapped(addr), "the parent's own mapping is untouched");
            }
        }
    }

    #[test]
    fn a_small_mapping_is_unmapped_in_place() {
        let bytes = mapping_bytes(map_of(1 << 20));
        let addr = bytes.as_ptr() as usize;
        assert!(mapped(addr));
        drop(bytes);
        assert!(!mapped(addr), "unmapped by the drop itself");
    }
}
