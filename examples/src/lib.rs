//! Example components for rankexec.
//!
//! - [`digits`]: the digits data set and a softmax-regression model in plain Rust.
//! - [`fedavg`]: `DigitsTrainer`, the rank component of `examples/jobs/fedavg`.
//!
//! [`registry`] registers them all; `rankexec worker` (the CLI in rank mode) and the
//! `digits-worker` binary use it.

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
