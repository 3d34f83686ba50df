//! The host side: a rank group (`MultiProcessExecutor`) driven from Python.
//!
//! The NVIDIA FLARE adapter (`rankexec.flare`) and any Python host use it through
//! `rankexec.host.RankGroup`, a thin Python layer over the native `_HostGroup`.
//!
//! - `group`: `_HostGroup`, its blocking calls (GIL released, Ctrl-C honoured).
//! - `blob`: `HostBlob`, a result blob exposed through the buffer protocol (no copy).
//! - `staging`: memory files prepared while the group is idle, so that a large payload
//!   from Python costs one copy into pages that already exist.
//! - `engine`: the engine that hands events fired in ranks to a Python callback.
//! - `convert`: Python objects to and from metadata values.
//! - `errors`: executor errors to the typed exceptions of `rankexec.host`.
//! - `wait`: running a blocking call on a helper thread, waking for signals.

use pyo3::prelude::*;

mod blob;
mod convert;
mod engine;
mod errors;
mod group;
mod staging;
mod wait;

/// Adds the host-side classes to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<group::HostGroup>()?;
    m.add_class::<blob::HostBlob>()?;
    m.add_class::<blob::PrefixedView>()?;
    Ok(())
}
