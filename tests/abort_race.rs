//! A cooperative abort is never lost. An abort that reaches a rank while the rank is
//! still receiving the task (a large input: a memory file to map locally, 64 MiB of
//! inline bytes over TCP) is honoured when the task starts, and the host's Abort does
//! not wait behind a half-written Execute. Every abort must therefore end
//! `Aborted { forced: false }` with the same rank processes alive: a lost abort shows
//! as `forced: true` after the abort grace and a relaunched group.

mod common;

use std::time::Duration;

use common::*;
use rankexec::executor::{ExecuteError, ExecutorConfig, MultiProcessExecutor, TransportConfig};
use rankexec::protocol::{Blob, Shareable, Signal};

const BIG: usize = 64 << 20;

fn big_input() -> Shareable {
    // `Bytes`-backed: cloning it per task is free, the executor packs it each time.
    Shareable::new().with_blob("model", Blob::from(vec![7u8; BIG]))
}

/// How many lines of every rank's stderr log contain `needle`.
fn rank_log_lines(logs: &std::path::Path, ranks: u32, needle: &str) -> usize {
    (0..ranks)
        .map(|r| {
            std::fs::read_to_string(logs.join(format!("rank-{r}/stderr.log")))
                .unwrap_or_default()
                .lines()
                .filter(|l| l.contains(needle))
                .count()
        })
        .sum()
}

/// Runs `rounds` tasks on a 2-rank Sleep group, aborting each `delay(i)` after the
/// call, and requires every abort to be cooperative with the group kept.
fn every_abort_is_cooperative(
    cfg: ExecutorConfig,
    logs: &std::path::Path,
    rounds: u32,
    delay: impl Fn(u32) -> Duration,
) {
    let ranks = cfg.num_of_processes;
    // Generous grace: a lost abort must not be hidden by a slow machine, and the test
    // waits on the result, never on this grace.
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let mut ctx = start(&exec);
    let pids = exec.live_pids();
    assert_eq!(pids.len(), ranks as usize);
    let input = big_input();
    let mut dispatched = 0;
    for i in 0..rounds {
        let (abort, t) = abort_after(delay(i), "controller asked");
        let err = exec
            .run_task("train", input.clone(), &mut ctx, &abort)
            .unwrap_err();
        t.join().unwrap();
        assert!(
            matches!(&err, ExecuteError::Aborted { forced: false, reason, .. } if reason == "controller asked"),
            "round {i} (abort after {:?}): {err:?}",
            delay(i)
        );
        assert_eq!(
            exec.live_pids(),
            pids,
            "round {i}: a cooperative abort keeps the group"
        );
        dispatched = rank_log_lines(logs, ranks, "sleeping");
    }
    let early = rank_log_lines(logs, ranks, "arrived before the task started");
    println!(
        "{rounds} aborts, all cooperative; rank task starts {dispatched} (of {} rank-rounds), aborts that reached a rank before its task started {early}",
        rounds * ranks
    );
    // A task that runs after all must still work on the same group.
    let out = exec
        .run_task(
            "train",
            Shareable::new().with_meta("secs", 0.01),
            &mut ctx,
            &Signal::new(),
        )
        .unwrap();
    assert!(out.meta("slept").is_some());
    assert_eq!(exec.live_pids(), pids);
    exec.finalize().unwrap();
    assert_gone(&pids, "after finalize");
}

fn sleep_config(logs: &std::path::Path) -> ExecutorConfig {
    let mut cfg = config(2, "Sleep", serde_json::json!({"secs": 60}), logs);
    cfg.deadlines.abort_grace = rankexec::executor::Dur(Duration::from_secs(20));
    cfg
}

#[test]
fn abort_right_after_execute_with_64mib_local_is_cooperative() {
    let _serial = serial();
    let logs = tempfile::tempdir().unwrap();
    let cfg = sleep_config(logs.path());
    // Delays from 0 to 11 ms, so aborts land before, while and after ranks receive.
    every_abort_is_cooperative(cfg, logs.path(), 24, |i| {
        Duration::from_millis(u64::from(i % 12))
    });
}

#[test]
fn abort_right_after_execute_with_64mib_over_tcp_is_cooperative() {
    let _serial = serial();
    let logs = tempfile::tempdir().unwrap();
    let mut cfg = sleep_config(logs.path());
    cfg.transport = TransportConfig::Tcp {
        bind: "127.0.0.1:0".into(),
        advertise: None,
    };
    // Inline over TCP: the 64 MiB take a while to write, and the Abort must not wait
    // behind them on the host nor be dropped by a rank still reading them.
    every_abort_is_cooperative(cfg, logs.path(), 8, |i| {
        Duration::from_millis(2 + 4 * u64::from(i))
    });
}
