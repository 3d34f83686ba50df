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

    /// Copies `parts` into one new sealed memory file, each at a page-aligned offset,
    /// with `pwrite` (the kernel's shmem write path: no page fault and no zeroing per
    /// page, about twice as fast as filling a fresh mapping), and returns one blob per
    /// part, in order. For bytes that already exist in ordinary memory; a producer that
    /// can write its bytes in place uses [`Blob::shared_many`] instead. The file is
    /// admitted against the host's available memory first.
    ///
    /// ```
    /// use rankexec_protocol::Blob;
    /// let blobs = Blob::copied_many(&[b"abc", b"de"]).unwrap();
    /// assert_eq!(&blobs[1][..], b"de");
    /// assert_eq!(blobs[1].memfd_offset(), 4096);
    /// ```
    pub fn copied_many(parts: &[&[u8]]) -> std::io::Result<Vec<Blob>> {
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
