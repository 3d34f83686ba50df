//! Serving as a rank from Python: the component registry (`"module:Class"` and
//! `"file.py:Class"` loaded by `rankexec._loader`), the script registry, and `Rank`,
//! whose `receive` serves the runtime's requests on Python's main thread.
//!
//! The Rust runtime runs on its own threads (`embed`): links, handshake, aborts,
//! heartbeats and memory files never need the GIL. Once the rank is ready, `receive`
//! waits for the next task on the exec socket itself (without the GIL, checking for
//! signals between slices) and `Task.reply` sends the result from this thread, so a
//! task wakes no other thread of the rank. Every piece of Python code runs on
//! the thread that calls `receive` (Python's main thread, where `KeyboardInterrupt` and
//! signal handlers are delivered): components are built there (inside the first
//! `receive`), their `handle_event` (and the script style's `on_event`) runs there, and
//! so does every task. Thread-bound state (a CUDA device, grad mode, `threading.local`,
//! an asyncio loop, signal handlers) set in `__init__` or in an event handler therefore
//! holds in `execute`.
//!
//! # Caveats
//!
//! - An event that arrives while a task runs waits until the task ends (and until the
//!   script calls `receive` again); the executor's event deadline bounds that wait, and
//!   the host tears the group down when it passes, so a task longer than that deadline
//!   must not be sent events. The task's abort signal never waits: it fires from the
//!   runtime's handle thread.
//! - A process that starts the runtime and never calls `receive` holds its build (and
//!   every event) up; the executor's start-up deadline ends it.
//! - Events a task fires itself (`Context.fire_event`) reach this rank's components on
//!   the thread that fired them, before they go to the host.
//! - `receive` checks for signals between slices of its wait, not while it reads a
//!   task's frame: over TCP, a large input that streams in delays Ctrl-C until it is in.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use rankexec_protocol::{ComponentConfig, ComponentError, FlContext, Registry};
use rankexec_sub_worker::embed::{self, Built, Next, Request, Tasks};
use rankexec_sub_worker::rank_info;

use super::convert::{error_from_exception, error_without_traceback};
use super::errors::{NotARank, RankexecError};
use super::task::{Abort, Context, Task, input_to_py, wait_sliced};

/// The foreign payload of a task: the component object (None in script style).
pub(crate) type Payload = Option<Arc<Py<PyAny>>>;

static STARTED: AtomicBool = AtomicBool::new(false);

/// The script style's `on_event` (set once, by `start`).
static ON_EVENT: OnceLock<Py<PyAny>> = OnceLock::new();

/// Builds a Python component through `rankexec._loader.build` (on the caller's thread).
fn build_python(py: Python<'_>, cfg: &ComponentConfig) -> Result<Built<Payload>, ComponentError> {
    let built = (|| -> PyResult<(Py<PyAny>, bool, bool)> {
        let obj = py
            .import("rankexec._loader")?
            .call_method1("build", (&cfg.id, &cfg.path, cfg.args.to_string()))?;
        let exec = obj.hasattr("execute")?;
        let events = obj.hasattr("handle_event")?;
        Ok((obj.unbind(), exec, events))
    })();
    let (obj, executor, handles_events) = built.map_err(|e| error_from_exception(py, &e))?;
    Ok(Built {
        payload: Some(Arc::new(obj)),
        executor,
        handles_events,
    })
}

/// Runs a `handle_event` (or the script's `on_event`) here and answers the runtime.
/// Raises what is not an `Exception` (`KeyboardInterrupt`, `SystemExit`) after failing
/// the event with it.
pub(crate) fn serve_event(py: Python<'_>, e: embed::Event<Payload>) -> PyResult<()> {
    let run = || -> PyResult<FlContext> {
        let c = Py::new(py, Context::new(e.ctx.clone()))?;
        match (&e.payload, ON_EVENT.get()) {
            (Some(obj), _) => {
                obj.bind(py)
                    .call_method1("handle_event", (e.event.as_str(), c.clone_ref(py)))?;
            }
            (None, Some(f)) => {
                f.bind(py).call1((e.event.as_str(), c.clone_ref(py)))?;
            }
            (None, None) => {}
        }
        Ok(c.bind(py).get().snapshot())
    };
    match run() {
        Ok(ctx) => {
            let _ = e.reply.send(Ok(ctx));
            Ok(())
        }
        Err(err) => {
            let _ = e.reply.send(Err(error_from_exception(py, &err)));
            if err.is_instance_of::<PyException>(py) {
                Ok(())
            } else {
                Err(err)
            }
        }
    }
}

/// Checks a Python component without building it (`rankexec._loader.check`).
fn check_python(cfg: &ComponentConfig) -> Result<(), ComponentError> {
    Python::attach(|py| {
        py.import("rankexec._loader")
            .and_then(|m| m.call_method1("check", (&cfg.id, &cfg.path, cfg.args.to_string())))
            .map(drop)
            .map_err(|e| error_without_traceback(py, &e))
    })
}

/// The registry of `python -m rankexec.worker`: every path is a Python component, built
/// by the thread in `receive`.
fn component_registry(tx: embed::Requests<Payload>) -> Registry {
    let mut r = Registry::new();
    r.fallback(move |cfg| embed::build_on_caller(&tx, cfg), check_python);
    r
}

/// The registry of a script: every component hands its tasks (and, with an `on_event`,
/// its events) to `receive()`.
fn script_registry(tx: embed::Requests<Payload>, on_event: bool) -> Registry {
    let mut r = Registry::new();
    r.fallback(
        move |cfg| {
            Ok(rankexec_protocol::Component::Executor(Arc::new(
                tx.bridge(&cfg.id, None, on_event),
            )))
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
    /// Waits for the next task; None once the host closed the group (and at once in a
    /// process forked from the rank). Builds the components and runs event handlers on
    /// this thread meanwhile. Ctrl-C raises `KeyboardInterrupt`.
    fn receive(&self, py: Python<'_>) -> PyResult<Option<Task>> {
        loop {
            let next = wait_sliced(py, None, |slice| {
                let mut tasks = self.tasks.lock().unwrap_or_else(PoisonError::into_inner);
                match tasks.next(slice) {
                    Next::Idle => None,
                    other => Some(other),
                }
            })?;
            match next {
                Some(Next::Request(Request::Task(t))) => return to_task(py, t).map(Some),
                Some(Next::Request(Request::Build(b))) => {
                    let _ = b.reply.send(build_python(py, &b.config));
                }
                Some(Next::Request(Request::Event(e))) => serve_event(py, e)?,
                _ => return Ok(None),
            }
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
        identity().map_or(0, |e| e.rank)
    }

    /// How many ranks the group has.
    #[getter]
    fn world_size(&self) -> u32 {
        identity().map_or(1, |e| e.world_size)
    }

    /// This rank's number on this host.
    #[getter]
    fn local_rank(&self) -> u32 {
        identity().map_or(0, |e| e.local_rank)
    }

    /// How many ranks run on this host.
    #[getter]
    fn local_world_size(&self) -> u32 {
        identity().map_or(1, |e| e.local_world_size)
    }
}

/// This rank's identity: what the runtime recorded, or, before its thread has read the
/// environment (right after `start` returns), the same reading of it.
fn identity() -> Option<rankexec_protocol::env::RankEnv> {
    rank_info()
        .map(|i| i.env)
        .or_else(|| rankexec_protocol::env::discover(&|k: &str| std::env::var(k).ok()).ok())
}

/// This rank's `(rank, local_rank, world_size, local_world_size)` as the runtime will
/// read them from the environment (any launcher's variables), or `None` when the
/// environment names no rank. Called before `start`, while the process has no runtime
/// thread, so that `rankexec._torchrun` may set torchrun's variables from it.
#[pyfunction]
pub fn rank_identity() -> Option<(u32, u32, u32, u32)> {
    identity().map(|e| (e.rank, e.local_rank, e.world_size, e.local_world_size))
}

/// Starts the rank runtime: `mode` is `"components"` or `"script"`.
#[pyfunction]
#[pyo3(signature = (mode, on_event=None))]
pub fn start(mode: &str, on_event: Option<Py<PyAny>>) -> PyResult<Rank> {
    if !matches!(mode, "components" | "script") {
        return Err(RankexecError::new_err(format!(
            "unknown mode `{mode}` (components or script)"
        )));
    }
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
    let (tx, rx) = embed::channel::<Payload>()?;
    let registry = if mode == "components" {
        component_registry(tx)
    } else {
        let handles = match on_event {
            Some(f) => ON_EVENT.set(f).is_ok(),
            None => false,
        };
        script_registry(tx, handles)
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
    match embed::channel::<Payload>() {
        Ok((tx, _rx)) => embed::cli(component_registry(tx), args),
        Err(_) => rankexec_sub_worker::EXIT_INTERNAL,
    }
}
