//! A rank SIGKILLed in the middle of a task: the task fails at once with the rank and
//! the signal, and no process is left.

mod common;

use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::{Signal as Sig, kill};
use nix::unistd::Pid;
use rankexec::executor::{ExecuteError, MultiProcessExecutor};
use rankexec::protocol::{Shareable, Signal};

#[test]
fn sigkill_mid_task() {
    let logs = tempfile::tempdir().unwrap();
    let exec = MultiProcessExecutor::new(config(
        4,
        "Sleep",
        serde_json::json!({"secs": 120}),
        logs.path(),
    ))
    .unwrap();
    let mut ctx = start(&exec);
    let pids = exec.live_pids();
    let victim = pids[2];
    // Kill it once it is inside the task (its log says so), not after a guessed delay.
    let log = logs.path().join("rank-2/stderr.log");
    let killer = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !std::fs::read_to_string(&log).is_ok_and(|t| t.contains("sleeping")) {
            assert!(Instant::now() < deadline, "rank 2 never started its task");
            std::thread::sleep(Duration::from_millis(5));
        }
        kill(Pid::from_raw(victim as i32), Sig::SIGKILL).unwrap();
        Instant::now()
    });
    let err = exec
        .run_task("t", Shareable::new(), &mut ctx, &Signal::new())
        .unwrap_err();
    let returned = Instant::now();
    let killed_at = killer.join().unwrap();
    let ExecuteError::RankFailed { failure, .. } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(failure.rank, 2);
    assert!(
        chain(&err).contains("killed by signal 9 (SIGKILL)"),
        "{}",
        chain(&err)
    );
    eprintln!(
        "crash detected and group torn down {:.1} ms after the kill",
        (returned - killed_at).as_secs_f64() * 1e3
    );
    for pid in &pids {
        assert!(!pid_alive(*pid), "pid {pid} is gone when the task returns");
    }
}
