//! A rank's component error surfaces with that rank's number; the group survives it.

mod common;

use common::*;
use rankexec::executor::{ExecuteError, FailureCause, MultiProcessExecutor};
use rankexec::protocol::{ErrorClass, Shareable, Signal};

#[test]
fn rank_two_error_names_rank_two() {
    let logs = tempfile::tempdir().unwrap();
    let cfg = config(
        4,
        "Fail",
        serde_json::json!({"ranks": [2], "message": "bad shard"}),
        logs.path(),
    );
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let mut ctx = start(&exec);
    let pids = exec.live_pids();
    let err = exec
        .run_task("train", Shareable::new(), &mut ctx, &Signal::new())
        .unwrap_err();
    let ExecuteError::RankFailed { failure, .. } = &err else {
        panic!("unexpected {err:?}")
    };
    assert_eq!(failure.rank, 2);
    assert_eq!(err.class(), ErrorClass::Exception);
    assert!(
        matches!(&failure.cause, FailureCause::Reported(e) if e.message == "bad shard (rank 2)"),
        "{failure:?}"
    );
    assert_eq!(chain(&err), "rank 2 failed: exception: bad shard (rank 2)");
    // The failing rank returned; nothing died, so the group keeps its processes.
    assert_eq!(exec.live_pids(), pids);
    exec.finalize().unwrap();
    assert_gone(&pids, "after finalize");
}

#[test]
fn group_serves_the_next_task_after_a_rank_error() {
    let logs = tempfile::tempdir().unwrap();
    // Rank 0 fails `raise` tasks only.
    let cfg = config(
        2,
        "Fail",
        serde_json::json!({"ranks": [0], "tasks": ["raise"], "message": "RuntimeError"}),
        logs.path(),
    );
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let mut ctx = start(&exec);
    let pids = exec.live_pids();
    let err = exec
        .run_task("raise", Shareable::new(), &mut ctx, &Signal::new())
        .unwrap_err();
    assert_eq!(
        chain(&err),
        "rank 0 failed: exception: RuntimeError (rank 0)"
    );
    let out = exec
        .run_task(
            "normal",
            Shareable::new().with_meta("x", 1),
            &mut ctx,
            &Signal::new(),
        )
        .unwrap();
    assert_eq!(out.meta("x").and_then(|v| v.as_i64()), Some(1));
    // Same processes: a component error is not a reason to relaunch.
    assert_eq!(exec.live_pids(), pids);
    exec.finalize().unwrap();
    assert_gone(&pids, "after finalize");
}
