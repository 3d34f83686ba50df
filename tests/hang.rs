//! Hangs end in their own errors: a rank that stops answering while idle (heartbeat),
//! a task past its deadline, an event nobody acknowledges. Each names the rank and
//! tears the group down.

mod common;

use std::time::Duration;

use common::*;
use nix::sys::signal::{Signal as Sig, kill};
use nix::unistd::Pid;
use rankexec::executor::{Dur, EventError, ExecuteError, FailureCause, MultiProcessExecutor};
use rankexec::protocol::{ErrorClass, EventType, Shareable, Signal};

fn short(mut c: rankexec::executor::ExecutorConfig) -> rankexec::executor::ExecutorConfig {
    let d = &mut c.deadlines;
    d.heartbeat_interval = Dur(Duration::from_millis(100));
    d.heartbeat_timeout = Dur(Duration::from_millis(1500));
    d.shutdown_grace = Dur(Duration::from_millis(300));
    d.term_grace = Dur(Duration::from_millis(300));
    c
}

#[test]
fn rank_that_stops_answering_while_idle() {
    let logs = tempfile::tempdir().unwrap();
    let exec =
        MultiProcessExecutor::new(short(config(2, "Echo", serde_json::json!({}), logs.path())))
            .unwrap();
    let mut ctx = start(&exec);
    let pids = exec.live_pids();
    // SIGSTOP: the process exists but answers nothing, not even SIGTERM.
    kill(Pid::from_raw(pids[1] as i32), Sig::SIGSTOP).unwrap();
    assert_gone(&pids, "the group after the heartbeat deadline");
    let err = exec
        .run_task("t", Shareable::new(), &mut ctx, &Signal::new())
        .unwrap_err();
    let ExecuteError::RankFailed { failure, .. } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(failure.rank, 1);
    assert!(
        matches!(failure.cause, FailureCause::Unresponsive(_)),
        "{failure:?}"
    );
    assert_eq!(err.class(), ErrorClass::Timeout);
    assert!(
        chain(&err).contains("sent no heartbeat for"),
        "{}",
        chain(&err)
    );
}

#[test]
fn task_past_its_deadline() {
    let logs = tempfile::tempdir().unwrap();
    let mut cfg = short(config(
        2,
        "Sleep",
        serde_json::json!({"secs": 120}),
        logs.path(),
    ));
    cfg.deadlines.task = Dur(Duration::from_millis(500));
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let mut ctx = start(&exec);
    let pids = exec.live_pids();
    let err = exec
        .run_task("train", Shareable::new(), &mut ctx, &Signal::new())
        .unwrap_err();
    let ExecuteError::Timeout { task, pending, .. } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(task, "train");
    assert_eq!(pending, &[0, 1]);
    assert_eq!(err.class(), ErrorClass::Timeout);
    for pid in &pids {
        assert!(!pid_alive(*pid), "the group is torn down");
    }
    // A short task then runs on a relaunched group.
    let out = exec.run_task(
        "train",
        Shareable::new().with_meta("secs", 0.0),
        &mut ctx,
        &Signal::new(),
    );
    assert!(out.is_ok(), "{out:?}");
}

#[test]
fn event_nobody_acknowledges() {
    let logs = tempfile::tempdir().unwrap();
    let mut cfg = with_component(
        short(config(2, "Echo", serde_json::json!({}), logs.path())),
        "slow",
        "EventLog",
        serde_json::json!({"delay_ms": 5000}),
    );
    cfg.deadlines.event = Dur(Duration::from_millis(500));
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let mut ctx = rankexec::protocol::FlContext::new();
    exec.start(&ctx).unwrap();
    let pids = exec.live_pids();
    let err = exec
        .fire_to_ranks(&EventType::new("round_started"), &mut ctx)
        .unwrap_err();
    let EventError::Timeout { event, pending, .. } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(event, "round_started");
    assert_eq!(pending, &[0, 1]);
    for pid in &pids {
        assert!(!pid_alive(*pid), "the group is torn down");
    }
}
