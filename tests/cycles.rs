//! 100 launch/abort cycles leave no process, file descriptor or socket file behind, and
//! every abort is cooperative (the ranks honour it: none may be lost and forced).

mod common;

use std::time::Duration;

use common::*;
use rankexec::executor::{ExecuteError, MultiProcessExecutor};
use rankexec::protocol::Shareable;

#[test]
fn hundred_launch_abort_cycles_leak_nothing() {
    let logs = tempfile::tempdir().unwrap();
    let fds_before = fd_count();
    let children_before = child_pids();
    let mut sockets = Vec::new();
    for cycle in 0..100 {
        // Every other cycle uses a new executor, so dropping one is covered too.
        let exec = MultiProcessExecutor::new(config(
            2,
            "Sleep",
            serde_json::json!({"secs": 60}),
            logs.path(),
        ))
        .unwrap();
        let mut ctx = start(&exec);
        sockets.push(socket_path(&exec.status().endpoint.unwrap()));
        let (abort, t) = abort_after(Duration::from_millis(5), "cycle");
        let err = exec
            .run_task("t", Shareable::new(), &mut ctx, &abort)
            .unwrap_err();
        t.join().unwrap();
        assert!(
            matches!(err, ExecuteError::Aborted { forced: false, .. }),
            "cycle {cycle}: {err:?}"
        );
        if cycle % 2 == 0 {
            exec.finalize().unwrap();
        }
        drop(exec);
    }
    assert_eq!(child_pids(), children_before, "no process left");
    for s in &sockets {
        assert!(!s.exists(), "socket file {} left behind", s.display());
        assert!(!s.parent().unwrap().exists(), "run dir left behind");
    }
    let mut fds = fd_count();
    for _ in 0..300 {
        if fds <= fds_before {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
        fds = fd_count();
    }
    assert!(
        fds <= fds_before,
        "descriptors: {fds_before} before, {fds} after"
    );
}
