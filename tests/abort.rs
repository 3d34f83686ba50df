//! A task aborted mid-way returns "aborted", the ranks' signals fire, and the next task
//! runs on the same group.

mod common;

use std::time::Duration;

use common::*;
use rankexec::executor::{ExecuteError, MultiProcessExecutor};
use rankexec::protocol::{ErrorClass, Shareable, Signal, Value};

#[test]
fn aborted_task_then_next_task_runs() {
    let logs = tempfile::tempdir().unwrap();
    let exec = MultiProcessExecutor::new(config(
        2,
        "Sleep",
        serde_json::json!({"secs": 60}),
        logs.path(),
    ))
    .unwrap();
    let mut ctx = start(&exec);
    let pids = exec.live_pids();
    let (abort, t) = abort_after(Duration::from_millis(300), "controller asked");
    let err = exec
        .run_task("train", Shareable::new(), &mut ctx, &abort)
        .unwrap_err();
    t.join().unwrap();
    assert!(
        matches!(&err, ExecuteError::Aborted { forced: false, reason, .. } if reason == "controller asked"),
        "{err:?}"
    );
    assert_eq!(err.class(), ErrorClass::Aborted);
    assert_eq!(exec.live_pids(), pids, "cooperative abort keeps the group");

    let out = exec
        .run_task(
            "train",
            Shareable::new().with_meta("secs", 0.01),
            &mut ctx,
            &Signal::new(),
        )
        .unwrap();
    assert_eq!(out.meta("rank"), Some(&Value::Int(0)));
    exec.finalize().unwrap();
    assert_gone(&pids, "after finalize");
}

#[test]
fn already_triggered_signal_returns_at_once() {
    let logs = tempfile::tempdir().unwrap();
    let exec = MultiProcessExecutor::new(config(
        1,
        "Sleep",
        serde_json::json!({"secs": 60}),
        logs.path(),
    ))
    .unwrap();
    let mut ctx = start(&exec);
    let abort = Signal::new();
    abort.trigger("before it started");
    let err = exec
        .run_task("train", Shareable::new(), &mut ctx, &abort)
        .unwrap_err();
    assert!(
        matches!(err, ExecuteError::Aborted { forced: false, .. }),
        "{err:?}"
    );
    exec.finalize().unwrap();
}
