//! The host process is SIGKILLed: every rank disappears within a second, whether the
//! kernel's parent-death signal or the connection's end of file tells it, and whether
//! the rank is idle or inside a task (its service threads notice; a closed stderr does
//! not stop them).

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::{Signal as Sig, kill};
use nix::unistd::Pid;

/// The host and its ranks, each killed when dropped (a failing check leaves none).
struct Host {
    child: Reaper,
    _ranks: Held,
}

fn spawn_host(extra: &[&str]) -> (Host, Vec<u32>, PathBuf) {
    let logs = tempfile::tempdir().unwrap().keep();
    let mut child = Reaper(
        Command::new(rankexec_bin())
            .args(["run", "--task", "t", "--print-pids", "--log-dir"])
            .arg(&logs)
            .args(extra)
            .env("RANKEXEC_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let out = child.0.stdout.take().unwrap();
    let mut lines = BufReader::new(out).lines();
    let pids = loop {
        let line = lines.next().expect("host printed its pids").unwrap();
        if let Some(rest) = line.strip_prefix("pids: ") {
            break rest
                .split(' ')
                .map(|p| p.parse().unwrap())
                .collect::<Vec<u32>>();
        }
    };
    // The host is alive and has not reaped them: these pids are its ranks.
    let ranks = Held::new(&pids);
    (
        Host {
            child,
            _ranks: ranks,
        },
        pids,
        logs,
    )
}

/// Waits (bounded) until the rank's stderr log (the launcher's, for a launched rank)
/// shows it inside its `Sleep` task.
fn wait_in_task(logs: &Path) {
    let file = logs.join("launcher/stderr.log");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !std::fs::read_to_string(&file).is_ok_and(|t| t.contains("sleeping")) {
        assert!(Instant::now() < deadline, "rank 0 never started its task");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn kill_host_and_time(mut host: Host, pids: &[u32]) -> Duration {
    for p in pids {
        assert!(pid_alive(*p), "rank {p} runs before the kill");
    }
    let t = Instant::now();
    kill(Pid::from_raw(host.child.0.id() as i32), Sig::SIGKILL).unwrap();
    let _ = host.child.0.wait();
    match wait_gone(pids, Duration::from_secs(1)) {
        Ok(_) => t.elapsed(),
        Err(alive) => panic!("ranks {alive:?} outlived the host by more than 1 s"),
    }
}

/// One `Sleep` rank started by a command launcher (`sh`, which runs it as its child): the
/// rank is not our child and is told no parent pid, so no `PR_SET_PDEATHSIG` (the
/// launcher's, `SIGTERM`, is not inherited by a forked child); only its connections
/// closing can tell it the host is gone.
fn eof_only_config(dir: &Path) -> PathBuf {
    let cfg = serde_json::json!({
        "executor_id": "e",
        "num_of_processes": 1,
        "components": [{"id": "e", "path": "Sleep", "args": {"secs": 120}}],
        "worker": {"program": worker_bin()},
        "launcher": {"command": {"argv": ["sh", "-c", "\"$@\"; exit $?", "sh", "env", "RANK=0", "WORLD_SIZE=1", "{program}", "{args}"], "rank_source": "torchrun"}}
    });
    let path = dir.join("cfg.json");
    std::fs::write(&path, cfg.to_string()).unwrap();
    path
}

#[test]
fn ranks_die_with_the_host_builtin_launcher() {
    let (host, pids, _) = spawn_host(&[
        "-n",
        "4",
        "--component",
        "Sleep",
        "--args",
        r#"{"secs": 120}"#,
    ]);
    assert_eq!(pids.len(), 4);
    let took = kill_host_and_time(host, &pids);
    eprintln!(
        "4 ranks gone {:.1} ms after SIGKILL of the host (PR_SET_PDEATHSIG + EOF)",
        took.as_secs_f64() * 1e3
    );
}

#[test]
fn ranks_die_with_the_host_by_end_of_file_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = eof_only_config(dir.path());
    let (host, pids, _) = spawn_host(&["--config", path.to_str().unwrap()]);
    assert_eq!(pids.len(), 2, "the launcher and its rank");
    let took = kill_host_and_time(host, &pids);
    eprintln!(
        "rank gone {:.1} ms after SIGKILL of the host (EOF only)",
        took.as_secs_f64() * 1e3
    );
}

#[test]
fn rank_inside_a_task_dies_with_the_host_by_end_of_file_alone() {
    // The rank's main thread is inside a 120 s task, so only its service threads can see
    // the connections close; they log to a stderr whose reader (the host) is dead.
    let dir = tempfile::tempdir().unwrap();
    let path = eof_only_config(dir.path());
    let (host, pids, logs) = spawn_host(&["--config", path.to_str().unwrap()]);
    wait_in_task(&logs);
    let took = kill_host_and_time(host, &pids);
    eprintln!(
        "rank inside a task gone {:.1} ms after SIGKILL of the host (EOF only)",
        took.as_secs_f64() * 1e3
    );
}
