//! `MultiProcessExecutor`: FLARE's multi-process executor, done right.
//!
//! A host (a federated client) calls it like any [`Executor`]. On `START_RUN` it
//! launches `num_of_processes` ranks and keeps them alive across tasks; every task is
//! fanned out to all ranks (or sent to rank 0 alone, `ResultPolicy::Rank0Only`) and rank
//! 0's result is returned (or all results are combined, see
//! [`ResultPolicy`](crate::ResultPolicy)); events travel both ways; `END_RUN`
//! reaches the ranks and then the group is torn down.
//!
//! ```no_run
//! use rankexec_executor::{ExecutorConfig, MultiProcessExecutor};
//! use rankexec_protocol::{EventType, FlComponent, FlContext, Shareable, Signal};
//!
//! let cfg = ExecutorConfig::simple(4, "Echo", serde_json::Value::Null);
//! let exec = MultiProcessExecutor::new(cfg)?;
//! let mut ctx = FlContext::new();
//! exec.handle_event(&EventType::START_RUN, &mut ctx)?;
//! let out = exec.run_task("train", Shareable::new().with_meta("round", 1), &mut ctx, &Signal::new())?;
//! assert_eq!(out.meta("rank").and_then(|v| v.as_i64()), Some(0));
//! exec.handle_event(&EventType::END_RUN, &mut ctx)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Caveats
//!
//! - **A rank that hangs** is found by the task deadline (busy) or the heartbeat
//!   deadline (idle); the whole group is torn down and the error names the rank.
//! - **The host process is `SIGKILL`ed**: ranks spawned by the built-in launcher get
//!   `SIGKILL` from the kernel (`PR_SET_PDEATHSIG`), and every rank (also under
//!   torchrun, mpirun or srun) sees its connections close and exits at once. Nothing
//!   waits on a timer.
//! - **The host panics**: the dispatcher thread is unaffected; dropping the executor
//!   (unwinding) tears the group down. If the panic aborts the process, see the point above.
//! - **Dropping** the executor without `END_RUN` tears the group down, bounded by the
//!   shutdown grace, the term grace and two seconds.
//! - **Processes that survive `SIGKILL`** (stuck in the kernel, e.g. in a GPU driver
//!   call) are reported in [`FinalizeReport::unkillable`] after a bounded wait instead of
//!   blocking teardown forever.
//! - **Children of ranks** are in the ranks' process group and are signalled with them;
//!   a child that moves to another group or session is not (use a cgroup if you need
//!   that guarantee).
//! - The library installs **no signal handler**; binaries decide (see
//!   [`killswitch::kill_all`](crate::killswitch::kill_all)).

use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, bounded};
use rankexec_protocol::{
    ComponentError, EventType, Executor, FlComponent, FlContext, Shareable, Signal, keys,
};

use crate::admission::Admission;
use crate::config::{ConfigError, ExecutorConfig, resolve_program};
use crate::dispatcher::{Command, Dispatcher, EventCmd, ExecuteCmd, Status, TaskAnswer, TaskReply};
use crate::error::{
    EventError, ExecuteError, FinalizeError, FinalizeReport, StartError, TaskRetry,
};

struct Handle {
    tx: Sender<Command>,
    thread: Option<JoinHandle<()>>,
}

/// Runs every task on a group of rank processes. See the module docs.
pub struct MultiProcessExecutor {
    cfg: Arc<ExecutorConfig>,
    handle: Mutex<Handle>,
}

impl std::fmt::Debug for MultiProcessExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MultiProcessExecutor")
            .field("executor_id", &self.cfg.executor_id)
            .field("num_of_processes", &self.cfg.num_of_processes)
            .finish()
    }
}

impl MultiProcessExecutor {
    /// Validates the configuration and starts the dispatcher thread (no ranks yet).
    pub fn new(cfg: ExecutorConfig) -> Result<Self, ConfigError> {
        let cfg = Arc::new(cfg);
        let admission = Admission::new(cfg.clone());
        Self::with_admission(cfg, admission)
    }

    /// Like [`new`](Self::new), with a custom admission (probes and ledger).
    pub fn with_admission(
        cfg: Arc<ExecutorConfig>,
        admission: Admission,
    ) -> Result<Self, ConfigError> {
        cfg.validate()?;
        let program = resolve_program(&cfg.worker.program)
            .map_err(|m| ConfigError::new("worker.program", m))?;
        let (tx, rx) = crossbeam_channel::unbounded();
        let dispatcher = Dispatcher::new(cfg.clone(), program, rx, admission).map_err(|e| {
            ConfigError::new(
                "executor",
                format!("cannot start the dispatcher's threads: {e}"),
            )
        })?;
        // This thread spawns the ranks, so it must live as long as the executor: the
        // ranks' PR_SET_PDEATHSIG fires when the thread that forked them exits.
        // Logs of the group (and its ranks' output) nest under the creator's span.
        let span = tracing::Span::current();
        let thread = std::thread::Builder::new()
            .name(format!("rx-dispatch-{}", cfg.executor_id))
            .spawn(move || span.in_scope(|| dispatcher.run()))
            .map_err(|e| {
                ConfigError::new(
                    "executor",
                    format!("cannot start the dispatcher thread: {e}"),
                )
            })?;
        Ok(MultiProcessExecutor {
            cfg,
            handle: Mutex::new(Handle {
                tx,
                thread: Some(thread),
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ExecutorConfig {
        &self.cfg
    }

    fn send(&self, cmd: Command) -> bool {
        self.handle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .tx
            .send(cmd)
            .is_ok()
    }

    /// Launches the group (what `START_RUN` does) and waits until every rank is ready.
    pub fn start(&self, ctx: &FlContext) -> Result<(), StartError> {
        let (reply, rx) = bounded(1);
        if !self.send(Command::Start {
            props: ctx.props().clone(),
            engine: ctx.engine().cloned(),
            reply,
        }) {
            return Err(StartError::DispatcherGone);
        }
        rx.recv().unwrap_or(Err(StartError::DispatcherGone))
    }

    /// Runs `task` on every rank and returns the result (rank 0's, or the combined one).
    /// Rank 0's context is merged into `ctx` by the merge rule of [`FlContext`].
    pub fn run_task(
        &self,
        task: &str,
        input: Shareable,
        ctx: &mut FlContext,
        abort: &Signal,
    ) -> Result<Shareable, ExecuteError> {
        self.submit_task(task, input, ctx, abort)?.wait(ctx)
    }

    /// Hands `task` to the dispatcher and returns at once: the caller waits for the
    /// result on its own thread ([`PendingTask::wait_timeout`]), in slices if it has
    /// other things to watch (a caller's abort flag, signals), with no thread of ours
    /// between the result and the caller. The ranks get `ctx`'s properties.
    pub fn submit_task(
        &self,
        task: &str,
        input: Shareable,
        ctx: &FlContext,
        abort: &Signal,
    ) -> Result<PendingTask, ExecuteError> {
        let (reply, rx) = bounded(1);
        if !self.send(Command::Execute(ExecuteCmd {
            task: task.to_owned(),
            input,
            props: ctx.props().clone(),
            abort: abort.clone(),
            reply: TaskReply::new(reply),
            wake: None,
            deadline: None,
        })) {
            return Err(ExecuteError::DispatcherGone);
        }
        Ok(PendingTask {
            task: task.to_owned(),
            rx,
        })
    }

    /// Delivers `event` to every rank and waits for all acknowledgements; rank 0's
    /// context is merged into `ctx`.
    pub fn fire_to_ranks(&self, event: &EventType, ctx: &mut FlContext) -> Result<(), EventError> {
        let (reply, rx) = bounded(1);
        if !self.send(Command::Event(EventCmd {
            event: event.clone(),
            props: ctx.props().clone(),
            reply,
        })) {
            return Err(EventError::DispatcherGone);
        }
        let props = rx.recv().unwrap_or(Err(EventError::DispatcherGone))?;
        for conflict in ctx.merge_from(props) {
            tracing::warn!(event = %event, "{conflict}");
        }
        Ok(())
    }

    /// Stops the group (close, grace, `SIGTERM`, grace, `SIGKILL`, reap), bounded and
    /// idempotent. A later task or `START_RUN` launches a new group.
    pub fn finalize(&self) -> Result<FinalizeReport, FinalizeError> {
        self.finalize_inner(None)
    }

    /// [`finalize`](Self::finalize) with `grace` in place of `deadlines.shutdown_grace`
    /// for the ranks' cooperative exit after `Close` (then `SIGTERM`, the term grace,
    /// `SIGKILL`, as always): for a job that was aborted, whose ranks' own end is not
    /// worth waiting for. A teardown already under way keeps its deadline.
    pub fn finalize_within(&self, grace: Duration) -> Result<FinalizeReport, FinalizeError> {
        self.finalize_inner(Some(grace))
    }

    fn finalize_inner(&self, grace: Option<Duration>) -> Result<FinalizeReport, FinalizeError> {
        let (reply, rx) = bounded(1);
        if !self.send(Command::Finalize { reply, grace }) {
            return Err(FinalizeError::DispatcherGone);
        }
        rx.recv().map_err(|_| FinalizeError::DispatcherGone)
    }

    /// Stops the group to free its resources; the next task relaunches it (used when
    /// more clients share a host than it can hold at once).
    pub fn park(&self) {
        let (reply, rx) = bounded(1);
        if self.send(Command::Park { reply }) {
            let _ = rx.recv();
        }
    }

    /// The group's state and processes. The dispatcher answers at once (a status never
    /// waits behind a task or a queued command, and nothing blocks the dispatcher). If
    /// the dispatcher thread has ended, the phase is `gone` and no process is listed.
    pub fn status(&self) -> Status {
        let (reply, rx) = bounded(1);
        if !self.send(Command::Status { reply }) {
            return Status::gone();
        }
        // The reply is dropped unanswered only if the dispatcher ends first.
        rx.recv().unwrap_or_else(|_| Status::gone())
    }

    /// The pids of the group's live processes (ranks, and a launcher if there is one;
    /// a launcher that execs into the rank is one process), in launch order.
    pub fn live_pids(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = Vec::new();
        for p in self
            .status()
            .processes
            .iter()
            .filter(|p| p.status.is_none())
        {
            if !pids.contains(&p.pid) {
                pids.push(p.pid);
            }
        }
        pids
    }
}

impl FlComponent for MultiProcessExecutor {
    fn handle_event(&self, event: &EventType, ctx: &mut FlContext) -> Result<(), ComponentError> {
        // Events that came up from our own ranks are not sent back down (loop guard).
        if ctx
            .get_prop(keys::EVENT_ORIGIN_SITE)
            .and_then(|v| v.as_str())
            == Some("rank")
        {
            return Ok(());
        }
        let wrap = |e: &dyn std::error::Error, class| {
            ComponentError::new(class, rankexec_protocol::error_chain(e))
        };
        if *event == EventType::START_RUN {
            self.start(ctx)
                .map_err(|e| wrap(&e, rankexec_protocol::ErrorClass::Exception))?;
        }
        let relayed = self.fire_to_ranks(event, ctx);
        if *event == EventType::END_RUN {
            let report = self
                .finalize()
                .map_err(|e| wrap(&e, rankexec_protocol::ErrorClass::Exception))?;
            if !report.unkillable.is_empty() {
                tracing::error!(pids = ?report.unkillable, "processes survived SIGKILL");
            }
        }
        relayed.map_err(|e| wrap(&e, rankexec_protocol::ErrorClass::Exception))
    }
}

impl Executor for MultiProcessExecutor {
    fn execute(
        &self,
        task: &str,
        input: Shareable,
        ctx: &mut FlContext,
        abort: &Signal,
    ) -> Result<Shareable, ComponentError> {
        self.run_task(task, input, ctx, abort).map_err(|e| {
            let class = e.class();
            ComponentError::new(class, format!("multi-process task `{task}` failed")).with_source(e)
        })
    }
}

impl Drop for MultiProcessExecutor {
    fn drop(&mut self) {
        let mut h = self.handle.lock().unwrap_or_else(PoisonError::into_inner);
        // Closing the command channel makes the dispatcher tear down and exit.
        let (tx, _) = crossbeam_channel::unbounded();
        drop(std::mem::replace(&mut h.tx, tx));
        if let Some(t) = h.thread.take() {
            let _ = t.join();
        }
    }
}

/// A task's result and the tries before it that a rank's death from outside ended
/// (`restart.retry_task`; empty when the first try succeeded).
#[derive(Debug)]
pub struct TaskOutcome {
    /// The result (rank 0's, or the combined one).
    pub output: Shareable,
    /// The tries a death ended, in order; the task ran again after each.
    pub retries: Vec<TaskRetry>,
}

/// A task handed to the dispatcher by [`MultiProcessExecutor::submit_task`]: its result
/// once every rank answered, with rank 0's context merged into the caller's by the merge
/// rule of [`FlContext`].
#[derive(Debug)]
pub struct PendingTask {
    task: String,
    rx: Receiver<TaskAnswer>,
}

impl PendingTask {
    /// Waits for the result. The dispatcher answers every task it took (each rank's
    /// task deadline bounds it); if it is gone, the error says so.
    pub fn wait(self, ctx: &mut FlContext) -> Result<Shareable, ExecuteError> {
        self.wait_outcome(ctx).map(|o| o.output)
    }

    /// Waits for the result and the retries it took.
    pub fn wait_outcome(self, ctx: &mut FlContext) -> Result<TaskOutcome, ExecuteError> {
        let result = self.rx.recv().unwrap_or(Err(ExecuteError::DispatcherGone));
        self.merged(result, ctx)
    }

    /// Waits up to `timeout`; None if the task is still running.
    pub fn wait_timeout(
        &self,
        timeout: Duration,
        ctx: &mut FlContext,
    ) -> Option<Result<Shareable, ExecuteError>> {
        self.wait_outcome_timeout(timeout, ctx)
            .map(|r| r.map(|o| o.output))
    }

    /// Waits up to `timeout` for the result and the retries it took; None if the task
    /// is still running.
    pub fn wait_outcome_timeout(
        &self,
        timeout: Duration,
        ctx: &mut FlContext,
    ) -> Option<Result<TaskOutcome, ExecuteError>> {
        let result = match self.rx.recv_timeout(timeout) {
            Ok(r) => r,
            Err(RecvTimeoutError::Timeout) => return None,
            Err(RecvTimeoutError::Disconnected) => Err(ExecuteError::DispatcherGone),
        };
        Some(self.merged(result, ctx))
    }

    fn merged(&self, result: TaskAnswer, ctx: &mut FlContext) -> Result<TaskOutcome, ExecuteError> {
        let (output, props, retries) = result?;
        for conflict in ctx.merge_from(props) {
            tracing::warn!(task = self.task, "{conflict}");
        }
        if !retries.is_empty() {
            tracing::warn!(
                task = self.task,
                "task succeeded after {} retr{}: {}",
                retries.len(),
                if retries.len() == 1 { "y" } else { "ies" },
                crate::error::describe_retries(&retries)
            );
        }
        Ok(TaskOutcome { output, retries })
    }
}
