//! Blocking calls from Python: the call runs on a helper thread while the caller waits
//! without the GIL, in short slices, so that Ctrl-C and a caller's abort flag are seen.
//!
//! Ctrl-C (any pending signal whose handler raises) first asks the call to wind down
//! (`on_interrupt`, e.g. abort the task) and keeps waiting, so that the group is left
//! in a known state; the exception is raised once the call returns. A second Ctrl-C
//! raises at once and leaves the call to finish on its own thread (the executor bounds
//! every call by its deadlines).

use std::time::Duration;

use crossbeam_channel::{RecvTimeoutError, bounded};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

/// Runs `f` on a helper thread named `name` and waits for it. After every `slice`
/// without a result, `on_tick` runs with the GIL (it may poll a flag); the first
/// interrupt calls `on_interrupt`.
pub(crate) fn run_blocking<T: Send + 'static>(
    py: Python<'_>,
    name: &str,
    slice: Duration,
    f: impl FnOnce() -> T + Send + 'static,
    mut on_tick: impl FnMut(Python<'_>) -> PyResult<()>,
    mut on_interrupt: impl FnMut(Python<'_>),
) -> PyResult<T> {
    let (tx, rx) = bounded(1);
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            let _ = tx.send(f());
        })
        .map_err(|e| PyRuntimeError::new_err(format!("cannot start a thread: {e}")))?;
    let mut interrupted: Option<PyErr> = None;
    loop {
        match py.detach(|| rx.recv_timeout(slice)) {
            Ok(v) => {
                return match interrupted {
                    Some(e) => Err(e),
                    None => Ok(v),
                };
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err(PyRuntimeError::new_err(format!(
                    "the `{name}` thread ended without a result"
                )));
            }
            Err(RecvTimeoutError::Timeout) => {}
        }
        if let Err(e) = py.check_signals() {
            if interrupted.is_some() {
                return Err(e);
            }
            on_interrupt(py);
            interrupted = Some(e);
            continue;
        }
        if interrupted.is_none() {
            on_tick(py)?;
        }
    }
}
