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
//! relaunches the group if the restart policy allows.

use rankexec_protocol::error_chain as chain;
use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, after, never, select};
use rankexec_protocol::env::vars;
use rankexec_protocol::wire::envelope::{self, BlobPolicy};
use rankexec_protocol::wire::message::{Execute, Init, Props, RankError, WireComponent};
use rankexec_protocol::wire::{
    Channel, Endpoint, FrameLimits, Listener, Message, OutFrame, Secret,
};
use rankexec_protocol::{Engine, ErrorClass, EventType, Shareable, Signal, Subscription};
use tracing::{debug, info, info_span, warn};

use crate::admission::ledger::Reservation;
use crate::admission::{Admission, AdmissionError, Admit, Grant, Refusal};
use crate::config::{EventRanks, ExecutorConfig, LauncherConfig, ResultPolicy, TransportConfig};
use crate::error::{
    EventError, ExecuteError, FailureCause, FinalizeReport, RankFailure, RemoteError, StartError,
};
use crate::group::launch::{self, LaunchPlan};
use crate::group::output::{OutputPump, Source, Tails};
use crate::group::process::{ProcInfo, ProcessTable, Role};
use crate::group::rundir::RunDir;
use crate::group::watch::{ExitWatcher, Exited};
use crate::offload::{DropThere, Offload};
use crate::os::{self, TermSignal};
use crate::result::reduce;
use crate::session::accept::{AcceptPolicy, Acceptor, Connected};
use crate::session::link::{LinkContext, LinkEvent, RankLink};

/// How long a rank that closed a channel has to show up as exited before the closed
/// connection itself is the failure.
const CLOSED_GRACE: Duration = Duration::from_millis(500);
/// After `SIGKILL`, how long to wait before reporting processes as unkillable.
const KILL_WAIT: Duration = Duration::from_secs(2);
/// How long to wait for a dead rank's stderr to drain into its error report.
const TAIL_WAIT: Duration = Duration::from_millis(200);
/// How often a launch waiting for resources re-checks them.
const ADMISSION_RETRY: Duration = Duration::from_millis(500);

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
    pub(crate) reply: Sender<Result<(Shareable, Props), ExecuteError>>,
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
    /// A task's frames, packed on the work thread.
    Packed {
        task_id: u64,
        frames: Result<Frames, ExecuteError>,
    },
}

/// Sends reports to the dispatcher.
#[derive(Clone)]
pub(crate) struct Reporter {
    generation: u64,
    tx: Sender<(u64, Report)>,
}

impl Reporter {
    pub(crate) fn link(&self, rank: u32, ev: LinkEvent) {
        let _ = self.tx.send((self.generation, Report::Link { rank, ev }));
    }
}

enum Waiter {
    Start(Sender<Result<(), StartError>>),
    Execute(ExecuteCmd),
}

impl Waiter {
    fn fail(self, err: &StartError) {
        match self {
            Waiter::Start(r) => drop(r.send(Err(err.clone()))),
            Waiter::Execute(c) => drop(c.reply.send(Err(ExecuteError::Start(err.clone())))),
        }
    }
}

enum Phase {
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
enum TermStage {
    Closing,
    Terminating,
    Killing,
}

/// How a teardown begins.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Teardown {
    /// `Close`, then the shutdown grace, `SIGTERM`, the term grace, `SIGKILL`. Stages no
    /// live process can act on are skipped (see `Dispatcher::stop_progress`).
    Graceful,
    /// `SIGKILL` at once: the ranks already had their grace (a forced abort).
    Kill,
}

/// Something to do once teardown is complete.
type After = Box<dyn FnOnce(&mut Dispatcher, &FinalizeReport) + Send>;

struct Group {
    generation: u64,
    epoch: Instant,
    phase: Phase,
    table: Arc<ProcessTable>,
    watcher: ExitWatcher,
    acceptor: Option<Acceptor>,
    policy: Option<Arc<AcceptPolicy>>,
    output: Option<OutputPump>,
    tails: Arc<Tails>,
    _run_dir: Option<RunDir>,
    links: Vec<RankLink>,
    last_seen: Vec<Arc<AtomicU64>>,
    external: bool,
    closed_pending: BTreeMap<u32, (Channel, Instant)>,
    /// Processes that exited while their stderr was still open: their failure is
    /// reported when it closes (so the report has their last lines) or at the deadline
    /// (a child they left holds it), in the order they exited. Nothing waits on it.
    exits_pending: Vec<PendingExit>,
    /// Ranks known not to answer (silent past the heartbeat deadline): a `Close` grace
    /// is not spent on them.
    unanswering: std::collections::BTreeSet<u32>,
    failures: Vec<RankFailure>,
    /// OOM-kill counters of each process's memory cgroup when it started.
    oom_baselines: BTreeMap<u32, os::OomCounter>,
    grant: Grant,
    /// The ledger entry, updated and finally released on the admission thread.
    reservation: Option<DropThere<Arc<Reservation>>>,
    log_dir: PathBuf,
    endpoint: String,
    pgid: u32,
}

/// An exit whose report waits for the process's stderr to close.
struct PendingExit {
    source: Source,
    /// The failure for a rank; `None` for a launcher during start-up.
    cause: Option<FailureCause>,
    status: crate::os::ExitStatus,
    deadline: Instant,
}

struct TaskOp {
    id: u64,
    cmd: ExecuteCmd,
    deadline: Instant,
    results: Vec<Option<Result<(Props, Shareable), RankError>>>,
    aborting: Option<(String, Instant, bool)>,
    _sub: Subscription,
    span: tracing::Span,
    /// The frames sent to the ranks (`None` while they are being packed), kept (with
    /// their memory files) until the task ends: while the parent holds a blob's memory
    /// file, a rank unmapping it never frees its pages, so that cost is not on the
    /// ranks' way to replying. Released off the dispatcher thread when the task ends.
    sent: Option<crate::reclaim::Deferred<Frames>>,
}

/// A task's `Execute` frames, by carrier: `[memory files, inline]`.
type Frames = [Option<Arc<OutFrame>>; 2];

/// What packing a task's frames needs, moved to the work thread.
struct PackSpec {
    task_id: u64,
    task: String,
    props: Props,
    input: Shareable,
    want_output: bool,
    /// Which carriers the ranks need: `[memory files, inline]`.
    needed: [bool; 2],
    zero_copy_threshold: u64,
}

impl PackSpec {
    fn pack(&self) -> Result<Frames, ExecuteError> {
        let mut frames: Frames = [None, None];
        for (slot, frame) in frames.iter_mut().enumerate() {
            if !self.needed[slot] {
                continue;
            }
            let policy = if slot == 0 {
                BlobPolicy {
                    zero_copy_threshold: self.zero_copy_threshold,
                    pass_fds: true,
                }
            } else {
                BlobPolicy::INLINE
            };
            let (mut body, mut fds) = (Vec::new(), Vec::new());
            let input = envelope::pack(&self.input, policy, &mut body, &mut fds)
                .map_err(|e| ExecuteError::Input(Arc::new(e)))?;
            let msg = Message::Execute(Box::new(Execute {
                task_id: self.task_id,
                task: self.task.clone(),
                props: self.props.clone(),
                input,
                want_output: self.want_output,
            }));
            let f = envelope::frame(&msg, body, fds).map_err(|e| {
                ExecuteError::Input(Arc::new(rankexec_protocol::wire::PackError::Codec(e)))
            })?;
            *frame = Some(Arc::new(f));
        }
        Ok(frames)
    }
}

struct EventOp {
    cmd: EventCmd,
    deadline: Instant,
    acks: Vec<Option<Result<Props, RankError>>>,
}

struct PendingLaunch {
    not_before: Instant,
    admission_deadline: Option<Instant>,
    /// An attempt is running on the admission thread.
    in_flight: bool,
    /// The id of the latest attempt (a late answer to an abandoned one is not this).
    attempt: u64,
    waiters: Vec<Waiter>,
}

pub(crate) struct Dispatcher {
    cfg: Arc<ExecutorConfig>,
    program: PathBuf,
    cmd_rx: Receiver<Command>,
    ev_tx: Sender<(u64, Report)>,
    ev_rx: Receiver<(u64, Report)>,
    /// Weak: the host's engine usually owns this executor (see `session::link`).
    engine: Option<std::sync::Weak<dyn Engine>>,
    start_props: Props,
    base_log_dir: Option<PathBuf>,
    generation: u64,
    group: Option<Group>,
    queue: VecDeque<Command>,
    task: Option<TaskOp>,
    events: BTreeMap<u64, EventOp>,
    pending: Option<PendingLaunch>,
    /// Used only on `admit`'s thread: admission may wait on a ledger lock, sample the
    /// CPU or load NVML, none of which the dispatcher may wait for.
    admission: Arc<std::sync::Mutex<Admission>>,
    admit: Offload,
    /// Admission attempts so far (ids for their answers).
    admission_attempts: u64,
    /// Packing inputs into memory files and reducing gathered results.
    work: Offload,
    consecutive_failures: u32,
    restarts: u32,
    last_failure: Option<ExecuteError>,
    deferred: Option<ExecuteError>,
    oom_startup_used: u32,
    oom_execute_used: u32,
    growth: f64,
    finalized: bool,
    next_task_id: u64,
    next_event_id: u64,
}

fn error_json_message(path: &std::path::Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let m = v.get("message")?;
    match m {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => {
            o.get("message").and_then(|x| x.as_str()).map(str::to_owned)
        }
        _ => None,
    }
}

impl Dispatcher {
    pub(crate) fn new(
        cfg: Arc<ExecutorConfig>,
        program: PathBuf,
        cmd_rx: Receiver<Command>,
        admission: Admission,
    ) -> std::io::Result<Self> {
        let (ev_tx, ev_rx) = crossbeam_channel::unbounded();
        let admit = Offload::start(format!("rx-admit-{}", cfg.executor_id))?;
        let work = Offload::start(format!("rx-work-{}", cfg.executor_id))?;
        Ok(Dispatcher {
            base_log_dir: cfg.log_dir.clone(),
            cfg,
            program,
            cmd_rx,
            ev_tx,
            ev_rx,
            engine: None,
            start_props: Props::new(),
            generation: 0,
            group: None,
            queue: VecDeque::new(),
            task: None,
            events: BTreeMap::new(),
            pending: None,
            admission: Arc::new(std::sync::Mutex::new(admission)),
            admit,
            admission_attempts: 0,
            work,
            consecutive_failures: 0,
            restarts: 0,
            last_failure: None,
            deferred: None,
            oom_startup_used: 0,
            oom_execute_used: 0,
            growth: 1.0,
            finalized: false,
            next_task_id: 1,
            next_event_id: 1,
        })
    }

    /// Runs until the executor handle is dropped; then finalizes.
    pub(crate) fn run(mut self) {
        loop {
            let deadline = self.next_deadline();
            let timer = match deadline {
                Some(d) => after(d.saturating_duration_since(Instant::now())),
                None => never(),
            };
            select! {
                recv(self.cmd_rx) -> cmd => match cmd {
                    Ok(cmd) => self.on_command(cmd),
                    Err(_) => break,
                },
                recv(self.ev_rx) -> ev => {
                    if let Ok((generation, report)) = ev {
                        self.on_report(generation, report);
                    }
                },
                recv(timer) -> _ => {},
            }
            self.on_timers(Instant::now());
            self.drain_queue();
        }
        // The executor was dropped without finalize: tear down, bounded, and launch
        // nothing more.
        self.finalized = true;
        if self.group.is_some() {
            self.begin_stop("executor dropped", Vec::new());
            while self.group.is_some() {
                let deadline = self
                    .next_deadline()
                    .unwrap_or_else(|| Instant::now() + KILL_WAIT);
                if let Ok((generation, report)) = self.ev_rx.recv_deadline(deadline) {
                    self.on_report(generation, report);
                }
                self.on_timers(Instant::now());
            }
        }
    }

    // ---- deadlines ---------------------------------------------------------------

    fn next_deadline(&self) -> Option<Instant> {
        let mut ds: Vec<Instant> = Vec::new();
        if let Some(p) = &self.pending {
            if !p.in_flight {
                ds.push(p.not_before);
            }
            ds.extend(p.admission_deadline);
        }
        if let Some(g) = &self.group {
            match &g.phase {
                Phase::Starting { deadline, .. } | Phase::Stopping { deadline, .. } => {
                    ds.push(*deadline)
                }
                Phase::Ready => {
                    let timeout = self.cfg.deadlines.heartbeat_timeout.0;
                    if let Some(oldest) =
                        g.last_seen.iter().map(|a| a.load(Ordering::Relaxed)).min()
                    {
                        ds.push(g.epoch + Duration::from_millis(oldest) + timeout);
                    }
                }
            }
            ds.extend(g.closed_pending.values().map(|(_, d)| *d));
            ds.extend(g.exits_pending.first().map(|e| e.deadline));
        }
        if let Some(t) = &self.task {
            ds.push(t.deadline);
            ds.extend(t.aborting.as_ref().map(|(_, d, _)| *d));
        }
        ds.extend(self.events.values().map(|e| e.deadline));
        ds.into_iter().min()
    }

    fn on_timers(&mut self, now: Instant) {
        self.check_pending_launch(now);
        let Some(g) = &mut self.group else { return };
        match &g.phase {
            Phase::Starting { deadline, .. } if now >= *deadline => {
                let missing = describe_missing(g);
                let err = StartError::Timeout {
                    timeout: self.cfg.deadlines.startup.0,
                    missing,
                };
                self.fail_start(err);
                return;
            }
            Phase::Stopping { deadline, .. } if now >= *deadline => {
                self.escalate();
                return;
            }
            Phase::Ready => {
                let timeout = self.cfg.deadlines.heartbeat_timeout.0;
                let now_ms = g.epoch.elapsed().as_millis() as u64;
                let silent = g
                    .last_seen
                    .iter()
                    .enumerate()
                    .map(|(r, a)| (r as u32, now_ms.saturating_sub(a.load(Ordering::Relaxed))))
                    .find(|(_, ms)| Duration::from_millis(*ms) > timeout);
                if let Some((rank, ms)) = silent {
                    g.unanswering.insert(rank);
                    let f =
                        self.failure(rank, FailureCause::Unresponsive(Duration::from_millis(ms)));
                    self.fail_group(f);
                    return;
                }
            }
            _ => {}
        }
        if g.exits_pending.first().is_some_and(|e| now >= e.deadline) {
            self.report_exits(now);
            return;
        }
        let expired: Vec<(u32, Channel)> = g
            .closed_pending
            .iter()
            .filter(|(_, (_, d))| now >= *d)
            .map(|(r, (c, _))| (*r, *c))
            .collect();
        if let Some((rank, ch)) = expired.first() {
            let f = self.failure(*rank, FailureCause::ConnectionClosed(*ch));
            self.fail_group(f);
            return;
        }
        if let Some(t) = &self.task {
            if let Some((_, d, _)) = &t.aborting
                && now >= *d
            {
                self.force_abort();
                return;
            }
            if now >= t.deadline {
                self.task_timeout();
                return;
            }
        }
        let late: Vec<u64> = self
            .events
            .iter()
            .filter(|(_, e)| now >= e.deadline)
            .map(|(id, _)| *id)
            .collect();
        if let Some(id) = late.first() {
            self.event_timeout(*id);
        }
    }

    // ---- commands ----------------------------------------------------------------

    fn settled(&self) -> bool {
        self.pending.is_none()
            && match &self.group {
                None => true,
                Some(g) => matches!(g.phase, Phase::Ready),
            }
    }

    /// Takes a command as it arrives: `Status` and `Finalize` are answered at once and
    /// never wait behind anything; the rest join the queue.
    fn on_command(&mut self, cmd: Command) {
        match cmd {
            Command::Status { reply } => drop(reply.send(self.status())),
            Command::Finalize { reply } => self.finalize(reply),
            other => self.queue.push_back(other),
        }
    }

    /// Runs queued commands, in arrival order, as soon as each can run; one that must
    /// wait holds back only what has to follow it. Everything waits for a settled group
    /// (no launch or teardown in progress). An `Execute` waits for the running task and
    /// for any queued `Park`; a `Park` waits for the running task and events, never for
    /// a queued `Execute` (the group is parked between the two tasks, and the next one
    /// relaunches it); a `Start` and an `Event` wait for nothing else.
    fn drain_queue(&mut self) {
        let mut i = 0;
        while i < self.queue.len() && self.settled() {
            let ready = match &self.queue[i] {
                Command::Start { .. } | Command::Event(_) => true,
                Command::Execute(_) => {
                    self.task.is_none()
                        && !self.queue.iter().any(|c| matches!(c, Command::Park { .. }))
                }
                Command::Park { .. } => self.task.is_none() && self.events.is_empty(),
                Command::Status { .. } | Command::Finalize { .. } => true,
            };
            if !ready {
                i += 1;
                continue;
            }
            let Some(cmd) = self.queue.remove(i) else {
                return;
            };
            match cmd {
                Command::Start {
                    props,
                    engine,
                    reply,
                } => self.cmd_start(props, engine, reply),
                Command::Execute(c) => self.cmd_execute(c),
                Command::Event(c) => self.cmd_event(c),
                Command::Park { reply } => {
                    if self.group.is_some() {
                        self.begin_stop(
                            "parked",
                            vec![Box::new(move |_, _| {
                                let _ = reply.send(());
                            })],
                        );
                    } else {
                        let _ = reply.send(());
                    }
                }
                Command::Status { reply } => drop(reply.send(self.status())),
                Command::Finalize { reply } => self.finalize(reply),
            }
        }
    }

    fn status(&self) -> Status {
        let phase = match (&self.group, &self.pending) {
            (None, Some(_)) => "admitting",
            (None, None) => "idle",
            (Some(g), _) => match g.phase {
                Phase::Starting { .. } => "starting",
                Phase::Ready if self.task.is_some() => "busy",
                Phase::Ready => "ready",
                Phase::Stopping { .. } => "stopping",
            },
        };
        Status {
            phase,
            processes: self
                .group
                .as_ref()
                .map(|g| g.table.snapshot())
                .unwrap_or_default(),
            restarts: self.restarts,
            queued: self.queue.len(),
            log_dir: self.group.as_ref().map(|g| g.log_dir.clone()),
            endpoint: self.group.as_ref().map(|g| g.endpoint.clone()),
            finalized: self.finalized,
        }
    }

    fn cmd_start(
        &mut self,
        props: Props,
        engine: Option<Arc<dyn Engine>>,
        reply: Sender<Result<(), StartError>>,
    ) {
        self.finalized = false;
        self.start_props = props;
        if let Some(engine) = engine {
            self.engine = Some(Arc::downgrade(&engine));
        }
        if self.group.is_some() {
            let _ = reply.send(Ok(()));
            return;
        }
        self.request_launch(Waiter::Start(reply), false);
    }

    fn cmd_execute(&mut self, c: ExecuteCmd) {
        if self.finalized {
            let _ = c.reply.send(Err(ExecuteError::Finalized));
            return;
        }
        if let Some(err) = self.deferred.take() {
            let _ = c.reply.send(Err(err));
            return;
        }
        if c.abort.is_triggered() {
            let _ = c.reply.send(Err(ExecuteError::Aborted {
                task: c.task.clone(),
                reason: c.abort.reason().unwrap_or_default(),
                forced: false,
            }));
            return;
        }
        if self.group.is_none() {
            let after_failure = self.consecutive_failures > 0;
            self.request_launch(Waiter::Execute(c), after_failure);
            return;
        }
        self.start_task(c);
    }

    fn cmd_event(&mut self, c: EventCmd) {
        if self.finalized {
            let _ = c.reply.send(Err(EventError::Finalized));
            return;
        }
        // An abort of the running task that has not reached us yet (its report may
        // trail this command, as when an `ABORT_TASK` handler forwards the event) goes
        // to the ranks first: a rank busy in an event handler would read it late.
        if let Some(t) = &self.task
            && t.aborting.is_none()
            && let Some(reason) = t.cmd.abort.reason()
        {
            self.abort_task(t.id, reason);
        }
        if self.group.is_none() {
            // No ranks to tell (never started, parked, or torn down).
            let _ = c.reply.send(Ok(c.props));
            return;
        }
        self.start_event(c);
    }

    // ---- launching ---------------------------------------------------------------

    fn request_launch(&mut self, waiter: Waiter, after_failure: bool) {
        if let Some(p) = &mut self.pending {
            p.waiters.push(waiter);
            return;
        }
        let mut not_before = Instant::now();
        if after_failure {
            if self.restarts >= self.cfg.restart.max_restarts {
                let last = self
                    .last_failure
                    .clone()
                    .unwrap_or(ExecuteError::Start(StartError::Aborted));
                let err = ExecuteError::RestartsExhausted {
                    restarts: self.restarts,
                    last: Box::new(last),
                };
                match waiter {
                    Waiter::Execute(c) => drop(c.reply.send(Err(err))),
                    other => other.fail(&StartError::Aborted),
                }
                return;
            }
            self.restarts += 1;
            let exp = self.consecutive_failures.saturating_sub(1).min(16);
            let backoff = self
                .cfg
                .restart
                .backoff
                .0
                .saturating_mul(1 << exp)
                .min(self.cfg.restart.max_backoff.0);
            info!(
                restart = self.restarts,
                backoff_ms = backoff.as_millis() as u64,
                "relaunching the rank group"
            );
            not_before += backoff;
        }
        self.pending = Some(PendingLaunch {
            not_before,
            admission_deadline: None,
            in_flight: false,
            attempt: 0,
            waiters: vec![waiter],
        });
        self.check_pending_launch(Instant::now());
    }

    fn check_pending_launch(&mut self, now: Instant) {
        if self.finalized {
            // A relaunch decided before finalize (an out-of-memory retry whose teardown
            // finished after it) must not bring a group back.
            if let Some(p) = self.pending.take() {
                for w in p.waiters {
                    w.fail(&StartError::Finalized);
                }
            }
            return;
        }
        let Some(p) = &mut self.pending else { return };
        if !p.in_flight && now < p.not_before {
            return;
        }
        // The admission deadline runs from the first attempt (after any back-off).
        let deadline = *p
            .admission_deadline
            .get_or_insert(now + self.cfg.deadlines.admission.0);
        if p.in_flight {
            if now >= deadline {
                // The attempt is stuck (a ledger lock held by a stopped process): give up;
                // its outcome, if it ever comes, is released on the admission thread.
                let err = StartError::Admission(
                    Refusal {
                        message: "the admission check did not finish (is the reservation ledger locked by a stopped process?)".to_owned(),
                    }
                    .into_error(self.cfg.deadlines.admission.0),
                );
                self.fail_pending(&err);
            }
            return;
        }
        p.in_flight = true;
        self.admission_attempts += 1;
        p.attempt = self.admission_attempts;
        let attempt = p.attempt;
        let (admission, growth, tx) = (self.admission.clone(), self.growth, self.ev_tx.clone());
        self.admit.run(move || {
            let outcome = admission
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .try_admit(growth);
            // Tagged with no group: the outcome belongs to the pending launch.
            let _ = tx.send((0, Report::Admitted { attempt, outcome }));
        });
    }

    fn fail_pending(&mut self, err: &StartError) {
        if let Some(p) = self.pending.take() {
            for w in p.waiters {
                w.fail(err);
            }
        }
    }

    /// Releases a reservation on the admission thread (the ledger update takes its lock).
    fn release(&self, reservation: Option<Reservation>) {
        drop(reservation.map(|r| DropThere::new(r, &self.admit)));
    }

    fn on_admitted(&mut self, attempt: u64, outcome: Result<Admit, AdmissionError>) {
        let now = Instant::now();
        let Some(p) = self
            .pending
            .as_mut()
            .filter(|p| p.in_flight && p.attempt == attempt)
        else {
            // Nobody waits any more (finalized, or the attempt timed out).
            if let Ok(Admit::Granted(grant)) = outcome {
                self.release(grant.reservation);
            }
            return;
        };
        p.in_flight = false;
        match outcome {
            Ok(Admit::Granted(grant)) => {
                let waiters = std::mem::take(&mut p.waiters);
                self.pending = None;
                self.launch_group(grant, waiters);
            }
            Ok(Admit::Wait(refusal)) => {
                let deadline = *p
                    .admission_deadline
                    .get_or_insert(now + self.cfg.deadlines.admission.0);
                if now >= deadline {
                    let err =
                        StartError::Admission(refusal.into_error(self.cfg.deadlines.admission.0));
                    self.fail_pending(&err);
                } else {
                    debug!("waiting for resources: {}", refusal.message);
                    p.not_before = (now + ADMISSION_RETRY).min(deadline);
                }
            }
            Err(e) => self.fail_pending(&StartError::Admission(e)),
        }
    }

    fn log_dir(&self) -> PathBuf {
        if let Some(d) = &self.base_log_dir {
            return d.clone();
        }
        if let Some(e) = self.engine.as_ref().and_then(std::sync::Weak::upgrade) {
            return e.workspace().join(&self.cfg.executor_id);
        }
        std::env::temp_dir().join("rankexec-logs").join(format!(
            "{}-{}",
            self.cfg.executor_id,
            os::own_pid()
        ))
    }

    fn launch_group(&mut self, mut grant: Grant, waiters: Vec<Waiter>) {
        // Released on the admission thread however this ends.
        let reservation = grant
            .reservation
            .take()
            .map(|r| DropThere::new(Arc::new(r), &self.admit));
        self.generation += 1;
        let generation = self.generation;
        let world = self.cfg.num_of_processes;
        let span = info_span!("group", executor = %self.cfg.executor_id, generation);
        let _enter = span.enter();
        let fail_now = |waiters: Vec<Waiter>, err: StartError| {
            warn!("cannot start the rank group: {}", chain(&err));
            for w in waiters {
                w.fail(&err);
            }
        };
        let log_dir = self.log_dir();
        for r in 0..world {
            if let Err(e) = std::fs::create_dir_all(log_dir.join(format!("rank-{r}"))) {
                return fail_now(
                    waiters,
                    StartError::LogDir {
                        path: log_dir.display().to_string(),
                        source: Arc::new(e),
                    },
                );
            }
            // A stale error file from an earlier group must not be read as this one's.
            let _ = std::fs::remove_file(log_dir.join(format!("rank-{r}/error.json")));
        }
        let (run_dir, listener) = match &self.cfg.transport {
            TransportConfig::Local => {
                let rd = match RunDir::create() {
                    Ok(d) => d,
                    Err(e) => return fail_now(waiters, StartError::RunDir(Arc::new(e))),
                };
                match Listener::bind_local(&rd.socket_path()) {
                    Ok(l) => (Some(rd), l),
                    Err(e) => {
                        return fail_now(
                            waiters,
                            StartError::Listen {
                                endpoint: rd.socket_path().display().to_string(),
                                source: Arc::new(e),
                            },
                        );
                    }
                }
            }
            TransportConfig::Tcp { bind, .. } => match Listener::bind_tcp(bind) {
                Ok(l) => (None, l),
                Err(e) => {
                    return fail_now(
                        waiters,
                        StartError::Listen {
                            endpoint: bind.clone(),
                            source: Arc::new(e),
                        },
                    );
                }
            },
        };
        let mut endpoint = listener.endpoint();
        if let (
            TransportConfig::Tcp {
                advertise: Some(host),
                ..
            },
            Endpoint::Tcp(addr),
        ) = (&self.cfg.transport, &endpoint)
            && let Some((_, port)) = addr.rsplit_once(':')
        {
            endpoint = Endpoint::Tcp(format!("{host}:{port}"));
        }
        let secret = match Secret::generate() {
            Ok(s) => s,
            Err(e) => {
                return fail_now(
                    waiters,
                    StartError::RunDir(Arc::new(std::io::Error::other(e.to_string()))),
                );
            }
        };
        // The launch id is public (it appears in logs); it shares nothing with the secret.
        let launch_id = format!(
            "{}-{generation}-{:08x}",
            os::own_pid(),
            getrandom::u32().unwrap_or(0)
        );
        let table = Arc::new(ProcessTable::default());
        let tx = self.ev_tx.clone();
        let watcher =
            match ExitWatcher::start(table.clone(), tx, move |e| (generation, Report::Exited(e))) {
                Ok(w) => w,
                Err(e) => return fail_now(waiters, StartError::RunDir(Arc::new(e))),
            };
        crate::killswitch::register(&table);

        let master_addr = "127.0.0.1".to_owned();
        let master_port = portpicker::pick_unused_port().unwrap_or(29500);
        let mut common: BTreeMap<String, String> = BTreeMap::new();
        common.insert(vars::ENDPOINT.into(), endpoint.to_string());
        common.insert(vars::SECRET.into(), secret.to_hex());
        common.insert(vars::LAUNCH_ID.into(), launch_id.clone());
        common.insert(vars::WORLD_SIZE.into(), world.to_string());
        common.insert(vars::LOG_DIR.into(), log_dir.display().to_string());
        common.insert(
            vars::CONNECT_TIMEOUT_MS.into(),
            self.cfg.deadlines.startup.0.as_millis().to_string(),
        );
        common.insert("MASTER_ADDR".into(), master_addr.clone());
        common.insert("MASTER_PORT".into(), master_port.to_string());
        common.extend(grant.common.clone());
        let builtin = matches!(self.cfg.launcher, LauncherConfig::Builtin);
        if let Some(src) = launch::rank_source(&self.cfg.launcher) {
            common.insert(vars::RANK_SOURCE.into(), src.to_owned());
        }
        let mut per_rank = Vec::new();
        if builtin {
            common.insert(vars::PARENT_PID.into(), os::own_pid().to_string());
            for r in 0..world {
                let mut m = BTreeMap::new();
                for (k, v) in [
                    (vars::RANK, r.to_string()),
                    (vars::LOCAL_RANK, r.to_string()),
                    (vars::LOCAL_WORLD_SIZE, world.to_string()),
                    ("RANK", r.to_string()),
                    ("LOCAL_RANK", r.to_string()),
                    ("WORLD_SIZE", world.to_string()),
                    ("LOCAL_WORLD_SIZE", world.to_string()),
                    ("GROUP_RANK", "0".into()),
                    ("GROUP_WORLD_SIZE", "1".into()),
                    ("ROLE_RANK", r.to_string()),
                    ("ROLE_WORLD_SIZE", world.to_string()),
                    ("ROLE_NAME", "default".into()),
                    ("TORCHELASTIC_RUN_ID", launch_id.clone()),
                    ("TORCHELASTIC_RESTART_COUNT", self.restarts.to_string()),
                    (
                        "TORCHELASTIC_MAX_RESTARTS",
                        self.cfg.restart.max_restarts.to_string(),
                    ),
                    (
                        vars::ERROR_FILE,
                        log_dir
                            .join(format!("rank-{r}/error.json"))
                            .display()
                            .to_string(),
                    ),
                ] {
                    m.insert(k.to_owned(), v);
                }
                if let Some(extra) = grant.per_rank.get(r as usize) {
                    m.extend(extra.clone());
                }
                per_rank.push(m);
            }
        }
        let plan = LaunchPlan {
            program: self.program.clone(),
            args: self.cfg.worker.args.clone(),
            world,
            common,
            per_rank,
            env: self.cfg.env.clone(),
            launcher: self.cfg.launcher.clone(),
            master_addr,
            master_port,
            log_dir: log_dir.clone(),
        };
        let epoch = Instant::now();
        let last_seen: Vec<Arc<AtomicU64>> =
            (0..world).map(|_| Arc::new(AtomicU64::new(0))).collect();
        let mut policy = AcceptPolicy::new(
            secret,
            launch_id,
            world,
            vec![None; world as usize],
            self.cfg.deadlines.startup.0.min(Duration::from_secs(10)),
        );
        let deadline = epoch + self.cfg.deadlines.startup.0;
        let mut group = Group {
            generation,
            epoch,
            phase: Phase::Starting {
                deadline,
                waiters,
                init_sent: false,
                acks: vec![false; world as usize],
            },
            table: table.clone(),
            watcher,
            acceptor: None,
            policy: None,
            output: None,
            tails: Arc::new(Tails::default()),
            _run_dir: run_dir,
            links: (0..world).map(|_| RankLink::new()).collect(),
            last_seen,
            external: !builtin,
            closed_pending: BTreeMap::new(),
            unanswering: Default::default(),
            exits_pending: Vec::new(),
            failures: Vec::new(),
            oom_baselines: BTreeMap::new(),
            grant,
            reservation,
            log_dir: log_dir.clone(),
            endpoint: endpoint.to_string(),
            pgid: 0,
        };
        let launched = launch::launch(&plan, &table, &group.watcher);
        for p in table.snapshot() {
            if let Role::Rank(r) = p.role {
                policy.expect_pid(r, p.pid);
            }
        }
        let policy = Arc::new(policy);
        group.policy = Some(policy.clone());
        let launched = match launched {
            Ok(l) => l,
            Err(e) => {
                self.group = Some(group);
                self.fail_start(e);
                return;
            }
        };
        group.pgid = launched.pgid;
        for p in table.snapshot() {
            if let Some(c) = os::oom_kills(p.pid) {
                group.oom_baselines.insert(p.pid, c);
            }
        }
        if let Some(r) = group.reservation.as_ref().and_then(DropThere::get) {
            let pids: Vec<u32> = table.snapshot().iter().map(|p| p.pid).collect();
            let r = r.clone();
            self.admit.run(move || r.set_rank_pids(&pids));
        }
        if let Some(p) = &group.grant.placement {
            info!(placement = %p.describe(), "placement");
        }
        match OutputPump::start(launched.pipes, &log_dir, self.cfg.executor_id.clone()) {
            Ok(p) => {
                let tx = self.ev_tx.clone();
                p.tails().notify_closed(move |src| {
                    let _ = tx.send((generation, Report::OutputClosed(src)));
                });
                group.tails = p.tails();
                group.output = Some(p);
            }
            Err(e) => warn!(error = %e, "cannot capture rank output"),
        }
        let tx = self.ev_tx.clone();
        let report: Arc<dyn Fn(Connected) + Send + Sync> =
            Arc::new(move |c| drop(tx.send((generation, Report::Connected(Box::new(c))))));
        match Acceptor::start(listener, policy, report) {
            Ok(a) => group.acceptor = Some(a),
            Err(e) => {
                self.group = Some(group);
                self.fail_start(StartError::Listen {
                    endpoint: endpoint.to_string(),
                    source: Arc::new(e),
                });
                return;
            }
        }
        info!(ranks = world, %endpoint, log_dir = %log_dir.display(), "rank group launched");
        self.group = Some(group);
    }

    // ---- reports -----------------------------------------------------------------

    fn on_report(&mut self, generation: u64, report: Report) {
        let report = match report {
            Report::AbortTask { task_id, reason } => return self.abort_task(task_id, reason),
            Report::Admitted { attempt, outcome } => return self.on_admitted(attempt, outcome),
            other => other,
        };
        let current = self.group.as_ref().map(|g| g.generation);
        if current != Some(generation) {
            if let Report::Connected(c) = report {
                c.conn.shutdown();
            }
            return;
        }
        match report {
            Report::Connected(c) => self.on_connected(*c),
            Report::Exited(e) => self.on_exited(e),
            Report::Link { rank, ev } => self.on_link(rank, ev),
            Report::OutputClosed(src) => self.on_output_closed(src),
            Report::Packed { task_id, frames } => self.on_packed(task_id, frames),
            Report::AbortTask { .. } | Report::Admitted { .. } => {}
        }
    }

    fn stopping(&self) -> bool {
        matches!(
            self.group.as_ref().map(|g| &g.phase),
            Some(Phase::Stopping { .. })
        )
    }

    fn on_connected(&mut self, c: Connected) {
        let Some(g) = &mut self.group else { return };
        if !matches!(g.phase, Phase::Starting { .. }) {
            c.conn.shutdown();
            return;
        }
        let rank = c.rank;
        let ctx = LinkContext {
            rank,
            reporter: Reporter {
                generation: g.generation,
                tx: self.ev_tx.clone(),
            },
            engine: self.engine.clone(),
            relay: self.cfg.relay_events_from == EventRanks::All || rank == 0,
            last_seen: g.last_seen[rank as usize].clone(),
            epoch: g.epoch,
            limits: FrameLimits::for_max_frame(self.cfg.max_frame.bytes()),
        };
        let link = &mut g.links[rank as usize];
        // The kernel's word for a local peer; a remote rank's claim is only reported.
        link.pid = c.peer.pid().unwrap_or(c.hello.who.pid);
        link.pgid = c.hello.who.pgid;
        if let Err(e) = link.attach(c.channel, c.conn, &ctx) {
            self.fail_start(StartError::Threads {
                rank,
                source: Arc::new(e),
            });
            return;
        }
        if g.external && !g.table.has_rank(rank) {
            // Not our child: held by the pidfd its connection's kernel-given pid opened.
            if let Some((index, fd)) = g.table.add_peer(rank, c.peer) {
                g.watcher.watch(index, fd);
            }
        }
        debug!(rank, channel = c.channel.as_str(), pid = c.hello.who.pid, host = %c.hello.who.host, "rank connected");
        self.maybe_send_init();
    }

    fn maybe_send_init(&mut self) {
        let Some(g) = &mut self.group else { return };
        let Phase::Starting { init_sent, .. } = &mut g.phase else {
            return;
        };
        if *init_sent || !g.links.iter().all(RankLink::complete) {
            return;
        }
        *init_sent = true;
        let d = &self.cfg.deadlines;
        let init = Init {
            executor_id: self.cfg.executor_id.clone(),
            components: self
                .cfg
                .components
                .iter()
                .map(|c| WireComponent {
                    id: c.id.clone(),
                    path: c.path.clone(),
                    args_json: c.args.to_string(),
                })
                .collect(),
            props: self.start_props.clone(),
            heartbeat_interval_ms: d.heartbeat_interval.0.as_millis() as u64,
            event_timeout_ms: d.event.0.as_millis() as u64,
            zero_copy_threshold: self.cfg.zero_copy_threshold.bytes(),
            max_frame_bytes: self.cfg.max_frame.bytes(),
        };
        let frame = match envelope::plain(&Message::Init(Box::new(init))) {
            Ok(f) => Arc::new(f),
            Err(e) => {
                self.fail_start(StartError::Encode(Arc::new(e)));
                return;
            }
        };
        for link in &g.links {
            link.send(Channel::Exec, frame.clone());
        }
        debug!("all ranks connected; Init sent");
    }

    fn failure(&self, rank: u32, cause: FailureCause) -> RankFailure {
        let g = self.group.as_ref();
        let pid = g.and_then(|g| {
            let link = &g.links[rank as usize];
            if link.pid != 0 {
                return Some(link.pid);
            }
            g.table
                .snapshot()
                .into_iter()
                .find(|p| matches!(p.role, Role::Rank(r) | Role::ExternalRank(r) if r == rank))
                .map(|p| p.pid)
        });
        // Never waits: an exit is reported once its stderr closed or `TAIL_WAIT` passed
        // (see `Group::exits_pending`); a live rank's stderr stays open.
        let stderr_tail = g
            .map(|g| g.tails.tail(Source::Rank(rank), Duration::ZERO))
            .unwrap_or_default();
        let error_file =
            g.and_then(|g| error_json_message(&g.log_dir.join(format!("rank-{rank}/error.json"))));
        RankFailure {
            rank,
            pid,
            cause,
            stderr_tail,
            error_file,
            after: g.map(|g| g.epoch.elapsed()).unwrap_or_default(),
        }
    }

    fn on_exited(&mut self, e: Exited) {
        debug!(pid = e.pid, role = ?e.role, status = %e.status, "process exited");
        if self.stopping() {
            self.maybe_finish_stop();
            return;
        }
        let Some(g) = &self.group else { return };
        match e.role {
            Role::Rank(rank) | Role::ExternalRank(rank) => {
                // A SIGKILL while the OOM-kill counter of the rank's memory cgroup (read
                // when it started) rose is the OOM killer's.
                let oom_killed = e.status.signal() == Some(9)
                    && g.oom_baselines
                        .get(&e.pid)
                        .is_some_and(|then| then.reread().is_some_and(|now| now > then.kills));
                let cause = if oom_killed {
                    FailureCause::OomKilled
                } else {
                    FailureCause::Exited(e.status)
                };
                if let Some(g) = &mut self.group {
                    g.closed_pending.remove(&rank);
                    g.exits_pending.push(PendingExit {
                        source: Source::Rank(rank),
                        cause: Some(cause),
                        status: e.status,
                        deadline: Instant::now() + TAIL_WAIT,
                    });
                }
                self.report_exits(Instant::now());
            }
            Role::Launcher => {
                if let Phase::Starting { .. } = g.phase {
                    if let Some(g) = &mut self.group {
                        g.exits_pending.push(PendingExit {
                            source: Source::Launcher,
                            cause: None,
                            status: e.status,
                            deadline: Instant::now() + TAIL_WAIT,
                        });
                    }
                    self.report_exits(Instant::now());
                } else {
                    // The ranks go with their launcher; give their connections a moment
                    // to close so the failure names a rank.
                    let deadline = Instant::now() + CLOSED_GRACE;
                    if let Some(g) = &mut self.group {
                        g.closed_pending
                            .entry(0)
                            .or_insert((Channel::Exec, deadline));
                    }
                    warn!("the launcher exited with {}", e.status);
                }
            }
        }
    }

    fn on_output_closed(&mut self, _src: Source) {
        self.report_exits(Instant::now());
    }

    /// Reports the earliest pending exit once its stderr has closed or its deadline
    /// passed (the failure that stops the group is the first exit, not the first with
    /// a closed stderr).
    fn report_exits(&mut self, now: Instant) {
        if self.stopping() {
            return;
        }
        let Some(g) = &mut self.group else { return };
        let Some(first) = g.exits_pending.first() else {
            return;
        };
        if g.tails.is_open(first.source) && now < first.deadline {
            return;
        }
        let first = g.exits_pending.remove(0);
        match (first.source, first.cause) {
            (Source::Rank(rank), Some(cause)) => {
                let f = self.failure(rank, cause);
                self.fail_group(f);
            }
            _ => {
                let tail = g.tails.tail(Source::Launcher, Duration::ZERO);
                self.fail_start(StartError::LauncherExited {
                    status: first.status,
                    tail,
                });
            }
        }
    }

    fn on_link(&mut self, rank: u32, ev: LinkEvent) {
        if self.stopping() {
            return;
        }
        match ev {
            LinkEvent::Closed(channel) => {
                let Some(g) = &mut self.group else { return };
                if g.external {
                    let f = self.failure(rank, FailureCause::ConnectionClosed(channel));
                    self.fail_group(f);
                } else {
                    // Our own child: wait briefly for its exit status, which says more.
                    g.closed_pending
                        .entry(rank)
                        .or_insert((channel, Instant::now() + CLOSED_GRACE));
                }
            }
            LinkEvent::Protocol { channel, what } => {
                let f = self.failure(rank, FailureCause::Protocol { channel, what });
                self.fail_group(f);
            }
            LinkEvent::InitAck(result) => self.on_init_ack(rank, result),
            LinkEvent::TaskResult { task_id, outcome } => {
                self.on_task_result(rank, task_id, outcome)
            }
            LinkEvent::EventAck { event_id, result } => self.on_event_ack(rank, event_id, result),
        }
    }

    fn on_init_ack(&mut self, rank: u32, result: Result<(), RankError>) {
        let Some(g) = &mut self.group else { return };
        let Phase::Starting { acks, .. } = &mut g.phase else {
            return;
        };
        if let Err(error) = result {
            let oom = error.class == ErrorClass::OutOfMemory;
            let err = StartError::Build {
                rank,
                error: RemoteError(error),
            };
            if oom && self.oom_startup_used < self.cfg.resources.oom_retries.startup {
                self.oom_startup_used += 1;
                self.growth *= self.cfg.resources.oom_growth;
                warn!(
                    rank,
                    retry = self.oom_startup_used,
                    "rank ran out of memory while building; relaunching with larger estimates"
                );
                self.retry_start();
                return;
            }
            self.fail_start(err);
            return;
        }
        acks[rank as usize] = true;
        if !acks.iter().all(|a| *a) {
            return;
        }
        let Phase::Starting { waiters, .. } = std::mem::replace(&mut g.phase, Phase::Ready) else {
            return;
        };
        if let Some(p) = &g.policy {
            p.stop_accepting();
        }
        let now = g.epoch.elapsed().as_millis() as u64;
        for a in &g.last_seen {
            a.store(now, Ordering::Relaxed);
        }
        info!(
            ranks = self.cfg.num_of_processes,
            startup_ms = g.epoch.elapsed().as_millis() as u64,
            "rank group ready"
        );
        // Waiting commands run now, in the order they arrived.
        for w in waiters.into_iter().rev() {
            match w {
                Waiter::Start(r) => drop(r.send(Ok(()))),
                Waiter::Execute(c) => self.queue.push_front(Command::Execute(c)),
            }
        }
    }

    /// Tears the starting group down and launches again, keeping the waiters.
    fn retry_start(&mut self) {
        let Some(g) = &mut self.group else { return };
        let waiters = match &mut g.phase {
            Phase::Starting { waiters, .. } => std::mem::take(waiters),
            _ => Vec::new(),
        };
        self.begin_stop(
            "out of memory at start-up; retrying",
            vec![Box::new(move |d: &mut Dispatcher, _| {
                d.pending = Some(PendingLaunch {
                    not_before: Instant::now(),
                    admission_deadline: None,
                    in_flight: false,
                    attempt: 0,
                    waiters,
                });
            })],
        );
    }

    // ---- tasks -------------------------------------------------------------------

    fn start_task(&mut self, c: ExecuteCmd) {
        let Some(g) = &self.group else { return };
        let id = self.next_task_id;
        self.next_task_id += 1;
        let span = info_span!("task", task = %c.task, task_id = id);
        let world = self.cfg.num_of_processes;
        // One frame per carrier kind, encoded once (off this thread: it copies large
        // blobs into memory files) and written to every rank when it comes back.
        let mut needed = [false; 2];
        for link in &g.links {
            needed[usize::from(!link.passes_fds())] = true;
        }
        let spec = PackSpec {
            task_id: id,
            task: c.task.clone(),
            props: c.props.clone(),
            input: c.input.clone(),
            want_output: self.cfg.result.gathers(&c.task),
            needed,
            zero_copy_threshold: self.cfg.zero_copy_threshold.bytes(),
        };
        let generation = g.generation;
        let tx = self.ev_tx.clone();
        self.work.run(move || {
            let frames = spec.pack();
            let _ = tx.send((
                generation,
                Report::Packed {
                    task_id: spec.task_id,
                    frames,
                },
            ));
        });
        let tx = self.ev_tx.clone();
        let sub = c.abort.on_trigger({
            let abort = c.abort.clone();
            move || {
                let reason = abort.reason().unwrap_or_else(|| "aborted".to_owned());
                let _ = tx.send((
                    generation,
                    Report::AbortTask {
                        task_id: id,
                        reason,
                    },
                ));
            }
        });
        span.in_scope(|| debug!(ranks = world, "task packing"));
        self.task = Some(TaskOp {
            id,
            deadline: Instant::now() + self.cfg.deadlines.task.0,
            results: vec![None; world as usize],
            aborting: None,
            _sub: sub,
            span,
            cmd: c,
            sent: None,
        });
    }

    /// The task's frames are packed: send them, unless the task ended meanwhile.
    fn on_packed(&mut self, task_id: u64, frames: Result<Frames, ExecuteError>) {
        let current = self
            .task
            .as_ref()
            .is_some_and(|t| t.id == task_id && t.sent.is_none());
        let (Some(g), true) = (&self.group, current) else {
            // Memory files are freed off this thread too.
            drop(frames.map(crate::reclaim::Deferred::new));
            return;
        };
        let frames = match frames {
            Ok(f) => f,
            Err(e) => {
                if let Some(t) = self.task.take() {
                    let _ = t.cmd.reply.send(Err(e));
                }
                return;
            }
        };
        for link in &g.links {
            if let Some(f) = &frames[usize::from(!link.passes_fds())] {
                link.send(Channel::Exec, f.clone());
            }
        }
        if let Some(t) = &mut self.task {
            t.span.in_scope(|| debug!("task sent"));
            t.sent = Some(crate::reclaim::Deferred::new(frames));
        }
    }

    fn send_abort(&self, task_id: u64, reason: &str) {
        let Some(g) = &self.group else { return };
        let Some(t) = &self.task else { return };
        let frame = match envelope::plain(&Message::Abort {
            task_id,
            reason: reason.to_owned(),
        }) {
            Ok(f) => Arc::new(f),
            Err(_) => return,
        };
        for (rank, link) in g.links.iter().enumerate() {
            if t.results[rank].is_none() {
                link.send(Channel::Handle, frame.clone());
            }
        }
    }

    fn abort_task(&mut self, task_id: u64, reason: String) {
        let Some(t) = &mut self.task else { return };
        if t.id != task_id {
            return;
        }
        if t.sent.is_none() {
            // No rank has seen the task: it ends here.
            if let Some(t) = self.task.take() {
                t.span
                    .in_scope(|| info!(%reason, "task aborted before it was sent"));
                let _ = t.cmd.reply.send(Err(ExecuteError::Aborted {
                    task: t.cmd.task,
                    reason,
                    forced: false,
                }));
            }
            return;
        }
        match &mut t.aborting {
            Some((_, _, by_user)) => {
                *by_user = true;
                return;
            }
            None => {
                t.aborting = Some((
                    reason.clone(),
                    Instant::now() + self.cfg.deadlines.abort_grace.0,
                    true,
                ));
            }
        }
        t.span.in_scope(|| info!(%reason, "aborting the task"));
        self.send_abort(task_id, &reason);
    }

    fn on_task_result(
        &mut self,
        rank: u32,
        task_id: u64,
        outcome: Result<(Props, Shareable), RankError>,
    ) {
        let Some(t) = &mut self.task else { return };
        if t.id != task_id || t.results[rank as usize].is_some() {
            return;
        }
        let first_error = outcome.is_err() && t.aborting.is_none();
        if let Err(e) = &outcome {
            // An abort we asked for is expected; anything else is worth a warning.
            if e.class == ErrorClass::Aborted && t.aborting.is_some() {
                t.span
                    .in_scope(|| info!(rank, "rank stopped: {}", e.message));
            } else {
                t.span
                    .in_scope(|| warn!(rank, class = %e.class, "rank reported: {}", e.message));
            }
        }
        t.results[rank as usize] = Some(outcome);
        if first_error {
            // Other ranks may be stuck waiting for the failed one in a collective: tell
            // them to stop, and kill them if they do not.
            t.aborting = Some((
                format!("rank {rank} failed"),
                Instant::now() + self.cfg.deadlines.abort_grace.0,
                false,
            ));
            self.send_abort(task_id, &format!("rank {rank} failed"));
        }
        if self
            .task
            .as_ref()
            .is_some_and(|t| t.results.iter().all(Option::is_some))
        {
            self.complete_task();
        }
    }

    fn complete_task(&mut self) {
        let Some(t) = self.task.take() else { return };
        let _enter = t.span.enter();
        let mut errors: Vec<(u32, RankError)> = Vec::new();
        let mut outputs: Vec<(Props, Shareable)> = Vec::new();
        for (rank, r) in t.results.into_iter().enumerate() {
            match r {
                Some(Ok(o)) => outputs.push(o),
                Some(Err(e)) => errors.push((rank as u32, e)),
                None => {}
            }
        }
        let by_user = t.aborting.as_ref().is_some_and(|(_, _, u)| *u);
        if by_user {
            let reason = t.aborting.map(|(r, _, _)| r).unwrap_or_default();
            info!("task aborted; every rank returned");
            let _ = t.cmd.reply.send(Err(ExecuteError::Aborted {
                task: t.cmd.task,
                reason,
                forced: false,
            }));
            return;
        }
        if !errors.is_empty() {
            // The root cause is the first error that is not an abort we caused.
            let root = errors
                .iter()
                .position(|(_, e)| e.class != ErrorClass::Aborted)
                .unwrap_or(0);
            let (rank, e) = errors.remove(root);
            let oom = e.class == ErrorClass::OutOfMemory;
            let failure = self.failure(rank, FailureCause::Reported(e));
            let others: Vec<RankFailure> = errors
                .into_iter()
                .filter(|(_, e)| e.class != ErrorClass::Aborted)
                .map(|(r, e)| self.failure(r, FailureCause::Reported(e)))
                .collect();
            if oom && self.oom_execute_used < self.cfg.resources.oom_retries.execute {
                self.oom_execute_used += 1;
                self.growth *= self.cfg.resources.oom_growth;
                warn!(
                    rank,
                    retry = self.oom_execute_used,
                    "rank ran out of memory; relaunching the group with larger estimates and retrying the task"
                );
                let cmd = t.cmd;
                self.begin_stop(
                    "out of memory; retrying the task",
                    vec![Box::new(move |d: &mut Dispatcher, _| {
                        d.queue.push_front(Command::Execute(cmd))
                    })],
                );
                return;
            }
            let _ = t.cmd.reply.send(Err(ExecuteError::RankFailed {
                failure: Box::new(failure),
                others,
            }));
            return;
        }
        // Every rank succeeded: the group is healthy (a gather error below is the
        // caller's, not the group's).
        self.consecutive_failures = 0;
        self.restarts = 0;
        self.oom_execute_used = 0;
        self.last_failure = None;
        debug!("task done");
        match &self.cfg.result {
            ResultPolicy::Gather {
                weight_key,
                average,
                ..
            } if self.cfg.result.gathers(&t.cmd.task) => {
                // Averaging models is CPU work proportional to their size: off this thread.
                let (weight_key, average, reply) =
                    (weight_key.clone(), average.clone(), t.cmd.reply);
                self.work.run(move || {
                    let _ = reply
                        .send(reduce(outputs, &weight_key, &average).map_err(ExecuteError::Gather));
                });
            }
            _ => {
                let (props, out) = outputs.swap_remove(0);
                let _ = t.cmd.reply.send(Ok((out, props)));
            }
        }
    }

    fn force_abort(&mut self) {
        let Some(t) = self.task.take() else { return };
        let pending = missing_ranks(&t.results);
        let (reason, by_user) = match &t.aborting {
            Some((r, _, u)) => (r.clone(), *u),
            None => (String::new(), false),
        };
        t.span.in_scope(|| {
            warn!(
                ?pending,
                "ranks did not stop within the abort grace; killing the group"
            )
        });
        let cmd = t.cmd;
        if by_user {
            let err = ExecuteError::Aborted {
                task: cmd.task.clone(),
                reason,
                forced: true,
            };
            self.begin_teardown(
                "abort grace expired",
                Teardown::Kill,
                vec![Box::new(move |_, _| drop(cmd.reply.send(Err(err))))],
            );
        } else {
            // A rank failed and the others did not stop: the failure is the answer.
            let (rank, e) = t
                .results
                .into_iter()
                .enumerate()
                .find_map(|(r, x)| x.and_then(|x| x.err()).map(|e| (r as u32, e)))
                .unwrap_or((
                    0,
                    RankError {
                        class: ErrorClass::Exception,
                        message: reason,
                    },
                ));
            let failure = self.failure(rank, FailureCause::Reported(e));
            self.note_failure();
            let err = ExecuteError::RankFailed {
                failure: Box::new(failure),
                others: Vec::new(),
            };
            self.last_failure = Some(err.clone());
            self.begin_teardown(
                "ranks did not stop after a rank failed",
                Teardown::Kill,
                vec![Box::new(move |_, _| drop(cmd.reply.send(Err(err))))],
            );
        }
    }

    fn task_timeout(&mut self) {
        let Some(t) = self.task.take() else { return };
        let pending = missing_ranks(&t.results);
        let err = ExecuteError::Timeout {
            task: t.cmd.task.clone(),
            timeout: self.cfg.deadlines.task.0,
            pending,
        };
        t.span.in_scope(|| warn!("{err}"));
        self.note_failure();
        self.last_failure = Some(err.clone());
        let reply = t.cmd.reply;
        self.begin_stop(
            "task deadline",
            vec![Box::new(move |_, _| drop(reply.send(Err(err))))],
        );
    }

    // ---- events ------------------------------------------------------------------

    fn start_event(&mut self, c: EventCmd) {
        let Some(g) = &self.group else { return };
        let id = self.next_event_id;
        self.next_event_id += 1;
        let frame = match envelope::plain(&Message::HandleEvent {
            event_id: id,
            event: c.event.clone(),
            props: c.props.clone(),
        }) {
            Ok(f) => Arc::new(f),
            Err(e) => {
                let _ = c.reply.send(Err(EventError::Encode {
                    event: c.event.to_string(),
                    source: Arc::new(e),
                }));
                return;
            }
        };
        for link in &g.links {
            link.send(Channel::Handle, frame.clone());
        }
        self.events.insert(
            id,
            EventOp {
                deadline: Instant::now() + self.cfg.deadlines.event.0,
                acks: vec![None; self.cfg.num_of_processes as usize],
                cmd: c,
            },
        );
    }

    fn on_event_ack(&mut self, rank: u32, event_id: u64, result: Result<Props, RankError>) {
        let Some(op) = self.events.get_mut(&event_id) else {
            return;
        };
        op.acks[rank as usize] = Some(result);
        if !op.acks.iter().all(Option::is_some) {
            return;
        }
        let Some(op) = self.events.remove(&event_id) else {
            return;
        };
        let event = op.cmd.event.to_string();
        let mut rank0 = None;
        for (r, a) in op.acks.into_iter().enumerate() {
            match a {
                Some(Err(error)) => {
                    let _ = op.cmd.reply.send(Err(EventError::Rank {
                        rank: r as u32,
                        event,
                        error: RemoteError(error),
                    }));
                    return;
                }
                Some(Ok(p)) if r == 0 => rank0 = Some(p),
                _ => {}
            }
        }
        let _ = op.cmd.reply.send(Ok(rank0.unwrap_or_default()));
    }

    fn event_timeout(&mut self, id: u64) {
        let Some(op) = self.events.remove(&id) else {
            return;
        };
        let pending = missing_ranks(&op.acks);
        let err = EventError::Timeout {
            event: op.cmd.event.to_string(),
            timeout: self.cfg.deadlines.event.0,
            pending: pending.clone(),
        };
        warn!("{err}");
        self.note_failure();
        let reply = op.cmd.reply;
        // Tasks in flight fail with the silent rank named.
        let rank = pending.first().copied().unwrap_or(0);
        let f = self.failure(rank, FailureCause::Unresponsive(self.cfg.deadlines.event.0));
        let mut after = self.fail_inflight(&f);
        after.push(Box::new(move |_, _| drop(reply.send(Err(err)))));
        self.begin_stop("event deadline", after);
    }

    // ---- failure and teardown ----------------------------------------------------

    fn note_failure(&mut self) {
        self.consecutive_failures += 1;
    }

    /// Errors for everything in flight, to deliver after teardown.
    fn fail_inflight(&mut self, f: &RankFailure) -> Vec<After> {
        let mut after: Vec<After> = Vec::new();
        if let Some(t) = self.task.take() {
            let err = ExecuteError::RankFailed {
                failure: Box::new(f.clone()),
                others: Vec::new(),
            };
            self.last_failure = Some(err.clone());
            let reply = t.cmd.reply;
            after.push(Box::new(move |_, _| drop(reply.send(Err(err)))));
        }
        for (_, op) in std::mem::take(&mut self.events) {
            let err = EventError::RankFailed {
                event: op.cmd.event.to_string(),
                failure: Box::new(f.clone()),
            };
            after.push(Box::new(move |_, _| drop(op.cmd.reply.send(Err(err)))));
        }
        after
    }

    /// A rank failed: record it, fail what is in flight, and stop the group.
    fn fail_group(&mut self, f: RankFailure) {
        if self.stopping() {
            return;
        }
        warn!("{}", f.report());
        let starting = matches!(
            self.group.as_ref().map(|g| &g.phase),
            Some(Phase::Starting { .. })
        );
        if starting {
            self.fail_start(StartError::RankFailed(Box::new(f)));
            return;
        }
        if let Some(g) = &mut self.group {
            g.failures.push(f.clone());
        }
        self.note_failure();
        let busy = self.task.is_some() || !self.events.is_empty();
        let after = self.fail_inflight(&f);
        if !busy {
            let err = ExecuteError::RankFailed {
                failure: Box::new(f),
                others: Vec::new(),
            };
            self.last_failure = Some(err.clone());
            self.deferred = Some(err);
        }
        self.begin_stop("a rank failed", after);
    }

    fn fail_start(&mut self, err: StartError) {
        let Some(g) = &mut self.group else { return };
        let waiters = match &mut g.phase {
            Phase::Starting { waiters, .. } => std::mem::take(waiters),
            _ => Vec::new(),
        };
        warn!("rank group start-up failed: {}", chain(&err));
        self.note_failure();
        self.last_failure = Some(ExecuteError::Start(err.clone()));
        self.begin_stop(
            "start-up failed",
            vec![Box::new(move |_, _| {
                for w in waiters {
                    w.fail(&err);
                }
            })],
        );
    }

    fn begin_stop(&mut self, reason: &str, after: Vec<After>) {
        self.begin_teardown(reason, Teardown::Graceful, after);
    }

    fn begin_teardown(&mut self, reason: &str, how: Teardown, after: Vec<After>) {
        let Some(g) = &mut self.group else {
            let report = FinalizeReport::default();
            for a in after {
                a(self, &report);
            }
            return;
        };
        if let Phase::Stopping {
            after: existing, ..
        } = &mut g.phase
        {
            existing.extend(after);
            return;
        }
        info!(%reason, ?how, "stopping the rank group");
        if let Some(p) = &g.policy {
            p.stop_accepting();
        }
        let now = Instant::now();
        if how == Teardown::Kill {
            let sent = g.table.signal_all(TermSignal::Kill);
            info!(targets = ?sent, "sent SIGKILL");
            for l in &mut g.links {
                l.shutdown();
            }
            g.phase = Phase::Stopping {
                stage: TermStage::Killing,
                deadline: now + KILL_WAIT,
                started: now,
                escalated: Some(TermSignal::Kill),
                after,
            };
            g.closed_pending.clear();
            self.maybe_finish_stop();
            return;
        }
        if let Ok(f) = envelope::plain(&Message::Close {
            reason: reason.to_owned(),
        }) {
            let f = Arc::new(f);
            for link in &g.links {
                link.send(Channel::Exec, f.clone());
                link.send(Channel::Handle, f.clone());
            }
        }
        g.phase = Phase::Stopping {
            stage: TermStage::Closing,
            deadline: now + self.cfg.deadlines.shutdown_grace.0,
            started: now,
            escalated: None,
            after,
        };
        g.closed_pending.clear();
        g.exits_pending.clear();
        self.maybe_finish_stop();
    }

    fn escalate(&mut self) {
        self.escalate_once();
        self.maybe_finish_stop();
    }

    /// Moves teardown to its next stage (`SIGTERM`, then `SIGKILL`, then giving up).
    fn escalate_once(&mut self) {
        let Some(g) = &mut self.group else { return };
        let Phase::Stopping {
            stage,
            deadline,
            escalated,
            ..
        } = &mut g.phase
        else {
            return;
        };
        let now = Instant::now();
        match stage {
            TermStage::Closing => {
                let sent = g.table.signal_all(TermSignal::Term);
                info!(targets = ?sent, "ranks did not exit after Close; sent SIGTERM");
                *stage = TermStage::Terminating;
                *escalated = Some(TermSignal::Term);
                *deadline = now + self.cfg.deadlines.term_grace.0;
            }
            TermStage::Terminating => {
                let sent = g.table.signal_all(TermSignal::Kill);
                warn!(targets = ?sent, "ranks did not exit after SIGTERM; sent SIGKILL");
                // A rank stuck writing to us must not keep its threads alive either.
                for l in &mut g.links {
                    l.shutdown();
                }
                *stage = TermStage::Killing;
                *escalated = Some(TermSignal::Kill);
                *deadline = now + KILL_WAIT;
            }
            TermStage::Killing => {
                let stuck = g.table.live_pids();
                warn!(
                    ?stuck,
                    "processes survived SIGKILL (stuck in the kernel?); giving up on them"
                );
                self.finish_stop(stuck);
            }
        }
    }

    /// Finishes teardown once every process is gone, and skips a stage that no live
    /// process can act on: the `Close` grace when no live rank can answer a `Close`
    /// (never connected, silent, stopped, gone), the `SIGTERM` grace when every live
    /// process is stopped (only `SIGKILL` acts on a stopped process).
    fn maybe_finish_stop(&mut self) {
        loop {
            let Some(g) = &self.group else { return };
            let Phase::Stopping { stage, .. } = &g.phase else {
                return;
            };
            if g.table.all_exited() {
                self.finish_stop(Vec::new());
                return;
            }
            let skip = match stage {
                TermStage::Closing => !any_live_answers_close(g),
                TermStage::Terminating => all_live_stopped(g),
                TermStage::Killing => false,
            };
            if !skip {
                return;
            }
            info!(stage = ?stage, "no live process can act on this stage; skipping its grace");
            self.escalate_once();
        }
    }

    fn finish_stop(&mut self, unkillable: Vec<u32>) {
        let Some(mut g) = self.group.take() else {
            return;
        };
        for l in &mut g.links {
            l.shutdown();
        }
        let (started, escalated, after) = match std::mem::replace(&mut g.phase, Phase::Ready) {
            Phase::Stopping {
                started,
                escalated,
                after,
                ..
            } => (started, escalated, after),
            _ => (Instant::now(), None, Vec::new()),
        };
        let report = FinalizeReport {
            elapsed: started.elapsed(),
            escalated,
            unkillable,
        };
        info!(
            elapsed_ms = report.elapsed.as_millis() as u64,
            escalated = ?report.escalated.map(TermSignal::name),
            "rank group stopped"
        );
        // Threads, listener, output pump, run directory go now; the admission
        // reservation on the admission thread (after any update queued there).
        drop(g);
        for a in after {
            a(self, &report);
        }
    }

    fn finalize(&mut self, reply: Sender<FinalizeReport>) {
        if self.finalized && self.group.is_none() {
            let _ = reply.send(FinalizeReport::default());
            return;
        }
        self.finalized = true;
        let mut after: Vec<After> = Vec::new();
        if let Some(t) = self.task.take() {
            let err = ExecuteError::Aborted {
                task: t.cmd.task.clone(),
                reason: "the job is ending".to_owned(),
                forced: false,
            };
            let r = t.cmd.reply;
            after.push(Box::new(move |_, _| drop(r.send(Err(err)))));
        }
        for (_, op) in std::mem::take(&mut self.events) {
            after.push(Box::new(move |_, _| {
                drop(op.cmd.reply.send(Err(EventError::Finalized)))
            }));
        }
        if let Some(p) = self.pending.take() {
            for w in p.waiters {
                w.fail(&StartError::Aborted);
            }
        }
        if let Some(g) = &mut self.group
            && let Phase::Starting { waiters, .. } = &mut g.phase
        {
            for w in std::mem::take(waiters) {
                w.fail(&StartError::Aborted);
            }
        }
        // Queued work will not run.
        for cmd in std::mem::take(&mut self.queue) {
            match cmd {
                Command::Execute(c) => drop(c.reply.send(Err(ExecuteError::Finalized))),
                Command::Event(c) => drop(c.reply.send(Err(EventError::Finalized))),
                Command::Start { reply, .. } => drop(reply.send(Err(StartError::Finalized))),
                Command::Park { reply } => drop(reply.send(())),
                Command::Finalize { reply } => drop(reply.send(FinalizeReport::default())),
                Command::Status { reply } => drop(reply.send(self.status())),
            }
        }
        self.deferred = None;
        after.push(Box::new(move |_, report| drop(reply.send(report.clone()))));
        self.begin_stop("finalize", after);
    }
}

/// Whether some live process may still act on a `Close`: a launcher (it exits with its
/// ranks), or a rank with a channel to receive it that is neither silent nor stopped.
/// Only our own children are looked up in `/proc`: a pid a rank reports is not trusted.
fn any_live_answers_close(g: &Group) -> bool {
    g.table
        .snapshot()
        .iter()
        .filter(|p| p.status.is_none())
        .any(|p| match p.role {
            Role::Launcher => true,
            Role::Rank(r) | Role::ExternalRank(r) => {
                let link = &g.links[r as usize];
                let reachable = link.has(Channel::Exec) || link.has(Channel::Handle);
                reachable
                    && !g.unanswering.contains(&r)
                    && !(matches!(p.role, Role::Rank(_)) && os::is_stopped(p.pid))
            }
        })
}

/// Whether every live process is one of our children and stopped.
fn all_live_stopped(g: &Group) -> bool {
    g.table
        .snapshot()
        .iter()
        .filter(|p| p.status.is_none())
        .all(|p| matches!(p.role, Role::Rank(_)) && os::is_stopped(p.pid))
}

fn describe_missing(g: &Group) -> String {
    let mut parts = Vec::new();
    let unconnected: Vec<String> = g
        .links
        .iter()
        .enumerate()
        .filter(|(_, l)| !l.complete())
        .map(|(r, l)| format!("{r} ({}/3 channels)", l.connected()))
        .collect();
    if !unconnected.is_empty() {
        parts.push(format!("ranks not connected: {}", unconnected.join(", ")));
    }
    if let Phase::Starting {
        acks,
        init_sent: true,
        ..
    } = &g.phase
    {
        let waiting: Vec<String> = acks
            .iter()
            .enumerate()
            .filter(|(_, a)| !**a)
            .map(|(r, _)| r.to_string())
            .collect();
        if !waiting.is_empty() {
            parts.push(format!(
                "ranks still building components: {}",
                waiting.join(", ")
            ));
        }
    }
    if parts.is_empty() {
        "no rank reported".to_owned()
    } else {
        parts.join("; ")
    }
}

/// The ranks (slot indices) that have not answered yet.
fn missing_ranks<T>(answers: &[Option<T>]) -> Vec<u32> {
    (0u32..)
        .zip(answers)
        .filter(|(_, a)| a.is_none())
        .map(|(rank, _)| rank)
        .collect()
}
