//! The host side: a rank group driven from Python.

use pyo3::prelude::*;

/// Adds the host-side classes and functions to the module.
pub fn register(_m: &Bound<'_, PyModule>) -> PyResult<()> {
    Ok(())
}
