//! Blocking calls from Python: the caller waits without the GIL, in short slices, so
//! that Ctrl-C and a caller's abort flag are seen. A task's result is waited for on the
//! caller's own thread (`wait_for`, no thread between the dispatcher and the caller);
//! calls the executor offers only as blocking ones run on a helper thread
//! (`run_blocking`).
//!
//! Ctrl-C (any pending signal whose handler raises) first asks the call to wind down
//! (`on_interrupt`, e.g. abort the task) and keeps waiting, so that the group is left
//! in a known state; the exception is raised once the call returns. A second Ctrl-C
//! raises at once and leaves the call to finish on its own (the executor bounds every
//! call by its deadlines).

use std::time::Duration;

use crossbeam_channel::{RecvTimeoutError, bounded};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

/// What one slice of a wait saw.
pub(crate) enum Slice<T> {
    /// The result.
    Done(T),
    /// Nothing yet.
    Pending,
    /// The result will never come (its producer is gone); the message says which.
    Gone(String),
}

/// Waits for `poll` (called without the GIL, with the slice to wait at most) to give a
/// result. After every `slice` without one, `on_tick` runs with the GIL (it may poll a
/// flag); the first interrupt calls `on_interrupt`.
pub(crate) fn wait_for<T: Send>(
    py: Python<'_>,
    slice: Duration,
    mut poll: impl FnMut(Duration) -> Slice<T> + Send,
    mut on_tick: impl FnMut(Python<'_>) -> PyResult<()>,
    mut on_interrupt: impl FnMut(Python<'_>),
) -> PyResult<T> {
    let mut interrupted: Option<PyErr> = None;
    loop {
        match py.detach(|| poll(slice)) {
            Slice::Done(v) => {
                return match interrupted {
                    Some(e) => Err(e),
                    None => Ok(v),
                };
            }
            Slice::Gone(why) => return Err(PyRuntimeError::new_err(why)),
            Slice::Pending => {}
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

/// Runs `f` on a helper thread named `name` and waits for it (see `wait_for`).
pub(crate) fn run_blocking<T: Send + 'static>(
    py: Python<'_>,
    name: &str,
    slice: Duration,
    f: impl FnOnce() -> T + Send + 'static,
    on_tick: impl FnMut(Python<'_>) -> PyResult<()>,
    on_interrupt: impl FnMut(Python<'_>),
) -> PyResult<T> {
    let (tx, rx) = bounded(1);
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            let _ = tx.send(f());
        })
        .map_err(|e| PyRuntimeError::new_err(format!("cannot start a thread: {e}")))?;
    wait_for(
        py,
        slice,
        |left| match rx.recv_timeout(left) {
            Ok(v) => Slice::Done(v),
            Err(RecvTimeoutError::Timeout) => Slice::Pending,
            Err(RecvTimeoutError::Disconnected) => {
                Slice::Gone(format!("the `{name}` thread ended without a result"))
            }
        },
        on_tick,
        on_interrupt,
    )
}
