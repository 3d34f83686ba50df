//! `HostBlob`: a blob a rank returned, readable from Python without a copy.
//!
//! It implements the buffer protocol read-only: `np.frombuffer(blob, dtype)` and
//! `memoryview(blob)` see the bytes where they are (a mapping of the rank's sealed
//! memory file for large blobs). The bytes live as long as any view of them does.
//!
//! `HostBlob.prefixed(header)` gives `PrefixedView`: a few bytes of the caller's, then
//! the blob's, as one read-only buffer without a copy of the blob (the protocol's
//! `PrefixedMap`): what FLARE's upload sends as a safetensors item (`rankexec.flare.
//! _download`). A blob not in a memory file has none (`ValueError`).

use std::ffi::{c_int, c_void};

use pyo3::exceptions::{PyBufferError, PyOSError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use rankexec_protocol::{Blob, PrefixError, PrefixedMap};

/// A result blob (read-only bytes).
#[pyclass(frozen, module = "rankexec._rankexec")]
pub struct HostBlob {
    pub(crate) blob: Blob,
}

#[pymethods]
impl HostBlob {
    fn __len__(&self) -> usize {
        self.blob.len()
    }

    /// Whether the bytes are a mapping of a shared memory file (not a copy).
    #[getter]
    fn shared(&self) -> bool {
        self.blob.is_shared()
    }

    /// The descriptor of its memory file in this process (valid while the blob lives;
    /// pass it on with `socket.send_fds`), or None for a small inline blob.
    #[getter]
    fn fileno(&self) -> Option<i32> {
        use std::os::fd::AsRawFd;
        self.blob.memfd().map(|fd| fd.as_raw_fd())
    }

    /// Where its bytes start in its memory file (a multiple of the page size).
    #[getter]
    fn offset(&self) -> u64 {
        self.blob.memfd_offset()
    }

    /// A writable view whose writes stay in this process: a copy-on-write mapping of
    /// the rank's memory file (no copy until a page is written), or a copy of a small
    /// blob. What torch tensors of a result are made from without a copy.
    fn copy_on_write(&self) -> PyResult<crate::rank::blob::PrivateBuffer> {
        crate::rank::blob::PrivateBuffer::of(&self.blob)
    }

    /// `prefix` (at most a page) then the blob's bytes, as one read-only buffer: the
    /// blob's pages are the memory file's own, mapped right after a page holding the
    /// prefix, so nothing of the blob is copied. ValueError for a blob that is not in
    /// a memory file or a prefix longer than a page.
    fn prefixed(&self, py: Python<'_>, prefix: &[u8]) -> PyResult<PrefixedView> {
        use std::os::fd::AsFd;
        let Some(fd) = self.blob.memfd() else {
            return Err(PyValueError::new_err("the blob is not in a memory file"));
        };
        let (offset, len) = (self.blob.memfd_offset(), self.blob.len());
        let map = py
            .detach(|| PrefixedMap::new(fd.as_fd(), offset, len, prefix))
            .map_err(|e| match e {
                PrefixError::Io(ref io) => PyOSError::new_err(format!("prefixed view: {e}: {io}")),
                _ => PyValueError::new_err(format!("prefixed view: {e}")),
            })?;
        // A view's bytes are read by this process only (a forked child has no such
        // mapping: `PrefixedMap`'s caveats).
        Ok(PrefixedView { map })
    }

    /// A copy of the bytes.
    fn tobytes<'py>(&self, py: Python<'py>) -> Bound<'py, pyo3::types::PyBytes> {
        pyo3::types::PyBytes::new(py, &self.blob)
    }

    fn __repr__(&self) -> String {
        format!(
            "HostBlob(len={}, shared={})",
            self.blob.len(),
            self.blob.is_shared()
        )
    }

    /// # Safety
    ///
    /// Called by Python with a valid `view` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("view is null"));
        }
        if (flags & ffi::PyBUF_WRITABLE) == ffi::PyBUF_WRITABLE {
            return Err(PyBufferError::new_err("a rank's result is read-only"));
        }
        let data: &[u8] = &slf.get().blob;
        let ptr = data.as_ptr();
        let len = data.len() as isize;
        // SAFETY: `view` is non-null and points to a `Py_buffer` Python asked us to fill.
        // `obj` holds a strong reference to this object, whose `Blob` is immutable
        // (frozen class, reference-counted bytes that are never written), so `buf`
        // stays valid and unchanged until Python releases the view. `format` points to
        // a static C string, so nothing needs to be freed in `__releasebuffer__`.
        unsafe {
            (*view).obj = slf.into_any().into_ptr();
            (*view).buf = ptr as *mut c_void;
            (*view).len = len;
            (*view).readonly = 1;
            (*view).itemsize = 1;
            (*view).format = if (flags & ffi::PyBUF_FORMAT) == ffi::PyBUF_FORMAT {
                c"B".as_ptr().cast_mut()
            } else {
                std::ptr::null_mut()
            };
            (*view).ndim = 1;
            (*view).shape = if (flags & ffi::PyBUF_ND) == ffi::PyBUF_ND {
                &mut (*view).len
            } else {
                std::ptr::null_mut()
            };
            (*view).strides = if (flags & ffi::PyBUF_STRIDES) == ffi::PyBUF_STRIDES {
                &mut (*view).itemsize
            } else {
                std::ptr::null_mut()
            };
            (*view).suboffsets = std::ptr::null_mut();
            (*view).internal = std::ptr::null_mut();
        }
        Ok(())
    }
}

/// A prefix and a blob's bytes in one read-only buffer (see `HostBlob.prefixed`).
#[pyclass(frozen, module = "rankexec._rankexec")]
pub struct PrefixedView {
    map: PrefixedMap,
}

#[pymethods]
impl PrefixedView {
    fn __len__(&self) -> usize {
        self.map.len()
    }

    /// # Safety
    /// Called by Python's buffer protocol.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let data = slf.get().map.as_slice();
        let (ptr, len) = (data.as_ptr().cast_mut(), data.len());
        // SAFETY: the mapping lives, unchanged and read-only, as long as this frozen
        // object, which the view references; `fill` refuses a writable request.
        unsafe { crate::rank::blob::fill(slf.as_any(), view, flags, ptr, len, true) }
    }
}
