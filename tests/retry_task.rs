//! `restart.retry_task`: a task whose rank died from outside runs again on a relaunched
//! group before it is answered; the answer names every try a death ended. An error of
//! the rank's own code (an exception, an exit code) is never retried, and with the
//! retry off a death fails the task as before.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::{Signal as Sig, kill};
use nix::unistd::Pid;
use rankexec::executor::{ExecuteError, MultiProcessExecutor};
use rankexec::protocol::{ErrorClass, FlContext, Shareable, Signal};

/// Runs one task and returns its outcome with the retries it took.
fn run(
    exec: &MultiProcessExecutor,
    ctx: &mut FlContext,
) -> Result<rankexec::executor::TaskOutcome, ExecuteError> {
    exec.submit_task("t", Shareable::new(), ctx, &Signal::new())
        .expect("submitted")
        .wait_outcome(ctx)
}

/// SIGKILLs `pid` once the rank's log (`log`) says its task began, from a thread.
fn kill_when_sleeping(log: &Path, pid: u32) -> std::thread::JoinHandle<()> {
    let log = log.to_owned();
    std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !std::fs::read_to_string(&log).is_ok_and(|t| t.contains("sleeping")) {
            assert!(Instant::now() < deadline, "the rank never began its task");
            std::thread::sleep(Duration::from_millis(5));
        }
        kill(Pid::from_raw(pid as i32), Sig::SIGKILL).expect("kill");
    })
}

#[test]
fn a_rank_killed_once_costs_a_retry_not_the_task() {
    let logs = tempfile::tempdir().unwrap();
    // Long enough for the killer to act during the first try; the retry sleeps it out.
    let mut cfg = config(2, "Sleep", serde_json::json!({"secs": 2}), logs.path());
    cfg.restart.retry_task = 2;
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let mut ctx = start(&exec);
    let first = exec.live_pids();
    let victim = first[1];
    let killer = kill_when_sleeping(&logs.path().join("rank-1/stderr.log"), victim);
    let outcome = run(&exec, &mut ctx).expect("the retry succeeds");
    killer.join().unwrap();
    assert_eq!(
        outcome.output.meta("slept").and_then(|v| v.as_f64()),
        Some(2.0)
    );
    assert_eq!(outcome.retries.len(), 1, "{:?}", outcome.retries);
    let r = &outcome.retries[0];
    assert_eq!(
        (r.attempt, r.failure.rank, r.failure.pid),
        (1, 1, Some(victim))
    );
    assert!(
        r.to_string().contains("killed by signal 9 (SIGKILL)"),
        "{r}"
    );
    // The first group is gone; the task ran on a new one, which stays up.
    assert_gone(&first, "the first group");
    let second = exec.live_pids();
    assert_eq!(second.len(), 2);
    assert!(second.iter().all(|p| !first.contains(p)));
    // A success resets the budget: the next task runs on the same group, no retry.
    let again = run(&exec, &mut ctx).expect("the next task");
    assert!(again.retries.is_empty());
    assert_eq!(exec.live_pids(), second);
}

#[test]
fn a_rank_that_dies_on_every_try_ends_the_task_naming_every_cause() {
    let logs = tempfile::tempdir().unwrap();
    let mut cfg = config(
        2,
        "Exit",
        serde_json::json!({"ranks": [1], "signal": "SIGKILL"}),
        logs.path(),
    );
    cfg.restart.retry_task = 2;
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let mut ctx = start(&exec);
    let err = run(&exec, &mut ctx).unwrap_err();
    let ExecuteError::Retried { retries, last } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(retries.len(), 2);
    for (i, r) in retries.iter().enumerate() {
        assert_eq!((r.attempt, r.failure.rank), (i as u32 + 1, 1));
    }
    assert!(
        matches!(&**last, ExecuteError::RankFailed { failure, .. } if failure.rank == 1),
        "{last:?}"
    );
    assert_eq!(err.class(), ErrorClass::Signal);
    let text = chain(&err);
    assert!(
        text.starts_with("retried 2 times after ranks died (try 1: rank 1: pid "),
        "{text}"
    );
    assert_eq!(
        text.matches("killed by signal 9 (SIGKILL)").count(),
        3,
        "{text}"
    );
    assert!(text.contains("; try 2: rank 1: pid "), "{text}");
    assert!(text.contains("the last try: rank 1 failed: pid "), "{text}");
    eprintln!("{text}");
}

#[test]
fn errors_of_the_ranks_own_code_are_not_retried() {
    for (path, args, class) in [
        (
            "Fail",
            serde_json::json!({"ranks": [1]}),
            ErrorClass::Exception,
        ),
        (
            "Exit",
            serde_json::json!({"ranks": [1], "code": 3}),
            ErrorClass::ExitCode,
        ),
        (
            "Exit",
            serde_json::json!({"ranks": [1], "signal": "SIGABRT"}),
            ErrorClass::Signal,
        ),
    ] {
        let logs = tempfile::tempdir().unwrap();
        let mut cfg = config(2, path, args, logs.path());
        cfg.restart.retry_task = 2;
        let exec = MultiProcessExecutor::new(cfg).unwrap();
        let mut ctx = start(&exec);
        let err = run(&exec, &mut ctx).unwrap_err();
        assert!(
            matches!(&err, ExecuteError::RankFailed { failure, .. } if failure.rank == 1),
            "{path}: {err:?}"
        );
        assert_eq!(err.class(), class, "{path}: {}", chain(&err));
    }
}

#[test]
fn with_the_retry_off_a_death_fails_the_task() {
    let logs = tempfile::tempdir().unwrap();
    let cfg = config(2, "Sleep", serde_json::json!({"secs": 60}), logs.path());
    assert_eq!(cfg.restart.retry_task, 0, "off by default");
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let mut ctx = start(&exec);
    let victim = exec.live_pids()[1];
    let killer = kill_when_sleeping(&logs.path().join("rank-1/stderr.log"), victim);
    let err = run(&exec, &mut ctx).unwrap_err();
    killer.join().unwrap();
    let ExecuteError::RankFailed { failure, .. } = &err else {
        panic!("{err:?}")
    };
    assert_eq!((failure.rank, failure.pid), (1, Some(victim)));
    assert!(chain(&err).contains("killed by signal 9 (SIGKILL)"));
}

#[test]
fn a_rank_killed_between_tasks_costs_the_next_task_nothing() {
    let logs = tempfile::tempdir().unwrap();
    let mut cfg = config(2, "Sleep", serde_json::json!({"secs": 0.1}), logs.path());
    cfg.restart.retry_task = 1;
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let mut ctx = start(&exec);
    let first = exec.live_pids();
    kill(Pid::from_raw(first[1] as i32), Sig::SIGKILL).expect("kill");
    // The idle group notices and is torn down (nobody waits for it).
    assert_gone(&first, "the idle group");
    let deadline = Instant::now() + Duration::from_secs(20);
    while exec.status().phase != "idle" {
        assert!(
            Instant::now() < deadline,
            "the dead group was never torn down"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let outcome = run(&exec, &mut ctx).expect("the next task runs on a new group");
    assert_eq!(outcome.retries.len(), 1, "{:?}", outcome.retries);
    let r = &outcome.retries[0];
    assert_eq!((r.attempt, r.failure.rank), (0, 1));
    assert!(
        r.to_string().starts_with("before the task: rank 1: pid "),
        "{r}"
    );
}
