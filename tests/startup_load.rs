//! Start-up under load. Idle connections take nothing a rank needs: the parent accepts
//! and challenges every one at once (more than the 76 handshake slots a 4-rank group
//! had on main) and the ranks get in beside them. Once the group is ready the listener
//! is closed. A large group starts on this machine too.

mod common;

use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use rankexec::executor::{Dur, MultiProcessExecutor, TransportConfig};
use rankexec::protocol::wire::{Conn, Endpoint};
use rankexec::protocol::{EventType, FlComponent, FlContext, Shareable, Signal, Value};

fn wait_file(path: &Path, within: Duration) -> String {
    let deadline = Instant::now() + within;
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

fn idle_connections_delay_but_never_deny_startup(transport: TransportConfig, what: &str) {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    // Every rank waits for the test's go-ahead; rank 0 first says where to connect.
    let script = dir.path().join("worker.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n[ \"$RANKEXEC_RANK\" = 0 ] && {{ echo \"$RANKEXEC_ENDPOINT\" > {d}/ep.tmp; mv {d}/ep.tmp {d}/ep; }}\n\
             while [ ! -e {d}/go ]; do sleep 0.01; done\nexec {w}\n",
            d = dir.path().display(),
            w = worker_bin().display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let world = 4;
    let mut cfg = config(world, "Echo", serde_json::json!({}), dir.path());
    cfg.worker.program = script.display().to_string();
    cfg.transport = transport;
    // Handshake deadline: min(startup, 10 s).
    cfg.deadlines.startup = Dur(Duration::from_secs(60));
    let exec = Arc::new(MultiProcessExecutor::new(cfg).unwrap());
    let e2 = exec.clone();
    let t0 = Instant::now();
    let starting =
        std::thread::spawn(move || e2.handle_event(&EventType::START_RUN, &mut FlContext::new()));
    let endpoint: Endpoint = wait_file(&dir.path().join("ep"), Duration::from_secs(20))
        .trim()
        .parse()
        .unwrap();
    // More idle connections than the slots a 4-rank group had on main (3 x 4 + 64 = 76).
    let idle: Vec<Conn> = (0..100)
        .map(|_| endpoint.connect(Duration::from_secs(5)).unwrap())
        .collect();
    // Every one is accepted and challenged at once: none waits for a slot.
    for (i, c) in idle.iter().enumerate() {
        let mut fd = [nix::poll::PollFd::new(
            c.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        let got = nix::poll::poll(&mut fd, nix::poll::PollTimeout::from(20_000u16));
        assert_eq!(
            got.ok(),
            Some(1),
            "{what}: idle connection {i} was never challenged"
        );
    }
    std::fs::write(dir.path().join("go"), "").unwrap();
    starting
        .join()
        .unwrap()
        .unwrap_or_else(|e| panic!("{what}: start-up failed: {}", chain(&e)));
    let took = t0.elapsed();
    let mut ctx = FlContext::new();
    let out = exec
        .run_task("t", Shareable::new(), &mut ctx, &Signal::new())
        .unwrap();
    assert_eq!(out.meta("rank"), Some(&Value::Int(0)));
    // The listener is closed now that the group is ready.
    let deadline = Instant::now() + Duration::from_secs(10);
    while endpoint.connect(Duration::from_secs(1)).is_ok() {
        assert!(
            Instant::now() < deadline,
            "{what}: the listener still accepts after start-up"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(idle);
    let pids = exec.live_pids();
    exec.finalize().unwrap();
    assert_gone(&pids, "after finalize");
    eprintln!(
        "{what}: 100 idle connections, 4-rank group ready after {:.1} s; listener closed once ready",
        took.as_secs_f64()
    );
}

#[test]
fn idle_local_connections_do_not_deny_startup() {
    idle_connections_delay_but_never_deny_startup(TransportConfig::Local, "local");
}

#[test]
fn idle_tcp_connections_do_not_deny_startup() {
    idle_connections_delay_but_never_deny_startup(
        TransportConfig::Tcp {
            bind: "127.0.0.1:0".into(),
            advertise: None,
        },
        "tcp",
    );
}

/// `RANKEXEC_TEST_BIG_WORLD` ranks (default 256; 1024 is the allowed maximum).
#[test]
fn a_big_group_starts() {
    let _serial = serial();
    let world: u32 = std::env::var("RANKEXEC_TEST_BIG_WORLD")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(world, "Echo", serde_json::json!({}), dir.path());
    cfg.deadlines.startup = Dur(Duration::from_secs(300));
    cfg.deadlines.heartbeat_interval = Dur(Duration::from_secs(2));
    cfg.deadlines.heartbeat_timeout = Dur(Duration::from_secs(120));
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let t0 = Instant::now();
    let mut ctx = FlContext::new();
    exec.handle_event(&EventType::START_RUN, &mut ctx)
        .unwrap_or_else(|e| panic!("{world} ranks: {}", chain(&e)));
    let ready = t0.elapsed();
    let out = exec
        .run_task("t", Shareable::new(), &mut ctx, &Signal::new())
        .unwrap();
    assert_eq!(out.meta("rank"), Some(&Value::Int(0)));
    let pids = exec.live_pids();
    assert_eq!(pids.len(), world as usize);
    exec.finalize().unwrap();
    assert_gone(&pids, "after finalize");
    eprintln!(
        "{world}-rank group ready in {:.1} s on {} cores; one task; all gone after finalize",
        ready.as_secs_f64(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
}
