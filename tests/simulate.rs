//! `rankexec simulate` end to end, with the real binary: the FedAvg example reaches its
//! accuracy, the timeout job is aborted by the controller, a client that cannot start
//! fails the job, `--max-groups` caps the groups alive at once, and nothing is left.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::*;

fn example(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples/jobs")
        .join(name)
}

fn simulate(job: &Path, ws: &Path, extra: &[&str]) -> (Output, serde_json::Value) {
    let out = Command::new(rankexec_bin())
        .arg("simulate")
        .arg(job)
        .arg("-w")
        .arg(ws)
        .arg("--no-progress")
        .args(extra)
        .output()
        .unwrap();
    let summary = std::fs::read_to_string(ws.join("summary.json"))
        .map(|s| serde_json::from_str(&s).unwrap())
        .unwrap_or(serde_json::Value::Null);
    (out, summary)
}

/// Pids of live processes whose environment names `ws` (the simulation's ranks).
fn processes_of(ws: &Path) -> Vec<u32> {
    let needle = format!("RANKEXEC_LOG_DIR={}", ws.display());
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .map(|env| {
                    env.split(|b| *b == 0)
                        .any(|kv| kv.starts_with(needle.as_bytes()))
                })
                .unwrap_or(false)
                && pid_alive(*pid)
        })
        .collect()
}

#[test]
fn fedavg_reaches_its_accuracy() {
    let ws = tempfile::tempdir().unwrap();
    let (out, s) = simulate(&example("fedavg"), ws.path(), &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("round   5: 2 clients"),
        "per-round progress: {stdout}"
    );
    assert_eq!(s["status"], "completed");
    assert_eq!(s["rounds"].as_array().unwrap().len(), 5);
    let acc = s["final_metrics"]["accuracy"].as_f64().unwrap();
    assert!(acc >= 0.90, "final accuracy {acc}");
    assert_eq!(s["leftover_pids"], serde_json::json!([]));
    // The model path is absolute; its tensors have their real shapes.
    let model = PathBuf::from(s["model"].as_str().unwrap());
    assert!(model.is_absolute(), "{}", model.display());
    assert_eq!(model, ws.path().join("server/global_model.safetensors"));
    let shapes = tensor_shapes(&model);
    eprintln!("tensor shapes: {shapes}");
    assert_eq!(shapes["weights"], serde_json::json!([10, 64]));
    assert_eq!(shapes["bias"], serde_json::json!([10]));
    // Each client's entry has its metrics and timing.
    let site1 = &s["rounds"][4]["clients"]["site-1"];
    eprintln!("round 5, site-1: {site1}");
    assert_eq!(site1["status"], "ok");
    assert!(site1["metrics"]["train_loss"].as_f64().is_some(), "{site1}");
    assert!(site1["seconds"].as_f64().unwrap() > 0.0, "{site1}");
    // Every round is in metrics.jsonl.
    let metrics = std::fs::read_to_string(ws.path().join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 5);
    assert_eq!(
        s["metrics_file"].as_str().unwrap(),
        ws.path().join("metrics.jsonl").display().to_string()
    );
    for site in ["site-1", "site-2"] {
        for r in 0..2 {
            let log = ws.path().join(format!("{site}/digits/rank-{r}/stderr.log"));
            let text = std::fs::read_to_string(&log).unwrap();
            assert!(text.contains("rank ready"), "{}", log.display());
            assert!(
                text.contains("trained") && text.contains("train_loss="),
                "the rank's own training lines: {}",
                log.display()
            );
        }
        let site_log = std::fs::read_to_string(ws.path().join(format!("{site}/log.txt"))).unwrap();
        assert!(
            site_log.contains("rank group ready"),
            "{site}'s log has its executor's lines"
        );
        let rank_line = site_log
            .lines()
            .find(|l| l.contains("rank{rank=0}") && l.contains("trained"))
            .unwrap_or_else(|| panic!("{site}'s log has its ranks' lines"));
        eprintln!("{site} log line: {rank_line}");
        assert_eq!(
            rank_line.matches("Z ").count(),
            1,
            "one timestamp: {rank_line}"
        );
        assert_eq!(
            rank_line.matches("INFO").count(),
            1,
            "one level: {rank_line}"
        );
    }
    assert!(processes_of(ws.path()).is_empty());
}

/// The `shape` of every tensor in a `.safetensors` header.
fn tensor_shapes(path: &Path) -> serde_json::Value {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| k.as_str() != "__metadata__")
        .map(|(k, v)| (k.clone(), v["shape"].clone()))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

#[test]
fn timeout_job_is_aborted_and_leaves_nothing() {
    let ws = tempfile::tempdir().unwrap();
    let (out, s) = simulate(&example("timeout"), ws.path(), &[]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "exit code 1 when the job does not complete"
    );
    assert_eq!(s["status"], "aborted");
    let reason = s["reason"].as_str().unwrap();
    assert!(
        reason.contains("site-1: task `train` timed out after 2 s and was aborted"),
        "{reason}"
    );
    assert!(
        reason.contains("site-2: task `train` timed out"),
        "{reason}"
    );
    assert_eq!(s["leftover_pids"], serde_json::json!([]));
    assert!(processes_of(ws.path()).is_empty(), "no rank process left");
}

#[test]
fn a_client_that_cannot_start_fails_the_job_with_its_message() {
    let job = tempfile::tempdir().unwrap();
    let src = example("timeout");
    std::fs::create_dir_all(job.path().join("app/config")).unwrap();
    std::fs::copy(src.join("meta.json"), job.path().join("meta.json")).unwrap();
    std::fs::copy(
        src.join("app/config/config_fed_server.json"),
        job.path().join("app/config/config_fed_server.json"),
    )
    .unwrap();
    let client = std::fs::read_to_string(src.join("app/config/config_fed_client.json"))
        .unwrap()
        .replace(
            r#""path": "Sleep", "args": {"secs": 600}"#,
            r#""path": "Fail", "args": {"when": "build", "message": "dataset missing"}"#,
        );
    std::fs::write(job.path().join("app/config/config_fed_client.json"), client).unwrap();
    let ws = tempfile::tempdir().unwrap();
    let (out, s) = simulate(job.path(), ws.path(), &[]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(s["status"], "failed");
    let reason = s["reason"].as_str().unwrap();
    assert!(
        reason.contains("could not build its components"),
        "{reason}"
    );
    assert!(reason.contains("dataset missing"), "{reason}");
    assert!(processes_of(ws.path()).is_empty());
}

/// `(site, ready, closed)` intervals of every group, from the ranks' own logs.
fn group_lives(ws: &Path) -> Vec<(String, String, String)> {
    let mut lives = Vec::new();
    for site in std::fs::read_dir(ws).unwrap().flatten() {
        let name = site.file_name().to_string_lossy().to_string();
        if !name.starts_with("site-") {
            continue;
        }
        let log = std::fs::read_to_string(site.path().join("digits/rank-0/stderr.log")).unwrap();
        let mut ready = None;
        for line in log.lines() {
            let ts = line
                .split_whitespace()
                .next()
                .unwrap_or_default()
                .to_owned();
            if line.contains("rank ready") {
                ready = Some(ts);
            } else if line.contains("rank closed") {
                lives.push((name.clone(), ready.take().unwrap(), ts));
            }
        }
    }
    lives
}

#[test]
fn max_groups_caps_groups_alive_at_once() {
    let ws = tempfile::tempdir().unwrap();
    let (out, s) = simulate(
        &example("fedavg"),
        ws.path(),
        &["-n", "3", "--max-groups", "1"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_eq!(s["status"], "completed");
    let lives = group_lives(ws.path());
    // Groups are parked between tasks: each site's group lives once per task.
    assert!(lives.len() >= 3 * 6, "{lives:?}");
    for (i, a) in lives.iter().enumerate() {
        for b in &lives[i + 1..] {
            if a.0 != b.0 {
                let overlap = a.1 < b.2 && b.1 < a.2;
                assert!(
                    !overlap,
                    "groups of {} and {} were alive at once: {a:?} {b:?}",
                    a.0, b.0
                );
            }
        }
    }
}
