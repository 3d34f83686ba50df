//! Ctrl-C on `rankexec simulate`: the first aborts the job cleanly; a second kills
//! every rank at once. Either way no rank process is left.

mod common;

use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::{Signal as Sig, kill};
use nix::unistd::Pid;

fn job_with(dir: &Path, rank_args: &str, grace: &str) {
    std::fs::create_dir_all(dir.join("app/config")).unwrap();
    std::fs::write(
        dir.join("meta.json"),
        r#"{"name": "interrupt", "min_clients": 2}"#,
    )
    .unwrap();
    std::fs::write(
        dir.join("app/config/config_fed_client.json"),
        format!(
            r#"{{"executors": [{{"tasks": ["train"], "executor": {{"id": "x", "path": "MultiProcessExecutor", "args": {{
                "executor_id": "s", "num_of_processes": 2, "worker": {{"program": "rankexec", "args": ["worker"]}},
                "deadlines": {{"abort_grace": "{grace}", "shutdown_grace": "{grace}", "term_grace": "{grace}"}},
                "components": [{{"id": "s", "path": "Sleep", "args": {rank_args}}}]}}}}}}]}}"#
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("app/config/config_fed_server.json"),
        r#"{"workflows": [{"id": "w", "path": "ScatterAndGather", "args": {"num_rounds": 1, "train_timeout": "600s"}}]}"#,
    )
    .unwrap();
}

fn rank_pids(ws: &Path) -> Vec<u32> {
    let needle = format!("RANKEXEC_LOG_DIR={}", ws.display());
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            pid_alive(*pid)
                && std::fs::read(format!("/proc/{pid}/environ"))
                    .map(|env| {
                        env.split(|b| *b == 0)
                            .any(|kv| kv.starts_with(needle.as_bytes()))
                    })
                    .unwrap_or(false)
        })
        .collect()
}

/// The simulator, with its own XDG_RUNTIME_DIR so its run directories are visible;
/// its stderr goes to `stderr` (where it says it was interrupted).
fn spawn(job: &Path, ws: &Path, xdg: &Path, stderr: &Path) -> std::process::Child {
    Command::new(rankexec_bin())
        .env("XDG_RUNTIME_DIR", xdg)
        .args(["simulate", "--no-progress", "-w"])
        .arg(ws)
        .arg(job)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(stderr).unwrap())
        .spawn()
        .unwrap()
}

/// How many ranks under `dir` have logged that their task began (`Sleep` says
/// "sleeping" in its rank's `stderr.log`).
fn sleeping_ranks(dir: &Path) -> usize {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.flatten()
        .map(|e| {
            let p = e.path();
            if p.is_dir() {
                sleeping_ranks(&p)
            } else {
                let in_rank_dir = p
                    .parent()
                    .and_then(Path::file_name)
                    .is_some_and(|n| n.to_string_lossy().starts_with("rank-"));
                let sleeping = p.file_name().is_some_and(|n| n == "stderr.log")
                    && std::fs::read_to_string(&p).is_ok_and(|t| t.contains("sleeping"));
                usize::from(in_rank_dir && sleeping)
            }
        })
        .sum()
}

/// Waits until the 4 ranks run and have begun their task; kills the simulator if
/// they never do.
fn wait_for_ranks(child: &mut std::process::Child, ws: &Path) -> Vec<u32> {
    let start = Instant::now();
    loop {
        let pids = rank_pids(ws);
        if pids.len() == 4 && sleeping_ranks(ws) == 4 {
            return pids;
        }
        if start.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "ranks never began their task ({} running, {} sleeping)",
                pids.len(),
                sleeping_ranks(ws)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until the file holds `needle`; false after `within`.
fn wait_file_contains(path: &Path, needle: &str, within: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < within {
        if std::fs::read_to_string(path).is_ok_and(|t| t.contains(needle)) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

#[test]
fn first_ctrl_c_aborts_cleanly() {
    let job = tempfile::tempdir().unwrap();
    job_with(job.path(), r#"{"secs": 600}"#, "2s");
    let ws = tempfile::tempdir().unwrap();
    let xdg = tempfile::tempdir().unwrap();
    let err = xdg.path().join("stderr.txt");
    let mut child = Reaper(spawn(job.path(), ws.path(), xdg.path(), &err));
    let pids = wait_for_ranks(&mut child.0, ws.path());
    kill(Pid::from_raw(child.0.id() as i32), Sig::SIGINT).unwrap();
    let status = wait_exit(&mut child.0, Duration::from_secs(60));
    let mut out = String::new();
    for l in BufReader::new(child.0.stdout.take().unwrap()).lines() {
        out.push_str(&l.unwrap());
        out.push('\n');
    }
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(out.contains("status: aborted"), "{out}");
    assert!(
        out.contains("reason: interrupted (Ctrl-C or SIGTERM)"),
        "{out}"
    );
    for p in &pids {
        assert!(!pid_alive(*p), "rank {p} left behind");
    }
    assert_eq!(entries(&xdg.path().join("rankexec")), Vec::<String>::new());
}

#[test]
fn second_ctrl_c_kills_at_once() {
    let job = tempfile::tempdir().unwrap();
    // Ranks that ignore aborts and SIGTERM, with long graces: only the second Ctrl-C
    // can end this quickly.
    job_with(
        job.path(),
        r#"{"secs": 600, "ignore_abort": true, "ignore_sigterm": true}"#,
        "60s",
    );
    let ws = tempfile::tempdir().unwrap();
    let xdg = tempfile::tempdir().unwrap();
    let err = xdg.path().join("stderr.txt");
    let mut child = Reaper(spawn(job.path(), ws.path(), xdg.path(), &err));
    let pids = wait_for_ranks(&mut child.0, ws.path());
    // Two groups' run dirs, and nothing else (their MASTER_PORT reservations are
    // abstract socket names, no files).
    let running = entries(&xdg.path().join("rankexec"));
    assert_eq!(running.len(), 2, "two groups' run dirs: {running:?}");
    kill(Pid::from_raw(child.0.id() as i32), Sig::SIGINT).unwrap();
    // The first signal must be handled as the first (two pending SIGINTs would merge
    // into one): its handler says so before the second is sent.
    assert!(
        wait_file_contains(&err, "interrupted: aborting", Duration::from_secs(20)),
        "the first Ctrl-C was never handled"
    );
    let t = Instant::now();
    kill(Pid::from_raw(child.0.id() as i32), Sig::SIGINT).unwrap();
    let gone = wait_gone(&pids, Duration::from_secs(1));
    let killed = t.elapsed();
    let status = wait_exit(&mut child.0, Duration::from_secs(30));
    eprintln!(
        "second Ctrl-C to every rank gone: {:.1} ms; to exit: {:.1} ms",
        killed.as_secs_f64() * 1e3,
        t.elapsed().as_secs_f64() * 1e3
    );
    assert_eq!(status.code(), Some(130));
    if let Err(alive) = gone {
        panic!("ranks {alive:?} survived the second Ctrl-C");
    }
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(ws.path().join("summary.json")).expect("summary.json written"),
    )
    .unwrap();
    eprintln!("summary status: {}", summary["status"]);
    assert_eq!(summary["status"], "interrupted");
    assert_eq!(
        entries(&xdg.path().join("rankexec")),
        Vec::<String>::new(),
        "run directories left"
    );
}
