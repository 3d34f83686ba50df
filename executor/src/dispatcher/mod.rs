//! The dispatcher: one thread that owns a `MultiProcessExecutor`'s state.
//!
//! Every event is linearized through one loop, as in nextest's runner: commands from the
//! host (start, execute, event, park, finalize), and reports from the acceptor, the
//! per-rank connection threads and the exit watcher. Every wait is a deadline in that
//! loop (`select!` with a timer), so nothing busy-polls and nothing blocks forever:
//!
//! | deadline | expiry |
//! |---|---|
//! | start-up | `StartError::Timeout`, group torn down |
//! | task | `ExecuteError::Timeout` naming the ranks still running, group torn down |
//! | abort grace | the group is killed, `ExecuteError::Aborted { forced: true }` |
//! | event | `EventError::Timeout` naming the silent ranks, group torn down |
//! | heartbeat | `FailureCause::Unresponsive`, group torn down |
//! | shutdown grace, term grace, kill wait | `SIGTERM`, then `SIGKILL`, then give up and report unkillable pids |
//!
//! Teardown is all-or-nothing (torchrun's rule): any rank failure stops the whole group,
//! and the task, event or start-up waiting on it gets the error only once every process
//! is gone. A failure while idle is reported to the next task; the task after that
//! relaunches the group if the restart policy allows. With `restart.retry_task`, a
//! rank's death from outside costs a retry instead (see `retry`).
//!
//! # Files
//!
//! - `state`: the state, the inputs (`Command`, `Report`) and deferred work.
//! - `run`: the loop, the queue and the deadlines.
//! - `launch`: launch planning (admission, back-off, spawning).
//! - `startup`: connections, `Init`, acknowledgements.
//! - `task`: tasks, aborts, results.
//! - `event`: events to the ranks.
//! - `failure`: failure reports and failing what is in flight.
//! - `retry`: running a task again after a rank's death from outside.
//! - `teardown`: the teardown ladder and finalize.
//! - `tests`, `retry_tests`: transitions driven without processes.

mod event;
mod failure;
mod launch;
mod retry;
#[cfg(test)]
mod retry_tests;
mod run;
mod startup;
mod state;
mod task;
mod teardown;
#[cfg(test)]
mod tests;

pub use state::Status;
pub(crate) use state::{
    Command, Dispatcher, EventCmd, ExecuteCmd, Reporter, TaskAnswer, TaskReply,
};
