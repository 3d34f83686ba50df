//! Example components for rankexec.
//!
//! - [`dataset`]: the digits data, embedded in the crate and parsed with checks.
//! - [`digits`]: the digits splits and a softmax-regression model in plain Rust.
//! - [`fedavg`]: `DigitsTrainer`, the rank component of `examples/jobs/fedavg`.
//!
//! [`registry`] registers them all; [`worker_registry`] adds them to the built-ins of
//! `rankexec-worker`: it is what `rankexec worker` (the CLI in rank mode) serves.
//!
//! The examples depend on the rankexec libraries, never the other way round: the
//! `rankexec` library does not use this crate; only the `rankexec` binary composes it.

pub mod dataset;
pub mod digits;
pub mod fedavg;
#[cfg(feature = "mpi")]
pub mod mpi_train;

use rankexec_protocol::Registry;

/// Every example component.
pub fn registry() -> Registry {
    let mut r = Registry::new();
    r.executor("DigitsTrainer", fedavg::DigitsTrainer::new);
    #[cfg(feature = "mpi")]
    r.executor("MpiDigitsTrainer", mpi_train::MpiDigitsTrainer::new);
    r
}

/// The built-in components of `rankexec-worker` plus every example component: the
/// registry of `rankexec worker`, and of the `rankexec` CLI when it checks a job.
pub fn worker_registry() -> Registry {
    let mut r = rankexec_sub_worker::builtins::registry();
    r.extend(registry());
    r
}
