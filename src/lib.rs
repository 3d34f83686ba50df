//! rankexec: a multi-process executor for federated learning.
//!
//! A federated client hosts a [`MultiProcessExecutor`](executor::MultiProcessExecutor);
//! it launches a process group of rank sub-workers (one per local GPU, or N CPU ranks),
//! keeps them alive across rounds, fans every task out to all ranks, returns rank 0's
//! result, relays events both ways, and tears the whole group down on abort.
//!
//! This crate re-exports the three libraries and holds the `rankexec` command line:
//!
//! - [`protocol`]: the component contract and the wire protocol;
//! - [`executor`]: the parent side (`MultiProcessExecutor`, GPUs, admission);
//! - [`sub_worker`]: the rank side (write your own worker binary).
//!
//! and the federated job host:
//!
//! - [`job`]: job folders (`meta.json`, client and server configuration);
//! - [`host`]: the client runtime that hosts executors;
//! - [`server`]: the FedAvg controller and model persistor;
//! - [`sim`]: `rankexec simulate`, the whole federation in one process;
//! - [`signals`]: Ctrl-C handling for binaries;
//! - [`bench`](mod@bench): `rankexec bench`.
//!
//! The library knows no example component: hosts pass the registry they serve (the
//! `rankexec` binary passes `rankexec_examples::worker_registry()`), so a program that
//! uses this library links only what it registers.

pub use rankexec_executor as executor;
pub use rankexec_protocol as protocol;
pub use rankexec_sub_worker as sub_worker;

pub mod bench;
pub mod host;
pub mod job;
pub mod logging;
pub mod server;
pub mod signals;
pub mod sim;
