//! A group that keeps failing is relaunched `max_restarts` times, then tasks fail with
//! the last cause.

mod common;

use common::*;
use rankexec::executor::{ExecuteError, MultiProcessExecutor};
use rankexec::protocol::{Shareable, Signal};

#[test]
fn restarts_are_bounded() {
    let logs = tempfile::tempdir().unwrap();
    let mut cfg = config(
        2,
        "Exit",
        serde_json::json!({"ranks": [1], "code": 3}),
        logs.path(),
    );
    cfg.restart.max_restarts = 2;
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let mut ctx = start(&exec);
    let mut run = || {
        exec.run_task("t", Shareable::new(), &mut ctx, &Signal::new())
            .unwrap_err()
    };
    // The first launch and two relaunches each run the task and fail.
    for attempt in 0..3 {
        let err = run();
        assert!(
            matches!(&err, ExecuteError::RankFailed { failure, .. } if failure.rank == 1),
            "attempt {attempt}: {err:?}"
        );
        assert!(chain(&err).contains("exited with code 3"));
    }
    let err = run();
    let ExecuteError::RestartsExhausted { restarts, last } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(*restarts, 2);
    assert!(matches!(**last, ExecuteError::RankFailed { .. }));
    assert!(
        chain(&err).starts_with("giving up after 2 relaunches: rank 1 failed"),
        "{}",
        chain(&err)
    );
    assert_eq!(exec.status().restarts, 2);
}
