//! A rank's outgoing buffers: into shared memory with one `pwrite` copy each, or with
//! none at all when a buffer is a view of the task's own input.
//!
//! - [`copy_buffers`]: every large buffer of a reply (or of `rankexec._rankexec.share`)
//!   goes into one sealed memory file (up to 4, written at once, from 256 MiB), each at a
//!   page-aligned offset, written with
//!   `pwrite` ([`Blob::copied_many`](rankexec_protocol::Blob::copied_many)): the kernel's
//!   shmem write path takes no page fault and zeroes no page, where filling a fresh
//!   mapping faults once per 4 KiB page (about twice the time on this project's VM).
//! - [`input_view`]: a buffer that lies inside one of the task's input blobs (a numpy
//!   array or torch tensor made from `input.blobs[...]` and sent back unchanged, as a
//!   rank that only reads its model does) is sent as a slice of that blob's memory file:
//!   no copy. Only read-only mappings of sealed files are matched, so the bytes at that
//!   address are the file's; a copy-on-write view (`Blob.copy_on_write`, the default of
//!   `rankexec.tensors.unpack` for torch) lives at other addresses and is copied, since
//!   the script may have written to it.
//!
//! Caveat: a view that starts inside a blob but not at a page boundary of its file (a
//! tensor in the middle of a safetensors blob) cannot be described by a memory file and
//! an offset (offsets are page-aligned on the wire), so it is copied.

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyBufferError;
use pyo3::prelude::*;
use rankexec_protocol::Blob as RBlob;

/// The blob of `inputs` whose read-only mapping holds `buf` entirely, sliced to `buf`,
/// when it starts at a page boundary of that blob's memory file.
pub(crate) fn input_view(buf: &PyBuffer<u8>, inputs: &[RBlob]) -> Option<RBlob> {
    if !buf.is_c_contiguous() || buf.len_bytes() == 0 {
        return None;
    }
    let start = buf.buf_ptr() as usize;
    let end = start.checked_add(buf.len_bytes())?;
    inputs.iter().find_map(|blob| {
        let fd = blob.memfd()?;
        let base = blob.as_ptr() as usize;
        let within = start >= base && end <= base + blob.len();
        if !within {
            return None;
        }
        let skip = start - base;
        let at = blob.memfd_offset() + skip as u64;
        if at != rankexec_protocol::page_align(at) {
            return None;
        }
        let bytes = blob.bytes().slice(skip..skip + buf.len_bytes());
        Some(RBlob::from_sealed_memfd_at(bytes, fd.clone(), at))
    })
}

/// Copies `bufs` (C-contiguous byte buffers) into sealed memory files (one, or up to 4
/// from 256 MiB), each at a page-aligned offset, with `pwrite`; one blob per buffer, in
/// order.
pub(crate) fn copy_buffers(py: Python<'_>, bufs: &[&PyBuffer<u8>]) -> PyResult<Vec<RBlob>> {
    let mut parts: Vec<(usize, usize)> = Vec::with_capacity(bufs.len());
    for buf in bufs {
        if !buf.is_c_contiguous() {
            return Err(PyBufferError::new_err(
                "a buffer to share is not C-contiguous",
            ));
        }
        parts.push((buf.buf_ptr() as usize, buf.len_bytes()));
    }
    let made = py.detach(move || {
        let slices: Vec<&[u8]> = parts
            .iter()
            .map(|&(ptr, len)| {
                if len == 0 {
                    return &[][..];
                }
                // SAFETY: each `(ptr, len)` comes from a `PyBuffer` the caller holds
                // (PyObject_GetBuffer) for the whole call, C-contiguous (checked above):
                // the exporter keeps those `len` bytes alive and in place until the
                // buffer is released, which happens only after this closure returns.
                // Another Python thread may write them meanwhile; that races only on
                // the values copied, as any GIL-free reader of a numpy array does.
                unsafe { std::slice::from_raw_parts(ptr as *const u8, len) }
            })
            .collect();
        RBlob::copied_many(&slices)
    })?;
    Ok(made)
}
