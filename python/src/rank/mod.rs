//! The rank side: Python rank code served by the Rust rank runtime.
//!
//! - [`runtime`]: `start` / `Rank.receive`, the component and script registries;
//! - [`task`]: `Task`, `Context`, `Abort`;
//! - [`blob`]: `Blob`, `SharedBuffer`, `PrivateBuffer` (zero-copy buffers);
//! - `outgoing`: a reply's buffers into shared memory (or passed on as input views);
//! - [`convert`]: values and exceptions;
//! - [`errors`]: the typed exceptions.

use pyo3::prelude::*;

pub mod blob;
pub mod convert;
pub mod errors;
pub(crate) mod outgoing;
pub mod runtime;
pub mod task;

/// Adds the rank-side classes and functions to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_class::<blob::Blob>()?;
    m.add_class::<blob::SharedBuffer>()?;
    m.add_class::<blob::PrivateBuffer>()?;
    m.add_class::<task::Task>()?;
    m.add_class::<task::Context>()?;
    m.add_class::<task::Abort>()?;
    m.add_class::<runtime::Rank>()?;
    m.add_function(wrap_pyfunction!(blob::share, m)?)?;
    m.add_function(wrap_pyfunction!(blob::trim_heap, m)?)?;
    m.add_function(wrap_pyfunction!(runtime::start, m)?)?;
    m.add_function(wrap_pyfunction!(runtime::rank_identity, m)?)?;
    m.add_function(wrap_pyfunction!(runtime::worker_cli, m)?)?;
    Ok(())
}
