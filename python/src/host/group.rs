//! `_HostGroup`: one `MultiProcessExecutor` owned by Python.
//!
//! Every blocking call (start, fire_event, close) runs on a helper thread while the
//! caller waits without the GIL (see `wait`); `execute` hands its task to the
//! dispatcher and waits for the result on the caller's thread (no thread between
//! them). Either way other Python threads run, Ctrl-C is seen within a slice, and
//! `execute` can poll a caller's abort flag at a few milliseconds (FLARE's `abort_signal` has no wake-up). `abort()` from another thread
//! fires the in-flight task's signal in every rank.
//!
//! A group dropped without `close()` is torn down when it is freed, also when its
//! `on_event` callback refers back to its owner: the callback is shown to the garbage
//! collector (`__traverse__`) and cleared with the group (`__clear__`).
//!
//! Input blobs are any C-contiguous buffer (bytes, numpy arrays, memoryviews); large ones
//! are copied once into a staged memory file (see `staging`), small ones inline.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyBufferError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};
use pyo3::{PyTraverseError, PyVisit};
use rankexec_executor::{ExecutorConfig, MultiProcessExecutor, TermSignal};
use rankexec_protocol::{Engine, FlContext, PropFlags, Shareable, Signal, keys};

use super::blob::HostBlob;
use super::convert;
use super::engine::PyEngine;
use super::errors;
use super::staging::Stager;
use super::wait::{Slice, run_blocking, wait_for};

/// How often a blocking call without an abort flag wakes to check for Ctrl-C: the
/// rank side's slice.
use crate::rank::task::SLICE as SIGNAL_SLICE;

/// A rank group driven from Python (wrapped by `rankexec.host.RankGroup`).
#[pyclass(module = "rankexec._rankexec", name = "_HostGroup")]
pub struct HostGroup {
    exec: Option<Arc<MultiProcessExecutor>>,
    engine: Arc<PyEngine>,
    stager: Arc<Stager>,
    in_flight: Arc<Mutex<Option<Signal>>>,
}

impl HostGroup {
    fn exec(&self) -> PyResult<Arc<MultiProcessExecutor>> {
        self.exec
            .clone()
            .ok_or_else(|| PyRuntimeError::new_err("the group is gone"))
    }

    fn context(&self, props: Option<&Bound<'_, PyDict>>) -> PyResult<FlContext> {
        let mut ctx = FlContext::with_engine(self.engine.clone() as Arc<dyn Engine>);
        let _ = ctx.set_prop(
            keys::IDENTITY_NAME,
            self.engine.identity.as_str(),
            PropFlags::PRIVATE_STICKY,
        );
        let _ = ctx.set_prop(
            keys::JOB_ID,
            self.engine.job_id.as_str(),
            PropFlags::PRIVATE_STICKY,
        );
        convert::context(ctx, props)
    }
}

/// What `execute` returns: the result's meta, its blobs, rank 0's context properties
/// and the tries a rank's death ended before it.
type Executed<'py> = (
    Bound<'py, PyDict>,
    Bound<'py, PyDict>,
    Bound<'py, PyDict>,
    Bound<'py, PyList>,
);

#[pymethods]
impl HostGroup {
    /// Validates `config` (the executor's JSON configuration) and starts the executor's
    /// dispatcher (no ranks yet).
    #[new]
    #[pyo3(signature = (config, on_event=None, site="local".to_owned(), job_id=String::new(), workspace=None))]
    fn new(
        py: Python<'_>,
        config: &str,
        on_event: Option<Py<PyAny>>,
        site: String,
        job_id: String,
        workspace: Option<PathBuf>,
    ) -> PyResult<Self> {
        let de = &mut serde_json::Deserializer::from_str(config);
        let cfg: ExecutorConfig = serde_path_to_error::deserialize(de).map_err(|e| {
            errors::config_text_error(
                py,
                format!("invalid configuration at {}: {}", e.path(), e.inner()),
            )
        })?;
        let threshold = usize::try_from(cfg.zero_copy_threshold.0).unwrap_or(usize::MAX);
        let workspace = workspace
            .or_else(|| cfg.log_dir.clone())
            .unwrap_or_else(|| std::env::temp_dir().join(format!("rankexec-{site}")));
        let exec = py
            .detach(|| MultiProcessExecutor::new(cfg))
            .map_err(|e| errors::config_error(py, &e))?;
        Ok(HostGroup {
            exec: Some(Arc::new(exec)),
            engine: Arc::new(PyEngine {
                callback: Mutex::new(on_event),
                identity: site,
                job_id,
                workspace,
            }),
            stager: Stager::new(threshold),
            in_flight: Arc::new(Mutex::new(None)),
        })
    }

    /// Launches the group and waits until every rank is ready.
    #[pyo3(signature = (props=None))]
    fn start(&self, py: Python<'_>, props: Option<&Bound<'_, PyDict>>) -> PyResult<()> {
        let exec = self.exec()?;
        let ctx = self.context(props)?;
        let e2 = exec.clone();
        let r = run_blocking(
            py,
            "rx-py-start",
            SIGNAL_SLICE,
            move || exec.start(&ctx),
            |_| Ok(()),
            |py| {
                let e = e2.clone();
                let _ = py.detach(move || e.finalize());
            },
        )?;
        r.map_err(|e| errors::start_error(py, &e))
    }

    /// Runs `task` on every rank; returns `(meta, blobs, props, retries)`. With
    /// `consume`, `blobs` is emptied once its buffers are in shared memory, before the
    /// ranks run: a caller that holds no other reference frees its copy of a large
    /// input for the whole task.
    #[pyo3(signature = (task, meta, blobs, props=None, abort_check=None, poll_s=0.005, abort_reason="aborted by the host".to_owned(), consume=false))]
    #[allow(clippy::too_many_arguments)]
    fn execute<'py>(
        &self,
        py: Python<'py>,
        task: String,
        meta: &Bound<'py, PyDict>,
        blobs: &Bound<'py, PyDict>,
        props: Option<&Bound<'py, PyDict>>,
        abort_check: Option<Py<PyAny>>,
        poll_s: f64,
        abort_reason: String,
        consume: bool,
    ) -> PyResult<Executed<'py>> {
        let exec = self.exec()?;
        // The task is in flight from here: an `abort()` while its input is converted or
        // copied into shared memory applies to it (the executor then ends it at once).
        let signal = Signal::new();
        let _in_flight = InFlight::set(&self.in_flight, signal.clone());
        let meta = crate::value::map_from_py(meta, "meta")?;
        let mut buffers: Vec<(String, PyUntypedBuffer)> = Vec::new();
        // Blobs already in sealed memory files (`rankexec.Blob`, `HostBlob`) are passed
        // on as they are: no copy.
        let mut ready: Vec<(String, rankexec_protocol::Blob)> = Vec::new();
        for (k, v) in blobs.iter() {
            let name: String = k
                .extract()
                .map_err(|_| PyValueError::new_err("blob names must be str"))?;
            if let Ok(b) = v.cast::<crate::rank::blob::Blob>() {
                ready.push((name, b.get().inner.clone()));
                continue;
            }
            if let Ok(b) = v.cast::<HostBlob>() {
                ready.push((name, b.get().blob.clone()));
                continue;
            }
            let buf = PyUntypedBuffer::get(&v).map_err(|e| {
                let kind = v
                    .get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default();
                let err = pyo3::exceptions::PyTypeError::new_err(format!(
                    "blob `{name}`: a {kind} is not a buffer (use bytes, a numpy array, a \
                     torch tensor or a SharedBuffer)"
                ));
                err.set_cause(py, Some(e));
                err
            })?;
            if !buf.is_c_contiguous() {
                return Err(PyBufferError::new_err(format!(
                    "blob `{name}` is not C-contiguous (use numpy.ascontiguousarray)"
                )));
            }
            buffers.push((name, buf));
        }
        let stager = self.stager.clone();
        let staged = py.detach(|| -> std::io::Result<_> {
            let srcs: Vec<&[u8]> = buffers
                .iter()
                .map(|(_, buf)| {
                    // SAFETY: `buf` holds the exporter's buffer (PyObject_GetBuffer) until
                    // it is released after this closure, so the pointer is valid for
                    // `len_bytes()` bytes and C-contiguous (checked above). Another Python
                    // thread could write to it meanwhile; that races only on the values
                    // copied, as any GIL-free reader of a numpy array does.
                    unsafe {
                        std::slice::from_raw_parts(buf.buf_ptr() as *const u8, buf.len_bytes())
                    }
                })
                .collect();
            let (blobs, size) = stager.stage(&srcs)?;
            let names = buffers.iter().map(|(name, _)| name.clone());
            Ok((
                names
                    .zip(blobs)
                    .collect::<std::collections::BTreeMap<_, _>>(),
                size,
            ))
        });
        drop(buffers);
        if consume {
            // The caller's references to the input go now: once in shared memory, the
            // input is not held twice while the task runs (see `execute`'s docs).
            blobs.clear();
            // Freed tensors under glibc's mmap threshold stay resident until trimmed.
            crate::os::trim_heap();
        }
        let (mut blob_map, staged_size) = staged.map_err(|e| errors::staging_error(py, &e))?;
        blob_map.extend(ready);
        let sizes = vec![staged_size];
        let input = Shareable::from_parts(meta, blob_map);
        let mut ctx = self.context(props)?;
        let slice = if abort_check.is_some() {
            Duration::try_from_secs_f64(poll_s.clamp(0.001, 1.0)).unwrap_or(SIGNAL_SLICE)
        } else {
            SIGNAL_SLICE
        };
        let (s_tick, s_int) = (signal.clone(), signal.clone());
        let pending = exec
            .submit_task(&task, input, &ctx, &signal)
            .map_err(|e| errors::execute_error(py, &e));
        let result = pending.and_then(|pending| {
            wait_for(
                py,
                slice,
                |left| match pending.wait_outcome_timeout(left, &mut ctx) {
                    Some(r) => Slice::Done(r),
                    None => Slice::Pending,
                },
                |py| {
                    if let Some(check) = &abort_check {
                        if s_tick.is_triggered() {
                            return Ok(());
                        }
                        match check.call0(py).and_then(|v| v.is_truthy(py)) {
                            Ok(true) => s_tick.trigger(abort_reason.clone()),
                            Ok(false) => {}
                            Err(e) => {
                                tracing::warn!(task, "the abort check raised: {e}; aborting");
                                s_tick.trigger("the abort check raised");
                            }
                        }
                    }
                    Ok(())
                },
                |_| s_int.trigger("interrupted (Ctrl-C)"),
            )
        });
        drop(_in_flight);
        self.stager.prepare_in_background(sizes);
        let outcome = result?.map_err(|e| errors::execute_error(py, &e))?;
        let retries = errors::retries_to_py(py, &outcome.retries)?;
        let (meta, blobs) = outcome.output.into_parts();
        let py_meta = crate::value::map_to_py(py, &meta)?;
        let py_blobs = PyDict::new(py);
        for (name, blob) in blobs {
            py_blobs.set_item(PyString::new(py, &name), Py::new(py, HostBlob { blob })?)?;
        }
        let py_props = convert::props_to_py(py, ctx.props())?;
        Ok((py_meta, py_blobs, py_props, retries))
    }

    /// Delivers `event` to every rank; returns rank 0's context properties.
    #[pyo3(signature = (event, props=None))]
    fn fire_event<'py>(
        &self,
        py: Python<'py>,
        event: String,
        props: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let exec = self.exec()?;
        let ctx = self.context(props)?;
        let (r, ctx) = run_blocking(
            py,
            "rx-py-event",
            SIGNAL_SLICE,
            move || {
                let mut ctx = ctx;
                let r = exec.fire_to_ranks(&rankexec_protocol::EventType::new(event), &mut ctx);
                (r, ctx)
            },
            |_| Ok(()),
            |_| {},
        )?;
        r.map_err(|e| errors::event_error(py, &e))?;
        convert::props_to_py(py, ctx.props())
    }

    /// Fires the in-flight task's abort signal in every rank; returns whether a task was
    /// in flight.
    #[pyo3(signature = (reason="aborted by the host".to_owned()))]
    fn abort(&self, reason: String) -> bool {
        match &*self
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
        {
            Some(s) => {
                s.trigger(reason);
                true
            }
            None => false,
        }
    }

    /// Tears the group down (close, grace, SIGTERM, grace, SIGKILL, reap); returns what
    /// was torn down: `{"elapsed_s", "escalated", "unkillable", "pids"}`. `grace`
    /// (seconds) replaces `deadlines.shutdown_grace` for the ranks' exit after the close.
    #[pyo3(signature = (grace=None))]
    fn close<'py>(&self, py: Python<'py>, grace: Option<f64>) -> PyResult<Bound<'py, PyDict>> {
        let grace = match grace {
            None => None,
            Some(g) => Some(Duration::try_from_secs_f64(g).map_err(|e| {
                PyValueError::new_err(format!("grace must be a duration in seconds: {e}"))
            })?),
        };
        let exec = self.exec()?;
        self.stager.clear();
        let pids = py.detach(|| exec.live_pids());
        let r = run_blocking(
            py,
            "rx-py-close",
            SIGNAL_SLICE,
            move || match grace {
                None => exec.finalize(),
                Some(g) => exec.finalize_within(g),
            },
            |_| Ok(()),
            |_| {},
        )?;
        let report = r.map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        let d = PyDict::new(py);
        d.set_item("elapsed_s", report.elapsed.as_secs_f64())?;
        d.set_item(
            "escalated",
            report.escalated.map(|s| match s {
                TermSignal::Term => "SIGTERM",
                TermSignal::Kill => "SIGKILL",
            }),
        )?;
        d.set_item("unkillable", report.unkillable)?;
        d.set_item("pids", pids)?;
        Ok(d)
    }

    /// The pids of the group's live processes.
    fn pids(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        let exec = self.exec()?;
        Ok(py.detach(|| exec.live_pids()))
    }

    /// `idle`, `admitting`, `starting`, `ready`, `busy` or `stopping`.
    #[getter]
    fn phase(&self, py: Python<'_>) -> PyResult<&'static str> {
        let exec = self.exec()?;
        Ok(py.detach(|| exec.status().phase))
    }

    /// The group's log directory (`rank-N/` folders), once started.
    #[getter]
    fn log_dir(&self, py: Python<'_>) -> PyResult<Option<PathBuf>> {
        let exec = self.exec()?;
        Ok(py.detach(|| exec.status().log_dir))
    }

    /// Prepares memory files for input blobs of these sizes now (otherwise done in the
    /// background after each task).
    fn prepare(&self, py: Python<'_>, sizes: Vec<usize>) {
        let stager = self.stager.clone();
        py.detach(move || stager.prepare(&sizes));
    }

    /// Bytes held by prepared memory files.
    #[getter]
    fn staged_bytes(&self) -> usize {
        self.stager.held()
    }

    /// Shows the event callback to the garbage collector: it usually refers back to
    /// the group's owner, and a cycle the collector cannot see would keep the ranks
    /// alive until the process exits.
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        // Never wait here: whoever holds the lock holds it only briefly, with the GIL.
        if let Ok(cb) = self.engine.callback.try_lock()
            && let Some(cb) = cb.as_ref()
        {
            visit.call(cb)?;
        }
        Ok(())
    }

    /// Breaks the cycle (drops the callback) and tears the group down, as dropping it
    /// does (bounded by the executor's shutdown deadlines).
    fn __clear__(&mut self) {
        let cb = self
            .engine
            .callback
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        drop(cb);
        self.teardown();
    }
}

/// The in-flight task's signal, registered for `abort()` while it lives.
struct InFlight<'a>(&'a Mutex<Option<Signal>>);

impl<'a> InFlight<'a> {
    fn set(slot: &'a Mutex<Option<Signal>>, signal: Signal) -> Self {
        *slot.lock().unwrap_or_else(PoisonError::into_inner) = Some(signal);
        InFlight(slot)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = None;
    }
}

impl HostGroup {
    /// Stops the executor (and its ranks) without holding the GIL.
    fn teardown(&mut self) {
        self.stager.clear();
        if let Some(exec) = self.exec.take() {
            // Teardown waits for relay threads that may need the GIL: release it. (While
            // the interpreter shuts down, relay threads cannot attach either: they fail
            // the event instead of waiting, so dropping here cannot deadlock.)
            let mut exec = Some(exec);
            let _ = Python::try_attach(|py| {
                let e = exec.take();
                py.detach(move || drop(e));
            });
            drop(exec);
        }
    }
}

impl Drop for HostGroup {
    fn drop(&mut self) {
        self.teardown();
    }
}
