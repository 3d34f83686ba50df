//! `MultiProcessExecutor` configuration: what a job's `executor.args` holds.
//!
//! Everything has a default except `executor_id` and `components`. [`ExecutorConfig::validate`]
//! checks the whole configuration before anything starts and names the offending field
//! with its JSON path.
//!
//! ```
//! use rankexec_executor::ExecutorConfig;
//! let cfg: ExecutorConfig = serde_json::from_value(serde_json::json!({
//!     "executor_id": "echo",
//!     "num_of_processes": 2,
//!     "components": [{"id": "echo", "path": "Echo"}],
//!     "deadlines": {"task": "10s"}
//! })).unwrap();
//! assert_eq!(cfg.num_of_processes, 2);
//! assert!(cfg.validate().is_ok());
//! ```
//!
//! # Files
//!
//! - `schema`: the fields, their serde form and defaults.
//! - `validate`: [`ExecutorConfig::validate`] and [`ConfigError`].
//! - `program`: [`resolve_program`].

mod program;
mod schema;
#[cfg(test)]
mod tests;
mod validate;

pub use program::resolve_program;
pub use schema::*;
pub use validate::ConfigError;
