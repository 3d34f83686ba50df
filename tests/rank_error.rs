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
