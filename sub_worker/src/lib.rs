//! The rank side of rankexec.
//!
//! A rank is a process that connects to its executor over three authenticated channels,
//! builds the components the executor names, and runs every task it is sent until the
//! executor closes the group. Write your own worker binary in a few lines:
//!
//! ```no_run
//! use rankexec_protocol::{ComponentError, Executor, FlComponent, FlContext, Shareable, Signal};
//!
//! struct Trainer;
//! impl FlComponent for Trainer {}
//! impl Executor for Trainer {
//!     fn execute(&self, task: &str, input: Shareable, ctx: &mut FlContext, abort: &Signal)
//!         -> Result<Shareable, ComponentError> {
//!         // train on this rank's shard, watching `abort`
//!         Ok(input)
//!     }
//! }
//!
//! fn main() -> std::process::ExitCode {
//!     let mut registry = rankexec_sub_worker::builtins::registry();
//!     registry.executor("Trainer", |_: serde_json::Value| Ok(Trainer));
//!     rankexec_sub_worker::main(registry)
//! }
//! ```
//!
//! - [`main`] / [`main_with_args`]: the worker command line ([`cli`]).
//! - [`run`]: serve as a rank ([`rank`] explains threads, exit codes and caveats).
//! - [`builtins`]: the components of `rankexec-worker`.
//! - [`rank_info`]: who this rank is, for component constructors.
//! - [`embed`]: the runtime on background threads, handing tasks to a foreign-language
//!   caller (the Python package).
//!
//! This crate does not depend on NVML: a rank learns its GPU from
//! `CUDA_VISIBLE_DEVICES`, set by the executor.

pub mod builtins;
pub mod cli;
pub mod embed;
mod engine;
pub mod errorfile;
pub mod handoff;
mod link;
mod logging;
mod os;
pub mod rank;

pub use cli::{main, main_with_args};
pub use engine::RankEngine;
pub use rank::{
    EXIT_INTERNAL, EXIT_OK, EXIT_PARENT_GONE, EXIT_PROTOCOL, EXIT_STARTUP, EXIT_USAGE, RankInfo,
    rank_info, run,
};
