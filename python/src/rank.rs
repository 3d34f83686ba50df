//! The rank side: Python rank code served by the Rust rank runtime.

use pyo3::prelude::*;

/// Adds the rank-side classes and functions to the module.
pub fn register(_m: &Bound<'_, PyModule>) -> PyResult<()> {
    Ok(())
}
