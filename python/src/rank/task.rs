//! A task as Python sees it: `Task` (name, input, reply), `Context` (who this rank is,
//! properties, events to the host) and `Abort` (the task's abort signal).
//!
//! Every blocking call (`Abort.wait`, `Context.fire_event`) waits in short slices
//! without the GIL and checks for signals between them, so Ctrl-C raises
//! `KeyboardInterrupt` promptly.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyString, PyType};
use rankexec_protocol::{Blob as RBlob, EventType, FlContext, PropFlags, Shareable, Signal};
use rankexec_sub_worker::embed::{self, Reply, Request};

use super::blob::{Blob, SharedBuffer};
use super::convert::error_from_exception;
use super::errors::{EventFailed, PropConflict, ReplyError};
use super::runtime::{Payload, serve_event};
use crate::value::{from_py, map_from_py, map_to_py, to_py};

/// Blobs at least this large are copied straight into a shared memory file.
const SHARED_FROM: usize = 64 << 10;

/// The longest a blocking call waits before it checks for signals.
pub(crate) const SLICE: Duration = Duration::from_millis(50);

/// Runs `poll` without the GIL in slices of at most [`SLICE`] until it returns `Some`
/// or `deadline` passes (`Ok(None)`); raises `KeyboardInterrupt` between slices.
pub(crate) fn wait_sliced<T: Send>(
    py: Python<'_>,
    deadline: Option<Instant>,
    mut poll: impl FnMut(Duration) -> Option<T> + Send,
) -> PyResult<Option<T>> {
    loop {
        let slice = match deadline {
            Some(d) => d.saturating_duration_since(Instant::now()).min(SLICE),
            None => SLICE,
        };
        if let Some(v) = py.detach(|| poll(slice)) {
            return Ok(Some(v));
        }
        py.check_signals()?;
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(None);
        }
    }
}

/// A task's abort signal.
#[pyclass(module = "rankexec", frozen)]
pub struct Abort {
    pub(crate) signal: Signal,
}

#[pymethods]
impl Abort {
    /// Whether the task was asked to stop.
    #[getter]
    fn triggered(&self) -> bool {
        self.signal.is_triggered()
    }

    /// Why, once triggered.
    #[getter]
    fn reason(&self) -> Option<String> {
        self.signal.reason()
    }

    /// Waits until triggered or `timeout` seconds pass (None or `inf`: no limit; zero
    /// or negative: no wait, only a look); returns whether it was triggered. A NaN
    /// timeout raises `ValueError`.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let deadline = match timeout {
            Some(t) if t.is_nan() => {
                return Err(PyValueError::new_err("timeout must be a number, not NaN"));
            }
            // Too far to represent (`inf`, 1e300): no deadline.
            Some(t) => Duration::try_from_secs_f64(t.max(0.0))
                .ok()
                .and_then(|d| Instant::now().checked_add(d)),
            None => None,
        };
        if timeout.is_some_and(|t| t <= 0.0) {
            return Ok(self.signal.is_triggered());
        }
        let signal = self.signal.clone();
        let got = wait_sliced(py, deadline, |slice| {
            signal.wait_timeout(slice).then_some(())
        })?;
        Ok(got.is_some())
    }

    fn __bool__(&self) -> bool {
        self.signal.is_triggered()
    }
}

/// Who this rank is, the task's properties, and events to the host.
#[pyclass(module = "rankexec", frozen)]
pub struct Context {
    pub(crate) ctx: Arc<Mutex<FlContext>>,
}

impl Context {
    pub(crate) fn new(ctx: FlContext) -> Self {
        Context {
            ctx: Arc::new(Mutex::new(ctx)),
        }
    }

    pub(crate) fn snapshot(&self) -> FlContext {
        self.ctx
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

fn env() -> Option<rankexec_protocol::env::RankEnv> {
    rankexec_sub_worker::rank_info().map(|i| i.env)
}

#[pymethods]
impl Context {
    /// This rank's number in its group.
    #[getter]
    fn rank(&self) -> u32 {
        env().map_or(0, |e| e.rank)
    }

    /// How many ranks the group has.
    #[getter]
    fn world_size(&self) -> u32 {
        env().map_or(1, |e| e.world_size)
    }

    /// This rank's number on this host.
    #[getter]
    fn local_rank(&self) -> u32 {
        env().map_or(0, |e| e.local_rank)
    }

    /// How many ranks run on this host.
    #[getter]
    fn local_world_size(&self) -> u32 {
        env().map_or(1, |e| e.local_world_size)
    }

    /// Every property's value (a copy).
    #[getter]
    fn props<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let ctx = self.ctx.lock().unwrap_or_else(PoisonError::into_inner);
        let d = PyDict::new(py);
        for (k, p) in ctx.props() {
            d.set_item(k, to_py(py, &p.value)?)?;
        }
        Ok(d)
    }

    /// A property's value, or `default`.
    #[pyo3(signature = (key, default=None))]
    fn get_prop<'py>(
        &self,
        py: Python<'py>,
        key: &str,
        default: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let ctx = self.ctx.lock().unwrap_or_else(PoisonError::into_inner);
        match ctx.get_prop(key) {
            Some(v) => to_py(py, v),
            None => Ok(default.unwrap_or_else(|| py.None().into_bound(py))),
        }
    }

    /// Sets a property; an existing key keeps its flags (other flags: `PropConflict`).
    #[pyo3(signature = (key, value, *, private=false, sticky=false))]
    fn set_prop(
        &self,
        key: &str,
        value: &Bound<'_, PyAny>,
        private: bool,
        sticky: bool,
    ) -> PyResult<()> {
        let v = from_py(value, key)?;
        self.ctx
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .set_prop(key, v, PropFlags { private, sticky })
            .map_err(|e| PropConflict::new_err(e.to_string()))
    }

    /// Fires `event` to this rank's components and then to the host's engine, with
    /// these extra properties; the properties handlers set come back into this context.
    #[pyo3(signature = (event, props=None))]
    fn fire_event(
        &self,
        py: Python<'_>,
        event: &str,
        props: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<()> {
        let mut ctx = self.snapshot();
        if let Some(p) = props {
            for (k, v) in map_from_py(p, "props")? {
                ctx.set_prop(k, v, PropFlags::PUBLIC)
                    .map_err(|e| PropConflict::new_err(e.to_string()))?;
            }
        }
        let engine = ctx
            .engine()
            .cloned()
            .ok_or_else(|| EventFailed::new_err("this context has no engine"))?;
        let (tx, rx) = crossbeam_channel::bounded(1);
        // This rank's own components handle the event on this thread (see below).
        let (local_tx, local_rx) = crossbeam_channel::unbounded::<Request<Payload>>();
        let ev = EventType::new(event);
        std::thread::Builder::new()
            .name("rx-py-event".into())
            .spawn(move || {
                let r = embed::fire_local(engine.as_ref(), &ev, &mut ctx, local_tx);
                let _ = tx.send(r.map(|()| ctx));
            })
            .map_err(|e| EventFailed::new_err(format!("cannot start the event thread: {e}")))?;
        // The engine's own deadline (the executor's event timeout) bounds the wait.
        // Meanwhile this thread runs this rank's handlers for the event: they run on
        // the thread that fired it, like a Rust rank's. A firing thread that ended
        // without answering (it panicked) is an answer too: waiting on its closed
        // channel would spin.
        let got = loop {
            let step = wait_sliced(py, None, |slice| {
                crossbeam_channel::select! {
                    recv(rx) -> r => Some(Fired::Done(r.ok())),
                    recv(local_rx) -> e => match e {
                        Ok(Request::Event(e)) => Some(Fired::Local(e)),
                        // Only events are sent here.
                        Ok(_) => None,
                        // The fire is over; its result follows.
                        Err(_) => match rx.recv_timeout(slice) {
                            Ok(r) => Some(Fired::Done(Some(r))),
                            Err(crossbeam_channel::RecvTimeoutError::Timeout) => None,
                            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                                Some(Fired::Done(None))
                            }
                        },
                    },
                    default(slice) => None,
                }
            })?;
            match step {
                Some(Fired::Local(e)) => serve_event(py, e)?,
                Some(Fired::Done(r)) => break Some(r),
                None => break None,
            }
        };
        match got {
            Some(Some(Ok(back))) => {
                *self.ctx.lock().unwrap_or_else(PoisonError::into_inner) = back;
                Ok(())
            }
            Some(Some(Err(e))) => Err(EventFailed::new_err(rankexec_protocol::error_chain(&e))),
            Some(None) => Err(EventFailed::new_err(
                "the event thread ended without an answer",
            )),
            None => Err(EventFailed::new_err("the event was not answered")),
        }
    }
}

/// What the wait in `Context.fire_event` saw.
enum Fired {
    /// The fire ended (None: its thread ended without an answer).
    Done(Option<Result<FlContext, rankexec_protocol::FireEventError>>),
    /// One of this rank's components must handle the event on this thread.
    Local(embed::Event<Payload>),
}

/// One task: its name, input, context and abort signal; answer it once with `reply`
/// or `fail`.
#[pyclass(module = "rankexec", frozen)]
pub struct Task {
    pub(crate) name: String,
    pub(crate) component: Option<Py<PyAny>>,
    pub(crate) input: Py<PyAny>,
    pub(crate) ctx: Py<Context>,
    pub(crate) abort: Py<Abort>,
    pub(crate) reply: Mutex<Option<Reply>>,
}

impl Task {
    /// The input's blobs still reachable from `input.blobs` (what a view sent back may
    /// lie in; see `outgoing::input_view`).
    fn input_blobs(&self, py: Python<'_>) -> Vec<RBlob> {
        let Ok(blobs) = self.input.bind(py).getattr("blobs") else {
            return Vec::new();
        };
        let Ok(blobs) = blobs.cast_into::<PyDict>() else {
            return Vec::new();
        };
        blobs
            .values()
            .iter()
            .filter_map(|v| v.cast::<Blob>().ok().map(|b| b.get().inner.clone()))
            .collect()
    }

    fn take_reply(&self) -> PyResult<Reply> {
        self.reply
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .ok_or_else(|| ReplyError::new_err("this task was already answered"))
    }
}

/// What a blob from Python becomes: ready (a `Blob` forwarded as is, a sealed
/// `SharedBuffer`, a small copy), or a large buffer still to copy into shared memory.
enum FromPy {
    Ready(RBlob),
    Copy(PyBuffer<u8>),
}

/// A blob from whatever Python gave: a `Blob` (forwarded as is), a `SharedBuffer`
/// (sealed, no copy), or anything with a contiguous buffer (one copy; large ones are
/// copied by [`shareable_from_py`], all into one memory file).
fn blob_from_py(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<FromPy> {
    if let Ok(b) = obj.cast::<Blob>() {
        return Ok(FromPy::Ready(b.get().inner.clone()));
    }
    if let Ok(s) = obj.cast::<SharedBuffer>() {
        return Ok(FromPy::Ready(s.get().sealed_blob()?));
    }
    let py = obj.py();
    let view = py
        .import("rankexec._shareable")?
        .call_method1("byte_view", (obj, name))?;
    let buf: PyBuffer<u8> = PyBuffer::get(&view)?;
    if buf.len_bytes() >= SHARED_FROM {
        Ok(FromPy::Copy(buf))
    } else {
        Ok(FromPy::Ready(RBlob::from(buf.to_vec(py)?)))
    }
}

fn shareable_from_py(
    py: Python<'_>,
    output: Option<&Bound<'_, PyAny>>,
    meta: Option<&Bound<'_, PyDict>>,
    blobs: Option<&Bound<'_, PyDict>>,
    inputs: &[RBlob],
) -> PyResult<Shareable> {
    let mut out = Shareable::new();
    let mut copies: Vec<(String, PyBuffer<u8>)> = Vec::new();
    let mut add = |m: Option<&Bound<'_, PyAny>>, b: Option<&Bound<'_, PyAny>>| -> PyResult<()> {
        if let Some(m) = m.filter(|m| !m.is_none()) {
            for (k, v) in map_from_py(m.cast::<PyDict>()?, "meta")? {
                out.set_meta(k, v);
            }
        }
        if let Some(b) = b.filter(|b| !b.is_none()) {
            for (k, v) in b.cast::<PyDict>()?.iter() {
                let name: String = k.extract()?;
                match blob_from_py(&v, &name)? {
                    FromPy::Ready(blob) => {
                        copies.retain(|(n, _)| *n != name);
                        out.set_blob(name, blob);
                    }
                    FromPy::Copy(buf) => {
                        out.take_blob(&name);
                        copies.retain(|(n, _)| *n != name);
                        match super::outgoing::input_view(&buf, inputs) {
                            Some(view) => out.set_blob(name, view),
                            None => copies.push((name, buf)),
                        }
                    }
                }
            }
        }
        Ok(())
    };
    if let Some(o) = output.filter(|o| !o.is_none()) {
        let (m, b) = match (o.getattr("meta"), o.getattr("blobs")) {
            (Ok(m), Ok(b)) => (m, b),
            _ => {
                return Err(PyTypeError::new_err(format!(
                    "the output must be a rankexec.Shareable (or have `meta` and `blobs`), \
                     not a {}",
                    o.get_type().name()?
                )));
            }
        };
        add(Some(&m), Some(&b))?;
    }
    add(meta.map(|m| m.as_any()), blobs.map(|b| b.as_any()))?;
    if !copies.is_empty() {
        // Every large buffer into one memory file: one copy each, one descriptor.
        let bufs: Vec<&PyBuffer<u8>> = copies.iter().map(|(_, b)| b).collect();
        let made = super::outgoing::copy_buffers(py, &bufs)?;
        for ((name, _), blob) in copies.into_iter().zip(made) {
            out.set_blob(name, blob);
        }
    }
    Ok(out)
}

#[pymethods]
impl Task {
    /// The task name.
    #[getter]
    fn name<'py>(&self, py: Python<'py>) -> Bound<'py, PyString> {
        PyString::new(py, &self.name)
    }

    /// The component object the task is for (component style), or None (script style).
    #[getter]
    fn component(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.component.as_ref().map(|c| c.clone_ref(py))
    }

    /// The input (`rankexec.Shareable`: `meta` dict and `blobs` dict of `Blob`).
    #[getter]
    fn input(&self, py: Python<'_>) -> Py<PyAny> {
        self.input.clone_ref(py)
    }

    /// The input's metadata.
    #[getter]
    fn meta<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.input.bind(py).getattr("meta")
    }

    /// The input's blobs.
    #[getter]
    fn blobs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.input.bind(py).getattr("blobs")
    }

    /// The task's context.
    #[getter]
    fn ctx(&self, py: Python<'_>) -> Py<Context> {
        self.ctx.clone_ref(py)
    }

    /// The task's abort signal.
    #[getter]
    fn abort(&self, py: Python<'_>) -> Py<Abort> {
        self.abort.clone_ref(py)
    }

    /// Whether the task was answered.
    #[getter]
    fn answered(&self) -> bool {
        self.reply
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none()
    }

    /// Answers the task with `output` (anything with `meta` and `blobs`) and/or `meta`
    /// and `blobs` dicts. Blobs may be `Blob`s, `SharedBuffer`s (sent without a copy),
    /// numpy arrays, torch tensors or any contiguous buffer.
    #[pyo3(signature = (output=None, *, meta=None, blobs=None))]
    fn reply(
        &self,
        py: Python<'_>,
        output: Option<&Bound<'_, PyAny>>,
        meta: Option<&Bound<'_, PyDict>>,
        blobs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<()> {
        let inputs = self.input_blobs(py);
        let out = match shareable_from_py(py, output, meta, blobs, &inputs) {
            Ok(o) => o,
            Err(e) => {
                // A reply that cannot be built fails the task (with why), and says so.
                let text = e.to_string();
                if let Ok(r) = self.take_reply() {
                    r.send(Err(error_from_exception(py, &e)));
                }
                return Err(ReplyError::new_err(format!(
                    "cannot send the output: {text}"
                )));
            }
        };
        let ctx = self.ctx.bind(py).get().snapshot();
        let reply = self.take_reply()?;
        // Packing and sending the result need no Python (and may wait for the socket).
        py.detach(move || reply.send(Ok((out, ctx))));
        Ok(())
    }

    /// Fails the task with `error` (an exception): the host gets its type, message and
    /// traceback; `TaskAborted` counts as an abort, `MemoryError` and torch's
    /// `OutOfMemoryError` as out of memory.
    fn fail(&self, py: Python<'_>, error: Bound<'_, PyAny>) -> PyResult<()> {
        let err = PyErr::from_value(error);
        let reply = self.take_reply()?;
        let failed = error_from_exception(py, &err);
        py.detach(move || reply.send(Err(failed)));
        Ok(())
    }
}

/// The Python `Shareable` for an input.
pub(crate) fn input_to_py(py: Python<'_>, input: Shareable) -> PyResult<Py<PyAny>> {
    let (meta, blobs) = input.into_parts();
    let m = map_to_py(py, &meta)?;
    let b = PyDict::new(py);
    for (k, v) in blobs {
        b.set_item(k, Py::new(py, Blob { inner: v })?)?;
    }
    // Looked up once: an import per task is a dictionary walk per task.
    static SHAREABLE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    let cls = SHAREABLE.import(py, "rankexec._shareable", "Shareable")?;
    Ok(cls.call1((m, b))?.unbind())
}
