//! Teardown signals only processes the OS vouches for. A rank's hello claims a pid and
//! a process group; a rank that lies (or runs on another host) must not get an
//! unrelated local process killed. And the executor refuses to spawn while `SIGCHLD`
//! is ignored, since the kernel would then reap ranks behind its back.

mod common;

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use rankexec::executor::{
    Dur, ExecutorConfig, LauncherConfig, MultiProcessExecutor, TransportConfig,
};
use rankexec::protocol::FlComponent;
use rankexec::protocol::wire::{Channel, Endpoint, Identity, Secret, client_handshake};
use rankexec::protocol::{EventType, FlContext};

/// One log capture for the whole test binary (the subscriber is global).
fn log() -> &'static LogCapture {
    static LOG: std::sync::OnceLock<LogCapture> = std::sync::OnceLock::new();
    LOG.get_or_init(LogCapture::install)
}

/// A one-rank group whose "launcher" only writes its environment and sleeps: the test
/// itself plays rank 0, with a forged hello.
fn forged_config(dir: &Path, transport: TransportConfig) -> ExecutorConfig {
    let mut c = config(1, "Echo", serde_json::json!({}), dir);
    c.launcher = LauncherConfig::Command {
        argv: vec![
            "sh".into(),
            "-c".into(),
            format!(
                "echo $$ > {d}/launcher.pid; env > {d}/launcher.env.tmp; mv {d}/launcher.env.tmp {d}/launcher.env; exec sleep 120",
                d = dir.display()
            ),
            // `$0` of the script: the worker is never run.
            "{program}".into(),
        ],
        rank_source: Some("torchrun".into()),
    };
    c.transport = transport;
    c.deadlines.startup = Dur(Duration::from_secs(4));
    c.deadlines.term_grace = Dur(Duration::from_secs(1));
    c.restart.max_restarts = 0;
    c
}

fn wait_file(path: &Path) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(t) = std::fs::read_to_string(path) {
            return t;
        }
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Plays rank 0 claiming to be `victim` (its pid and its process group).
fn forge_rank(dir: &Path, victim: u32) -> rankexec::protocol::wire::Conn {
    let env = wait_file(&dir.join("launcher.env"));
    let var = |k: &str| {
        env.lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")))
            .unwrap_or_else(|| panic!("{k} in the launcher's environment"))
            .to_owned()
    };
    let endpoint: Endpoint = var("RANKEXEC_ENDPOINT").parse().unwrap();
    let secret = Secret::from_hex(&var("RANKEXEC_SECRET")).unwrap();
    let conn = endpoint.connect(Duration::from_secs(5)).unwrap();
    let who = Identity {
        channel: Channel::Exec,
        rank: 0,
        world_size: 1,
        launch_id: var("RANKEXEC_LAUNCH_ID"),
        pid: victim,
        pgid: victim,
        host: "elsewhere".into(),
    };
    client_handshake(&conn, &secret, &who, Duration::from_secs(5)).unwrap();
    conn
}

fn lying_rank_does_not_get_a_bystander_killed(transport: TransportConfig, what: &str) {
    let _serial = serial();
    let log = log();
    let seen = log.text().len();
    let dir = tempfile::tempdir().unwrap();
    // The bystander: an unrelated process of ours, leader of its own group.
    let mut victim = Command::new("sleep")
        .arg("120")
        .process_group(0)
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let victim_pid = victim.id();
    let exec = Arc::new(MultiProcessExecutor::new(forged_config(dir.path(), transport)).unwrap());
    let e2 = exec.clone();
    let starting = std::thread::spawn(move || {
        let mut ctx = FlContext::new();
        e2.handle_event(&EventType::START_RUN, &mut ctx)
    });
    let conn = forge_rank(dir.path(), victim_pid);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !log.text()[seen..].contains("rank connected") {
        assert!(
            Instant::now() < deadline,
            "the forged rank was admitted\n{}",
            log.text()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // The rank never answers Init: start-up times out and the group is torn down
    // (SIGTERM, then SIGKILL, to everything the executor tracks).
    let started = starting.join().unwrap();
    assert!(
        started.is_err(),
        "start-up cannot succeed without Init acks"
    );
    let launcher: u32 = wait_file(&dir.path().join("launcher.pid"))
        .trim()
        .parse()
        .unwrap();
    assert_gone(&[launcher], "the launcher is torn down");
    drop(conn);
    drop(exec);
    // Teardown signalled everything at once; the bystander would have gone with the
    // launcher. Give it the whole term grace and then some to be sure.
    let survived = wait_gone(&[victim_pid], Duration::from_secs(3)).is_err();
    let _ = victim.kill();
    let _ = victim.wait();
    assert!(
        survived,
        "{what}: pid {victim_pid}, claimed by a lying rank, was killed\n{}",
        log.text()
    );
    eprintln!("{what}: bystander pid {victim_pid} claimed by the forged hello survived teardown");
}

#[test]
fn a_lying_local_rank_cannot_name_a_process_to_kill() {
    // On a local socket the kernel names the peer (here: the test process itself, which
    // is the host and is never tracked); the claimed pid is ignored.
    lying_rank_does_not_get_a_bystander_killed(TransportConfig::Local, "local socket");
}

#[test]
fn a_remote_rank_is_never_signalled() {
    lying_rank_does_not_get_a_bystander_killed(
        TransportConfig::Tcp {
            bind: "127.0.0.1:0".into(),
            advertise: None,
        },
        "tcp",
    );
}

#[test]
fn refuses_to_spawn_while_sigchld_is_ignored() {
    // SIG_IGN survives `exec`: the host starts with SIGCHLD ignored, as under a parent
    // that ignores it (shells do not reliably pass on `trap '' CHLD`).
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new("python3")
        .arg("-c")
        .arg("import os, signal, sys; signal.signal(signal.SIGCHLD, signal.SIG_IGN); os.execv(sys.argv[1], sys.argv[1:])")
        .arg(rankexec_bin())
        .args(["run", "-n", "1", "--component", "Echo", "--log-dir"])
        .arg(dir.path())
        .env("RANKEXEC_LOG", "warn")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "the host must refuse: {text}");
    assert!(
        text.contains("SIGCHLD is ignored"),
        "the error says why: {text}"
    );
    let line = text
        .lines()
        .find(|l| l.contains("SIGCHLD"))
        .unwrap_or_default();
    eprintln!("host with SIGCHLD ignored: {line}");
}
