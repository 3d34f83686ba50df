//! The real torchrun (`torchrun --no-python --nproc-per-node 2 ... rankexec-worker`) as the
//! launcher. torch 2.x starts every worker in a session of its own, so a signal to
//! torchrun's process group misses them: teardown must reach each worker itself. No
//! worker may outlive a finalize, an abort that ends in a kill, or a SIGKILLed host.
//!
//! torchrun is found next to `$RANKEXEC_TEST_PYTHON` (a Python with torch), else in
//! `PATH`. Without it each test prints why it is skipped and returns.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use rankexec::executor::{Dur, ExecutorConfig, LauncherConfig, MultiProcessExecutor};
use rankexec::protocol::{Shareable, Signal};

/// The directory holding torchrun, or why there is none.
fn torchrun_dir() -> Result<PathBuf, String> {
    if let Some(py) = std::env::var_os("RANKEXEC_TEST_PYTHON") {
        let dir = Path::new(&py)
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default();
        return if dir.join("torchrun").is_file() {
            Ok(dir)
        } else {
            Err(format!(
                "RANKEXEC_TEST_PYTHON={} has no torchrun beside it (torch is absent)",
                Path::new(&py).display()
            ))
        };
    }
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .find(|d| d.join("torchrun").is_file())
        .ok_or_else(|| {
            "torch is absent: no torchrun in PATH and RANKEXEC_TEST_PYTHON is not set".to_owned()
        })
}

macro_rules! torchrun_or_skip {
    () => {
        match torchrun_dir() {
            Ok(d) => d,
            Err(why) => {
                eprintln!("SKIPPED: {why}");
                return;
            }
        }
    };
}

fn torchrun_config(dir: &Path, torch: &Path, args: serde_json::Value) -> ExecutorConfig {
    let mut c = config(2, "Sleep", args, dir);
    c.launcher = LauncherConfig::Torchrun { extra_args: vec![] };
    // torchrun is Python that imports torch: over 30 s with the CPUs saturated.
    c.deadlines.startup = Dur(Duration::from_secs(300));
    let path = std::env::var("PATH").unwrap_or_default();
    c.env
        .set
        .insert("PATH".into(), format!("{}:{path}", torch.display()));
    c.restart.max_restarts = 0;
    c
}

fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let i = stat.rfind(')')?;
    Some(stat[i + 2..].split(' ').map(str::to_owned).collect())
}

/// Live children of `parent`.
fn children_of(parent: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if let Some(f) = stat_fields(pid)
            && f[1] == parent.to_string()
            && f[0] != "Z"
        {
            out.push(pid);
        }
    }
    out
}

/// The session of `pid` (field 6 of `/proc/PID/stat`).
fn session_of(pid: u32) -> Option<u32> {
    stat_fields(pid)?.get(3)?.parse().ok()
}

/// Waits until `launcher` has `n` children (torchrun's workers); returns them.
fn workers_of(launcher: u32, n: usize) -> Vec<u32> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let w = children_of(launcher);
        if w.len() == n {
            return w;
        }
        assert!(
            Instant::now() < deadline,
            "torchrun {launcher} has workers {w:?}, expected {n}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// torchrun, the one child of this test process started since `before`.
fn the_launcher(before: &[u32]) -> u32 {
    let now: Vec<u32> = child_pids()
        .into_iter()
        .filter(|p| !before.contains(p))
        .collect();
    assert_eq!(now.len(), 1, "one launcher process, got {now:?}");
    now[0]
}

fn assert_own_sessions(workers: &[u32]) {
    for w in workers {
        assert_eq!(
            session_of(*w),
            Some(*w),
            "torchrun starts worker {w} in a session of its own"
        );
    }
}

#[test]
fn no_torchrun_worker_outlives_finalize() {
    let torch = torchrun_or_skip!();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let before = child_pids();
    let exec = MultiProcessExecutor::new(torchrun_config(
        dir.path(),
        &torch,
        serde_json::json!({"secs": 0.01}),
    ))
    .unwrap();
    let mut ctx = start(&exec);
    exec.run_task("t", Shareable::new(), &mut ctx, &Signal::new())
        .unwrap();
    let launcher = the_launcher(&before);
    let workers = workers_of(launcher, 2);
    assert_own_sessions(&workers);
    let report = exec.finalize();
    let mut all = workers.clone();
    all.push(launcher);
    assert_gone(&all, "finalize");
    eprintln!(
        "finalize: torchrun {launcher} and workers {workers:?} (own sessions) gone; {report:?}"
    );
}

#[test]
fn no_torchrun_worker_outlives_an_abort_that_kills() {
    let torch = torchrun_or_skip!();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let before = child_pids();
    // Ranks that ignore both the abort and SIGTERM: only SIGKILL ends them.
    let exec = MultiProcessExecutor::new(torchrun_config(
        dir.path(),
        &torch,
        serde_json::json!({"secs": 120, "ignore_abort": true, "ignore_sigterm": true}),
    ))
    .unwrap();
    let mut ctx = start(&exec);
    let launcher = the_launcher(&before);
    let workers = workers_of(launcher, 2);
    assert_own_sessions(&workers);
    let (abort, fired) = abort_after(Duration::from_millis(300), "test abort");
    let out = exec.run_task("t", Shareable::new(), &mut ctx, &abort);
    let _ = fired.join();
    assert!(out.is_err(), "the task was aborted");
    let mut all = workers.clone();
    all.push(launcher);
    assert_gone(&all, "abort");
    eprintln!(
        "abort: {}; torchrun {launcher} and workers {workers:?} gone",
        chain(&out.unwrap_err())
    );
}

#[test]
fn no_torchrun_worker_outlives_a_sigkilled_host() {
    let torch = torchrun_or_skip!();
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let cfg = torchrun_config(dir.path(), &torch, serde_json::json!({"secs": 120}));
    let cfg_path = dir.path().join("cfg.json");
    std::fs::write(&cfg_path, serde_json::to_string(&cfg).unwrap()).unwrap();
    // Killed on any exit of this test, with torchrun and its workers (held below).
    let mut host = Reaper(
        Command::new(rankexec_bin())
            .args(["run", "--task", "t", "--print-pids", "--config"])
            .arg(&cfg_path)
            .env("RANKEXEC_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut lines = BufReader::new(host.0.stdout.take().unwrap()).lines();
    while !lines
        .next()
        .expect("the host printed its pids")
        .unwrap()
        .starts_with("pids: ")
    {}
    let launchers = children_of(host.0.id());
    let _launchers = Held::new(&launchers);
    assert_eq!(launchers.len(), 1, "one torchrun under the host");
    let launcher = launchers[0];
    let workers = workers_of(launcher, 2);
    let _workers = Held::new(&workers);
    assert_own_sessions(&workers);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(host.0.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let _ = host.0.wait();
    let t = Instant::now();
    assert_gone(&workers, "SIGKILL of the host (workers)");
    let workers_took = t.elapsed();
    assert_gone(&[launcher], "SIGKILL of the host (torchrun)");
    eprintln!(
        "host SIGKILLed: workers {workers:?} gone within {:.0} ms, torchrun {launcher} within {:.0} ms",
        workers_took.as_secs_f64() * 1e3,
        t.elapsed().as_secs_f64() * 1e3
    );
}
