//! TCP on an open network: anyone who can reach the port can connect. A peer that
//! connects and never authenticates holds nothing a rank needs (no handshake slot: it
//! waits with its descriptor alone) and is closed after a short pre-authentication
//! deadline, so a flood from another host never keeps real ranks out (a flood from the
//! ranks' own address: `tests/startup_flood.rs`).

mod common;

use std::io::Read;
use std::net::{Ipv4Addr, SocketAddrV4, TcpStream};
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

/// A TCP connection from `from` (another loopback address: another "host") to `to`.
fn connect_from(from: Ipv4Addr, to: SocketAddrV4) -> std::io::Result<TcpStream> {
    use rustix::net::{AddressFamily, SocketType, bind, connect, socket};
    let fd = socket(AddressFamily::INET, SocketType::STREAM, None)?;
    bind(&fd, &SocketAddrV4::new(from, 0))?;
    connect(&fd, &to)?;
    Ok(TcpStream::from(fd))
}

/// `n` connections from `from` that never say a word, each replaced as soon as the
/// parent closes it when `keep_up`, until `stop`. Counts the connections the parent
/// closed (timed out, or turned away at once when over a limit).
struct Flood {
    stop: Arc<AtomicBool>,
    closed: Arc<AtomicUsize>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Flood {
    fn start(n: usize, from: Ipv4Addr, to: SocketAddrV4, keep_up: bool) -> Flood {
        let stop = Arc::new(AtomicBool::new(false));
        let closed = Arc::new(AtomicUsize::new(0));
        let threads = (0..n)
            .map(|_| {
                let (stop, closed) = (stop.clone(), closed.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::SeqCst) {
                        let Ok(mut s) = connect_from(from, to) else {
                            // Refused (the listener is gone once the group is ready).
                            std::thread::sleep(Duration::from_millis(20));
                            continue;
                        };
                        let _ = s.set_read_timeout(Some(Duration::from_millis(100)));
                        let mut buf = [0u8; 4096];
                        // Read the challenge and ignore it; never answer.
                        loop {
                            match s.read(&mut buf) {
                                Ok(0) => {
                                    closed.fetch_add(1, Ordering::SeqCst);
                                    if !keep_up {
                                        return;
                                    }
                                    break;
                                }
                                Ok(_) => {}
                                Err(e)
                                    if matches!(
                                        e.kind(),
                                        std::io::ErrorKind::WouldBlock
                                            | std::io::ErrorKind::TimedOut
                                    ) =>
                                {
                                    if stop.load(Ordering::SeqCst) {
                                        return;
                                    }
                                }
                                Err(_) => {
                                    closed.fetch_add(1, Ordering::SeqCst);
                                    if !keep_up {
                                        return;
                                    }
                                    break;
                                }
                            }
                        }
                    }
                })
            })
            .collect();
        Flood {
            stop,
            closed,
            threads,
        }
    }

    fn stop(self) -> usize {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads {
            let _ = t.join();
        }
        self.closed.load(Ordering::SeqCst)
    }
}

/// Starts a 2-rank TCP group whose ranks wait until `n` silent connections from
/// `from` are in (kept up or not), with a start-up deadline of `startup`.
fn start_under_flood(n: usize, from: Ipv4Addr, keep_up: bool, startup: Duration, what: &str) {
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
    // The handshake deadline is min(startup, 10 s); the ranks dial for `startup`.
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
    let flood = Flood::start(n, from, to, keep_up);
    // The flood takes its slots before the ranks come: wait until the parent has
    // answered each (its challenge is the first thing it sends).
    std::thread::sleep(Duration::from_millis(500));
    let t0 = Instant::now();
    std::fs::write(dir.path().join("go"), "").unwrap();
    let started = starting.join().unwrap();
    let took = t0.elapsed();
    let closed = flood.stop();
    started.unwrap_or_else(|e| panic!("{what}: start-up failed: {}", chain(&e)));
    let mut ctx = FlContext::new();
    let out = exec
        .run_task("t", Shareable::new(), &mut ctx, &Signal::new())
        .unwrap();
    assert_eq!(out.meta("rank"), Some(&Value::Int(0)));
    let pids = exec.live_pids();
    exec.finalize().unwrap();
    assert_gone(&pids, "after finalize");
    eprintln!(
        "{what}: 2-rank group ready {:.1} s after its ranks started; the parent closed \
         {closed} silent connections (timed out or turned away)",
        took.as_secs_f64()
    );
}

/// 70 silent connections, kept up for the whole start-up from another address, filled
/// every handshake slot a 2-rank group once had (3 x 2 + 64): start-up failed ("ranks
/// not connected: 0 (0/3 channels), 1 (0/3 channels)"). There is no such pool now.
#[test]
fn a_flood_from_another_host_does_not_keep_ranks_out() {
    start_under_flood(
        70,
        Ipv4Addr::new(127, 0, 0, 2),
        true,
        Duration::from_secs(40),
        "70 silent connections from 127.0.0.2, kept up",
    );
}

/// 70 silent connections from the ranks' own address, made once: they once held every
/// slot for the whole handshake deadline (min(startup, 10 s)), as long as the ranks
/// dial, and start-up failed with "exec channel handshake failed: handshake transport:
/// connection closed". They wait beside the ranks now, and a TCP peer has
/// `PRE_AUTH_TCP` (3 s) to prove itself before it is closed.
#[test]
fn silent_connections_give_their_slots_back_quickly() {
    start_under_flood(
        70,
        Ipv4Addr::new(127, 0, 0, 1),
        false,
        Duration::from_secs(9),
        "70 silent connections from 127.0.0.1, once",
    );
}
