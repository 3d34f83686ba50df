//! Serving as a rank from Python: the component registry (`"module:Class"` and
//! `"file.py:Class"` loaded by `rankexec._loader`), the script registry, and `Rank`,
//! which hands tasks to Python's main thread.
//!
//! The Rust runtime runs on its own threads (`embed`): links, handshake, heartbeats
//! and memory files never need the GIL. Components are built on the runtime thread
//! (with the GIL, while the main thread waits in `receive`), events are handled on the
//! rank's handle thread, and tasks run on the thread that calls `receive` (Python's
//! main thread, where `KeyboardInterrupt` is delivered).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use pyo3::prelude::*;
use rankexec_protocol::{
    Component, ComponentConfig, ComponentError, EventType, FlContext, Registry,
};
use rankexec_sub_worker::embed::{self, Bridge, EventFn, Next, Tasks};
use rankexec_sub_worker::rank_info;

use super::convert::error_from_exception;
use super::errors::{NotARank, RankexecError};
use super::task::{Abort, Context, Task, input_to_py, wait_sliced};

/// The foreign payload of a task: the component object (None in script style).
type Payload = Option<Arc<Py<PyAny>>>;

static STARTED: AtomicBool = AtomicBool::new(false);

fn py_error(e: &PyErr) -> ComponentError {
    Python::attach(|py| error_from_exception(py, e))
}

/// An event handler calling `f(event, ctx)` with the GIL.
fn event_fn(f: Arc<Py<PyAny>>, method: Option<&'static str>) -> Arc<EventFn> {
    Arc::new(move |event: &EventType, ctx: &mut FlContext| {
        Python::attach(|py| {
            let c = Py::new(py, Context::new(ctx.clone())).map_err(|e| py_error(&e))?;
            let target = f.bind(py);
            let r = match method {
                Some(m) => target.call_method1(m, (event.as_str(), c.clone_ref(py))),
                None => target.call1((event.as_str(), c.clone_ref(py))),
            };
            r.map_err(|e| error_from_exception(py, &e))?;
            *ctx = c.bind(py).get().snapshot();
            Ok(())
        })
    })
}

/// Builds a Python component through `rankexec._loader.build`.
fn build_python(
    cfg: &ComponentConfig,
    tx: &crossbeam_channel::Sender<embed::Task<Payload>>,
) -> Result<Component, ComponentError> {
    Python::attach(|py| {
        let built = (|| -> PyResult<(Py<PyAny>, bool, bool)> {
            let obj = py
                .import("rankexec._loader")?
                .call_method1("build", (&cfg.id, &cfg.path, cfg.args.to_string()))?;
            let exec = obj.hasattr("execute")?;
            let events = obj.hasattr("handle_event")?;
            Ok((obj.unbind(), exec, events))
        })();
        let (obj, exec, events) = built.map_err(|e| error_from_exception(py, &e))?;
        let obj = Arc::new(obj);
        let events = events.then(|| event_fn(obj.clone(), Some("handle_event")));
        let bridge = Bridge::new(Some(obj), tx.clone(), events);
        Ok(if exec {
            Component::Executor(Arc::new(bridge))
        } else {
            Component::Handler(Arc::new(bridge))
        })
    })
}

/// Checks a Python component without building it (`rankexec._loader.check`).
fn check_python(cfg: &ComponentConfig) -> Result<(), ComponentError> {
    Python::attach(|py| {
        py.import("rankexec._loader")
            .and_then(|m| m.call_method1("check", (&cfg.id, &cfg.path, cfg.args.to_string())))
            .map(drop)
            .map_err(|e| error_from_exception(py, &e))
    })
}

/// The registry of `python -m rankexec.worker`: every path is a Python component.
fn component_registry(tx: crossbeam_channel::Sender<embed::Task<Payload>>) -> Registry {
    let mut r = Registry::new();
    r.fallback(move |cfg| build_python(cfg, &tx), check_python);
    r
}

/// The registry of a script: every component hands its tasks to `receive()`.
fn script_registry(
    tx: crossbeam_channel::Sender<embed::Task<Payload>>,
    on_event: Option<Arc<Py<PyAny>>>,
) -> Registry {
    let mut r = Registry::new();
    r.fallback(
        move |_cfg| {
            let events = on_event.clone().map(|f| event_fn(f, None));
            Ok(Component::Executor(Arc::new(Bridge::new(
                None,
                tx.clone(),
                events,
            ))))
        },
        |_cfg| Ok(()),
    );
    r
}

/// This process serving as a rank. Get it from `rankexec.init()` (script style) or let
/// `python -m rankexec.worker` drive it (component style).
#[pyclass(module = "rankexec", frozen)]
pub struct Rank {
    tasks: Mutex<Tasks<Payload>>,
}

fn to_task(py: Python<'_>, t: embed::Task<Payload>) -> PyResult<Task> {
    let input = input_to_py(py, t.input)?;
    let component = t.payload.map(|p| p.clone_ref(py));
    Ok(Task {
        name: t.task,
        component,
        input,
        ctx: Py::new(py, Context::new(t.ctx))?,
        abort: Py::new(py, Abort { signal: t.abort })?,
        reply: Mutex::new(Some(t.reply)),
    })
}

#[pymethods]
impl Rank {
    /// Waits for the next task; None once the host closed the group. Ctrl-C raises
    /// `KeyboardInterrupt`.
    fn receive(&self, py: Python<'_>) -> PyResult<Option<Task>> {
        let next = wait_sliced(py, None, |slice| {
            let mut tasks = self.tasks.lock().unwrap_or_else(PoisonError::into_inner);
            match tasks.next(slice) {
                Next::Idle => None,
                other => Some(other),
            }
        })?;
        match next {
            Some(Next::Task(t)) => to_task(py, t).map(Some),
            _ => Ok(None),
        }
    }

    /// The runtime's exit code once it stopped (0 after the host closed the group).
    #[getter]
    fn exit_code(&self) -> Option<u8> {
        self.tasks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .exit_code()
    }

    /// This rank's number in its group.
    #[getter]
    fn rank(&self) -> u32 {
        rank_info().map_or(0, |i| i.env.rank)
    }

    /// How many ranks the group has.
    #[getter]
    fn world_size(&self) -> u32 {
        rank_info().map_or(1, |i| i.env.world_size)
    }

    /// This rank's number on this host.
    #[getter]
    fn local_rank(&self) -> u32 {
        rank_info().map_or(0, |i| i.env.local_rank)
    }

    /// How many ranks run on this host.
    #[getter]
    fn local_world_size(&self) -> u32 {
        rank_info().map_or(1, |i| i.env.local_world_size)
    }
}

/// Starts the rank runtime: `mode` is `"components"` or `"script"`.
#[pyfunction]
#[pyo3(signature = (mode, on_event=None))]
pub fn start(mode: &str, on_event: Option<Py<PyAny>>) -> PyResult<Rank> {
    if std::env::var_os(rankexec_protocol::env::vars::ENDPOINT).is_none() {
        return Err(NotARank::new_err(
            "not started by a rankexec executor (RANKEXEC_ENDPOINT is not set)",
        ));
    }
    if STARTED.swap(true, Ordering::SeqCst) {
        return Err(RankexecError::new_err(
            "this process already serves as a rank",
        ));
    }
    let (tx, rx) = embed::channel::<Payload>();
    let registry = match mode {
        "components" => component_registry(tx),
        "script" => script_registry(tx, on_event.map(Arc::new)),
        other => {
            return Err(RankexecError::new_err(format!(
                "unknown mode `{other}` (components or script)"
            )));
        }
    };
    let tasks = embed::start(registry, rx)?;
    Ok(Rank {
        tasks: Mutex::new(tasks),
    })
}

/// The worker command line (`--check-components`, `--list-components`, ...) for
/// Python components; returns the exit code.
#[pyfunction]
pub fn worker_cli(args: Vec<String>) -> u8 {
    // Checks import modules with the GIL held on this thread (attach is re-entrant).
    let (tx, _rx) = embed::channel::<Payload>();
    embed::cli(component_registry(tx), args)
}
