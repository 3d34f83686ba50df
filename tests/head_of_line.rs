//! No head-of-line blocking: while a task runs and another waits to start, `status()`,
//! an event, `finalize()` and `park()` are each answered without waiting for either,
//! and a queued task is never started only to be aborted by a finalize. Each check is
//! about ordering (the call returns while the tasks are still in flight), with tasks
//! that would take minutes, so a slow machine cannot make a test pass or fail.

mod common;

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::*;
use rankexec::executor::{ExecuteError, MultiProcessExecutor};
use rankexec::protocol::{EventType, FlContext, Shareable, Signal};

/// Longer than any wait below: a call that waits for a task fails its deadline.
const LONG_TASK_SECS: f64 = 600.0;
const WITHIN: Duration = Duration::from_secs(60);

type Task = JoinHandle<Result<Shareable, ExecuteError>>;

fn run(exec: &Arc<MultiProcessExecutor>, abort: &Signal) -> Task {
    let (exec, abort) = (exec.clone(), abort.clone());
    std::thread::spawn(move || {
        exec.run_task(
            "train",
            Shareable::new().with_meta("secs", LONG_TASK_SECS),
            &mut FlContext::new(),
            &abort,
        )
    })
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let t = Instant::now();
    while !cond() {
        assert!(t.elapsed() < WITHIN, "{what}: not within {WITHIN:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Rank log lines saying a task started.
fn task_starts(logs: &std::path::Path) -> usize {
    (0..2)
        .map(|r| {
            std::fs::read_to_string(logs.join(format!("rank-{r}/stderr.log")))
                .unwrap_or_default()
                .matches("sleeping")
                .count()
        })
        .sum()
}

/// A group with one task running (both ranks inside it) and a second one queued.
fn busy_with_one_queued(
    logs: &std::path::Path,
) -> (Arc<MultiProcessExecutor>, (Signal, Task), (Signal, Task)) {
    let exec = Arc::new(
        MultiProcessExecutor::new(config(2, "Sleep", serde_json::json!({"secs": 1}), logs))
            .unwrap(),
    );
    start(&exec);
    let first = Signal::new();
    let running = run(&exec, &first);
    wait_until("the first task reaches both ranks", || {
        task_starts(logs) == 2
    });
    let second = Signal::new();
    let queued = run(&exec, &second);
    wait_until("the second task is queued", || exec.status().queued == 1);
    assert!(!running.is_finished() && !queued.is_finished());
    (exec, (first, running), (second, queued))
}

#[test]
fn status_and_events_do_not_wait_behind_tasks() {
    let _serial = serial();
    let logs = tempfile::tempdir().unwrap();
    let (exec, (first, running), (second, queued)) = busy_with_one_queued(logs.path());
    let t = Instant::now();
    let status = exec.status();
    assert_eq!(status.phase, "busy");
    assert_eq!(status.processes.len(), 2);
    let mut ctx = FlContext::new();
    exec.fire_to_ranks(&EventType::new("round_started"), &mut ctx)
        .unwrap();
    println!(
        "status and an event answered in {:.1} ms while a task ran and another waited",
        t.elapsed().as_secs_f64() * 1e3
    );
    assert!(!running.is_finished() && !queued.is_finished());
    first.trigger("done");
    second.trigger("done");
    assert!(running.join().unwrap().is_err());
    assert!(queued.join().unwrap().is_err());
    exec.finalize().unwrap();
}

#[test]
fn finalize_does_not_start_a_queued_task() {
    let _serial = serial();
    let logs = tempfile::tempdir().unwrap();
    let (exec, (_first, running), (_second, queued)) = busy_with_one_queued(logs.path());
    let pids = exec.live_pids();
    let report = exec.finalize().unwrap();
    let err = running.join().unwrap().unwrap_err();
    assert!(
        matches!(&err, ExecuteError::Aborted { forced: false, reason, .. } if reason == "the job is ending"),
        "{err:?}"
    );
    let err = queued.join().unwrap().unwrap_err();
    assert!(matches!(err, ExecuteError::Finalized), "{err:?}");
    assert_gone(&pids, "after finalize");
    println!(
        "finalize with a task running and one queued: {:.1} ms; rank task starts {}",
        report.elapsed.as_secs_f64() * 1e3,
        task_starts(logs.path())
    );
    assert_eq!(task_starts(logs.path()), 2, "the queued task never started");
}

#[test]
fn park_does_not_wait_behind_a_queued_task() {
    let _serial = serial();
    let logs = tempfile::tempdir().unwrap();
    let (exec, (first, running), (second, queued)) = busy_with_one_queued(logs.path());
    let pids = exec.live_pids();
    let parked = std::thread::spawn({
        let exec = exec.clone();
        move || exec.park()
    });
    // Park waits for the running task (it cannot stop the group under it)...
    wait_until("park is queued", || exec.status().queued == 2);
    assert!(!parked.is_finished());
    first.trigger("round over");
    assert!(running.join().unwrap().is_err());
    // ...but not for the queued one, which would run for minutes.
    wait_until("park returns", || parked.is_finished());
    parked.join().unwrap();
    assert!(!queued.is_finished(), "park ran before the queued task");
    assert_gone(&pids, "the parked group");
    // The queued task then runs on a relaunched group.
    wait_until("the queued task starts on a new group", || {
        task_starts(logs.path()) == 4
    });
    let relaunched = exec.live_pids();
    assert!(relaunched.iter().all(|p| !pids.contains(p)), "a new group");
    second.trigger("done");
    assert!(matches!(
        queued.join().unwrap(),
        Err(ExecuteError::Aborted { forced: false, .. })
    ));
    exec.finalize().unwrap();
    assert_gone(&relaunched, "after finalize");
}
