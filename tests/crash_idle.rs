//! A rank SIGKILLed while idle: the group is torn down at once, the next task fails
//! naming the rank and the signal, and the task after that runs on a new group.

mod common;

use common::*;
use nix::sys::signal::{Signal as Sig, kill};
use nix::unistd::Pid;
use rankexec::executor::{ExecuteError, ExitStatus, FailureCause, MultiProcessExecutor};
use rankexec::protocol::{ErrorClass, Shareable, Signal};

#[test]
fn sigkill_while_idle() {
    let logs = tempfile::tempdir().unwrap();
    let exec =
        MultiProcessExecutor::new(config(3, "Echo", serde_json::json!({}), logs.path())).unwrap();
    let mut ctx = start(&exec);
    let pids = exec.live_pids();
    kill(Pid::from_raw(pids[1] as i32), Sig::SIGKILL).unwrap();
    // Found without any task running: every rank is stopped.
    assert_gone(&pids, "the whole group after rank 1 died");

    let err = exec
        .run_task("t", Shareable::new(), &mut ctx, &Signal::new())
        .unwrap_err();
    let ExecuteError::RankFailed { failure, .. } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(failure.rank, 1);
    assert_eq!(failure.pid, Some(pids[1]));
    assert!(matches!(
        failure.cause,
        FailureCause::Exited(ExitStatus::Signal { signal: 9, .. })
    ));
    assert_eq!(err.class(), ErrorClass::Signal);
    assert_eq!(
        chain(&err),
        format!(
            "rank 1 failed: pid {} was killed by signal 9 (SIGKILL)",
            pids[1]
        )
    );

    exec.run_task("t", Shareable::new(), &mut ctx, &Signal::new())
        .unwrap();
    let new_pids = exec.live_pids();
    assert_eq!(new_pids.len(), 3);
    assert!(new_pids.iter().all(|p| !pids.contains(p)), "a fresh group");
    exec.finalize().unwrap();
}
