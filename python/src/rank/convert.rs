//! Python exceptions into typed component errors (class, message, traceback). Values
//! are converted by `crate::value`.

use pyo3::exceptions::{PyKeyboardInterrupt, PyMemoryError};
use pyo3::prelude::*;
use rankexec_protocol::{ComponentError, ErrorClass};

use super::errors::TaskAborted;

/// A component error for a Python exception: its class from the exception's type, its
/// message the formatted traceback.
pub(crate) fn error_from_exception(py: Python<'_>, err: &PyErr) -> ComponentError {
    let class = if err.is_instance_of::<TaskAborted>(py) {
        ErrorClass::Aborted
    } else if err.is_instance_of::<PyMemoryError>(py) || is_torch_oom(py, err) {
        ErrorClass::OutOfMemory
    } else {
        ErrorClass::Exception
    };
    let text = traceback_text(py, err).unwrap_or_else(|| err.to_string());
    let text = if err.is_instance_of::<PyKeyboardInterrupt>(py) && text.trim().is_empty() {
        "KeyboardInterrupt".to_owned()
    } else {
        text
    };
    ComponentError::new(class, text.trim_end().to_owned())
}

/// A component error with the exception's type and message only (no traceback): for
/// configuration checks, where the frames are the loader's own.
pub(crate) fn error_without_traceback(py: Python<'_>, err: &PyErr) -> ComponentError {
    let text = py
        .import("traceback")
        .and_then(|tb| tb.call_method1("format_exception_only", (err.value(py),)))
        .and_then(|lines| lines.extract::<Vec<String>>())
        .map(|parts| parts.concat())
        .unwrap_or_else(|_| err.to_string());
    ComponentError::failed(text.trim_end().to_owned())
}

/// `traceback.format_exception(err)`, joined.
fn traceback_text(py: Python<'_>, err: &PyErr) -> Option<String> {
    let tb = py.import("traceback").ok()?;
    let lines = tb.call_method1("format_exception", (err.value(py),)).ok()?;
    let parts: Vec<String> = lines.extract().ok()?;
    Some(parts.concat())
}

/// Whether `err` is torch's `OutOfMemoryError` (without importing torch).
fn is_torch_oom(py: Python<'_>, err: &PyErr) -> bool {
    let ty = err.get_type(py);
    let name = ty.name().map(|n| n.to_string()).unwrap_or_default();
    let module = ty.module().map(|m| m.to_string()).unwrap_or_default();
    name == "OutOfMemoryError" && module.starts_with("torch")
}
