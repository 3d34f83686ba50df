//! A group's processes: spawning, watching, output, teardown targets.
//!
//! - `launch`: the built-in launcher and external launcher templates.
//! - [`process`]: the process table ([`ChildPid`], race-free signalling and reaping).
//! - `watch`: the exit watcher thread (pidfds).
//! - `output`: stdout/stderr capture into per-rank files and the host log.
//! - `rundir`: the private run directory.

pub(crate) mod launch;
pub(crate) mod output;
pub mod process;
pub(crate) mod rundir;
pub(crate) mod watch;

pub use process::{ChildPid, ProcInfo, Role};
