//! Ranks start with a clean signal state, however the host was started. A host started
//! as a script's background job (`cmd &`) ignores `SIGINT` and `SIGQUIT`, and a host
//! embedded in a larger program may block signals; `exec` keeps both, so every rank
//! used to ignore Ctrl-C (and Python ranks then raised no `KeyboardInterrupt`). The
//! test starts the host that way and reads each rank's dispositions from
//! `/proc/PID/status`, for the builtin launcher and for a command launcher.
//!
//! The masks are read the moment the host reports the group ready, so "ready" must mean
//! the rank's signal state is final: glibc's `pthread_create` blocks every signal in
//! the calling thread until the new thread exists, and a rank used to start its service
//! threads after it acknowledged `Init`, so its main thread could still read as
//! `SigBlk: fffffffffffbfeff` here (issue 32; reproduced every time with the rank's
//! `clone3` delayed by `strace -e inject=clone3:delay_exit=...`). Ranks now start
//! those threads first; the last test holds every `clone3` to show it.

mod common;

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::{Command, Stdio};

use common::*;
use nix::sys::signal::{Signal as Sig, kill};
use nix::unistd::Pid;

/// A line of `/proc/PID/status` (`SigIgn`, `SigBlk`, `Threads`), as a number in
/// `radix`; every field comes from one read of the file.
fn field(status: &str, name: &str, radix: u32) -> u64 {
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name}:")))
        .unwrap_or_else(|| panic!("no {name} in {status}"));
    u64::from_str_radix(line.trim(), radix).unwrap()
}

fn status(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap()
}

fn bit(sig: i32) -> u64 {
    1 << (sig - 1)
}

/// A host started for a check, and its ranks; all killed when dropped, so a failing
/// check leaves no process behind.
struct Started {
    /// The host's pid (the child's own, or the traced host under a wrapper).
    host: u32,
    ranks: Vec<u32>,
    // Dropped in this order: the ranks, the host under a wrapper, the child.
    _ranks: Held,
    _wrapped: Held,
    child: Reaper,
}

/// Starts `rankexec run` with SIGINT and SIGQUIT ignored and SIGUSR1 blocked (as `sh`
/// does for `cmd &`, plus a blocked signal), under `wrap` (a command prefix, or none),
/// and waits until it reports its group ready and prints its ranks' pids.
fn start_host(wrap: &[&str], extra: &[&str], logs: &Path) -> Started {
    let rankexec = rankexec_bin();
    let mut argv: Vec<&std::ffi::OsStr> = wrap.iter().map(|a| a.as_ref()).collect();
    argv.push(rankexec.as_os_str());
    let mut cmd = Command::new(argv[0]);
    cmd.args(&argv[1..])
        .args(["run", "--task", "t", "--print-pids", "--log-dir"])
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
    let mut child = Reaper(cmd.spawn().unwrap());
    let out = child.0.stdout.take().unwrap();
    let host = if wrap.is_empty() {
        child.0.id()
    } else {
        // The wrapper (strace) started the host as its only child; it has printed, so
        // it is there.
        let me = child.0.id();
        let kids = std::fs::read_to_string(format!("/proc/{me}/task/{me}/children"));
        kids.unwrap_or_default()
            .split_whitespace()
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or(me)
    };
    let wrapped = Held::new(if wrap.is_empty() {
        &[][..]
    } else {
        std::slice::from_ref(&host)
    });
    let mut lines = BufReader::new(out).lines();
    let ranks: Vec<u32> = loop {
        let line = lines.next().expect("the host printed its pids").unwrap();
        if let Some(rest) = line.strip_prefix("pids: ") {
            break rest.split(' ').map(|p| p.parse().unwrap()).collect();
        }
    };
    // The host is alive and has not reaped them: these pids are its ranks.
    let held = Held::new(&ranks);
    assert_eq!(
        held.pids(),
        ranks,
        "every rank is alive when the host says ready"
    );
    Started {
        host,
        ranks,
        _ranks: held,
        _wrapped: wrapped,
        child,
    }
}

/// Each rank's masks, read once the host reported the group ready.
fn rank_masks(s: &Started, what: &str) -> Vec<(u32, u64, u64)> {
    s.ranks
        .iter()
        .map(|&pid| {
            let st = status(pid);
            let (ign, blk) = (field(&st, "SigIgn", 16), field(&st, "SigBlk", 16));
            let threads = field(&st, "Threads", 10);
            eprintln!("{what}: rank pid {pid}: SigIgn {ign:#x} SigBlk {blk:#x} Threads {threads}");
            (pid, ign, blk)
        })
        .collect()
}

/// SIGKILLs the host, then waits for its ranks to leave on their own.
fn stop(mut s: Started) {
    kill(Pid::from_raw(s.host as i32), Sig::SIGKILL).unwrap();
    if s.host == s.child.0.id() {
        let _ = s.child.0.wait();
    }
    assert_gone(&s.ranks, "ranks after the host");
}

fn check(extra: &[&str], what: &str) {
    let logs = tempfile::tempdir().unwrap();
    let started = start_host(&[], extra, logs.path());
    let host_ign = field(&status(started.host), "SigIgn", 16);
    // `rankexec run` catches SIGINT itself (exec resets a caught signal), but keeps
    // SIGQUIT ignored: the premise that ranks could inherit.
    assert_ne!(
        host_ign & bit(libc::SIGQUIT),
        0,
        "the host itself ignores SIGQUIT (the test's premise); host SigIgn {host_ign:#x}"
    );
    for (pid, ign, blk) in rank_masks(&started, what) {
        for sig in [libc::SIGINT, libc::SIGQUIT] {
            assert_eq!(ign & bit(sig), 0, "{what}: rank {pid} ignores signal {sig}");
        }
        assert_eq!(
            blk & bit(libc::SIGUSR1),
            0,
            "{what}: rank {pid} blocks SIGUSR1"
        );
    }
    stop(started);
}

/// Ready means the rank's signal mask is final: with every `clone3` of the host and its
/// ranks held 100 ms on its way out (strace's fault injection), so that a thread
/// started after ready would leave the main thread inside `pthread_create` with every
/// signal blocked when the host reports ready, each rank blocks nothing. Before the
/// fix every read was `0xfffffffffffbfeff` (20 of 20); skipped without `strace`.
#[test]
fn ranks_are_ready_with_their_final_mask_when_threads_start_slowly() {
    let strace = std::process::Command::new("strace")
        .arg("-V")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !strace.is_ok_and(|s| s.success()) {
        eprintln!("SKIPPED: strace is not installed (apt-get install strace)");
        return;
    }
    let logs = tempfile::tempdir().unwrap();
    let trace = logs.path().join("strace.out");
    let trace = trace.to_str().unwrap();
    let wrap = [
        "strace",
        "-f",
        "-o",
        trace,
        "-e",
        "trace=clone3",
        "-e",
        "inject=clone3:delay_exit=100000",
    ];
    let extra = [
        "-n",
        "2",
        "--component",
        "Sleep",
        "--args",
        r#"{"secs": 120}"#,
    ];
    let started = start_host(&wrap, &extra, logs.path());
    for (pid, _, blk) in rank_masks(&started, "slow clone3") {
        assert_eq!(
            blk, 0,
            "rank {pid} reported ready with signals blocked (SigBlk {blk:#x})"
        );
    }
    // The ranks and the host are killed through their pidfds; strace then reaps the
    // host and exits (killing strace first would leave the host a zombie for init).
    // A host's death under a tracer is not what this test is about.
    let Started {
        ranks,
        _ranks,
        _wrapped,
        mut child,
        ..
    } = started;
    drop(_ranks);
    drop(_wrapped);
    wait_exit(&mut child.0, DIE_TIME);
    assert_gone(&ranks, "ranks killed with their traced host");
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
