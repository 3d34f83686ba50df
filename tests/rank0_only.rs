//! `result: rank0_only`: only rank 0 gets the tasks (a FLARE Client API script's
//! ranks other than 0 follow rank 0 through collectives); the other ranks never run
//! one, yet their death still fails the task in flight and tears the group down.

mod common;

use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::{Signal as Sig, kill};
use nix::unistd::Pid;
use rankexec::executor::{ExecuteError, MultiProcessExecutor, ResultPolicy};
use rankexec::protocol::{Shareable, Signal, Value};

fn exec_with(
    result: ResultPolicy,
    path: &str,
    args: serde_json::Value,
    logs: &std::path::Path,
) -> MultiProcessExecutor {
    let mut cfg = config(2, path, args, logs);
    cfg.result = result;
    MultiProcessExecutor::new(cfg).unwrap()
}

#[test]
fn tasks_never_reach_the_other_ranks() {
    // Rank 1 fails every task it runs: with rank0_only it runs none.
    let args = serde_json::json!({"ranks": [1], "message": "rank 1 ran a task"});
    let logs = tempfile::tempdir().unwrap();
    let exec = exec_with(ResultPolicy::Rank0Only, "Fail", args.clone(), logs.path());
    let mut ctx = start(&exec);
    let pids = exec.live_pids();
    for round in 0..3 {
        let out = exec
            .run_task(
                "train",
                Shareable::new().with_meta("round", round),
                &mut ctx,
                &Signal::new(),
            )
            .unwrap();
        assert_eq!(out.meta("rank"), Some(&Value::Int(0)));
        assert_eq!(out.meta("round"), Some(&Value::Int(round)));
    }
    assert_eq!(exec.live_pids(), pids, "the group lives on");
    exec.finalize().unwrap();
    assert_gone(&pids, "after finalize");

    // The same group with the default policy: rank 1 gets the task and fails it.
    let logs = tempfile::tempdir().unwrap();
    let exec = exec_with(ResultPolicy::Rank0, "Fail", args, logs.path());
    let mut ctx = start(&exec);
    let err = exec
        .run_task("train", Shareable::new(), &mut ctx, &Signal::new())
        .unwrap_err();
    let ExecuteError::RankFailed { failure, .. } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(failure.rank, 1);
    assert!(chain(&err).contains("rank 1 ran a task"), "{}", chain(&err));
    exec.finalize().unwrap();
}

#[test]
fn a_rank_without_the_task_that_dies_fails_it() {
    let logs = tempfile::tempdir().unwrap();
    let exec = exec_with(
        ResultPolicy::Rank0Only,
        "Sleep",
        serde_json::json!({"secs": 120}),
        logs.path(),
    );
    let mut ctx = start(&exec);
    let pids = exec.live_pids();
    let victim = pids[1];
    let (rank0_log, rank1_log) = (
        logs.path().join("rank-0/stderr.log"),
        logs.path().join("rank-1/stderr.log"),
    );
    let killer = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !std::fs::read_to_string(&rank0_log).is_ok_and(|t| t.contains("sleeping")) {
            assert!(Instant::now() < deadline, "rank 0 never started its task");
            std::thread::sleep(Duration::from_millis(5));
        }
        let rank1 = std::fs::read_to_string(&rank1_log).unwrap_or_default();
        kill(Pid::from_raw(victim as i32), Sig::SIGKILL).unwrap();
        rank1
    });
    let err = exec
        .run_task("t", Shareable::new(), &mut ctx, &Signal::new())
        .unwrap_err();
    let rank1_before_kill = killer.join().unwrap();
    assert!(
        !rank1_before_kill.contains("sleeping"),
        "rank 1 got the task:\n{rank1_before_kill}"
    );
    let ExecuteError::RankFailed { failure, .. } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(failure.rank, 1);
    assert!(chain(&err).contains("SIGKILL"), "{}", chain(&err));
    assert_gone(&pids, "when the task returned");
}
