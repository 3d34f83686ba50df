//! The host is SIGKILLed while every core is busy: its ranks leave anyway, under each
//! launcher this machine has (the built-in one always; torchrun and mpirun when they
//! are installed; srun is in `tests/slurm.rs`, under its cluster), and so does the
//! launcher, which the kernel tells of the host's death (`PR_SET_PDEATHSIG`, `SIGTERM`).
//! A rank whose stdout and stderr go to a reader that stopped reading (a full pipe)
//! leaves too: its last log line is never waited for long.
//!
//! The busy processes are this test's children, killed and reaped when it ends (pass or
//! fail). Deadlines are generous (10 s for the ranks): the figures are printed, and
//! measured in BENCHMARKS.md (`benchmarks/host_death.py`), never asserted.

mod common;

use std::io::{BufRead, BufReader};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::{Signal as Sig, kill};
use nix::unistd::Pid;
use rankexec::executor::{ExecutorConfig, LauncherConfig};

/// How long the ranks may take to leave after the host's SIGKILL (they take
/// milliseconds; this bounds a broken build, not a slow machine).
const RANKS_GONE: Duration = Duration::from_secs(10);
/// How long the launcher may take (torchrun's Python needs CPU time to stop).
const LAUNCHER_GONE: Duration = Duration::from_secs(30);

/// Whether `pid` runs the worker binary.
fn is_rank(pid: u32) -> bool {
    let want = std::fs::canonicalize(worker_bin()).unwrap_or_else(|_| worker_bin());
    std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|exe| exe == want)
}

/// A `rankexec run` host, SIGKILLed and reaped on drop if the test has not.
struct Host {
    child: Reaper,
    ranks: Vec<u32>,
    others: Vec<u32>,
}

/// Starts `rankexec run` with `cfg` and waits until `world` ranks are inside their task
/// (each logs `sleeping`), unless `in_task` is false.
fn start_host(cfg: &ExecutorConfig, dir: &Path, world: usize, in_task: bool) -> Host {
    let path = dir.join("cfg.json");
    std::fs::write(&path, serde_json::to_string(cfg).unwrap()).unwrap();
    let mut child = Reaper(
        Command::new(rankexec_bin())
            .args(["run", "--task", "t", "--print-pids", "--config"])
            .arg(&path)
            .env("RANKEXEC_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut lines = BufReader::new(child.0.stdout.take().unwrap()).lines();
    let pids: Vec<u32> = loop {
        let line = lines.next().expect("the host printed its pids").unwrap();
        if let Some(rest) = line.strip_prefix("pids: ") {
            break rest.split(' ').filter_map(|p| p.parse().ok()).collect();
        }
    };
    let (ranks, others): (Vec<u32>, Vec<u32>) = pids.into_iter().partition(|p| is_rank(*p));
    assert_eq!(ranks.len(), world, "ranks among the host's pids");
    if in_task {
        let logs = cfg.log_dir.clone().unwrap_or_else(|| dir.to_owned());
        let deadline = Instant::now() + Duration::from_secs(60);
        while count_in_files(&logs, "sleeping") < world {
            assert!(
                Instant::now() < deadline,
                "the ranks never started their task"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    Host {
        child,
        ranks,
        others,
    }
}

/// How often `needle` occurs in the files under `dir`.
fn count_in_files(dir: &Path, needle: &str) -> usize {
    let mut n = 0;
    let mut stack: Vec<PathBuf> = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if let Ok(text) = std::fs::read_to_string(&p) {
                n += text.matches(needle).count();
            }
        }
    }
    n
}

/// Waits for `pids` to go; on failure kills them (no process left by a failing test)
/// and panics.
fn expect_gone(pids: &[u32], within: Duration, what: &str) {
    match wait_gone(pids, within) {
        Ok(_) => {}
        Err(alive) => {
            for p in &alive {
                let _ = kill(Pid::from_raw(*p as i32), Sig::SIGKILL);
            }
            panic!("{what}: {alive:?} still alive {within:?} after the host's SIGKILL");
        }
    }
}

/// SIGKILLs the host with every core busy; returns how long its ranks and the rest of
/// its processes (the launcher) took to leave.
fn kill_under_load(mut host: Host, what: &str) -> (Duration, Duration) {
    let hogs = Hogs::start();
    let t = Instant::now();
    kill(Pid::from_raw(host.child.0.id() as i32), Sig::SIGKILL).unwrap();
    let _ = host.child.0.wait();
    expect_gone(&host.ranks, RANKS_GONE, &format!("{what}: ranks"));
    let ranks = t.elapsed();
    expect_gone(&host.others, LAUNCHER_GONE, &format!("{what}: launcher"));
    let all = t.elapsed();
    eprintln!(
        "{what}: host SIGKILLed with {} busy processes on {} cores: ranks {:?} gone in {:.1} ms, \
         launcher {:?} in {:.1} ms",
        hogs.count(),
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        host.ranks,
        ranks.as_secs_f64() * 1e3,
        host.others,
        all.as_secs_f64() * 1e3
    );
    (ranks, all)
}

fn sleep_config(dir: &Path) -> ExecutorConfig {
    let mut c = config(2, "Sleep", serde_json::json!({"secs": 120}), dir);
    c.restart.max_restarts = 0;
    c
}

/// The directory holding `prog`: beside `$RANKEXEC_TEST_PYTHON` for torchrun, else in
/// `PATH`.
fn find(prog: &str) -> Option<PathBuf> {
    if prog == "torchrun"
        && let Some(py) = std::env::var_os("RANKEXEC_TEST_PYTHON")
    {
        let dir = Path::new(&py).parent()?.to_path_buf();
        return dir.join(prog).is_file().then_some(dir);
    }
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .find(|d| d.join(prog).is_file())
}

#[test]
fn builtin_ranks_leave_a_sigkilled_host_on_a_busy_machine() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let host = start_host(&sleep_config(dir.path()), dir.path(), 2, true);
    kill_under_load(host, "builtin");
}

#[test]
fn torchrun_ranks_leave_a_sigkilled_host_on_a_busy_machine() {
    let Some(torch) = find("torchrun") else {
        eprintln!("SKIPPED: no torchrun (torch is absent; set RANKEXEC_TEST_PYTHON)");
        return;
    };
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = sleep_config(dir.path());
    cfg.launcher = LauncherConfig::Torchrun { extra_args: vec![] };
    let path = std::env::var("PATH").unwrap_or_default();
    cfg.env
        .set
        .insert("PATH".into(), format!("{}:{path}", torch.display()));
    let host = start_host(&cfg, dir.path(), 2, true);
    kill_under_load(host, "torchrun");
}

#[test]
fn mpirun_ranks_leave_a_sigkilled_host_on_a_busy_machine() {
    if find("mpirun").is_none() {
        eprintln!("SKIPPED: no mpirun (apt-get install openmpi-bin)");
        return;
    }
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = sleep_config(dir.path());
    let mut extra_args = vec!["--oversubscribe".to_owned()];
    if nix::unistd::geteuid().is_root() {
        extra_args.push("--allow-run-as-root".into());
    }
    cfg.launcher = LauncherConfig::Mpirun { extra_args };
    let host = start_host(&cfg, dir.path(), 2, true);
    kill_under_load(host, "mpirun");
}

/// The rank's stdout and stderr are a FIFO this test holds open and never reads, filled
/// before the rank starts: the rank's parting log line cannot be written. On main the
/// rank stayed blocked in that write (`anon_pipe_write`) after its host's SIGKILL,
/// forever; its service threads saw the end of file but never reached `_exit`. The rank
/// is a child of `sh` (the launcher, which the kernel SIGTERMs), so only its
/// connections can tell it.
#[test]
fn a_rank_whose_output_nobody_reads_still_leaves() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("out.fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
    // Held, never read: a reader that is alive and has stopped reading.
    let stalled = std::fs::File::options()
        .read(true)
        .custom_flags(nix::libc::O_NONBLOCK)
        .open(&fifo)
        .unwrap();
    let mut cfg = config(1, "Sleep", serde_json::json!({"secs": 120}), dir.path());
    cfg.restart.max_restarts = 0;
    // `dd` fills the pipe until it would block (whatever its size), then the rank runs
    // as the shell's child, logging only warnings (nothing until its parting line).
    let script = format!(
        "exec >{f} 2>&1; dd if=/dev/zero of=/dev/fd/1 bs=4096 count=4096 oflag=nonblock \
         2>/dev/null; \"$@\"; exit $?",
        f = fifo.display()
    );
    cfg.launcher = LauncherConfig::Command {
        argv: [
            "sh",
            "-c",
            &script,
            "sh",
            "env",
            "RANK=0",
            "WORLD_SIZE=1",
            "RANKEXEC_LOG=warn",
            "{program}",
            "{args}",
        ]
        .map(str::to_owned)
        .to_vec(),
        rank_source: Some("torchrun".into()),
    };
    let host = start_host(&cfg, dir.path(), 1, false);
    let (ranks, _) = kill_under_load(host, "rank with a full, unread stdout/stderr");
    drop(stalled);
    eprintln!(
        "a rank whose output nobody reads left {:.1} ms after its host's SIGKILL",
        ranks.as_secs_f64() * 1e3
    );
}
