//! The dispatcher's state, its inputs (commands from the host, reports from the
//! group's threads) and the work it defers until teardown ends.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use rankexec_protocol::wire::message::{Props, RankError};
use rankexec_protocol::wire::{Channel, OutFrame};
use rankexec_protocol::{Engine, EventType, Shareable, Signal, Subscription};

use crate::admission::ledger::Reservation;
use crate::admission::{Admission, AdmissionError, Admit, Grant};
use crate::config::ExecutorConfig;
use crate::error::{
    EventError, ExecuteError, FailureCause, FinalizeReport, RankFailure, StartError, TaskRetry,
};
use crate::group::output::{OutputPump, Source, Tails};
use crate::group::process::{ProcInfo, ProcessTable};
use crate::group::rundir::RunDir;
use crate::group::watch::{ExitWatcher, Exited};
use crate::offload::{DropThere, Offload};
use crate::os::{self, TermSignal};
use crate::session::accept::{AcceptPolicy, Acceptor, Connected};
use crate::session::link::{LinkEvent, RankLink};

/// How long a rank that closed a channel has to show up as exited before the closed
/// connection itself is the failure.
pub(super) const CLOSED_GRACE: Duration = Duration::from_millis(500);
/// After `SIGKILL`, how long to wait before reporting processes as unkillable.
pub(super) const KILL_WAIT: Duration = Duration::from_secs(2);
/// How long to wait for a dead rank's stderr to drain into its error report.
pub(super) const TAIL_WAIT: Duration = Duration::from_millis(200);
/// How long a failed task waits, when it may be retried, for a rank's death from
/// outside to show up as its root cause (see `TaskOp::settle`).
pub(super) const SETTLE_GRACE: Duration = Duration::from_secs(1);
/// How often a launch waiting for resources re-checks them.
pub(super) const ADMISSION_RETRY: Duration = Duration::from_millis(500);

/// A request from the host.
pub(crate) enum Command {
    Start {
        props: Props,
        engine: Option<Arc<dyn Engine>>,
        reply: Sender<Result<(), StartError>>,
    },
    Execute(ExecuteCmd),
    Event(EventCmd),
    Park {
        reply: Sender<()>,
    },
    Finalize {
        reply: Sender<FinalizeReport>,
        /// Replaces `deadlines.shutdown_grace` for this teardown (an aborted job's
        /// ranks are not waited for as long as a finished job's).
        grace: Option<Duration>,
    },
    Status {
        reply: Sender<Status>,
    },
}

pub(crate) struct ExecuteCmd {
    pub(crate) task: String,
    pub(crate) input: Shareable,
    pub(crate) props: Props,
    pub(crate) abort: Signal,
    pub(crate) reply: TaskReply,
    /// Wakes the dispatcher when `abort` fires while the command waits (behind a task
    /// or a launch), so it is answered at once; set by the dispatcher.
    pub(crate) wake: Option<Subscription>,
    /// The task's deadline, set by its first run: a retry keeps it.
    pub(crate) deadline: Option<Instant>,
}

/// What a task's caller receives: rank 0's (or the combined) result and context, and
/// the tries a rank's death ended before it (`restart.retry_task`).
pub(crate) type TaskAnswer = Result<(Shareable, Props, Vec<TaskRetry>), ExecuteError>;

/// Where a task's answer goes. It carries the task's retries so far: every answer, from
/// any path (result, failure, abort, start-up failure), names them.
pub(crate) struct TaskReply {
    tx: Sender<TaskAnswer>,
    pub(super) retries: Vec<TaskRetry>,
}

impl TaskReply {
    pub(crate) fn new(tx: Sender<TaskAnswer>) -> Self {
        TaskReply {
            tx,
            retries: Vec::new(),
        }
    }

    /// Answers the caller; an error after retries says which tries ended how.
    pub(crate) fn send(
        self,
        result: Result<(Shareable, Props), ExecuteError>,
    ) -> Result<(), crossbeam_channel::SendError<TaskAnswer>> {
        let retries = self.retries;
        let answer = match result {
            Ok((out, props)) => Ok((out, props, retries)),
            Err(e) if retries.is_empty() => Err(e),
            Err(e) => Err(ExecuteError::Retried {
                retries,
                last: Box::new(e),
            }),
        };
        self.tx.send(answer)
    }
}

pub(crate) struct EventCmd {
    pub(crate) event: EventType,
    pub(crate) props: Props,
    pub(crate) reply: Sender<Result<Props, EventError>>,
}

/// A snapshot for callers.
#[derive(Debug, Clone, Default)]
pub struct Status {
    /// `idle` (no group), `admitting`, `starting`, `ready`, `busy` or `stopping`; `gone`
    /// when the dispatcher thread has ended.
    pub phase: &'static str,
    /// Every tracked process of the current group.
    pub processes: Vec<ProcInfo>,
    /// Relaunches since the last successful task.
    pub restarts: u32,
    /// Commands waiting to run (tasks behind the running one, a park waiting for it).
    pub queued: usize,
    /// The group's log directory.
    pub log_dir: Option<PathBuf>,
    /// Where the group's ranks connect (`local:PATH` or `tcp:HOST:PORT`).
    pub endpoint: Option<String>,
    /// Whether the executor was finalized.
    pub finalized: bool,
}

impl Status {
    /// What is known once the dispatcher thread has ended: nothing runs any more.
    pub(crate) fn gone() -> Status {
        Status {
            phase: "gone",
            finalized: true,
            ..Status::default()
        }
    }
}

/// Reports from a group's threads, tagged with the group's generation so that reports
/// from a previous group are ignored.
pub(crate) enum Report {
    Connected(Box<Connected>),
    Exited(Exited),
    Link {
        rank: u32,
        ev: LinkEvent,
    },
    AbortTask {
        task_id: u64,
        reason: String,
    },
    /// The outcome of admission attempt `attempt` (run on the admission thread).
    Admitted {
        attempt: u64,
        outcome: Result<Admit, AdmissionError>,
    },
    /// Every output pipe of a rank (or the launcher) has closed.
    OutputClosed(Source),
    /// A waiting task's abort signal fired.
    WaitingAborted,
    /// A task's frames, packed on the work thread.
    Packed {
        task_id: u64,
        frames: Result<Frames, ExecuteError>,
    },
}

/// Sends reports to the dispatcher.
#[derive(Clone)]
pub(crate) struct Reporter {
    pub(super) generation: u64,
    pub(super) tx: Sender<(u64, Report)>,
}

impl Reporter {
    pub(crate) fn link(&self, rank: u32, ev: LinkEvent) {
        let _ = self.tx.send((self.generation, Report::Link { rank, ev }));
    }
}

pub(super) enum Waiter {
    Start(Sender<Result<(), StartError>>),
    Execute(ExecuteCmd),
}

impl Waiter {
    pub(super) fn fail(self, err: &StartError) {
        match self {
            Waiter::Start(r) => drop(r.send(Err(err.clone()))),
            Waiter::Execute(c) => drop(c.reply.send(Err(ExecuteError::Start(err.clone())))),
        }
    }
}

pub(super) enum Phase {
    Starting {
        deadline: Instant,
        waiters: Vec<Waiter>,
        init_sent: bool,
        acks: Vec<bool>,
    },
    Ready,
    Stopping {
        stage: TermStage,
        deadline: Instant,
        started: Instant,
        escalated: Option<TermSignal>,
        after: Vec<After>,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum TermStage {
    Closing,
    Terminating,
    Killing,
}

/// How a teardown begins.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Teardown {
    /// `Close`, then the shutdown grace, `SIGTERM`, the term grace, `SIGKILL`. Stages no
    /// live process can act on are skipped (see `Dispatcher::stop_progress`).
    Graceful,
    /// `SIGKILL` at once: the ranks already had their grace (a forced abort).
    Kill,
}

/// What to do once teardown is complete (every process gone): answers are delivered
/// only then, so a caller that hears of a failure finds no process left.
pub(super) enum After {
    /// Answer a task with an error.
    FailTask(TaskReply, ExecuteError),
    /// Answer an event with an error.
    FailEvent(Sender<Result<Props, EventError>>, EventError),
    /// Answer a park.
    Parked(Sender<()>),
    /// Answer a finalize with the teardown's report.
    Finalized(Sender<FinalizeReport>),
    /// Fail the commands that waited for a start-up.
    FailWaiters(Vec<Waiter>, StartError),
    /// Run a task again, on a relaunched group (it ran out of memory, or a rank died
    /// from outside).
    RetryTask(ExecuteCmd),
    /// Launch again for the commands that waited (out of memory at start-up).
    Relaunch(Vec<Waiter>),
}

pub(super) struct Group {
    pub(super) generation: u64,
    pub(super) epoch: Instant,
    pub(super) phase: Phase,
    pub(super) table: Arc<ProcessTable>,
    pub(super) watcher: ExitWatcher,
    pub(super) acceptor: Option<Acceptor>,
    pub(super) policy: Option<Arc<AcceptPolicy>>,
    pub(super) output: Option<OutputPump>,
    pub(super) tails: Arc<Tails>,
    pub(super) _run_dir: Option<RunDir>,
    pub(super) links: Vec<RankLink>,
    pub(super) last_seen: Vec<Arc<AtomicU64>>,
    pub(super) external: bool,
    /// Ranks whose connection closed, waiting briefly for their exit status.
    pub(super) closed_pending: BTreeMap<u32, ClosedPending>,
    /// Processes that exited while their stderr was still open: their failure is
    /// reported when it closes (so the report has their last lines) or at the deadline
    /// (a child they left holds it), in the order they exited. Nothing waits on it.
    pub(super) exits_pending: Vec<PendingExit>,
    /// Ranks known not to answer (silent past the heartbeat deadline): a `Close` grace
    /// is not spent on them.
    pub(super) unanswering: std::collections::BTreeSet<u32>,
    pub(super) failures: Vec<RankFailure>,
    /// OOM-kill counters of each process's memory cgroup when it started.
    pub(super) oom_baselines: BTreeMap<u32, os::OomCounter>,
    pub(super) grant: Grant,
    /// The ledger entry, updated and finally released on the admission thread.
    pub(super) reservation: Option<DropThere<Arc<Reservation>>>,
    pub(super) log_dir: PathBuf,
    pub(super) endpoint: String,
    pub(super) pgid: u32,
}

/// A connection that closed: the failure if no exit status comes by `deadline`.
#[derive(Clone, Copy, Debug)]
pub(super) struct ClosedPending {
    pub(super) channel: Channel,
    pub(super) deadline: Instant,
}

/// A task being stopped.
#[derive(Debug)]
pub(super) struct Aborting {
    pub(super) reason: String,
    /// When the abort grace ends and the group is killed.
    pub(super) deadline: Instant,
    /// Whether the caller asked (its answer is then `Aborted`), rather than a rank's
    /// failure making the others stop (the answer is that failure).
    pub(super) by_user: bool,
}

/// An exit whose report waits for the process's stderr to close.
pub(super) struct PendingExit {
    pub(super) source: Source,
    /// The failure for a rank; `None` for a launcher during start-up.
    pub(super) cause: Option<FailureCause>,
    pub(super) status: crate::os::ExitStatus,
    pub(super) deadline: Instant,
}

pub(super) struct TaskOp {
    pub(super) id: u64,
    pub(super) cmd: ExecuteCmd,
    pub(super) deadline: Instant,
    pub(super) results: Vec<Option<Result<(Props, Shareable), RankError>>>,
    pub(super) aborting: Option<Aborting>,
    pub(super) _sub: Subscription,
    pub(super) span: tracing::Span,
    /// The frames sent to the ranks (`None` while they are being packed), kept (with
    /// their memory files) until the task ends: while the parent holds a blob's memory
    /// file, a rank unmapping it never frees its pages, so that cost is not on the
    /// ranks' way to replying. Released off the dispatcher thread when the task ends.
    pub(super) sent: Option<crate::reclaim::Deferred<Frames>>,
    /// A task that failed while a retry was possible waits until then before it is
    /// answered: a rank's death from outside that comes meanwhile is the root cause (a
    /// collective's error in a surviving rank is often reported before the dead rank's
    /// exit is seen), and the task is retried. See `Dispatcher::hold_for_death`.
    pub(super) settle: Option<Instant>,
}

/// A task's `Execute` frames, by carrier: `[memory files, inline]`.
pub(super) type Frames = [Option<Arc<OutFrame>>; 2];

/// What packing a task's frames needs, moved to the work thread.
pub(super) struct PackSpec {
    pub(super) task_id: u64,
    pub(super) task: String,
    pub(super) props: Props,
    pub(super) input: Shareable,
    pub(super) want_output: bool,
    /// Which carriers the ranks need: `[memory files, inline]`.
    pub(super) needed: [bool; 2],
    pub(super) zero_copy_threshold: u64,
}

pub(super) struct EventOp {
    pub(super) cmd: EventCmd,
    pub(super) deadline: Instant,
    /// How long the ranks were given (the event deadline, plus what was left of the
    /// running task's when the event was sent).
    pub(super) allowed: std::time::Duration,
    pub(super) acks: Vec<Option<Result<Props, RankError>>>,
}

pub(super) struct PendingLaunch {
    pub(super) not_before: Instant,
    pub(super) admission_deadline: Option<Instant>,
    /// An attempt is running on the admission thread.
    pub(super) in_flight: bool,
    /// The id of the latest attempt (a late answer to an abandoned one is not this).
    pub(super) attempt: u64,
    pub(super) waiters: Vec<Waiter>,
}

pub(crate) struct Dispatcher {
    pub(super) cfg: Arc<ExecutorConfig>,
    pub(super) program: PathBuf,
    pub(super) cmd_rx: Receiver<Command>,
    pub(super) ev_tx: Sender<(u64, Report)>,
    pub(super) ev_rx: Receiver<(u64, Report)>,
    /// Weak: the host's engine usually owns this executor (see `session::link`).
    pub(super) engine: Option<std::sync::Weak<dyn Engine>>,
    pub(super) start_props: Props,
    pub(super) base_log_dir: Option<PathBuf>,
    pub(super) generation: u64,
    pub(super) group: Option<Group>,
    pub(super) queue: VecDeque<Command>,
    pub(super) task: Option<TaskOp>,
    pub(super) events: BTreeMap<u64, EventOp>,
    pub(super) pending: Option<PendingLaunch>,
    /// Used only on `admit`'s thread: admission may wait on a ledger lock, sample the
    /// CPU or load NVML, none of which the dispatcher may wait for.
    pub(super) admission: Arc<std::sync::Mutex<Admission>>,
    pub(super) admit: Offload,
    /// Admission attempts so far (ids for their answers).
    pub(super) admission_attempts: u64,
    /// Packing inputs into memory files and reducing gathered results.
    pub(super) work: Offload,
    pub(super) consecutive_failures: u32,
    pub(super) restarts: u32,
    pub(super) last_failure: Option<ExecuteError>,
    pub(super) deferred: Option<ExecuteError>,
    pub(super) oom_startup_used: u32,
    pub(super) oom_execute_used: u32,
    pub(super) growth: f64,
    pub(super) finalized: bool,
    /// The `Close` grace given to `finalize`, set only while it starts its teardown.
    pub(super) close_grace: Option<Duration>,
    pub(super) next_task_id: u64,
    pub(super) next_event_id: u64,
}
