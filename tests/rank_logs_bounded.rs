//! A rank's logs are bounded while it lives: a rank that prints far more than
//! `max_rank_log` on stdout and on stderr leaves at most that many bytes of each on
//! disk (`NAME.log` plus `NAME.log.1`), its last lines, while it still runs; and its
//! failure report's stderr tail is still its last stderr lines.
//!
//! The rank is a shell script that prints, then execs the real worker, so the group
//! starts and the rank stays alive after printing (the worker serves `Exit`, which ends
//! it when the test says so).

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use rankexec::executor::{ByteSize, ExecuteError, MultiProcessExecutor, WorkerConfig};
use rankexec::protocol::{Shareable, Signal};

const CAP: u64 = 256 << 10;
/// Lines printed on each stream: about 70 bytes each, 2 MiB in all, 8 times the cap.
const LINES: u64 = 30_000;
const PAD: &str = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUV";
/// Bytes of one numbered line: `stdout line 00000042 PAD` and its newline.
const LINE: u64 = 12 + 8 + 1 + PAD.len() as u64 + 1;

/// What is on disk of one stream: `NAME.log.1` (empty if none), then `NAME.log`.
fn kept(rank_dir: &Path, stream: &str) -> (u64, String) {
    let mut bytes = 0;
    let mut text = String::new();
    for name in [format!("{stream}.log.1"), format!("{stream}.log")] {
        if let Ok(t) = std::fs::read_to_string(rank_dir.join(name)) {
            bytes += t.len() as u64;
            text.push_str(&t);
        }
    }
    (bytes, text)
}

/// Waits for `cond` (every wait has a deadline).
fn wait_until(what: &str, within: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !cond() {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The kept text's lines are the last ones printed on `stream`: numbered lines in a
/// row up to the last, then the script's last line (the worker's own lines may follow
/// on stderr). Returns how many numbered lines are kept.
fn assert_last_lines(stream: &str, text: &str) -> u64 {
    let prefix = format!("{stream} line ");
    let numbers: Vec<u64> = text
        .lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .map(|rest| rest[..8].parse().expect("a line number"))
        .collect();
    let last = format!("LAST {stream} line");
    let after = text.lines().find(|l| !l.starts_with(&prefix));
    assert_eq!(
        after,
        Some(last.as_str()),
        "{stream}: the kept numbered lines are followed by the script's last line"
    );
    assert_eq!(
        numbers.last(),
        Some(&(LINES - 1)),
        "{stream}: the last line is kept"
    );
    assert!(
        numbers.windows(2).all(|w| w[1] == w[0] + 1),
        "{stream}: the kept lines are the last ones, in a row"
    );
    assert!(numbers[0] > 0, "{stream}: the first lines are gone");
    numbers.len() as u64
}

#[test]
fn a_rank_printing_far_past_the_cap_keeps_its_last_lines_within_the_cap_while_it_lives() {
    let logs = tempfile::tempdir().unwrap();
    let rank_dir = logs.path().join("rank-0");
    let script = format!(
        "seq -f 'stdout line %08.0f {PAD}' 0 {n} && echo 'LAST stdout line' && \
         seq -f 'stderr line %08.0f {PAD}' 0 {n} >&2 && echo 'LAST stderr line' >&2 && \
         exec '{worker}'",
        n = LINES - 1,
        worker = worker_bin().display()
    );
    let mut cfg = config(1, "Exit", serde_json::json!({"code": 7}), logs.path());
    cfg.worker = WorkerConfig {
        program: "/bin/sh".into(),
        args: vec!["-c".into(), script],
    };
    cfg.max_rank_log = ByteSize(CAP);
    cfg.restart.max_restarts = 0;
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let mut ctx = start(&exec);
    let pids = exec.live_pids();
    assert_eq!(pids.len(), 1, "{pids:?}");

    // The pump has written both streams' last lines (it may lag the group's start).
    wait_until(
        "the rank's last lines reach its log files",
        DIE_TIME,
        || {
            kept(&rank_dir, "stdout").1.contains("LAST stdout line")
                && kept(&rank_dir, "stderr").1.contains("LAST stderr line")
        },
    );
    assert!(
        pid_alive(pids[0]),
        "the rank runs while its logs are measured"
    );
    for stream in ["stdout", "stderr"] {
        let (bytes, text) = kept(&rank_dir, stream);
        let printed = LINES * LINE + 17;
        println!(
            "{stream}: printed {printed} bytes, {bytes} on disk (cap {CAP}): {:?}",
            entries(&rank_dir)
        );
        assert!(
            bytes <= CAP,
            "{stream}: {bytes} bytes on disk while the rank lives, over the cap of {CAP}"
        );
        let lines = assert_last_lines(stream, &text);
        // Half of the cap at least: the older file was near its half when it rotated.
        assert!(
            lines * LINE >= CAP / 2 - LINE,
            "{stream}: only {lines} lines kept"
        );
    }
    assert!(
        pid_alive(pids[0]),
        "the rank ran while its logs were measured"
    );

    // The failure's stderr tail (kept in memory) is the stream's last lines.
    let err = exec
        .run_task("t", Shareable::new(), &mut ctx, &Signal::new())
        .unwrap_err();
    let ExecuteError::RankFailed { failure, .. } = &err else {
        panic!("{}", chain(&err))
    };
    let (bytes, text) = kept(&rank_dir, "stderr");
    assert!(bytes <= CAP, "stderr: {bytes} bytes on disk, over {CAP}");
    let on_disk: Vec<&str> = text.lines().collect();
    let tail = &failure.stderr_tail;
    println!("stderr tail in the failure: {tail:?}");
    assert!(!tail.is_empty(), "{}", failure.report());
    assert_eq!(
        tail.as_slice(),
        &on_disk[on_disk.len() - tail.len()..],
        "the failure's tail is the last stderr lines"
    );
    assert_gone(&pids, "the failed rank");
}
