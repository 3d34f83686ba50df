//! Memory files prepared while the group is idle.
//!
//! A payload that comes from Python lives in ordinary memory, so reaching the ranks
//! costs one copy into a sealed memory file. The expensive part of that copy is not
//! the bytes but the pages: a fresh memory file allocates (and the kernel zeroes) every
//! page on first touch, and on a VM that returns freed pages to its host each of those
//! faults also goes to the hypervisor. So after every task, a background thread
//! prepares a memory file of each large size just used, with its pages allocated and
//! mapped writable (`MAP_POPULATE`; where the kernel gives huge pages only on request,
//! `MADV_HUGEPAGE` then `MADV_POPULATE_WRITE`, see the protocol's `os::huge`). The next
//! task of the same shape only copies into
//! pages that exist, unmaps, seals and sends.
//!
//! A prepared file's mapping is kept from forked children (`MADV_DONTFORK`): a host
//! that forks (multiprocessing, DataLoader workers) between tasks would otherwise keep
//! the file from being sealed. See `os` for the fallback when it still cannot be.
//!
//! The large blobs of one input go into one memory file, each at a page-aligned
//! offset: a model of hundreds of tensors passes one descriptor, not one per tensor. An
//! input of 256 MiB and more goes into up to 4 files of consecutive blobs, written at
//! once by as many threads (`Blob::copied_many`: the kernel writes one file at a time).
//!
//! Caveats: Linux only (`memfd_create` and seals). A prepared file holds its memory
//! while idle, so only inputs up to [`PREPARE_MAX`] bytes are prepared: above that, a
//! second idle copy of a model would cost more host memory than the page faults cost
//! time (a large model's input goes to a fresh file, correct, only slower). A size not
//! prepared falls back to a fresh file, written with `pwrite` rather than through a
//! mapping (no page fault per 4 KiB page; the parts land at the same page-aligned
//! offsets).

use std::io;
use std::sync::{Arc, Mutex, PoisonError};

use rankexec_protocol::Blob;

use crate::os::StagedFile as Prepared;

/// How many prepared files of one size are kept.
const PER_SIZE: usize = 1;

/// The largest input prepared ahead (see the module docs).
pub(crate) const PREPARE_MAX: usize = 64 << 20;

/// The pool of prepared files, and the threshold above which blobs are staged.
pub(crate) struct Stager {
    threshold: usize,
    spare: Mutex<Vec<Prepared>>,
}

impl Stager {
    pub(crate) fn new(threshold: usize) -> Arc<Stager> {
        Arc::new(Stager {
            threshold: threshold.max(1),
            spare: Mutex::new(Vec::new()),
        })
    }

    /// Whether a blob of `len` bytes goes through a memory file.
    pub(crate) fn stages(&self, len: usize) -> bool {
        len >= self.threshold
    }

    /// Blobs holding copies of `srcs`, in order: the large ones together in one memory
    /// file (a prepared one when one of that size is ready, else a fresh one), each at a
    /// page-aligned offset; small ones plain copies. Returns the blobs and the size of
    /// the memory file (0 without one).
    pub(crate) fn stage(&self, srcs: &[&[u8]]) -> io::Result<(Vec<Blob>, usize)> {
        let large: Vec<usize> = (0..srcs.len())
            .filter(|&i| self.stages(srcs[i].len()))
            .collect();
        let mut out: Vec<Blob> = srcs
            .iter()
            .map(|s| {
                if self.stages(s.len()) {
                    Blob::default()
                } else {
                    Blob::from(s.to_vec())
                }
            })
            .collect();
        if large.is_empty() {
            return Ok((out, 0));
        }
        let mut offsets = Vec::with_capacity(large.len());
        let mut total = 0u64;
        for &i in &large {
            let at = rankexec_protocol::page_align(total);
            offsets.push(at as usize);
            total = at + srcs[i].len() as u64;
        }
        let total = usize::try_from(total).map_err(|_| io::Error::other("input too large"))?;
        let ready = {
            let mut spare = self.spare.lock().unwrap_or_else(PoisonError::into_inner);
            spare
                .iter()
                .position(|p| p.len() == total)
                .map(|i| spare.swap_remove(i))
        };
        let parts: Vec<(usize, &[u8])> = large
            .iter()
            .zip(&offsets)
            .map(|(&i, &at)| (at, srcs[i]))
            .collect();
        let blobs = match ready {
            Some(file) => file.fill(&parts)?,
            // No file ready: a fresh one, written with `pwrite` (the kernel's shmem write
            // path, no fault or zeroing per page: about twice as fast as filling a
            // fresh mapping, see `Blob::copied_many`).
            None => {
                let srcs: Vec<&[u8]> = parts.iter().map(|(_, s)| *s).collect();
                Blob::copied_many(&srcs)?
            }
        };
        for (i, blob) in large.into_iter().zip(blobs) {
            out[i] = blob;
        }
        Ok((out, total))
    }

    /// Prepares files of these sizes on a background thread (sizes already prepared are
    /// skipped); failures only log.
    pub(crate) fn prepare_in_background(self: &Arc<Self>, sizes: Vec<usize>) {
        let sizes: Vec<usize> = sizes
            .into_iter()
            .filter(|s| self.stages(*s) && *s <= PREPARE_MAX)
            .collect();
        if sizes.is_empty() {
            return;
        }
        let me = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name("rx-stage".into())
            .spawn(move || me.prepare(&sizes));
        if let Err(e) = spawned {
            tracing::warn!("cannot start the staging thread: {e}");
        }
    }

    /// Prepares files of these sizes now.
    pub(crate) fn prepare(&self, sizes: &[usize]) {
        for &len in sizes {
            if len == 0 {
                continue;
            }
            let have = self
                .spare
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .iter()
                .filter(|p| p.len() == len)
                .count();
            if have >= PER_SIZE {
                continue;
            }
            match Prepared::new(len) {
                Ok(p) => {
                    // Checked again: the background thread and `prepare()` may race.
                    let mut spare = self.spare.lock().unwrap_or_else(PoisonError::into_inner);
                    if spare.iter().filter(|p| p.len() == len).count() < PER_SIZE {
                        spare.push(p);
                    }
                }
                Err(e) => tracing::warn!(len, "cannot prepare a memory file: {e}"),
            }
        }
    }

    /// Bytes held by prepared files.
    pub(crate) fn held(&self) -> usize {
        self.spare
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|p| p.len())
            .sum()
    }

    /// Frees every prepared file.
    pub(crate) fn clear(&self) {
        self.spare
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }
}
