//! A dead rank's failure report carries its last stderr lines, and waiting for them
//! never stalls the executor: when a child the rank left behind (a DataLoader worker,
//! here a `sleep`) keeps the rank's stderr open, the failure is reported at the short
//! tail deadline with the lines that did arrive; and the child goes with the group.

mod common;

use std::time::{Duration, Instant};

use common::*;
use rankexec::executor::{
    ExitStatus, FailureCause, MultiProcessExecutor, StartError, WorkerConfig,
};
use rankexec::protocol::FlContext;

/// A one-rank executor whose "worker" is a shell script.
fn shell_rank(script: &str, logs: &std::path::Path) -> MultiProcessExecutor {
    let mut cfg = config(1, "Echo", serde_json::json!({}), logs);
    cfg.worker = WorkerConfig {
        program: "/bin/sh".into(),
        args: vec!["-c".into(), script.into()],
    };
    MultiProcessExecutor::new(cfg).unwrap()
}

fn failed_start(exec: &MultiProcessExecutor) -> rankexec::executor::RankFailure {
    match exec.start(&FlContext::new()).unwrap_err() {
        StartError::RankFailed(f) => *f,
        other => panic!("{}", chain(&other)),
    }
}

#[test]
fn a_dead_ranks_last_stderr_lines_are_in_its_failure() {
    let logs = tempfile::tempdir().unwrap();
    let exec = shell_rank("echo 'last words before exit' >&2; exit 7", logs.path());
    let f = failed_start(&exec);
    assert!(
        matches!(f.cause, FailureCause::Exited(ExitStatus::Code(7))),
        "{f:?}"
    );
    assert!(
        f.stderr_tail
            .iter()
            .any(|l| l.contains("last words before exit")),
        "{:?}",
        f.stderr_tail
    );
    println!("{}", f.report());
}

#[test]
fn a_child_holding_a_dead_ranks_stderr_does_not_stall_the_report() {
    let logs = tempfile::tempdir().unwrap();
    let child_file = logs.path().join("child");
    let exec = shell_rank(
        &format!(
            "echo 'last words, child left behind' >&2; sleep 600.25 & echo $! > {f}.tmp && \
             mv {f}.tmp {f}; exit 7",
            f = child_file.display()
        ),
        logs.path(),
    );
    let t = Instant::now();
    let f = failed_start(&exec);
    let took = t.elapsed();
    // The rank left its child in its process group; teardown sent that group SIGKILL
    // before it reaped the rank, so the child is gone (the test kills nothing itself).
    let child: u32 = std::fs::read_to_string(&child_file)
        .expect("the rank wrote its child's pid before it exited")
        .trim()
        .parse()
        .unwrap();
    if let Err(alive) = wait_gone(&[child], DIE_TIME) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        panic!("the dead rank's child {alive:?} escaped teardown");
    }
    assert!(
        matches!(f.cause, FailureCause::Exited(ExitStatus::Code(7))),
        "{f:?}"
    );
    assert!(
        f.stderr_tail
            .iter()
            .any(|l| l.contains("last words, child left behind")),
        "{:?}",
        f.stderr_tail
    );
    println!(
        "a child holds the dead rank's stderr: start failed after {:.0} ms with its last line",
        took.as_secs_f64() * 1e3
    );
    // The whole start-up took well under the start-up deadline (30 s here): the report
    // waited for the tail deadline, not for the child.
    assert!(took < Duration::from_secs(20), "{took:?}");
}
