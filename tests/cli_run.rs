//! `rankexec run` as a new user meets it: it works without a separately built worker,
//! it is quiet unless asked, its rank logs go to a private temporary directory that it
//! removes (and keeps, saying where, when a round failed), and Ctrl-C or SIGTERM stop it
//! cleanly: the first aborts and tears the group down (exit 130), the second kills every
//! rank at once. Each leaves no process and no run directory.

mod common;

use std::io::{BufRead as _, BufReader};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::{Signal as Sig, kill};
use nix::unistd::Pid;

/// A copy of `rankexec` alone in a directory: no `rankexec-worker` next to it.
fn lone_rankexec() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("rankexec");
    std::fs::copy(rankexec_bin(), &bin).unwrap();
    (dir, bin)
}

/// `rankexec run` with a private TMPDIR and XDG_RUNTIME_DIR (so what it leaves is
/// visible) and a PATH without the build directory.
fn run_cmd(bin: &Path, tmp: &Path, xdg: &Path) -> Command {
    let mut c = Command::new(bin);
    c.arg("run")
        .env("TMPDIR", tmp)
        .env("XDG_RUNTIME_DIR", xdg)
        .env("PATH", "/usr/bin:/bin")
        .env_remove("RANKEXEC_LOG")
        .env_remove("RUST_LOG");
    c
}

#[test]
fn run_works_without_a_built_worker_and_is_quiet() {
    let (_d, bin) = lone_rankexec();
    let (tmp, xdg) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let out = run_cmd(&bin, tmp.path(), xdg.path())
        .args([
            "-n",
            "4",
            "--component",
            "Echo",
            "--meta",
            r#"{"x": 5}"#,
            "--rounds",
            "3",
        ])
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    eprintln!("stdout:\n{stdout}stderr:\n{stderr}");
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains(r#"round 2: ok in"#) && stdout.contains(r#"{"rank":0,"round":2,"x":5}"#),
        "{stdout}"
    );
    assert_eq!(stderr, "", "nothing on stderr by default");
    let logs = stdout
        .lines()
        .find_map(|l| l.strip_prefix("rank logs: "))
        .unwrap_or_else(|| panic!("where the rank logs go: {stdout}"));
    assert!(
        logs.starts_with(&tmp.path().join("rankexec-run-").display().to_string())
            && logs.ends_with(" (removed at exit unless a round fails)"),
        "{logs}"
    );
    // The temporary log directory is gone, and nothing went to a shared place.
    assert_eq!(entries(tmp.path()), Vec::<String>::new());
    assert_eq!(entries(&xdg.path().join("rankexec")), Vec::<String>::new());

    let out = run_cmd(&bin, tmp.path(), xdg.path())
        .args(["-v", "-n", "2", "--rounds", "1"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success());
    assert!(stderr.contains("INFO"), "-v shows info lines: {stderr}");
    assert!(stderr.contains("ranks run `rankexec worker`"), "{stderr}");
    let rank_line = stderr
        .lines()
        .find(|l| l.contains("rank{rank=0}: rank ready"))
        .unwrap_or_else(|| panic!("the ranks' lines: {stderr}"));
    assert_eq!(
        rank_line.matches("INFO").count(),
        1,
        "one level: {rank_line}"
    );
    assert_eq!(
        rank_line.matches("Z ").count(),
        1,
        "one timestamp: {rank_line}"
    );
}

#[test]
fn a_failed_round_keeps_the_private_rank_logs_and_says_where() {
    let (tmp, xdg) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let out = run_cmd(&rankexec_bin(), tmp.path(), xdg.path())
        .args([
            "-n",
            "3",
            "--component",
            "Exit",
            "--args",
            r#"{"ranks": [1], "code": 7}"#,
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}");
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    let kept = stdout
        .lines()
        .find_map(|l| l.strip_prefix("rank logs kept in "))
        .unwrap_or_else(|| panic!("no log path in {stdout}"));
    let kept = Path::new(kept);
    assert!(kept.starts_with(tmp.path()), "{}", kept.display());
    let mode = std::fs::metadata(kept).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700, "the log directory is private");
    assert!(kept.join("rank-1/stderr.log").exists());
    assert_eq!(entries(&xdg.path().join("rankexec")), Vec::<String>::new());
}

#[test]
fn a_rank_error_is_printed_once() {
    let (tmp, xdg) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let out = run_cmd(&rankexec_bin(), tmp.path(), xdg.path())
        .args(["-n", "2", "--component", "Fail", "--args"])
        .arg(r#"{"ranks": [1], "message": "bad batch on purpose"}"#)
        .output()
        .unwrap();
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{all}");
    assert_eq!(out.status.code(), Some(1), "{all}");
    assert!(all.contains("round 0: failed: rank 1 failed"), "{all}");
    assert_eq!(
        all.matches("bad batch on purpose").count(),
        1,
        "the rank's error once, not repeated by a log line and a report: {all}"
    );
}

/// What a child wrote to stderr so far (read on a thread), and whether the thread has
/// read to the end.
#[derive(Clone, Default)]
struct Stderr(Arc<Mutex<String>>, Arc<AtomicBool>);

impl Stderr {
    fn text(&self) -> String {
        self.0.lock().unwrap().clone()
    }

    /// All of it: waits until the reader has seen the end of the pipe. The child having
    /// exited is not enough: on a loaded machine its last lines may still be unread.
    fn all(&self, within: Duration) -> String {
        let start = Instant::now();
        while !self.1.load(Ordering::Acquire) && start.elapsed() < within {
            std::thread::sleep(Duration::from_millis(10));
        }
        self.text()
    }

    /// Waits until the text contains `needle`.
    fn wait_for(&self, needle: &str, within: Duration) -> bool {
        let start = Instant::now();
        while start.elapsed() < within {
            if self.text().contains(needle) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }
}

/// Starts `run` on ranks that sleep, through `sh` with SIGINT ignored when asked (a
/// script's background job); returns the child, its rank pids and its stderr.
fn start_sleepers(
    config: &Path,
    tmp: &Path,
    xdg: &Path,
    ignore_sigint: bool,
) -> (std::process::Child, Vec<u32>, Stderr) {
    let trap = if ignore_sigint { "trap '' INT; " } else { "" };
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(format!("{trap}exec \"$0\" \"$@\""))
        .arg(rankexec_bin())
        .arg("run")
        .arg("--config")
        .arg(config)
        .args(["--task", "train", "--print-pids"])
        .env("TMPDIR", tmp)
        .env("XDG_RUNTIME_DIR", xdg)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let err = Stderr::default();
    let mut from = BufReader::new(child.stderr.take().unwrap());
    let to = err.clone();
    std::thread::spawn(move || {
        let mut line = String::new();
        while from.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
            to.0.lock().unwrap().push_str(&line);
            line.clear();
        }
        to.1.store(true, Ordering::Release);
    });
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let pids: Vec<u32> = loop {
        match lines.next() {
            Some(Ok(l)) => {
                if let Some(p) = l.strip_prefix("pids: ") {
                    break p.split(' ').map(|x| x.parse().unwrap()).collect();
                }
            }
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the group never reported its pids");
            }
        }
    };
    // The rest of stdout is read on a thread so the child never blocks on it.
    std::thread::spawn(move || lines.for_each(drop));
    (child, pids, err)
}

fn sleeper_config(dir: &Path, rank_args: &str, grace: &str) -> PathBuf {
    let p = dir.join("executor.json");
    std::fs::write(
        &p,
        format!(
            r#"{{"executor_id": "s", "num_of_processes": 2,
                "deadlines": {{"abort_grace": "{grace}", "shutdown_grace": "{grace}", "term_grace": "{grace}"}},
                "components": [{{"id": "s", "path": "Sleep", "args": {rank_args}}}]}}"#
        ),
    )
    .unwrap();
    p
}

/// Waits until the rank runs its task (its log says so).
fn wait_task_started(tmp: &Path) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(30) {
        for d in entries(tmp) {
            let log = tmp.join(d).join("rank-0/stderr.log");
            if std::fs::read_to_string(log)
                .map(|t| t.contains("sleeping"))
                .unwrap_or(false)
            {
                return;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("the task never started");
}

#[test]
fn sigterm_with_sigint_ignored_aborts_cleanly() {
    let (dir, tmp, xdg) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let cfg = sleeper_config(dir.path(), r#"{"secs": 600}"#, "2s");
    let (child, pids, err) = start_sleepers(&cfg, tmp.path(), xdg.path(), true);
    let mut child = Reaper(child);
    // A run dir while running, and nothing else (the MASTER_PORT reservation is an
    // abstract socket name, no file).
    let running = entries(&xdg.path().join("rankexec"));
    assert_eq!(running.len(), 1, "a run dir while running: {running:?}");
    wait_task_started(tmp.path());
    let t = Instant::now();
    kill(Pid::from_raw(child.0.id() as i32), Sig::SIGTERM).unwrap();
    let status = wait_exit(&mut child.0, Duration::from_secs(60));
    let stderr = err.all(Duration::from_secs(60));
    eprintln!(
        "SIGTERM to exit: {:.1} ms, status {status:?}\nstderr: {stderr}",
        t.elapsed().as_secs_f64() * 1e3
    );
    assert_eq!(status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("interrupted: aborting"), "{stderr}");
    assert_gone(&pids, "ranks after SIGTERM");
    assert_eq!(
        entries(&xdg.path().join("rankexec")),
        Vec::<String>::new(),
        "run dir left"
    );
    assert_eq!(
        entries(tmp.path()),
        Vec::<String>::new(),
        "temporary logs left"
    );
}

#[test]
fn second_ctrl_c_kills_every_rank_and_leaves_nothing() {
    let (dir, tmp, xdg) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    // Ranks that ignore aborts and SIGTERM, with long graces: only the second signal
    // ends this quickly.
    let cfg = sleeper_config(
        dir.path(),
        r#"{"secs": 600, "ignore_abort": true, "ignore_sigterm": true}"#,
        "60s",
    );
    let (child, pids, err) = start_sleepers(&cfg, tmp.path(), xdg.path(), false);
    let mut child = Reaper(child);
    wait_task_started(tmp.path());
    let pid = Pid::from_raw(child.0.id() as i32);
    kill(pid, Sig::SIGINT).unwrap();
    // The second press once the first was seen.
    assert!(
        err.wait_for("interrupted: aborting", Duration::from_secs(60)),
        "{}",
        err.text()
    );
    let t = Instant::now();
    kill(pid, Sig::SIGINT).unwrap();
    let status = wait_exit(&mut child.0, Duration::from_secs(30));
    let gone = wait_gone(&pids, Duration::from_secs(30));
    eprintln!(
        "second Ctrl-C to exit: {:.1} ms, status {status:?}",
        t.elapsed().as_secs_f64() * 1e3
    );
    assert_eq!(status.code(), Some(130), "{}", err.text());
    if let Err(alive) = gone {
        panic!("ranks {alive:?} survived the second Ctrl-C");
    }
    assert_eq!(
        entries(&xdg.path().join("rankexec")),
        Vec::<String>::new(),
        "run dir left"
    );
}
