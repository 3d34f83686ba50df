//! The local simulator: server and clients of a federated job in one process.
//!
//! - [`run`]: [`simulate`] and `summary.json`.
//! - [`client`]: a simulated site (group gate, lazy `START_RUN`).
//! - [`progress`]: bars and per-round lines.
//! - [`logs`]: console, job and per-site log files.
//! - [`metrics`]: every round's report in `metrics.jsonl`.

pub mod client;
pub mod logs;
pub mod metrics;
pub mod progress;
pub mod run;

pub use run::{SimError, SimOptions, Summary, prepare_workspace, simulate};
