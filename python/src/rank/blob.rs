//! Blobs as Python buffers, without copies.
//!
//! - [`Blob`]: a received (or sealed) blob, exported read-only through the buffer
//!   protocol: `np.frombuffer(blob)`, `torch.frombuffer(blob)` and `memoryview(blob)`
//!   see the mapped memory file itself. `blob.copy_on_write()` gives a writable view
//!   whose writes stay private to this process.
//! - [`SharedBuffer`]: an output filled in place: a new memory file mapped writable;
//!   sending it (or `seal()`) seals the file, and every rank and the parent then map
//!   these pages. Views made before sealing stay valid (see `os` for how).
//!
//! Caveat: a view keeps its buffer object (and so the mapping) alive; the memory is
//! released when the last view and the object are gone.

use std::ffi::c_int;
use std::os::fd::AsFd;
use std::sync::{Mutex, PoisonError};

use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use rankexec_protocol::Blob as RBlob;

use super::errors::BufferSealed;
use crate::os::{WritableFile, inode, private_copy};

/// Fills `view` for `len` bytes at `ptr`, owned by `owner`.
///
/// # Safety
/// `view` comes from Python's buffer protocol; `ptr..ptr+len` must stay valid as long
/// as `owner` lives (the view holds a reference to it).
pub(crate) unsafe fn fill(
    owner: &Bound<'_, PyAny>,
    view: *mut ffi::Py_buffer,
    flags: c_int,
    ptr: *mut u8,
    len: usize,
    readonly: bool,
) -> PyResult<()> {
    let len = isize::try_from(len).map_err(|_| PyOSError::new_err("blob too large"))?;
    // SAFETY: per this function's contract; PyBuffer_FillInfo takes a new reference to
    // `owner`, refuses a writable request on read-only data, and sets format, shape and
    // strides for a one-dimensional byte buffer.
    let rc = unsafe {
        ffi::PyBuffer_FillInfo(
            view,
            owner.as_ptr(),
            ptr.cast(),
            len,
            c_int::from(readonly),
            flags,
        )
    };
    if rc == -1 {
        return Err(PyErr::fetch(owner.py()));
    }
    Ok(())
}

/// A blob: read-only bytes, usually a mapping of a sealed shared memory file.
#[pyclass(module = "rankexec", frozen)]
pub struct Blob {
    pub(crate) inner: RBlob,
}

#[pymethods]
impl Blob {
    /// # Safety
    /// Called by Python's buffer protocol.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let b = slf.get().inner.bytes();
        let (ptr, len) = (b.as_ptr().cast_mut(), b.len());
        // SAFETY: the bytes live as long as the blob object, which the view references;
        // they are exported read-only.
        unsafe { fill(slf.as_any(), view, flags, ptr, len, true) }
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// The size in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.len()
    }

    /// The `length` bytes at `offset` (a multiple of the page size) of this blob, as a
    /// blob of the same memory file: no copy, and it is passed on as that file.
    fn slice(&self, offset: usize, length: usize) -> PyResult<Blob> {
        let end = offset
            .checked_add(length)
            .filter(|&e| e <= self.inner.len())
            .ok_or_else(|| {
                PyValueError::new_err(format!(
                    "{length} bytes at {offset} are outside a blob of {} bytes",
                    self.inner.len()
                ))
            })?;
        let bytes = self.inner.bytes().slice(offset..end);
        let inner = match self.inner.memfd() {
            Some(fd) => {
                let at = self.inner.memfd_offset() + offset as u64;
                if at != rankexec_protocol::page_align(at) {
                    return Err(PyValueError::new_err(format!(
                        "offset {offset} is not at a page boundary of the memory file"
                    )));
                }
                RBlob::from_sealed_memfd_at(bytes, fd.clone(), at)
            }
            None => RBlob::new(bytes),
        };
        Ok(Blob { inner })
    }

    /// The descriptor of its memory file in this process (valid while the blob lives;
    /// pass it on with `socket.send_fds`), or None for a small inline blob.
    #[getter]
    fn fileno(&self) -> Option<i32> {
        use std::os::fd::AsRawFd;
        self.inner.memfd().map(|fd| fd.as_raw_fd())
    }

    /// Where its bytes start in its memory file (a multiple of the page size).
    #[getter]
    fn offset(&self) -> u64 {
        self.inner.memfd_offset()
    }

    /// The blob of `length` bytes at `offset` of the memory file `fd` (a descriptor
    /// received from another process of this user, say with `socket.recv_fds`): the
    /// file must be sealed against writes, shrinking and growing. `fd` stays the
    /// caller's (it is duplicated).
    #[staticmethod]
    fn from_fd(fd: i32, offset: u64, length: u64) -> PyResult<Blob> {
        let mut v = Self::from_fd_parts(fd, vec![(offset, length)])?;
        v.pop()
            .ok_or_else(|| PyOSError::new_err("no blob made from the memory file"))
    }

    /// The blobs at each `(offset, length)` of the memory file `fd`, as `from_fd` makes
    /// one, sharing one duplicate of `fd` and one mapping.
    #[staticmethod]
    fn from_fd_parts(fd: i32, parts: Vec<(u64, u64)>) -> PyResult<Vec<Blob>> {
        use std::os::fd::BorrowedFd;
        if fd < 0 {
            return Err(PyOSError::new_err(format!("not a descriptor: {fd}")));
        }
        // SAFETY: the borrow lives for one `fcntl(F_DUPFD_CLOEXEC)` only and no memory is
        // read through it: a number that is not open makes that call fail with EBADF,
        // and a descriptor that is not a sealed memory file is refused by the seal check
        // before anything is mapped.
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        let owned = borrowed.try_clone_to_owned()?;
        let mut end = 0u64;
        for &(offset, length) in &parts {
            if offset != rankexec_protocol::page_align(offset) {
                return Err(PyOSError::new_err(format!(
                    "memory file {fd}: offset {offset} is not at a page boundary"
                )));
            }
            let e = offset
                .checked_add(length)
                .ok_or_else(|| PyOSError::new_err(format!("memory file {fd}: length overflows")))?;
            end = end.max(e);
        }
        let whole = RBlob::from_memfd(owned, 0, end)
            .map_err(|e| PyOSError::new_err(format!("memory file {fd}: {e}")))?;
        let (Some(file), bytes) = (whole.memfd().cloned(), whole.bytes().clone()) else {
            return Ok(parts
                .iter()
                .map(|_| Blob {
                    inner: RBlob::default(),
                })
                .collect());
        };
        Ok(parts
            .into_iter()
            .map(|(offset, length)| {
                let (start, stop) = (offset as usize, (offset + length) as usize);
                Blob {
                    inner: RBlob::from_sealed_memfd_at(
                        bytes.slice(start..stop),
                        file.clone(),
                        offset,
                    ),
                }
            })
            .collect())
    }

    /// Whether the blob is a shared memory file (mapped, not copied).
    #[getter]
    fn shared(&self) -> bool {
        self.inner.is_shared()
    }

    /// The inode of its memory file (every rank mapping the same file sees the same
    /// inode), or None for a small inline blob.
    #[getter]
    fn inode(&self) -> PyResult<Option<u64>> {
        match self.inner.memfd() {
            Some(fd) => Ok(Some(inode(fd.as_fd())?)),
            None => Ok(None),
        }
    }

    /// The address of the first byte in this process.
    #[getter]
    fn address(&self) -> usize {
        self.inner.as_ptr() as usize
    }

    /// A writable view whose writes stay in this process: a copy-on-write mapping of
    /// the memory file (no copy until a page is written), or a copy of a small blob.
    fn copy_on_write(&self) -> PyResult<PrivateBuffer> {
        PrivateBuffer::of(&self.inner)
    }

    /// A copy as `bytes`.
    fn tobytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner)
    }

    fn __repr__(&self) -> String {
        format!(
            "Blob(nbytes={}, shared={})",
            self.inner.len(),
            if self.inner.is_shared() {
                "True"
            } else {
                "False"
            }
        )
    }
}

enum Private {
    Map(memmap2::MmapMut),
    Heap(Vec<u8>),
}

/// A writable, private view of a blob (see `Blob.copy_on_write`).
#[pyclass(module = "rankexec", frozen)]
pub struct PrivateBuffer {
    data: Mutex<Private>,
}

impl PrivateBuffer {
    /// A writable view of `blob` whose writes stay in this process: a copy-on-write
    /// mapping of its memory file (no copy until a page is written), or a copy of a
    /// small blob.
    pub(crate) fn of(blob: &RBlob) -> PyResult<PrivateBuffer> {
        let len = blob.len();
        let data = match blob.memfd() {
            Some(fd) if len > 0 => {
                Private::Map(private_copy(fd.as_fd(), blob.memfd_offset(), len)?)
            }
            _ => Private::Heap(blob.to_vec()),
        };
        Ok(PrivateBuffer {
            data: Mutex::new(data),
        })
    }
}

#[pymethods]
impl PrivateBuffer {
    /// # Safety
    /// Called by Python's buffer protocol.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let (ptr, len) = {
            let mut d = slf
                .get()
                .data
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            match &mut *d {
                Private::Map(m) => (m.as_mut_ptr(), m.len()),
                Private::Heap(v) => (v.as_mut_ptr(), v.len()),
            }
        };
        // SAFETY: the mapping or vector lives as long as this object, which the view
        // references, and is never resized.
        unsafe { fill(slf.as_any(), view, flags, ptr, len, false) }
    }

    fn __len__(&self) -> usize {
        match &*self.data.lock().unwrap_or_else(PoisonError::into_inner) {
            Private::Map(m) => m.len(),
            Private::Heap(v) => v.len(),
        }
    }
}

struct SharedState {
    file: WritableFile,
    sealed: Option<RBlob>,
}

/// An output buffer in shared memory, filled in place and sent without a copy.
#[pyclass(module = "rankexec", frozen)]
pub struct SharedBuffer {
    state: Mutex<SharedState>,
    len: usize,
}

impl SharedBuffer {
    /// Seals the buffer (once) and returns its blob.
    pub(crate) fn sealed_blob(&self) -> PyResult<RBlob> {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(b) = &st.sealed {
            return Ok(b.clone());
        }
        let blob = st.file.seal()?;
        st.sealed = Some(blob.clone());
        Ok(blob)
    }
}

#[pymethods]
impl SharedBuffer {
    /// A zero-filled buffer of `nbytes` bytes in a new shared memory file.
    #[new]
    fn new(nbytes: usize) -> PyResult<Self> {
        Ok(SharedBuffer {
            state: Mutex::new(SharedState {
                file: WritableFile::create(nbytes)?,
                sealed: None,
            }),
            len: nbytes,
        })
    }

    /// # Safety
    /// Called by Python's buffer protocol.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let (ptr, len, sealed) = {
            let mut st = slf
                .get()
                .state
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let (p, n) = st.file.raw();
            (p, n, st.sealed.is_some())
        };
        if sealed && flags & ffi::PyBUF_WRITABLE != 0 {
            return Err(BufferSealed::new_err(
                "this buffer was sent; it is read-only now",
            ));
        }
        // SAFETY: the mapping lives as long as this object (unmapped on drop), which the
        // view references; sealing replaces it in place without moving it.
        unsafe { fill(slf.as_any(), view, flags, ptr, len, sealed) }
    }

    fn __len__(&self) -> usize {
        self.len
    }

    /// The size in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.len
    }

    /// Whether it was sealed (sent); later writable views are refused.
    #[getter]
    fn sealed(&self) -> bool {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .sealed
            .is_some()
    }

    /// The inode of its memory file.
    #[getter]
    fn inode(&self) -> PyResult<u64> {
        Ok(self
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .file
            .inode()?)
    }

    /// The address of the first byte in this process.
    #[getter]
    fn address(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .file
            .raw()
            .0 as usize
    }

    /// Copies `data` (any C-contiguous buffer) to `offset` with `pwrite`: the same bytes
    /// as `memoryview(buf)[offset:offset + n] = data`, about twice as fast into pages
    /// not yet touched (no page fault per 4 KiB page). Refused once sealed
    /// (`BufferSealed`) and past the end (`ValueError`).
    fn write_at(&self, py: Python<'_>, offset: usize, data: &Bound<'_, PyAny>) -> PyResult<()> {
        use pyo3::buffer::PyBuffer;
        let view = py
            .import("rankexec._shareable")?
            .call_method1("byte_view", (data, "data"))?;
        let buf = PyBuffer::<u8>::get(&view)?;
        if !buf.is_c_contiguous() {
            return Err(PyValueError::new_err("data is not C-contiguous"));
        }
        let (ptr, len) = (buf.buf_ptr() as usize, buf.len_bytes());
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(PyValueError::new_err(format!(
                "{len} bytes at {offset} do not fit a buffer of {} bytes",
                self.len
            )));
        }
        let writer = {
            let st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            if st.sealed.is_some() {
                return Err(BufferSealed::new_err(
                    "this buffer was sent; it is read-only now",
                ));
            }
            st.file.writer()?
        };
        py.detach(|| {
            let src: &[u8] = if len == 0 {
                &[]
            } else {
                // SAFETY: `buf` holds the exporter's buffer (PyObject_GetBuffer) until it
                // is dropped after this closure, C-contiguous (checked above), so the
                // `len` bytes at `ptr` stay valid and in place meanwhile.
                unsafe { std::slice::from_raw_parts(ptr as *const u8, len) }
            };
            writer.write_at(offset, src)
        })
        .map_err(PyErr::from)
    }

    /// Seals the file and returns it as a read-only `Blob` (the same pages).
    fn seal(&self) -> PyResult<Blob> {
        Ok(Blob {
            inner: self.sealed_blob()?,
        })
    }
}

/// Gives the C heap's free pages back to the kernel (glibc's `malloc_trim(0)`), after a
/// large input was released: tensors of 1-32 MiB that glibc served from its heap stay
/// resident once freed until then. Returns whether any memory was released.
#[pyfunction]
pub fn trim_heap() -> bool {
    crate::os::trim_heap()
}

/// Copies `buffers` (anything with a contiguous buffer) into one sealed memory file,
/// each at a page-aligned offset, and returns a `Blob` of each: what a process that
/// is not a rank (Flower's ClientApp) hands to the node's host with `socket.send_fds`,
/// one descriptor for a whole model.
#[pyfunction]
pub fn share(py: Python<'_>, buffers: Vec<Bound<'_, PyAny>>) -> PyResult<Vec<Blob>> {
    use pyo3::buffer::PyBuffer;
    let bufs: Vec<PyBuffer<u8>> = buffers
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let view = py
                .import("rankexec._shareable")?
                .call_method1("byte_view", (b, format!("buffer {i}")))?;
            PyBuffer::<u8>::get(&view)
        })
        .collect::<PyResult<_>>()?;
    let refs: Vec<&PyBuffer<u8>> = bufs.iter().collect();
    let made = super::outgoing::copy_buffers(py, &refs)?;
    Ok(made.into_iter().map(|inner| Blob { inner }).collect())
}
