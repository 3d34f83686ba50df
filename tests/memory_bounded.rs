//! `rankexec simulate` over 100,000 rounds of a tiny in-process job: the process's RSS
//! stays flat, every round is streamed to `metrics.jsonl`, and the console output and
//! `summary.json` stay small (the last rounds only).
//!
//! It takes about a minute in a debug build (two client threads per round).

mod common;

use std::io::{Read as _, Seek as _, SeekFrom};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const ROUNDS: u32 = 100_000;

fn echo_job(dir: &Path) {
    std::fs::create_dir_all(dir.join("app/config")).unwrap();
    std::fs::write(
        dir.join("meta.json"),
        r#"{"name": "echo-rounds", "min_clients": 2}"#,
    )
    .unwrap();
    std::fs::write(
        dir.join("app/config/config_fed_client.json"),
        r#"{"executors": [{"tasks": ["train"], "executor": {"id": "echo", "path": "Echo", "args": {}}}]}"#,
    )
    .unwrap();
    std::fs::write(
        dir.join("app/config/config_fed_server.json"),
        format!(
            r#"{{"workflows": [{{"id": "w", "path": "ScatterAndGather", "args": {{"num_rounds": {ROUNDS}, "aggregation_weight": "round"}}}}]}}"#
        ),
    )
    .unwrap();
}

/// The round of the last complete line of `metrics.jsonl` (0 before the first).
fn last_round(file: &Path) -> u32 {
    let Ok(mut f) = std::fs::File::open(file) else {
        return 0;
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    if f.seek(SeekFrom::Start(len.saturating_sub(4096))).is_err() {
        return 0;
    }
    let mut tail = String::new();
    if f.read_to_string(&mut tail).is_err() {
        return 0;
    }
    tail.lines()
        .rev()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find_map(|v| v["round"].as_u64())
        .unwrap_or(0) as u32
}

/// Resident memory of a process, in KiB.
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// Waits until the job has run `round` rounds; returns the RSS then.
fn rss_at(child: &mut std::process::Child, metrics: &Path, round: u32) -> u64 {
    let start = Instant::now();
    while last_round(metrics) < round {
        if let Some(st) = child.try_wait().unwrap() {
            panic!("the simulator ended ({st}) before round {round}");
        }
        if start.elapsed() > Duration::from_secs(600) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("round {round} not reached in 600 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    rss_kib(child.id())
}

#[test]
fn memory_and_output_are_flat_over_100k_rounds() {
    let job = tempfile::tempdir().unwrap();
    echo_job(job.path());
    let ws = tempfile::tempdir().unwrap();
    let mut child = Command::new(rankexec_bin())
        .args(["simulate", "--no-progress", "-w"])
        .arg(ws.path())
        .arg(job.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let metrics = ws.path().join("metrics.jsonl");
    let t = Instant::now();
    let early = rss_at(&mut child, &metrics, 10_000);
    let late = rss_at(&mut child, &metrics, 95_000);
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary_len = std::fs::metadata(ws.path().join("summary.json"))
        .unwrap()
        .len();
    eprintln!(
        "RSS at round 10,000: {early} KiB; at round 95,000: {late} KiB; growth {} KiB \
         ({:.1} bytes/round); {ROUNDS} rounds in {:.1} s; stdout {} lines; summary.json {summary_len} bytes",
        late as i64 - early as i64,
        (late as f64 - early as f64) * 1024.0 / 85_000.0,
        t.elapsed().as_secs_f64(),
        stdout.lines().count(),
    );
    assert!(out.status.success(), "{stdout}");
    assert!(
        late < early + 4 * 1024,
        "RSS grew from {early} KiB to {late} KiB"
    );
    let lines = std::fs::read_to_string(&metrics).unwrap().lines().count();
    assert_eq!(lines, ROUNDS as usize, "every round in metrics.jsonl");
    assert!(
        stdout.lines().count() < 400,
        "console output is bounded: {} lines",
        stdout.lines().count()
    );
    assert!(
        summary_len < 64 * 1024,
        "summary.json is {summary_len} bytes"
    );
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ws.path().join("summary.json")).unwrap())
            .unwrap();
    assert_eq!(s["rounds_run"], ROUNDS);
    assert_eq!(s["rounds"].as_array().unwrap().len(), 10);
    assert!(stdout.contains(&format!(
        "(the last 10 of {ROUNDS} rounds; every round is in "
    )));
}
