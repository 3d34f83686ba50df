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
    // Every rank waits for the test's go-ahead, so the hostile connections below meet
    // an acceptor in start-up (once the group is ready, the listener is closed).
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nsecret=$(cat /dev/fd/$RANKEXEC_SECRET_FD)\n\
             echo $$ > {d}/pid.$RANKEXEC_RANK.tmp && mv {d}/pid.$RANKEXEC_RANK.tmp {d}/pid.$RANKEXEC_RANK\n\
             [ \"$RANKEXEC_RANK\" = 0 ] && {{ env; echo RANKEXEC_SECRET=$secret; }} > {e}.tmp && mv {e}.tmp {e}\n\
             while [ ! -e {d}/go ]; do sleep 0.01; done\n\
             RANKEXEC_SECRET=$secret exec env -u RANKEXEC_SECRET_FD {w}\n",
            e = env_file.display(),
            d = dir.path().display(),
            w = worker_bin().display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut cfg = config(2, "Echo", serde_json::json!({}), dir.path());
    cfg.worker.program = script.display().to_string();
    cfg.deadlines.startup = rankexec::executor::Dur(Duration::from_secs(60));
    let exec = std::sync::Arc::new(MultiProcessExecutor::new(cfg).unwrap());
    let e2 = exec.clone();
    let starting = std::thread::spawn(move || {
        use rankexec::protocol::FlComponent;
        let mut ctx = rankexec::protocol::FlContext::new();
        e2.handle_event(&rankexec::protocol::EventType::START_RUN, &mut ctx)
            .map(|()| ctx)
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !env_file.exists() {
        assert!(std::time::Instant::now() < deadline, "rank 0 never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    // Both ranks are held from here: a failing assertion below kills them (through
    // pidfds) instead of leaving them waiting for the go-ahead.
    let pid_file = |rank: u32| dir.path().join(format!("pid.{rank}"));
    while !(pid_file(0).exists() && pid_file(1).exists()) {
        assert!(
            std::time::Instant::now() < deadline,
            "the ranks never started"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let rank_pids: Vec<u32> = (0..2)
        .map(|r| {
            std::fs::read_to_string(pid_file(r))
                .unwrap()
                .trim()
                .parse()
                .unwrap()
        })
        .collect();
    let _ranks = Held::new(&rank_pids);
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

    // A length over the maximum (refused before any allocation).
    let c = connect(&endpoint);
    read_challenge(&c);
    let mut p = b"RXF1".to_vec();
    p.extend_from_slice(&(1u32 << 30).to_le_bytes());
    p.extend_from_slice(&(u64::MAX).to_le_bytes());
    p.extend_from_slice(&0u32.to_le_bytes());
    (&c).write_all(&p).unwrap();
    expect_log("header of 1073741824 bytes exceeds the limit of 4096");

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
        matches!(&err, HandshakeError::Refused { reason } if reason == "rank 7 is outside world size 2"),
        "{err}"
    );
    expect_log("rank 7 is outside world size 2");

    // A peer of another user. The run directory is private, so the kernel refuses the
    // connection first; with the socket reachable anyway (a misconfiguration), the
    // executor's own SO_PEERCRED check refuses it.
    if nix::unistd::geteuid().is_root() {
        use std::os::unix::process::CommandExt;
        let sock = match &endpoint {
            Endpoint::Local(p) => p.clone(),
            Endpoint::Tcp(_) => unreachable!(),
        };
        let other_user = |what: &str, endpoint: &str| {
            let out = std::process::Command::new(worker_bin())
                .env_clear()
                .env("RANKEXEC_RANK", "1")
                .env("RANKEXEC_WORLD_SIZE", "2")
                .env("RANKEXEC_ENDPOINT", endpoint)
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
        let denied = other_user("private run dir", &endpoint.to_string());
        assert!(
            denied.contains("cannot connect the exec channel"),
            "{denied}"
        );
        // Reached through a hard link in a folder of the test's own that others may
        // enter, not by opening the run directory's parent: that folder is this user's
        // base for every rankexec, which any group starting meanwhile (another suite,
        // a job) makes private again, and the kernel would refuse the peer first.
        let base = sock.parent().and_then(|d| d.parent()).unwrap();
        let open = tempfile::Builder::new()
            .prefix("rx-open")
            .tempdir_in(base.parent().unwrap())
            .unwrap();
        std::fs::set_permissions(open.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
        std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o777)).unwrap();
        let link = open.path().join("ctl.sock");
        std::fs::hard_link(&sock, &link).unwrap();
        let refused = other_user("socket reached", &format!("local:{}", link.display()));
        assert!(refused.contains("handshake"), "{refused}");
        expect_log("refused connection: peer runs as uid 65534, not 0");
    } else {
        eprintln!("skipping the other-uid case: it needs root to run a process as another user");
    }
    // None of it disturbed the group: it starts once its ranks may connect.
    std::fs::write(dir.path().join("go"), "").unwrap();
    let mut ctx = starting
        .join()
        .unwrap()
        .unwrap_or_else(|e| panic!("start-up failed: {}", chain(&e)));
    let out = exec.run_task("t", Shareable::new(), &mut ctx, &Signal::new());
    assert_eq!(
        out.unwrap().meta("rank"),
        Some(&Value::Int(0)),
        "ranks work after every hostile input"
    );
    // Late connections (a duplicate rank 0, say) find no listener at all.
    let closed_by = std::time::Instant::now() + Duration::from_secs(10);
    while endpoint.connect(Duration::from_secs(1)).is_ok() {
        assert!(
            std::time::Instant::now() < closed_by,
            "the listener still accepts after start-up"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        !log.text().contains(&secret.to_hex()),
        "the secret never appears in logs"
    );
    exec.finalize().unwrap();
}
