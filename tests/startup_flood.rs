//! Start-up over TCP under a flood of silent connections from the ranks' own address
//! (127.0.0.1), re-opened as soon as the parent closes them, for the whole start-up.
//! No fixed handshake pool exists for them to fill: every connection is challenged at
//! once and waits with nothing but its descriptor, so the ranks' own connections are
//! served beside the flood and the group is ready well within its 5 s deadline.
//!
//! On main, 70 such connections (the 3 x 2 + 64 handshake slots of a 2-rank group, half
//! of them per source) failed the start-up: "rank 1 failed during start-up: ... exec
//! channel handshake failed: handshake transport: connection closed".

mod common;

use std::io::Read;
use std::net::{SocketAddrV4, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::*;
use rankexec::executor::{Dur, MultiProcessExecutor, TransportConfig};
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

/// `n` silent connections to `to`, kept up from one thread until stopped: each one the
/// parent closes is replaced at once. Counts the challenges received and the
/// connections the parent closed.
struct Flood {
    stop: Arc<AtomicBool>,
    challenged: Arc<AtomicUsize>,
    closed: Arc<AtomicUsize>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Flood {
    fn start(n: usize, to: SocketAddrV4) -> Flood {
        let stop = Arc::new(AtomicBool::new(false));
        let challenged = Arc::new(AtomicUsize::new(0));
        let closed = Arc::new(AtomicUsize::new(0));
        let (s, ch, cl) = (stop.clone(), challenged.clone(), closed.clone());
        let thread = std::thread::spawn(move || {
            let open = |_| -> Option<TcpStream> {
                let c = TcpStream::connect_timeout(&to.into(), Duration::from_millis(200)).ok()?;
                c.set_nonblocking(true).ok()?;
                Some(c)
            };
            let mut conns: Vec<Option<TcpStream>> = (0..n).map(open).collect();
            let mut buf = [0u8; 4096];
            while !s.load(Ordering::SeqCst) {
                for slot in conns.iter_mut() {
                    if s.load(Ordering::SeqCst) {
                        break;
                    }
                    let Some(c) = slot else {
                        // Refused (the listener is gone once the group is ready).
                        *slot = open(0);
                        continue;
                    };
                    // Read the challenge and ignore it; never answer.
                    match c.read(&mut buf) {
                        Ok(0) => {
                            cl.fetch_add(1, Ordering::SeqCst);
                            *slot = open(0);
                        }
                        Ok(_) => {
                            ch.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(_) => {
                            cl.fetch_add(1, Ordering::SeqCst);
                            *slot = open(0);
                        }
                    }
                }
                // Wait for any of them to say something (bounded, to see `stop`).
                let fds: Vec<_> = conns.iter().flatten().map(|c| c.as_fd()).collect();
                let mut polled: Vec<nix::poll::PollFd<'_>> = fds
                    .iter()
                    .map(|fd| nix::poll::PollFd::new(*fd, nix::poll::PollFlags::POLLIN))
                    .collect();
                let _ = nix::poll::poll(&mut polled, nix::poll::PollTimeout::from(50u8));
            }
        });
        Flood {
            stop,
            challenged,
            closed,
            thread: Some(thread),
        }
    }

    /// Waits until the parent has challenged `n` of the flood's connections.
    fn wait_challenged(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.challenged.load(Ordering::SeqCst) < n {
            assert!(
                Instant::now() < deadline,
                "the parent challenged only {} of {n} flood connections",
                self.challenged.load(Ordering::SeqCst)
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Stops the flood; returns how many of its connections the parent closed.
    fn stop(mut self) -> usize {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.closed.load(Ordering::SeqCst)
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Raises this process's soft descriptor limit towards 8192 (up to the hard limit);
/// false if it stays below `need`.
fn enough_descriptors(need: u64) -> bool {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let lim = getrlimit(Resource::Nofile);
    let soft = lim.current.unwrap_or(u64::MAX);
    let want = lim.maximum.unwrap_or(u64::MAX).min(8192);
    if soft < want {
        let raised = Rlimit {
            current: Some(want),
            maximum: lim.maximum,
        };
        if setrlimit(Resource::Nofile, raised).is_err() {
            return soft >= need;
        }
    }
    soft.max(want) >= need
}

/// A 2-rank TCP group with a 5 s start-up deadline whose ranks start once `n` silent
/// connections from 127.0.0.1 (the ranks' own address) have been challenged; the flood
/// is kept up until the group is ready.
fn start_under_flood(n: usize) {
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
    let mut cfg = config(2, "Echo", serde_json::json!({}), dir.path());
    cfg.worker.program = script.display().to_string();
    cfg.transport = TransportConfig::Tcp {
        bind: "127.0.0.1:0".into(),
        advertise: None,
    };
    let startup = Duration::from_secs(5);
    cfg.deadlines.startup = Dur(startup);
    let exec = Arc::new(MultiProcessExecutor::new(cfg).unwrap());
    let e2 = exec.clone();
    let starting =
        std::thread::spawn(move || e2.handle_event(&EventType::START_RUN, &mut FlContext::new()));
    let ep = wait_file(&dir.path().join("ep"), Duration::from_secs(20));
    let to: SocketAddrV4 = ep
        .trim()
        .strip_prefix("tcp:")
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("a TCP endpoint, got {ep}"));
    let flood = Flood::start(n, to);
    // Every flood connection is in and challenged before the ranks come.
    flood.wait_challenged(n);
    let t0 = Instant::now();
    std::fs::write(dir.path().join("go"), "").unwrap();
    let started = starting.join().unwrap();
    let took = t0.elapsed();
    let closed = flood.stop();
    started.unwrap_or_else(|e| {
        panic!(
            "{n} silent connections from 127.0.0.1: start-up failed: {}",
            chain(&e)
        )
    });
    let mut ctx = FlContext::new();
    let out = exec
        .run_task("t", Shareable::new(), &mut ctx, &Signal::new())
        .unwrap();
    assert_eq!(out.meta("rank"), Some(&Value::Int(0)));
    let pids = exec.live_pids();
    exec.finalize().unwrap();
    assert_gone(&pids, "after finalize");
    eprintln!(
        "{n} silent connections from 127.0.0.1, kept up: 2-rank group ready {:.0} ms after \
         its ranks started (deadline {startup:?}); the flood saw {closed} of its connections \
         closed by the parent before it stopped",
        took.as_secs_f64() * 1e3
    );
}

/// The case: 70 connections, as many as a 2-rank group had handshake slots.
#[test]
fn a_kept_up_flood_from_the_ranks_own_address_does_not_keep_them_out() {
    start_under_flood(70);
}

/// 1,000 connections: more than any fixed pool would hold.
#[test]
fn a_flood_of_a_thousand_connections_does_not_keep_ranks_out() {
    // The flood's ends and the parent's ends are both in this process.
    if !enough_descriptors(4096) {
        eprintln!("SKIPPED: the descriptor limit's hard maximum is below 4096");
        return;
    }
    start_under_flood(1000);
}
