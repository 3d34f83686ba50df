//! A dead rank's failure report carries its last stderr lines, and waiting for them
//! never stalls the executor: when a child the rank left behind (a DataLoader worker,
//! here a `sleep`) keeps the rank's stderr open, the failure is reported at the short
//! tail deadline with the lines that did arrive.

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

/// Kills what is left of a process group (the `sleep` a rank left behind).
fn kill_group_members(pgid: u32, marker: &str) {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return;
    };
    for e in dir.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let in_group = nix::unistd::getpgid(Some(nix::unistd::Pid::from_raw(pid)))
            .is_ok_and(|g| g.as_raw() as u32 == pgid);
        if in_group && String::from_utf8_lossy(&cmdline).contains(marker) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
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
    let marker = "600.25";
    let exec = shell_rank(
        &format!("echo 'last words, child left behind' >&2; sleep {marker} & exit 7"),
        logs.path(),
    );
    let t = Instant::now();
    let f = failed_start(&exec);
    let took = t.elapsed();
    let pid = f.pid.expect("the rank's pid");
    kill_group_members(pid, marker);
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
