//! `rankexec._rankexec`: the native core of the `rankexec` Python package.
//!
//! A thin PyO3 layer over the Rust crates; the pure-Python face lives in
//! `python/rankexec/`. Two halves, one file tree each:
//!
//! - [`rank`]: the rank side. The Rust rank runtime (links, handshake, heartbeat,
//!   memory files) runs on its own threads without the GIL; Python code sees only tasks
//!   and events.
//! - [`host`]: the host side. A rank group (`MultiProcessExecutor`) driven from Python,
//!   used by the NVIDIA FLARE adapter.
//!
//! Beside them, `gpus`: the site's GPU inventory and whole-job reservations in the host's ledger,
//! for a scheduler in Python (FLARE's resource manager, `rankexec.flare.resources`).
//!
//! Platform code (memory files for blobs filled from Python) lives behind `os`;
//! Python objects become contract values in `value`, for both halves.

use pyo3::prelude::*;

mod gpus;
pub mod host;
mod os;
pub mod rank;
mod value;

/// The extension module.
#[pymodule]
fn _rankexec(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // The workspace version: the wheel's version (maturin reads it from Cargo.toml) and
    // `rankexec --version` come from the same line.
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    rank::register(m)?;
    host::register(m)?;
    gpus::register(m)?;
    value::register(m)?;
    Ok(())
}
