//! The unit of data exchanged between the host, the executor and its ranks.
//!
//! A [`Shareable`] is FLARE's Shareable without the dictionary soup: string-keyed
//! metadata ([`Value`]s, small, encoded in the frame header) and named binary
//! [`Blob`]s (large, written raw after the header, or passed as a sealed memory
//! file to local ranks so that every rank maps the same pages).

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Deref;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use bytes::Bytes;

use crate::value::Value;

/// Named binary data: model weights, gradients, datasets.
///
/// A blob is cheap to clone (reference counted). A blob that arrived as a sealed
/// memory file keeps that file (and where in it its bytes start: several blobs of one
/// message share one file), so forwarding it to other ranks passes the same file again
/// instead of copying the bytes.
///
/// ```
/// use rankexec_protocol::Blob;
/// let b = Blob::from(vec![1u8, 2, 3]);
/// assert_eq!(&b[..], &[1, 2, 3]);
/// assert!(!b.is_shared());
/// ```
#[derive(Clone, Default)]
pub struct Blob {
    bytes: Bytes,
    memfd: Option<Arc<OwnedFd>>,
    /// Where `bytes` start in `memfd` (a multiple of the page size).
    offset: u64,
}

impl Blob {
    /// Wraps bytes that live in this process.
    pub fn new(bytes: Bytes) -> Self {
        Blob {
            bytes,
            memfd: None,
            offset: 0,
        }
    }

    /// Wraps bytes mapped from a sealed memory file, keeping the file for forwarding.
    ///
    /// The caller guarantees that `memfd` is sealed against writes, shrinking and growing and that
    /// `bytes` is a mapping of its contents.
    pub fn from_sealed_memfd(bytes: Bytes, memfd: Arc<OwnedFd>) -> Self {
        Self::from_sealed_memfd_at(bytes, memfd, 0)
    }

    /// Wraps bytes mapped from a sealed memory file at `offset` (a multiple of the page
    /// size): one file holds several blobs.
    ///
    /// The caller guarantees that `memfd` is sealed against writes, shrinking and
    /// growing and that `bytes` is a mapping of its contents from `offset` on.
    pub fn from_sealed_memfd_at(bytes: Bytes, memfd: Arc<OwnedFd>, offset: u64) -> Self {
        Blob {
            bytes,
            memfd: Some(memfd),
            offset,
        }
    }

    /// Builds a blob of `len` bytes directly in sealed shared memory: `fill` writes the
    /// bytes once, in place, and every local rank maps these same pages, so fanning it
    /// out costs no copy at all. (A blob made from ordinary bytes is copied into shared
    /// memory once, when it is first sent.)
    ///
    /// ```
    /// use rankexec_protocol::Blob;
    /// let b = Blob::shared_with(4, |buf| buf.copy_from_slice(&[1, 2, 3, 4])).unwrap();
    /// assert!(b.is_shared());
    /// assert_eq!(&b[..], &[1, 2, 3, 4]);
    /// ```
    pub fn shared_with(len: usize, fill: impl FnOnce(&mut [u8])) -> std::io::Result<Blob> {
        let fd = crate::os::sealed_memfd_with("rankexec-blob", len, fill)?;
        let (bytes, fd) = crate::os::map_sealed(fd, len as u64).map_err(|e| match e {
            crate::os::ShmError::Io(e) => e,
            other => std::io::Error::other(other.to_string()),
        })?;
        Ok(Blob::from_sealed_memfd(bytes, fd))
    }

    /// Builds several blobs in one sealed memory file, each at a page-aligned offset:
    /// `fill` gets one buffer per entry of `lens`, in order, and writes each once. A
    /// model of hundreds of tensors so becomes one file (and one descriptor per frame),
    /// and every blob can still be mapped on its own. The file is admitted against the
    /// host's available memory first ([`NoMemory`](crate::NoMemory) inside the error).
    ///
    /// ```
    /// use rankexec_protocol::Blob;
    /// let blobs = Blob::shared_many(&[3, 2], |bufs| {
    ///     bufs[0].copy_from_slice(b"abc");
    ///     bufs[1].copy_from_slice(b"de");
    /// })
    /// .unwrap();
    /// assert_eq!(&blobs[1][..], b"de");
    /// assert!(std::sync::Arc::ptr_eq(blobs[0].memfd().unwrap(), blobs[1].memfd().unwrap()));
    /// ```
    pub fn shared_many(
        lens: &[usize],
        fill: impl FnOnce(&mut [&mut [u8]]),
    ) -> std::io::Result<Vec<Blob>> {
        let mut offsets = Vec::with_capacity(lens.len());
        let mut total = 0u64;
        for &len in lens {
            let at = crate::os::page_align(total);
            offsets.push(at);
            total = at + len as u64;
        }
        let size = usize::try_from(total)
            .map_err(|_| std::io::Error::other("blobs larger than the address space"))?;
        let fd = crate::os::sealed_memfd_with("rankexec-blobs", size, |buf| {
            let mut parts: Vec<&mut [u8]> = Vec::with_capacity(lens.len());
            let mut rest = buf;
            let mut at = 0u64;
            for (&len, &offset) in lens.iter().zip(&offsets) {
                let (_, tail) = rest.split_at_mut((offset - at) as usize);
                let (part, tail) = tail.split_at_mut(len);
                parts.push(part);
                rest = tail;
                at = offset + len as u64;
            }
            fill(&mut parts);
        })?;
        let (bytes, fd) = crate::os::map_sealed(fd, total).map_err(|e| match e {
            crate::os::ShmError::Io(e) => e,
            other => std::io::Error::other(other.to_string()),
        })?;
        Ok(lens
            .iter()
            .zip(offsets)
            .map(|(&len, at)| {
                let start = at as usize;
                Blob::from_sealed_memfd_at(bytes.slice(start..start + len), fd.clone(), at)
            })
            .collect())
    }

    /// Copies `parts` into new sealed memory files, each part at a page-aligned offset
    /// of one of them, with `pwrite` (the kernel's shmem write path: no page fault and
    /// no zeroing per page, about twice as fast as filling a fresh mapping), and returns
    /// one blob per part, in order. For bytes that already exist in ordinary memory; a
    /// producer that can write its bytes in place uses [`Blob::shared_many`] instead.
    /// The whole is admitted against the host's available memory first.
    ///
    /// A large copy (from 256 MiB, in parts) is split into up to 4 files of consecutive
    /// parts, each of at least 128 MiB, written at once by as many threads: the kernel takes
    /// a file's lock for each write, so one file is written by one thread at a time,
    /// while several files are not (2 GiB on a 2-core VM: 0.9-1.2 s into one file,
    /// 0.46-0.47 s into four; BENCHMARKS.md). A part is never split.
    ///
    /// ```
    /// use rankexec_protocol::Blob;
    /// let blobs = Blob::copied_many(&[b"abc", b"de"]).unwrap();
    /// assert_eq!(&blobs[1][..], b"de");
    /// assert_eq!(blobs[1].memfd_offset(), 4096);
    /// ```
    pub fn copied_many(parts: &[&[u8]]) -> std::io::Result<Vec<Blob>> {
        Self::copied_in_files(parts, WRITERS, SPLIT_FROM)
    }

    /// [`Blob::copied_many`] with its split made explicit: up to `writers` files, each
    /// of at least `split_from` bytes.
    pub(crate) fn copied_in_files(
        parts: &[&[u8]],
        writers: usize,
        split_from: u64,
    ) -> std::io::Result<Vec<Blob>> {
        let lens: Vec<u64> = parts.iter().map(|p| p.len() as u64).collect();
        let groups = split_into_files(&lens, writers, split_from);
        if groups.len() <= 1 {
            return copied_into_one(parts);
        }
        crate::os::admit(lens.iter().sum()).map_err(std::io::Error::other)?;
        let written: Vec<std::io::Result<Vec<Blob>>> = std::thread::scope(|s| {
            let started: Vec<_> = groups
                .iter()
                .map(|range| {
                    let group = &parts[range.clone()];
                    let spawned = std::thread::Builder::new()
                        .name("rx-copy".into())
                        .spawn_scoped(s, move || copied_into_one(group));
                    (group, spawned)
                })
                .collect();
            started
                .into_iter()
                .map(|(group, spawned)| match spawned {
                    Ok(handle) => handle.join().unwrap_or_else(|_| {
                        Err(std::io::Error::other("a copying thread panicked"))
                    }),
                    // No thread to be had: this one writes that file.
                    Err(_) => copied_into_one(group),
                })
                .collect()
        });
        let mut out = Vec::with_capacity(parts.len());
        for blobs in written {
            out.extend(blobs?);
        }
        Ok(out)
    }

    /// A blob of `len` bytes at `offset` (a multiple of the page size) of a memory file
    /// received from another process (over a socket of the caller's own): checked to be
    /// sealed against writes, shrinking and growing and long enough, then mapped
    /// read-only, as a frame's memory files are.
    pub fn from_memfd(fd: OwnedFd, offset: u64, len: u64) -> Result<Blob, crate::os::ShmError> {
        if offset != crate::os::page_align(offset) {
            return Err(crate::os::ShmError::Io(std::io::Error::other(format!(
                "offset {offset} is not at a page boundary"
            ))));
        }
        let end = offset
            .checked_add(len)
            .ok_or(crate::os::ShmError::TooShort {
                actual: 0,
                declared: u64::MAX,
            })?;
        let (bytes, fd) = crate::os::map_sealed(fd, end)?;
        let start = offset as usize;
        Ok(Blob::from_sealed_memfd_at(
            bytes.slice(start..start + len as usize),
            fd,
            offset,
        ))
    }

    /// The sealed memory file behind this blob, if it has one.
    pub fn memfd(&self) -> Option<&Arc<OwnedFd>> {
        self.memfd.as_ref()
    }

    /// Where the blob's bytes start in its memory file (0 without one).
    pub fn memfd_offset(&self) -> u64 {
        self.offset
    }

    /// Whether the blob is backed by a sealed memory file (shared, not copied).
    pub fn is_shared(&self) -> bool {
        self.memfd.is_some()
    }

    /// The bytes as a cheaply cloneable [`Bytes`].
    pub fn bytes(&self) -> &Bytes {
        &self.bytes
    }
}

impl Deref for Blob {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes
    }
}

impl AsRef<[u8]> for Blob {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

impl fmt::Debug for Blob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Blob")
            .field("len", &self.bytes.len())
            .field("shared", &self.is_shared())
            .finish()
    }
}

impl PartialEq for Blob {
    fn eq(&self, other: &Self) -> bool {
        self.bytes == other.bytes
    }
}

impl From<Vec<u8>> for Blob {
    fn from(v: Vec<u8>) -> Self {
        Blob::new(Bytes::from(v))
    }
}

impl From<Bytes> for Blob {
    fn from(b: Bytes) -> Self {
        Blob::new(b)
    }
}

impl From<&'static [u8]> for Blob {
    fn from(b: &'static [u8]) -> Self {
        Blob::new(Bytes::from_static(b))
    }
}

/// Task input and output: metadata plus named blobs.
///
/// ```
/// use rankexec_protocol::{Shareable, Value};
/// let mut s = Shareable::new();
/// s.set_meta("round", 3);
/// s.set_blob("weights", vec![0u8; 16]);
/// assert_eq!(s.meta("round").and_then(Value::as_i64), Some(3));
/// assert_eq!(s.blob("weights").map(|b| b.len()), Some(16));
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Shareable {
    meta: BTreeMap<String, Value>,
    blobs: BTreeMap<String, Blob>,
}

impl Shareable {
    /// An empty shareable.
    pub fn new() -> Self {
        Self::default()
    }

    /// Builds a shareable from its parts.
    pub fn from_parts(meta: BTreeMap<String, Value>, blobs: BTreeMap<String, Blob>) -> Self {
        Shareable { meta, blobs }
    }

    /// Splits the shareable into its metadata and blobs.
    pub fn into_parts(self) -> (BTreeMap<String, Value>, BTreeMap<String, Blob>) {
        (self.meta, self.blobs)
    }

    /// Sets a metadata entry, returning `self` for chaining.
    pub fn with_meta(mut self, key: impl Into<String>, value: impl Into<Value>) -> Self {
        self.set_meta(key, value);
        self
    }

    /// Sets a blob, returning `self` for chaining.
    pub fn with_blob(mut self, name: impl Into<String>, blob: impl Into<Blob>) -> Self {
        self.set_blob(name, blob);
        self
    }

    /// Sets a metadata entry.
    pub fn set_meta(&mut self, key: impl Into<String>, value: impl Into<Value>) {
        self.meta.insert(key.into(), value.into());
    }

    /// A metadata entry.
    pub fn meta(&self, key: &str) -> Option<&Value> {
        self.meta.get(key)
    }

    /// All metadata.
    pub fn meta_map(&self) -> &BTreeMap<String, Value> {
        &self.meta
    }

    /// Sets a blob.
    pub fn set_blob(&mut self, name: impl Into<String>, blob: impl Into<Blob>) {
        self.blobs.insert(name.into(), blob.into());
    }

    /// A blob.
    pub fn blob(&self, name: &str) -> Option<&Blob> {
        self.blobs.get(name)
    }

    /// Removes and returns a blob.
    pub fn take_blob(&mut self, name: &str) -> Option<Blob> {
        self.blobs.remove(name)
    }

    /// All blobs.
    pub fn blobs(&self) -> &BTreeMap<String, Blob> {
        &self.blobs
    }

    /// Total size of all blobs in bytes.
    pub fn blob_bytes(&self) -> u64 {
        self.blobs.values().map(|b| b.len() as u64).sum()
    }
}

/// Files a large [`Blob::copied_many`] is split into, written at once.
pub(crate) const WRITERS: usize = 4;

/// The least a file of a split [`Blob::copied_many`] holds, in bytes.
pub(crate) const SPLIT_FROM: u64 = 128 << 20;

/// Consecutive runs of `lens` (index ranges), one per file: as many as `writers`, or
/// fewer so that each holds at least `split_from` bytes; one run for a small total.
/// Runs are cut greedily at about an equal share of the total.
fn split_into_files(lens: &[u64], writers: usize, split_from: u64) -> Vec<std::ops::Range<usize>> {
    let total: u64 = lens.iter().sum();
    let files = usize::try_from(total / split_from.max(1))
        .unwrap_or(usize::MAX)
        .clamp(1, writers.max(1))
        .min(lens.len().max(1));
    let share = total.div_ceil(files as u64);
    let mut runs = Vec::with_capacity(files);
    let (mut start, mut held) = (0usize, 0u64);
    for (i, &len) in lens.iter().enumerate() {
        held += len;
        let last_run = runs.len() + 1 == files;
        if held >= share && !last_run && i + 1 < lens.len() {
            runs.push(start..i + 1);
            (start, held) = (i + 1, 0);
        }
    }
    runs.push(start..lens.len());
    runs
}

/// Copies `parts` into one new sealed memory file (see [`Blob::copied_many`]).
fn copied_into_one(parts: &[&[u8]]) -> std::io::Result<Vec<Blob>> {
    let mut placed = Vec::with_capacity(parts.len());
    let mut total = 0u64;
    for part in parts {
        let at = crate::os::page_align(total);
        placed.push((at, *part));
        total = at + part.len() as u64;
    }
    if usize::try_from(total).is_err() {
        return Err(std::io::Error::other("blobs larger than the address space"));
    }
    let fd = crate::os::sealed_memfd_at("rankexec-blobs", total, &placed)?;
    let (bytes, fd) = crate::os::map_sealed(fd, total).map_err(|e| match e {
        crate::os::ShmError::Io(e) => e,
        other => std::io::Error::other(other.to_string()),
    })?;
    Ok(placed
        .iter()
        .map(|(at, part)| {
            let start = *at as usize;
            Blob::from_sealed_memfd_at(bytes.slice(start..start + part.len()), fd.clone(), *at)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_copies_stay_in_one_file_and_large_ones_split_at_part_boundaries() {
        assert_eq!(split_into_files(&[10, 20], 4, 100), vec![0..2]);
        assert_eq!(split_into_files(&[], 4, 100), vec![0..0]);
        // 400 bytes, at least 100 a file: 4 files of about 100.
        assert_eq!(
            split_into_files(&[100, 100, 100, 100], 4, 100),
            vec![0..1, 1..2, 2..3, 3..4]
        );
        // 250 bytes: 2 files (each at least 100); a part is never split.
        assert_eq!(split_into_files(&[200, 50], 4, 100), vec![0..1, 1..2]);
        // One part: one file, whatever its size.
        assert_eq!(split_into_files(&[1000], 4, 100), vec![0..1]);
        // Many small parts: at most `writers` files, every part in exactly one.
        let lens = vec![7u64; 100];
        let runs = split_into_files(&lens, 4, 100);
        assert_eq!(runs.len(), 4);
        assert_eq!(runs.first().map(|r| r.start), Some(0));
        assert!(runs.windows(2).all(|w| w[0].end == w[1].start));
        assert_eq!(runs.last().map(|r| r.end), Some(100));
    }

    #[test]
    fn a_split_copy_gives_every_part_back_in_order_from_several_sealed_files() {
        let parts: Vec<Vec<u8>> = (0..9u8).map(|i| vec![i; 5000 + usize::from(i)]).collect();
        let slices: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        let blobs = Blob::copied_in_files(&slices, 3, 10_000).unwrap();
        assert_eq!(blobs.len(), parts.len());
        for (blob, part) in blobs.iter().zip(&parts) {
            assert_eq!(&blob[..], &part[..]);
            assert_eq!(blob.memfd_offset() % 4096, 0);
        }
        let mut files: Vec<*const OwnedFd> = blobs
            .iter()
            .map(|b| Arc::as_ptr(b.memfd().unwrap()))
            .collect();
        files.dedup();
        assert_eq!(files.len(), 3, "three files, each of consecutive parts");
        // The one-file path for the same parts: one file.
        let one = Blob::copied_in_files(&slices, 1, 10_000).unwrap();
        assert!(
            one.windows(2)
                .all(|w| Arc::ptr_eq(w[0].memfd().unwrap(), w[1].memfd().unwrap()))
        );
    }
}
