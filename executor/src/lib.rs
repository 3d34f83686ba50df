//! The parent side of rankexec: [`MultiProcessExecutor`] launches, supervises and tears
//! down a process group of rank sub-workers.
//!
//! - [`executor`]: the public executor (read its Caveats).
//! - [`config`]: its configuration ([`ExecutorConfig`]).
//! - [`error`]: one error enum per operation.
//! - `dispatcher`: the single thread that owns the group's state; `offload`: the
//!   threads it hands slow work to (admission, packing, reducing).
//! - [`group`]: processes (spawn, watch, signal, reap, output).
//! - `session`: accepting and talking to ranks.
//! - [`gpu`] and [`admission`]: NVML inventory, placement, memory admission.
//! - [`killswitch`]: kill every group now (second Ctrl-C).
//! - [`result`]: combining results (`gather`, and FedAvg's weighted average).
//! - [`units`]: sizes and durations in configuration.

pub mod admission;
pub mod config;
mod dispatcher;
pub mod error;
pub mod executor;
pub mod gpu;
pub mod group;
pub mod killswitch;
mod offload;
pub mod os;
mod reclaim;
pub mod result;
mod session;
pub mod units;

pub use config::{
    ConfigError, Deadlines, EnvConfig, EventRanks, ExecutorConfig, GpuConfig, GpuMode,
    LauncherConfig, OomRetries, ResourceConfig, RestartPolicy, ResultPolicy, TransportConfig,
    WorkerConfig,
};
pub use dispatcher::Status;
pub use error::{
    EventError, ExecuteError, FailureCause, FinalizeError, FinalizeReport, GatherError,
    RankFailure, RemoteError, StartError, TaskRetry,
};
pub use executor::{MultiProcessExecutor, PendingTask, TaskOutcome};
pub use os::{ExitStatus, TermSignal};
pub use units::{ByteSize, Dur};
