//! An authenticated rank that breaks the protocol fails the group with a typed error
//! that names the rank, the channel and what it did. The test plays the rank itself.

mod common;

use std::io::Write as _;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use rankexec::executor::{ExecuteError, FailureCause, LauncherConfig, MultiProcessExecutor};
use rankexec::protocol::wire::message::{Channel, Message};
use rankexec::protocol::wire::{
    Conn, Endpoint, FrameLimits, Identity, Secret, client_handshake, envelope, frame,
};
use rankexec::protocol::{ErrorClass, FlContext, Shareable, Signal};

struct FakeRank {
    exec: Conn,
    _handle: Conn,
    _event: Conn,
}

/// Waits for the launched program's environment, then connects and initializes as rank 0.
fn fake_rank(dir: &Path) -> FakeRank {
    let env_file = dir.join("env");
    // The script writes the file whole (write, then rename).
    let start = Instant::now();
    while !env_file.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "launcher never started"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let env = std::fs::read_to_string(&env_file).unwrap();
    let var = |k: &str| {
        env.lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")))
            .unwrap()
            .to_owned()
    };
    let pid: u32 = std::fs::read_to_string(dir.join("pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let endpoint: Endpoint = var("RANKEXEC_ENDPOINT").parse().unwrap();
    let secret = Secret::from_hex(&var("RANKEXEC_SECRET")).unwrap();
    let connect = |channel| {
        let c = endpoint.connect(Duration::from_secs(5)).unwrap();
        let who = Identity {
            channel,
            rank: 0,
            world_size: 1,
            launch_id: var("RANKEXEC_LAUNCH_ID"),
            pid,
            pgid: pid,
            host: "fake".into(),
        };
        client_handshake(&c, &secret, &who, Duration::from_secs(5)).unwrap();
        c
    };
    let (exec, handle, event) = (
        connect(Channel::Exec),
        connect(Channel::Handle),
        connect(Channel::Event),
    );
    let f = frame::read_frame(&exec, &FrameLimits::for_max_frame(1 << 20)).unwrap();
    assert!(matches!(envelope::decode(&f).unwrap(), Message::Init(_)));
    envelope::plain(&Message::InitAck { result: Ok(()) })
        .unwrap()
        .write_to(&exec)
        .unwrap();
    FakeRank {
        exec,
        _handle: handle,
        _event: event,
    }
}

fn executor(dir: &Path) -> MultiProcessExecutor {
    let script = dir.join("rank.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\necho $$ > {d}/pid\nenv > {d}/env.tmp\nmv {d}/env.tmp {d}/env\nexec sleep 120\n",
            d = dir.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut cfg = config(1, "Echo", serde_json::json!({}), dir);
    cfg.worker.program = script.display().to_string();
    cfg.launcher = LauncherConfig::Command {
        argv: vec!["{program}".into()],
        rank_source: None,
    };
    MultiProcessExecutor::new(cfg).unwrap()
}

fn violate(bytes: impl FnOnce(&Conn)) -> (ExecuteError, Vec<u32>) {
    let dir = tempfile::tempdir().unwrap();
    let exec = executor(dir.path());
    let d = dir.path().to_owned();
    let rank = std::thread::spawn(move || fake_rank(&d));
    exec.start(&FlContext::new()).unwrap();
    let rank = rank.join().unwrap();
    let pids = exec.live_pids();
    bytes(&rank.exec);
    // The violation tears the group down; the next task reports why.
    let start = Instant::now();
    while exec.status().phase != "idle" {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "group not torn down"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let err = exec
        .run_task("t", Shareable::new(), &mut FlContext::new(), &Signal::new())
        .unwrap_err();
    (err, pids)
}

#[test]
fn garbage_after_authentication() {
    let (err, pids) = violate(|c| (&*c).write_all(&[0x55; 40]).unwrap());
    let ExecuteError::RankFailed { failure, .. } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(failure.rank, 0);
    assert!(
        matches!(&failure.cause, FailureCause::Protocol { channel: Channel::Exec, what } if what.starts_with("not a rankexec frame")),
        "{failure:?}"
    );
    assert_eq!(err.class(), ErrorClass::Protocol);
    for p in pids {
        assert!(!pid_alive(p), "launcher {p} was torn down");
    }
}

#[test]
fn a_message_on_the_wrong_channel() {
    let (err, _) = violate(|c| {
        envelope::plain(&Message::Heartbeat { seq: 1 })
            .unwrap()
            .write_to(c)
            .unwrap();
    });
    assert!(
        chain(&err).contains(
            "broke the protocol on the exec channel: Heartbeat is not allowed on this channel"
        ),
        "{}",
        chain(&err)
    );
}
