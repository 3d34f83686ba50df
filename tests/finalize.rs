//! Finalize leaves no process, no socket file and no run directory, is idempotent, and
//! a later START_RUN launches a new group.

mod common;

use common::*;
use rankexec::executor::MultiProcessExecutor;
use rankexec::protocol::{Shareable, Signal};

#[test]
fn finalize_cleans_up_and_is_idempotent() {
    let logs = tempfile::tempdir().unwrap();
    let exec =
        MultiProcessExecutor::new(config(3, "Echo", serde_json::json!({}), logs.path())).unwrap();
    let fds_before = fd_count();
    let mut ctx = start(&exec);
    let pids = exec.live_pids();
    let sock = socket_path(&exec.status().endpoint.unwrap());
    exec.run_task("t", Shareable::new(), &mut ctx, &Signal::new())
        .unwrap();

    let report = exec.finalize().unwrap();
    assert_eq!(
        report.escalated, None,
        "ranks exit on Close; no signal needed"
    );
    assert!(report.unkillable.is_empty());
    for pid in &pids {
        assert!(!pid_alive(*pid), "pid {pid} gone when finalize returns");
    }
    assert!(
        child_pids().is_empty(),
        "no child process left: {:?}",
        child_pids()
    );
    assert!(!sock.exists());
    assert!(!sock.parent().unwrap().exists());
    // Threads holding sockets exit asynchronously; give them a moment.
    let mut fds = fd_count();
    for _ in 0..200 {
        if fds <= fds_before {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
        fds = fd_count();
    }
    assert!(
        fds <= fds_before,
        "descriptors leaked: {fds_before} before, {fds} after"
    );

    let again = exec.finalize().unwrap();
    assert_eq!(
        again.elapsed,
        std::time::Duration::ZERO,
        "second finalize does nothing"
    );

    // A new START_RUN brings up a new group.
    let mut ctx = start(&exec);
    let new_pids = exec.live_pids();
    assert_eq!(new_pids.len(), 3);
    assert!(new_pids.iter().all(|p| !pids.contains(p)));
    exec.run_task("t", Shareable::new(), &mut ctx, &Signal::new())
        .unwrap();
    drop(exec);
    assert_gone(&new_pids, "after drop");
}
