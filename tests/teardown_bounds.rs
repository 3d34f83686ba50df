//! Teardown does not wait on ranks that cannot answer. The graces here are long (30 s)
//! on purpose: each test asserts the group is gone well before a grace it must skip
//! could have elapsed, so what is measured is the code path, not the machine's speed.

mod common;

use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::{Signal as Sig, kill};
use nix::unistd::Pid;
use rankexec::executor::{Dur, ExecuteError, ExecutorConfig, FailureCause, MultiProcessExecutor};
use rankexec::executor::{StartError, WorkerConfig};
use rankexec::protocol::{FlContext, Shareable};

const GRACE: Duration = Duration::from_secs(30);

/// Long shutdown and term graces; a skipped grace is one that did not elapse.
fn long_graces(mut c: ExecutorConfig) -> ExecutorConfig {
    c.deadlines.shutdown_grace = Dur(GRACE);
    c.deadlines.term_grace = Dur(GRACE);
    c
}

/// Runs a task on another thread and returns once the group is busy with it.
fn task_in_flight(
    exec: &std::sync::Arc<MultiProcessExecutor>,
    mut ctx: FlContext,
) -> std::thread::JoinHandle<Result<Shareable, ExecuteError>> {
    let task = std::thread::spawn({
        let exec = exec.clone();
        move || {
            exec.run_task(
                "t",
                Shareable::new(),
                &mut ctx,
                &rankexec::protocol::Signal::new(),
            )
        }
    });
    let t = Instant::now();
    while exec.status().phase != "busy" {
        assert!(t.elapsed() < GRACE, "the task never started");
        std::thread::sleep(Duration::from_millis(5));
    }
    task
}

#[test]
fn a_stopped_rank_costs_the_heartbeat_deadline_not_the_graces() {
    let _serial = serial();
    let logs = tempfile::tempdir().unwrap();
    let mut cfg = long_graces(config(2, "Echo", serde_json::json!({}), logs.path()));
    cfg.deadlines.heartbeat_interval = Dur(Duration::from_millis(100));
    cfg.deadlines.heartbeat_timeout = Dur(Duration::from_secs(2));
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let mut ctx = start(&exec);
    let pids = exec.live_pids();
    // SIGSTOP: the rank answers neither a Close nor SIGTERM; only SIGKILL acts on it.
    let stopped = Instant::now();
    kill(Pid::from_raw(pids[1] as i32), Sig::SIGSTOP).unwrap();
    let gone = wait_gone(&pids, GRACE)
        .unwrap_or_else(|alive| panic!("{alive:?} alive a whole grace after SIGSTOP"));
    let took = stopped.elapsed();
    println!(
        "SIGSTOPped rank: group gone {:.2} s after SIGSTOP (heartbeat_timeout 2 s, shutdown_grace and term_grace 30 s each)",
        took.as_secs_f64()
    );
    assert!(gone < GRACE);
    let err = exec
        .run_task(
            "t",
            Shareable::new(),
            &mut ctx,
            &rankexec::protocol::Signal::new(),
        )
        .unwrap_err();
    let ExecuteError::RankFailed { failure, .. } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(failure.rank, 1);
    assert!(
        matches!(failure.cause, FailureCause::Unresponsive(_)),
        "{failure:?}"
    );
}

#[test]
fn forced_abort_goes_straight_to_kill() {
    let _serial = serial();
    let logs = tempfile::tempdir().unwrap();
    // Ranks that ignore both the abort and SIGTERM: only SIGKILL ends them.
    let mut cfg = long_graces(config(
        2,
        "Sleep",
        serde_json::json!({"secs": 600, "ignore_abort": true, "ignore_sigterm": true}),
        logs.path(),
    ));
    cfg.deadlines.abort_grace = Dur(Duration::from_secs(1));
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let mut ctx = start(&exec);
    let pids = exec.live_pids();
    let (abort, fired) = abort_after(Duration::from_millis(200), "stop");
    let err = exec
        .run_task("train", Shareable::new(), &mut ctx, &abort)
        .unwrap_err();
    let took = fired.join().unwrap().elapsed();
    assert!(
        matches!(err, ExecuteError::Aborted { forced: true, .. }),
        "{err:?}"
    );
    println!(
        "forced abort: answered {:.2} s after the signal (abort_grace 1 s, shutdown_grace and term_grace 30 s each)",
        took.as_secs_f64()
    );
    assert!(
        took < GRACE,
        "the Close or SIGTERM grace was spent: {took:?}"
    );
    for pid in &pids {
        assert!(!pid_alive(*pid), "pid {pid} survived a forced abort");
    }
    exec.finalize().unwrap();
}

#[test]
fn start_up_with_no_rank_connected_ends_without_a_close_grace() {
    let _serial = serial();
    let logs = tempfile::tempdir().unwrap();
    let mut cfg = long_graces(config(2, "Echo", serde_json::json!({}), logs.path()));
    // A "worker" that never connects.
    cfg.worker = WorkerConfig {
        program: "/bin/sleep".into(),
        args: vec!["600".into()],
    };
    cfg.deadlines.startup = Dur(Duration::from_secs(1));
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let t = Instant::now();
    let err = exec.start(&FlContext::new()).unwrap_err();
    let took = t.elapsed();
    assert!(matches!(err, StartError::Timeout { .. }), "{err:?}");
    assert!(chain(&err).contains("0/3 channels"), "{}", chain(&err));
    println!(
        "no rank connected: start failed {:.2} s after the call (startup 1 s, shutdown_grace 30 s)",
        took.as_secs_f64()
    );
    assert!(took < GRACE, "the Close grace was spent: {took:?}");
    assert_eq!(exec.live_pids(), Vec::<u32>::new());
}

#[test]
fn ranks_that_can_answer_get_the_whole_ladder() {
    let _serial = serial();
    let log = LogCapture::install();
    let logs = tempfile::tempdir().unwrap();
    // Busy in a task that ignores its abort, and ignoring SIGTERM: Close (which fires
    // the task's signal), SIGTERM and SIGKILL are each tried in turn.
    let mut cfg = config(
        2,
        "Sleep",
        serde_json::json!({"secs": 600, "ignore_abort": true, "ignore_sigterm": true}),
        logs.path(),
    );
    let grace = Duration::from_millis(300);
    cfg.deadlines.shutdown_grace = Dur(grace);
    cfg.deadlines.term_grace = Dur(grace);
    let exec = std::sync::Arc::new(MultiProcessExecutor::new(cfg).unwrap());
    let ctx = start(&exec);
    let pids = exec.live_pids();
    let task = task_in_flight(&exec, ctx);
    let report = exec.finalize().unwrap();
    let err = task.join().unwrap().unwrap_err();
    assert!(
        matches!(err, ExecuteError::Aborted { forced: false, .. }),
        "{err:?}"
    );
    println!(
        "finalize with ranks ignoring abort and SIGTERM: {:.2} s, escalated to {:?}",
        report.elapsed.as_secs_f64(),
        report.escalated
    );
    assert_eq!(report.escalated, Some(rankexec::executor::TermSignal::Kill));
    assert!(report.elapsed >= grace * 2, "{report:?}");
    assert!(log.text().contains("sent SIGTERM"));
    for pid in &pids {
        assert!(!pid_alive(*pid), "pid {pid} survived");
    }
}

#[test]
fn finalize_within_replaces_the_shutdown_grace() {
    let _serial = serial();
    let logs = tempfile::tempdir().unwrap();
    // Busy in a task that ignores its abort, with 30 s graces: only the grace given to
    // `finalize_within` (an aborted job's close) stands between Close and SIGTERM.
    let cfg = long_graces(config(
        2,
        "Sleep",
        serde_json::json!({"secs": 600, "ignore_abort": true}),
        logs.path(),
    ));
    let exec = std::sync::Arc::new(MultiProcessExecutor::new(cfg).unwrap());
    let ctx = start(&exec);
    let pids = exec.live_pids();
    let task = task_in_flight(&exec, ctx);
    let report = exec.finalize_within(Duration::from_millis(200)).unwrap();
    let err = task.join().unwrap().unwrap_err();
    assert!(
        matches!(err, ExecuteError::Aborted { forced: false, .. }),
        "{err:?}"
    );
    println!(
        "finalize_within(200 ms), shutdown_grace 30 s: {:.2} s, escalated to {:?}",
        report.elapsed.as_secs_f64(),
        report.escalated
    );
    assert_eq!(report.escalated, Some(rankexec::executor::TermSignal::Term));
    assert!(
        report.elapsed < GRACE,
        "the 30 s shutdown grace was waited: {report:?}"
    );
    for pid in &pids {
        assert!(!pid_alive(*pid), "pid {pid} survived");
    }
    // The grace was for that teardown only: the executor's own is unchanged.
    assert_eq!(exec.status().phase, "idle");
}
