//! Task retries (`restart.retry_task`): a task whose rank died from outside (a signal,
//! the OOM killer, a lost node or link; see [`RankFailure::from_outside`]) is run again
//! on a relaunched group, with the same input and within its first run's deadline,
//! before its caller is answered. The answer names every try a death ended.
//!
//! The decision is made where a death meets the task in flight (`fail_inflight`): the
//! group is torn down as for any failure, and the task goes back to the front of the
//! queue (`After::RetryTask`), where it waits for the relaunch like any task after a
//! failure (the back-off applies and the relaunch counts against `max_restarts`).
//!
//! A death while no task runs (between tasks) would fail the next task at once; with
//! retries, that task runs on the relaunched group instead, and its answer names the
//! death as try 0 (`absorb_idle_death`). Try 0 is not one of the task's tries: the
//! budget, `retry_task`, is per task and counts only deaths during it (`tries_used`).
//!
//! Caveat: when one rank dies, the others often fail first in a collective (gloo's
//! "connection closed by peer"), and with `rank0_only` rank 0's error alone completes
//! the task. So a task that failed while a retry is possible waits up to
//! `SETTLE_GRACE` for a death from outside to show up as the root cause before it is
//! answered with the error (`hold_for_death`). An error that no death follows is
//! answered that much later; nothing else waits. A signal's death of a rank we spawned
//! is a cause whenever it comes; a closed connection of a rank we did not spawn (or a
//! silent rank) after another rank reported an error is not: an external launcher
//! stops the other ranks after one failed (torchrun does), so it is the error's
//! consequence, and the error is the answer.

use std::time::Instant;

use rankexec_protocol::ErrorClass;
use tracing::{info, warn};

use crate::error::{ExecuteError, FailureCause, RankFailure, TaskRetry};

use super::state::*;

impl Dispatcher {
    /// Whether the task in flight may be run again after a death now: retries left and
    /// time left before its deadline.
    pub(super) fn may_retry(&self, t: &TaskOp, now: Instant) -> bool {
        let used = tries_used(&t.cmd.reply.retries);
        used < self.cfg.restart.retry_task as usize && now < t.deadline && !self.finalized
    }

    /// Holds a task that would be answered with a rank's error while a retry is
    /// possible, until `SETTLE_GRACE` passes; true when it was held (see the module's
    /// caveat). A held task is answered at its settle deadline (`on_timers`) or
    /// retried by a death that comes first.
    pub(super) fn hold_for_death(&mut self) -> bool {
        let now = Instant::now();
        let Some(t) = &self.task else { return false };
        let by_user = t.aborting.as_ref().is_some_and(|a| a.by_user);
        let failed = t.results.iter().any(|r| {
            matches!(r, Some(Err(e)) if e.class != ErrorClass::Aborted && e.class != ErrorClass::OutOfMemory)
        });
        if t.settle.is_some() || by_user || !failed || !self.may_retry(t, now) {
            return false;
        }
        let healthy = self
            .group
            .as_ref()
            .is_some_and(|g| matches!(g.phase, Phase::Ready));
        if !healthy {
            return false;
        }
        if let Some(t) = &mut self.task {
            // Never past the task's deadline (the error is then the answer).
            t.settle = Some((now + SETTLE_GRACE).min(t.deadline));
            t.span.in_scope(|| {
                info!(
                    grace_ms = SETTLE_GRACE.as_millis() as u64,
                    "a rank reported an error; waiting briefly for a rank's death to retry on"
                )
            });
        }
        true
    }

    /// A death while no task ran is kept for the next task (`deferred`); with retries
    /// and a death from outside, that task runs on a relaunched group instead of failing
    /// with it, and its answer names the death (as try 0: before the task). `None`: the
    /// task goes on; else the error it is answered with.
    pub(super) fn absorb_idle_death(
        &self,
        c: &mut ExecuteCmd,
        err: ExecuteError,
    ) -> Option<ExecuteError> {
        // One death before the task is absorbed; it takes none of the task's tries.
        let retry_left =
            self.cfg.restart.retry_task > 0 && !c.reply.retries.iter().any(|r| r.attempt == 0);
        match &err {
            ExecuteError::RankFailed { failure, .. } if retry_left && failure.from_outside() => {
                info!(
                    task = %c.task,
                    "rank {} died from outside before the task ({failure}); running it on a relaunched group",
                    failure.rank
                );
                c.reply.retries.push(TaskRetry {
                    attempt: 0,
                    failure: (**failure).clone(),
                });
                None
            }
            _ => Some(err),
        }
    }

    /// What happens to the task in flight when rank failure `f` stops the group:
    /// retried when `f` is a death from outside and a retry is possible, else answered
    /// with `err`.
    pub(super) fn retry_or_fail(&mut self, t: TaskOp, f: &RankFailure, err: ExecuteError) -> After {
        // A rank we did not spawn whose connection closes, or a silent rank, after a
        // rank reported an error of its own in this task: most likely the launcher
        // stopping the others after that error (torchrun does), not a cause.
        let reported = t
            .results
            .iter()
            .any(|r| matches!(r, Some(Err(e)) if e.class != ErrorClass::Aborted));
        let ambiguous = matches!(
            f.cause,
            FailureCause::ConnectionClosed(_) | FailureCause::Unresponsive(_)
        );
        if !(f.from_outside() && !(reported && ambiguous) && self.may_retry(&t, Instant::now())) {
            self.last_failure = Some(err.clone());
            return After::FailTask(t.cmd.reply, err);
        }
        let TaskOp {
            cmd: mut c,
            deadline,
            span,
            ..
        } = t;
        let attempt = tries_used(&c.reply.retries) as u32 + 1;
        span.in_scope(|| {
            warn!(
                attempt,
                of = self.cfg.restart.retry_task,
                "rank {} died from outside ({f}); retrying the task on a relaunched group",
                f.rank
            )
        });
        c.reply.retries.push(TaskRetry {
            attempt,
            failure: f.clone(),
        });
        c.deadline = Some(deadline);
        self.last_failure = Some(err);
        After::RetryTask(c)
    }
}

/// The task's own tries so far: try 0 (a death before the task) is not one of them.
fn tries_used(retries: &[TaskRetry]) -> usize {
    retries.iter().filter(|r| r.attempt > 0).count()
}
