//! What a rank leaves in its process group (a PyTorch DataLoader worker; here a
//! `sleep` the rank's shell started before it became the worker) goes with the group:
//! when the rank is SIGKILLed and the group is torn down, on finalize, and on a forced
//! abort. The group's leader (rank 0) stays an unreaped zombie until teardown has sent
//! its group a last `SIGKILL`, so the group id cannot have been reused when it is
//! signalled.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::{Signal as Sig, kill};
use nix::unistd::Pid;
use rankexec::executor::{
    Dur, ExecuteError, ExitStatus, FailureCause, MultiProcessExecutor, WorkerConfig,
};
use rankexec::protocol::{Shareable, Signal};

/// `world` ranks of the `Sleep` builtin; each rank's shell first starts a `sleep` in
/// the background (in the rank's process group) and writes its pid to `child-RANK`.
fn leaving_children(world: u32, args: serde_json::Value, dir: &Path) -> MultiProcessExecutor {
    let mut cfg = config(world, "Sleep", args, dir);
    let script = format!(
        "sleep 1000.$RANKEXEC_RANK & echo $! > {d}/child-$RANKEXEC_RANK.tmp && \
         mv {d}/child-$RANKEXEC_RANK.tmp {d}/child-$RANKEXEC_RANK; exec {w}",
        d = dir.display(),
        w = worker_bin().display()
    );
    cfg.worker = WorkerConfig {
        program: "/bin/sh".into(),
        args: vec!["-c".into(), script],
    };
    cfg.deadlines.abort_grace = Dur(Duration::from_millis(300));
    cfg.deadlines.shutdown_grace = Dur(Duration::from_millis(500));
    cfg.deadlines.term_grace = Dur(Duration::from_millis(500));
    MultiProcessExecutor::new(cfg).unwrap()
}

/// The pids the ranks' shells wrote, waiting (with a deadline) for each file.
fn children(dir: &Path, world: u32) -> Vec<u32> {
    let deadline = Instant::now() + Duration::from_secs(20);
    (0..world)
        .map(|r| {
            let f: PathBuf = dir.join(format!("child-{r}"));
            loop {
                if let Ok(text) = std::fs::read_to_string(&f) {
                    return text.trim().parse().expect("a pid");
                }
                assert!(Instant::now() < deadline, "rank {r} never wrote {f:?}");
                std::thread::sleep(Duration::from_millis(10));
            }
        })
        .collect()
}

/// Asserts every pid is alive now, and in the group of the ranks' leader.
fn assert_in_group(pids: &[u32], pgid: u32) {
    for p in pids {
        assert!(pid_alive(*p), "child {p} died before the test acted");
        let g = nix::unistd::getpgid(Some(Pid::from_raw(*p as i32))).unwrap();
        assert_eq!(g.as_raw() as u32, pgid, "child {p} is in the ranks' group");
    }
}

/// Waits for the pids to go; on failure kills them (no process left by a failing
/// test) and panics.
fn expect_gone(pids: &[u32], what: &str) -> Duration {
    match wait_gone(pids, DIE_TIME) {
        Ok(took) => took,
        Err(alive) => {
            for p in &alive {
                let _ = kill(Pid::from_raw(*p as i32), Sig::SIGKILL);
            }
            panic!("{what}: the ranks' children {alive:?} escaped teardown");
        }
    }
}

/// SIGKILLs rank `victim` mid-task; once the executor has reported the failure and
/// torn the group down, every rank's child is gone.
fn killed_rank_takes_its_children(victim: usize) {
    let dir = tempfile::tempdir().unwrap();
    let exec = leaving_children(2, serde_json::json!({"secs": 600}), dir.path());
    let mut ctx = start(&exec);
    let ranks = exec.live_pids();
    assert_eq!(ranks.len(), 2);
    let kids = children(dir.path(), 2);
    assert_in_group(&kids, ranks[0]);
    let target = ranks[victim];
    let abort = Signal::new();
    std::thread::scope(|s| {
        let run = s.spawn(|| exec.run_task("train", Shareable::new(), &mut ctx, &abort));
        // Kill the rank once the task is running in it (its log says so).
        let log = dir.path().join(format!("rank-{victim}/stderr.log"));
        let deadline = Instant::now() + Duration::from_secs(20);
        while !std::fs::read_to_string(&log).is_ok_and(|t| t.contains("sleeping")) {
            assert!(
                Instant::now() < deadline,
                "rank {victim} never began the task"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        // The executor holds the rank unreaped while it runs: the pid is still its own.
        kill(Pid::from_raw(target as i32), Sig::SIGKILL).unwrap();
        let err = run.join().unwrap().unwrap_err();
        let ExecuteError::RankFailed { failure, .. } = &err else {
            panic!("{}", chain(&err))
        };
        assert_eq!(failure.rank, victim as u32, "{}", chain(&err));
        assert!(
            matches!(
                failure.cause,
                FailureCause::Exited(ExitStatus::Signal { signal: 9, .. })
            ),
            "{failure:?}"
        );
    });
    let took = expect_gone(&kids, "after the failure");
    assert_gone(&ranks, "the ranks after the failure");
    println!(
        "rank {victim} SIGKILLed: its group's children {kids:?} gone {:.1} ms after the failure was returned",
        took.as_secs_f64() * 1e3
    );
    exec.finalize().unwrap();
}

#[test]
fn a_killed_leader_rank_takes_the_groups_children() {
    killed_rank_takes_its_children(0);
}

#[test]
fn a_killed_member_rank_takes_the_groups_children() {
    killed_rank_takes_its_children(1);
}

#[test]
fn finalize_takes_the_ranks_children() {
    let dir = tempfile::tempdir().unwrap();
    let exec = leaving_children(2, serde_json::json!({"secs": 600}), dir.path());
    let _ctx = start(&exec);
    let ranks = exec.live_pids();
    let kids = children(dir.path(), 2);
    assert_in_group(&kids, ranks[0]);
    let report = exec.finalize().unwrap();
    assert!(report.unkillable.is_empty(), "{report:?}");
    let took = expect_gone(&kids, "after finalize");
    assert_gone(&ranks, "the ranks after finalize");
    println!(
        "finalize: the ranks' children {kids:?} gone {:.1} ms after it returned",
        took.as_secs_f64() * 1e3
    );
}

#[test]
fn a_forced_abort_takes_the_ranks_children() {
    let dir = tempfile::tempdir().unwrap();
    let exec = leaving_children(
        2,
        serde_json::json!({"secs": 600, "ignore_abort": true}),
        dir.path(),
    );
    let mut ctx = start(&exec);
    let ranks = exec.live_pids();
    let kids = children(dir.path(), 2);
    assert_in_group(&kids, ranks[0]);
    let abort = Signal::new();
    std::thread::scope(|s| {
        let run = s.spawn(|| exec.run_task("train", Shareable::new(), &mut ctx, &abort));
        let log = dir.path().join("rank-0/stderr.log");
        let deadline = Instant::now() + Duration::from_secs(20);
        while !std::fs::read_to_string(&log).is_ok_and(|t| t.contains("sleeping")) {
            assert!(Instant::now() < deadline, "rank 0 never began the task");
            std::thread::sleep(Duration::from_millis(10));
        }
        abort.trigger("stop now");
        let err = run.join().unwrap().unwrap_err();
        assert!(
            matches!(err, ExecuteError::Aborted { forced: true, .. }),
            "{}",
            chain(&err)
        );
    });
    let took = expect_gone(&kids, "after a forced abort");
    assert_gone(&ranks, "the ranks after a forced abort");
    println!(
        "forced abort: the ranks' children {kids:?} gone {:.1} ms after it returned",
        took.as_secs_f64() * 1e3
    );
    exec.finalize().unwrap();
}
