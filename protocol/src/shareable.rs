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
/// memory file keeps that file, so forwarding it to other ranks passes the same
/// file again instead of copying the bytes.
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
}

impl Blob {
    /// Wraps bytes that live in this process.
    pub fn new(bytes: Bytes) -> Self {
        Blob { bytes, memfd: None }
    }

    /// Wraps bytes mapped from a sealed memory file, keeping the file for forwarding.
    ///
    /// The caller guarantees that `memfd` is sealed against writes, shrinking and growing and that
    /// `bytes` is a mapping of its contents.
    pub fn from_sealed_memfd(bytes: Bytes, memfd: Arc<OwnedFd>) -> Self {
        Blob {
            bytes,
            memfd: Some(memfd),
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

    /// The sealed memory file behind this blob, if it has one.
    pub fn memfd(&self) -> Option<&Arc<OwnedFd>> {
        self.memfd.as_ref()
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
