//! Transitions of the state machine, driven without processes: commands go in through
//! `on_command`/`drain_queue`, reports through `on_report`, time through `on_timers`,
//! and a "group" is installed with no process in it (teardown then ends at once).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, bounded};
use rankexec_protocol::wire::Channel;
use rankexec_protocol::wire::message::{Props, RankError};
use rankexec_protocol::{ErrorClass, EventType, Shareable, Signal};

use super::state::*;
use crate::admission::{Admission, Grant};
use crate::config::ExecutorConfig;
use crate::error::{EventError, ExecuteError, FailureCause, FinalizeReport, StartError};
use crate::group::output::Tails;
use crate::group::process::ProcessTable;
use crate::group::watch::ExitWatcher;
use crate::session::link::{LinkEvent, RankLink};
use crate::units::Dur;

pub(super) type ExecReply = Receiver<super::state::TaskAnswer>;

pub(super) fn dispatcher(n: u32) -> Dispatcher {
    let mut cfg = ExecutorConfig::simple(n, "Echo", serde_json::Value::Null);
    // Long enough never to fire unless a test moves time past it.
    cfg.deadlines.heartbeat_timeout = Dur(Duration::from_secs(3600));
    let cfg = Arc::new(cfg);
    let (_tx, rx) = crossbeam_channel::unbounded();
    let admission = Admission::new(cfg.clone());
    Dispatcher::new(cfg, PathBuf::from("/nonexistent/worker"), rx, admission).unwrap()
}

/// Installs a ready group whose ranks are not processes: nothing is sent anywhere, and
/// a teardown finds every process gone at once.
pub(super) fn ready_group(d: &mut Dispatcher) -> u64 {
    d.generation += 1;
    let generation = d.generation;
    let world = d.cfg.num_of_processes;
    let table = Arc::new(ProcessTable::default());
    let watcher = ExitWatcher::start(table.clone(), d.ev_tx.clone(), move |e| {
        (generation, Report::Exited(e))
    })
    .unwrap();
    d.group = Some(Group {
        generation,
        epoch: Instant::now(),
        phase: Phase::Ready,
        table,
        watcher,
        acceptor: None,
        policy: None,
        output: None,
        tails: Arc::new(Tails::default()),
        _run_dir: None,
        links: (0..world).map(|_| RankLink::new()).collect(),
        last_seen: (0..world).map(|_| Arc::new(AtomicU64::new(0))).collect(),
        external: false,
        closed_pending: BTreeMap::new(),
        exits_pending: Vec::new(),
        unanswering: Default::default(),
        failures: Vec::new(),
        oom_baselines: BTreeMap::new(),
        grant: Grant::default(),
        reservation: None,
        log_dir: std::env::temp_dir(),
        endpoint: "local:/nonexistent".into(),
        pgid: 0,
    });
    generation
}

pub(super) fn execute(d: &mut Dispatcher, abort: &Signal) -> ExecReply {
    execute_with(d, abort, Shareable::new().with_meta("x", 1))
}

pub(super) fn execute_with(d: &mut Dispatcher, abort: &Signal, input: Shareable) -> ExecReply {
    let (reply, rx) = bounded(1);
    d.on_command(Command::Execute(ExecuteCmd {
        task: "train".into(),
        input,
        props: Props::new(),
        abort: abort.clone(),
        reply: super::state::TaskReply::new(reply),
        wake: None,
        deadline: None,
    }));
    d.drain_queue();
    rx
}

/// Handles reports until `done` holds (a report comes from a helper thread).
pub(super) fn pump(d: &mut Dispatcher, done: impl Fn(&Dispatcher) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done(d) {
        let (generation, report) = d
            .ev_rx
            .recv_deadline(deadline)
            .expect("no report within 10 s");
        d.on_report(generation, report);
    }
}

/// Starts a task and waits until its frames went out.
pub(super) fn sent_task(d: &mut Dispatcher, abort: &Signal) -> (ExecReply, u64) {
    let rx = execute(d, abort);
    pump(d, |d| d.task.as_ref().is_some_and(|t| t.sent.is_some()));
    let id = d.task.as_ref().map(|t| t.id).unwrap();
    (rx, id)
}

pub(super) fn result(
    d: &mut Dispatcher,
    generation: u64,
    rank: u32,
    task_id: u64,
    class: ErrorClass,
) {
    d.on_report(
        generation,
        Report::Link {
            rank,
            ev: LinkEvent::TaskResult {
                task_id,
                outcome: Err(RankError {
                    class,
                    message: "stopped".into(),
                }),
            },
        },
    );
}

pub(super) fn answer<T>(rx: &Receiver<T>) -> T {
    rx.try_recv().expect("the caller has its answer")
}

#[test]
fn abort_before_start_answers_at_once_and_launches_nothing() {
    let mut d = dispatcher(2);
    let abort = Signal::new();
    abort.trigger("too late");
    let rx = execute(&mut d, &abort);
    let err = answer(&rx).unwrap_err();
    assert!(
        matches!(&err, ExecuteError::Aborted { forced: false, reason, .. } if reason == "too late"),
        "{err:?}"
    );
    assert!(d.pending.is_none() && d.group.is_none());
}

#[test]
fn finalize_while_launching_fails_the_start_and_launches_nothing() {
    let mut d = dispatcher(2);
    let (reply, start) = bounded(1);
    d.on_command(Command::Start {
        props: Props::new(),
        engine: None,
        reply,
    });
    d.drain_queue();
    assert!(d.pending.as_ref().is_some_and(|p| p.in_flight));
    assert_eq!(d.status().phase, "admitting");
    let (reply, fin) = bounded(1);
    d.on_command(Command::Finalize { reply, grace: None });
    assert!(matches!(answer(&start), Err(StartError::Aborted)));
    let report: FinalizeReport = answer(&fin);
    assert_eq!(report.escalated, None);
    // The admission attempt answers later: nothing may launch from it.
    let (generation, late) = d.ev_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(matches!(late, Report::Admitted { .. }));
    d.on_report(generation, late);
    assert!(d.group.is_none() && d.pending.is_none());
}

#[test]
fn cooperative_abort_keeps_the_group() {
    let mut d = dispatcher(2);
    let generation = ready_group(&mut d);
    let abort = Signal::new();
    let (rx, id) = sent_task(&mut d, &abort);
    d.on_report(
        generation,
        Report::AbortTask {
            task_id: id,
            reason: "asked".into(),
        },
    );
    assert!(d.task.as_ref().is_some_and(|t| t.aborting.is_some()));
    result(&mut d, generation, 0, id, ErrorClass::Aborted);
    assert!(rx.try_recv().is_err(), "rank 1 has not returned");
    result(&mut d, generation, 1, id, ErrorClass::Aborted);
    assert!(matches!(
        answer(&rx),
        Err(ExecuteError::Aborted { forced: false, .. })
    ));
    assert!(
        d.group
            .as_ref()
            .is_some_and(|g| matches!(g.phase, Phase::Ready))
    );
}

#[test]
fn abort_grace_expiry_kills_the_group() {
    let mut d = dispatcher(2);
    let generation = ready_group(&mut d);
    let (rx, id) = sent_task(&mut d, &Signal::new());
    d.on_report(
        generation,
        Report::AbortTask {
            task_id: id,
            reason: "asked".into(),
        },
    );
    result(&mut d, generation, 0, id, ErrorClass::Aborted);
    d.on_timers(Instant::now() + d.cfg.deadlines.abort_grace.0);
    assert!(matches!(
        answer(&rx),
        Err(ExecuteError::Aborted { forced: true, .. })
    ));
    assert!(d.group.is_none(), "the group was killed");
}

#[test]
fn a_failure_during_an_abort_is_the_answer_and_stops_the_group() {
    let mut d = dispatcher(2);
    let generation = ready_group(&mut d);
    let (rx, id) = sent_task(&mut d, &Signal::new());
    d.on_report(
        generation,
        Report::AbortTask {
            task_id: id,
            reason: "asked".into(),
        },
    );
    d.on_report(
        generation,
        Report::Link {
            rank: 1,
            ev: LinkEvent::Protocol {
                channel: Channel::Exec,
                what: "garbage".into(),
            },
        },
    );
    let err = answer(&rx).unwrap_err();
    let ExecuteError::RankFailed { failure, .. } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(failure.rank, 1);
    assert!(matches!(failure.cause, FailureCause::Protocol { .. }));
    assert!(d.group.is_none());
    // The next task relaunches (after the restart back-off).
    let _next = execute(&mut d, &Signal::new());
    assert!(d.pending.is_some());
}

#[test]
fn an_event_during_a_task_gets_its_deadline_from_the_tasks_end() {
    let mut d = dispatcher(2);
    let generation = ready_group(&mut d);
    let (task, id) = sent_task(&mut d, &Signal::new());
    let task_deadline = d.task.as_ref().map(|t| t.deadline).unwrap();
    let (reply, event) = bounded(1);
    d.on_command(Command::Event(EventCmd {
        event: EventType::new("round_started"),
        props: Props::new(),
        reply,
    }));
    d.drain_queue();
    assert_eq!(d.events.len(), 1, "the event runs beside the task");
    // Rank 0 answers the task; nobody answers the event.
    d.on_report(
        generation,
        Report::Link {
            rank: 0,
            ev: LinkEvent::TaskResult {
                task_id: id,
                outcome: Ok((Props::new(), Shareable::new())),
            },
        },
    );
    // A Python rank handles the event after its task: the event deadline alone does
    // not end it while the task may still run.
    d.on_timers(Instant::now() + d.cfg.deadlines.event.0);
    assert!(event.try_recv().is_err(), "the event still waits");
    assert!(d.group.is_some() && d.task.is_some());
    // Its deadline runs from the task's: still bounded.
    let op = d.events.values().next().expect("the event is in flight");
    assert_eq!(op.deadline, task_deadline + d.cfg.deadlines.event.0);
    drop(task);
}

#[test]
fn an_event_timeout_while_idle_fails_it_and_stops_the_group() {
    let mut d = dispatcher(2);
    ready_group(&mut d);
    let (reply, event) = bounded(1);
    d.on_command(Command::Event(EventCmd {
        event: EventType::new("round_started"),
        props: Props::new(),
        reply,
    }));
    d.drain_queue();
    assert_eq!(d.events.len(), 1);
    d.on_timers(Instant::now() + d.cfg.deadlines.event.0);
    assert!(matches!(
        answer(&event),
        Err(EventError::Timeout { ref pending, .. }) if pending == &[0, 1]
    ));
    assert!(d.events.is_empty());
}

#[test]
fn finalize_while_a_task_is_packed_aborts_it_and_ignores_the_frames() {
    let mut d = dispatcher(2);
    ready_group(&mut d);
    // Large enough to be packed on the work thread.
    let input = Shareable::new().with_blob("model", vec![1u8; 1 << 20]);
    let rx = execute_with(&mut d, &Signal::new(), input);
    assert!(d.task.as_ref().is_some_and(|t| t.sent.is_none()));
    let (reply, fin) = bounded(1);
    d.on_command(Command::Finalize { reply, grace: None });
    assert!(matches!(
        answer(&rx),
        Err(ExecuteError::Aborted { forced: false, .. })
    ));
    answer(&fin);
    // The packed frames arrive for a task that is gone.
    let (generation, late) = d.ev_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    d.on_report(generation, late);
    assert!(d.task.is_none() && d.group.is_none());
}

#[test]
fn a_queued_task_whose_abort_fires_is_answered_at_once() {
    let mut d = dispatcher(2);
    let generation = ready_group(&mut d);
    let (running, _id) = sent_task(&mut d, &Signal::new());
    let abort = Signal::new();
    let queued = execute(&mut d, &abort);
    assert_eq!(d.queue.len(), 1, "behind the running task");
    abort.trigger("not needed any more");
    pump(&mut d, |d| d.queue.is_empty());
    assert!(matches!(
        answer(&queued),
        Err(ExecuteError::Aborted { forced: false, ref reason, .. }) if reason == "not needed any more"
    ));
    assert!(running.try_recv().is_err(), "the running task is untouched");
    assert!(d.group.as_ref().is_some_and(|g| g.generation == generation));
}

#[test]
fn a_task_waiting_for_a_launch_whose_abort_fires_drops_the_launch() {
    let mut d = dispatcher(2);
    // A relaunch after a failure waits out its back-off: no admission attempt yet.
    d.consecutive_failures = 1;
    let abort = Signal::new();
    let rx = execute(&mut d, &abort);
    assert!(
        d.pending.as_ref().is_some_and(|p| !p.in_flight),
        "the task waits for a launch"
    );
    abort.trigger("stop");
    pump(&mut d, |d| d.pending.is_none());
    assert!(matches!(
        answer(&rx),
        Err(ExecuteError::Aborted { forced: false, .. })
    ));
    // Past the back-off nothing launches.
    d.on_timers(Instant::now() + Duration::from_secs(60));
    assert!(d.group.is_none() && d.pending.is_none());
}

#[test]
fn a_blob_already_in_shared_memory_is_not_counted_as_bytes_to_copy() {
    use rankexec_protocol::Blob;
    let shared = Blob::shared_with(1 << 20, |b| b.fill(7)).unwrap();
    let heap = Blob::from(vec![1u8; 1 << 20]);
    let only_shared =
        Shareable::from_parts(BTreeMap::new(), [("w".to_owned(), shared.clone())].into());
    let both = Shareable::from_parts(
        BTreeMap::new(),
        [("w".to_owned(), shared), ("h".to_owned(), heap)].into(),
    );
    // Ranks that take descriptors get the sealed file as is: packed on the dispatcher.
    assert_eq!(super::task::bytes_to_copy(&only_shared, false), 0);
    assert_eq!(super::task::bytes_to_copy(&both, false), 1 << 20);
    // A TCP rank gets every byte in its frame.
    assert_eq!(super::task::bytes_to_copy(&only_shared, true), 1 << 20);
    assert_eq!(super::task::bytes_to_copy(&both, true), 2 << 20);
}
