//! A rank that ignores its abort signal (and SIGTERM) is killed once the abort grace
//! has passed, with no further Close or SIGTERM grace; the next task runs on a fresh
//! group.

mod common;

use std::time::Duration;

use common::*;
use rankexec::executor::{Dur, ExecuteError, MultiProcessExecutor};
use rankexec::protocol::{Shareable, Signal, Value};

#[test]
fn stubborn_rank_is_killed_then_replaced() {
    let log = LogCapture::install();
    let logs = tempfile::tempdir().unwrap();
    let mut cfg = config(
        2,
        "Sleep",
        serde_json::json!({"secs": 120, "ignore_abort": true, "ignore_sigterm": true}),
        logs.path(),
    );
    cfg.deadlines.abort_grace = Dur(Duration::from_millis(300));
    cfg.deadlines.shutdown_grace = Dur(Duration::from_millis(200));
    cfg.deadlines.term_grace = Dur(Duration::from_millis(200));
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let mut ctx = start(&exec);
    let pids = exec.live_pids();
    let (abort, _fired) = abort_after(Duration::from_millis(200), "stop now");
    let err = exec
        .run_task("t", Shareable::new(), &mut ctx, &abort)
        .unwrap_err();
    assert!(
        matches!(err, ExecuteError::Aborted { forced: true, .. }),
        "{err:?}"
    );
    for pid in &pids {
        assert!(!pid_alive(*pid), "rank {pid} was killed");
    }
    assert!(log.text().contains("abort grace expired"));
    assert!(log.text().contains("sent SIGKILL"));
    assert!(
        !log.text().contains("sent SIGTERM"),
        "a forced abort goes straight to SIGKILL"
    );

    let out = exec
        .run_task(
            "t",
            Shareable::new().with_meta("secs", 0.0),
            &mut ctx,
            &Signal::new(),
        )
        .unwrap();
    assert_eq!(out.meta("rank"), Some(&Value::Int(0)));
    assert!(
        exec.live_pids().iter().all(|p| !pids.contains(p)),
        "on a fresh group"
    );
    exec.finalize().unwrap();
}
