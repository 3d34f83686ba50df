//! Ranks start with a clean signal state, however the host was started. A host started
//! as a script's background job (`cmd &`) ignores `SIGINT` and `SIGQUIT`, and a host
//! embedded in a larger program may block signals; `exec` keeps both, so every rank
//! used to ignore Ctrl-C (and Python ranks then raised no `KeyboardInterrupt`). The
//! test starts the host that way and reads each rank's dispositions from
//! `/proc/PID/status`, for the builtin launcher and for a command launcher.

mod common;

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::{Command, Stdio};

use common::*;
use nix::sys::signal::{Signal as Sig, kill};
use nix::unistd::Pid;

/// A signal mask line of `/proc/PID/status` (`SigIgn`, `SigBlk`), as bits.
fn mask(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"));
    u64::from_str_radix(line.trim(), 16).unwrap()
}

fn bit(sig: i32) -> u64 {
    1 << (sig - 1)
}

/// Starts `rankexec run` with SIGINT and SIGQUIT ignored and SIGUSR1 blocked (as `sh`
/// does for `cmd &`, plus a blocked signal), returns it and its ranks' pids.
fn start_host(extra: &[&str], logs: &Path) -> (std::process::Child, Vec<u32>) {
    let mut cmd = Command::new(rankexec_bin());
    cmd.args(["run", "--task", "t", "--print-pids", "--log-dir"])
        .arg(logs)
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    // SAFETY: runs between fork and exec; `sigaction` and `sigprocmask` are
    // async-signal-safe and only touch values on this closure's stack.
    unsafe {
        cmd.pre_exec(|| {
            let mut ign: libc::sigaction = std::mem::zeroed();
            ign.sa_sigaction = libc::SIG_IGN;
            libc::sigaction(libc::SIGINT, &ign, std::ptr::null_mut());
            libc::sigaction(libc::SIGQUIT, &ign, std::ptr::null_mut());
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGUSR1);
            libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            Ok(())
        });
    }
    let mut host = cmd.spawn().unwrap();
    let mut lines = BufReader::new(host.stdout.take().unwrap()).lines();
    let pids = loop {
        let line = lines.next().expect("the host printed its pids").unwrap();
        if let Some(rest) = line.strip_prefix("pids: ") {
            break rest.split(' ').map(|p| p.parse().unwrap()).collect();
        }
    };
    (host, pids)
}

fn check(extra: &[&str], what: &str) {
    let logs = tempfile::tempdir().unwrap();
    let (mut host, pids) = start_host(extra, logs.path());
    let host_ign = mask(host.id(), "SigIgn");
    // `rankexec run` catches SIGINT itself (exec resets a caught signal), but keeps
    // SIGQUIT ignored: the premise that ranks could inherit.
    assert_ne!(
        host_ign & bit(libc::SIGQUIT),
        0,
        "the host itself ignores SIGQUIT (the test's premise)"
    );
    for pid in &pids {
        let (ign, blk) = (mask(*pid, "SigIgn"), mask(*pid, "SigBlk"));
        eprintln!(
            "{what}: host SigIgn {host_ign:#x}; rank pid {pid}: SigIgn {ign:#x} SigBlk {blk:#x}"
        );
        for sig in [libc::SIGINT, libc::SIGQUIT] {
            assert_eq!(ign & bit(sig), 0, "{what}: rank {pid} ignores signal {sig}");
        }
        assert_eq!(
            blk & bit(libc::SIGUSR1),
            0,
            "{what}: rank {pid} blocks SIGUSR1"
        );
    }
    kill(Pid::from_raw(host.id() as i32), Sig::SIGKILL).unwrap();
    let _ = host.wait();
    assert_gone(&pids, "ranks after the host");
}

#[test]
fn builtin_ranks_of_a_background_host_take_ctrl_c() {
    check(
        &[
            "-n",
            "2",
            "--component",
            "Sleep",
            "--args",
            r#"{"secs": 120}"#,
        ],
        "builtin",
    );
}

#[test]
fn launched_ranks_of_a_background_host_take_ctrl_c() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = serde_json::json!({
        "executor_id": "e",
        "num_of_processes": 1,
        "components": [{"id": "e", "path": "Sleep", "args": {"secs": 120}}],
        "worker": {"program": worker_bin()},
        "launcher": {"command": {"argv": ["env", "RANK=0", "WORLD_SIZE=1", "{program}", "{args}"], "rank_source": "torchrun"}}
    });
    let path = dir.path().join("cfg.json");
    std::fs::write(&path, cfg.to_string()).unwrap();
    check(&["--config", path.to_str().unwrap()], "command launcher");
}
