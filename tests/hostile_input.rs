//! Hostile and broken input against a live executor: each connection is refused with a
//! logged reason, never a panic or a big allocation, and the ranks keep working.

mod common;

use std::io::Write as _;
use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use common::*;
use rankexec::executor::MultiProcessExecutor;
use rankexec::protocol::wire::message::{Channel, Handshake, Hello};
use rankexec::protocol::wire::{
    Conn, Endpoint, FrameLimits, HandshakeError, Identity, OutFrame, Secret, client_handshake,
    codec, frame,
};
use rankexec::protocol::{Shareable, Signal, Value};

fn connect(endpoint: &Endpoint) -> Conn {
    endpoint.connect(Duration::from_secs(5)).unwrap()
}

fn read_challenge(c: &Conn) {
    let f = frame::read_frame(c, &FrameLimits::HANDSHAKE).unwrap();
    assert!(matches!(
        codec::decode::<Handshake>(&f.header).unwrap(),
        Handshake::Challenge { .. }
    ));
}

fn identity(rank: u32) -> Identity {
    Identity {
        channel: Channel::Exec,
        rank,
        world_size: 2,
        launch_id: String::new(),
        pid: std::process::id(),
        pgid: std::process::id(),
        host: "attacker".into(),
    }
}

#[test]
fn every_hostile_input_is_refused_and_ranks_keep_working() {
    let log = LogCapture::install();
    let dir = tempfile::tempdir().unwrap();
    // Rank 0's wrapper leaves its environment and the secret from its pipe where the
    // test can read them, as another process of the same user could.
    let script = dir.path().join("worker.sh");
    let env_file = dir.path().join("rank0.env");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nsecret=$(cat /dev/fd/$RANKEXEC_SECRET_FD)\n\
             [ \"$RANKEXEC_RANK\" = 0 ] && {{ env; echo RANKEXEC_SECRET=$secret; }} > {}\n\
             RANKEXEC_SECRET=$secret exec env -u RANKEXEC_SECRET_FD {}\n",
            env_file.display(),
            worker_bin().display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut cfg = config(2, "Echo", serde_json::json!({}), dir.path());
    cfg.worker.program = script.display().to_string();
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let mut ctx = start(&exec);
    let env = std::fs::read_to_string(&env_file).unwrap();
    let var = |k: &str| {
        env.lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")))
            .unwrap()
            .to_owned()
    };
    let endpoint: Endpoint = var("RANKEXEC_ENDPOINT").parse().unwrap();
    let secret = Secret::from_hex(&var("RANKEXEC_SECRET")).unwrap();
    let launch_id = var("RANKEXEC_LAUNCH_ID");
    let still_works = |ctx: &mut rankexec::protocol::FlContext, what: &str| {
        let out = exec.run_task("t", Shareable::new(), ctx, &Signal::new());
        assert_eq!(
            out.unwrap().meta("rank"),
            Some(&Value::Int(0)),
            "ranks work after {what}"
        );
    };
    let expect_log = |needle: &str| {
        assert!(
            log.wait_for(needle, Duration::from_secs(5)),
            "log should say: {needle}\n{}",
            log.text()
        );
    };

    // Garbage bytes.
    let c = connect(&endpoint);
    read_challenge(&c);
    (&c).write_all(&[0xAB; 64]).unwrap();
    expect_log("refused connection: handshake transport: not a rankexec frame");
    still_works(&mut ctx, "garbage");

    // A truncated frame: a prefix promising a header that never comes.
    let c = connect(&endpoint);
    read_challenge(&c);
    let mut p = b"RXF1".to_vec();
    p.extend_from_slice(&100u32.to_le_bytes());
    p.extend_from_slice(&0u64.to_le_bytes());
    p.extend_from_slice(&0u32.to_le_bytes());
    p.extend_from_slice(b"partial");
    (&c).write_all(&p).unwrap();
    drop(c);
    expect_log("connection closed mid-frame after 7 of 100 header bytes");
    still_works(&mut ctx, "a truncated frame");

    // A length over the maximum (refused before any allocation).
    let c = connect(&endpoint);
    read_challenge(&c);
    let mut p = b"RXF1".to_vec();
    p.extend_from_slice(&(1u32 << 30).to_le_bytes());
    p.extend_from_slice(&(u64::MAX).to_le_bytes());
    p.extend_from_slice(&0u32.to_le_bytes());
    (&c).write_all(&p).unwrap();
    expect_log("header of 1073741824 bytes exceeds the limit of 4096");
    still_works(&mut ctx, "an oversized length");

    // A wrong secret.
    let c = connect(&endpoint);
    let err = client_handshake(
        &c,
        &Secret::generate().unwrap(),
        &identity(1),
        Duration::from_secs(5),
    )
    .unwrap_err();
    assert!(
        matches!(&err, HandshakeError::Refused { reason } if reason == "authentication failed"),
        "{err}"
    );
    expect_log("refused connection: authentication failed");

    // A wrong protocol version.
    let c = connect(&endpoint);
    read_challenge(&c);
    let hello = Handshake::Hello(Hello {
        version: 99,
        who: Identity {
            channel: Channel::Exec,
            rank: 0,
            world_size: 2,
            launch_id: launch_id.clone(),
            pid: 1,
            pgid: 1,
            host: "h".into(),
        },
        nonce: [0; 32],
        mac: [0; 32],
    });
    OutFrame::header_only(&codec::encode(&hello).unwrap())
        .write_to(&c)
        .unwrap();
    expect_log("refused connection: protocol version 99 does not match 1");

    // Holding the secret, but naming a rank outside the world.
    let c = connect(&endpoint);
    let mut who = identity(7);
    who.launch_id = launch_id.clone();
    let err = client_handshake(&c, &secret, &who, Duration::from_secs(5)).unwrap_err();
    assert!(
        matches!(&err, HandshakeError::Refused { reason } if reason == "start-up is over; no new connections are accepted" || reason == "rank 7 is outside world size 2"),
        "{err}"
    );
    expect_log("rank 7 is outside world size 2");

    // Holding the secret, as a valid rank, after start-up (a duplicate rank 0).
    let c = connect(&endpoint);
    let mut who = identity(0);
    who.launch_id = launch_id.clone();
    let err = client_handshake(&c, &secret, &who, Duration::from_secs(5)).unwrap_err();
    assert!(
        matches!(&err, HandshakeError::Refused { reason } if reason == "start-up is over; no new connections are accepted"),
        "{err}"
    );
    still_works(&mut ctx, "late and duplicate connections");

    // A peer of another user. The run directory is private, so the kernel refuses the
    // connection first; with the directory opened up (a misconfiguration), the
    // executor's own SO_PEERCRED check refuses it.
    if nix::unistd::geteuid().is_root() {
        use std::os::unix::process::CommandExt;
        let sock = match &endpoint {
            Endpoint::Local(p) => p.clone(),
            Endpoint::Tcp(_) => unreachable!(),
        };
        let run_dir = sock.parent().unwrap().to_owned();
        let other_user = |what: &str| {
            let out = std::process::Command::new(worker_bin())
                .env_clear()
                .env("RANKEXEC_RANK", "1")
                .env("RANKEXEC_WORLD_SIZE", "2")
                .env("RANKEXEC_ENDPOINT", endpoint.to_string())
                .env("RANKEXEC_SECRET", secret.to_hex())
                .env("RANKEXEC_LAUNCH_ID", &launch_id)
                .env("RANKEXEC_CONNECT_TIMEOUT_MS", "3000")
                .uid(65534)
                .gid(65534)
                .output()
                .unwrap();
            assert_eq!(
                out.status.code(),
                Some(1),
                "{what}: the other user's rank fails to start"
            );
            String::from_utf8_lossy(&out.stderr).into_owned()
        };
        let denied = other_user("private run dir");
        assert!(
            denied.contains("cannot connect the exec channel"),
            "{denied}"
        );
        let base = run_dir.parent().unwrap().to_owned();
        std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o711)).unwrap();
        std::fs::set_permissions(&run_dir, std::fs::Permissions::from_mode(0o711)).unwrap();
        std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o777)).unwrap();
        let refused = other_user("opened run dir");
        std::fs::set_permissions(&run_dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o700)).unwrap();
        assert!(refused.contains("handshake"), "{refused}");
        expect_log("refused connection: peer runs as uid 65534, not 0");
    } else {
        eprintln!("skipping the other-uid case: it needs root to run a process as another user");
    }
    still_works(&mut ctx, "every hostile input");
    assert!(
        !log.text().contains(&secret.to_hex()),
        "the secret never appears in logs"
    );
    exec.finalize().unwrap();
}
