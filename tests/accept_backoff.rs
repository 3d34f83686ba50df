//! The parent runs out of file descriptors while a connection waits: `accept` fails and
//! leaves it queued. The acceptor pauses before retrying (no busy loop, no log flood)
//! and serves the connection once descriptors are free again.
//!
//! This binary has one test: it lowers its own descriptor limit.

mod common;

use std::time::Duration;

use common::*;
use rankexec::executor::MultiProcessExecutor;
use rankexec::protocol::{Shareable, Signal};
use rustix::net::{AddressFamily, SocketAddrUnix, SocketType};
use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
use std::os::unix::fs::PermissionsExt;

#[test]
fn failed_accepts_back_off_and_recover() {
    let log = LogCapture::install();
    let logs = tempfile::tempdir().unwrap();
    // The rank waits for the go-ahead, so the acceptor is still in start-up (once the
    // group is ready its listener is closed); it first says where it would connect.
    let script = logs.path().join("worker.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\necho \"$RANKEXEC_ENDPOINT\" > {d}/ep.tmp && mv {d}/ep.tmp {d}/ep\n\
             while [ ! -e {d}/go ]; do sleep 0.01; done\nexec {w}\n",
            d = logs.path().display(),
            w = worker_bin().display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut cfg = config(1, "Env", serde_json::json!({}), logs.path());
    cfg.worker.program = script.display().to_string();
    let exec = std::sync::Arc::new(MultiProcessExecutor::new(cfg).unwrap());
    let e2 = exec.clone();
    let starting = std::thread::spawn(move || {
        use rankexec::protocol::FlComponent;
        let mut ctx = rankexec::protocol::FlContext::new();
        e2.handle_event(&rankexec::protocol::EventType::START_RUN, &mut ctx)
            .map(|()| ctx)
    });
    let ep_file = logs.path().join("ep");
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while !ep_file.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the rank never started"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // The host is still making descriptors after the rank starts (its output pump, the
    // acceptor); lowering the limit before it is done fails the start-up instead. On a
    // saturated machine the rank's script often got here first.
    assert!(
        log.wait_for("rank group launched", Duration::from_secs(120)),
        "the group was never launched:\n{}",
        log.text()
    );
    let endpoint = std::fs::read_to_string(&ep_file).unwrap().trim().to_owned();
    let addr = SocketAddrUnix::new(socket_path(&endpoint)).unwrap();
    // The client's descriptor exists before the limit drops; connecting needs no new one.
    let client = rustix::net::socket(AddressFamily::UNIX, SocketType::STREAM, None).unwrap();

    // The limit caps descriptor numbers: set it to the lowest free one, so no new
    // descriptor can be made at all.
    let saved = getrlimit(Resource::Nofile);
    let lowest_free = {
        use std::os::fd::AsRawFd;
        std::fs::File::open("/dev/null").unwrap().as_raw_fd() as u64
    };
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(lowest_free),
            maximum: saved.maximum,
        },
    )
    .unwrap();
    rustix::net::connect(&client, &addr).unwrap();
    // Three failed accepts: the connection stays queued and the acceptor retries.
    let provoked = log_count_reaches(&log, "accept failed", 3, Duration::from_secs(60));
    setrlimit(Resource::Nofile, saved).unwrap();
    assert!(
        provoked,
        "accept did not fail three times: the test did not provoke EMFILE; log:\n{}",
        log.text()
    );
    // Each retry came after a pause (the acceptor waits 100 ms): the gaps between the
    // failures' log timestamps. A slow machine only makes them longer.
    let times: Vec<f64> = log
        .text()
        .lines()
        .filter(|l| l.contains("accept failed"))
        .take(3)
        .map(|l| seconds_of_day(l).unwrap_or_else(|| panic!("no timestamp in {l:?}")))
        .collect();
    for pair in times.windows(2) {
        let gap = (pair[1] - pair[0]).rem_euclid(86_400.0);
        println!("failed accepts {:.1} ms apart", gap * 1e3);
        assert!(
            gap >= 0.05,
            "failed accepts {:.1} ms apart: the acceptor is spinning",
            gap * 1e3
        );
    }
    // With descriptors back, the queued connection is accepted and challenged.
    assert!(
        wait_readable(&client, Duration::from_secs(60)),
        "the queued connection was never served"
    );
    // The group itself was never disturbed: it starts and works.
    std::fs::write(logs.path().join("go"), "").unwrap();
    let mut ctx = starting.join().unwrap().unwrap();
    exec.run_task("env", Shareable::new(), &mut ctx, &Signal::new())
        .unwrap();
    let pids = exec.live_pids();
    exec.finalize().unwrap();
    assert_gone(&pids, "after finalize");
}

/// Whether the parent wrote to the client socket (its handshake challenge) in time.
fn wait_readable(fd: &rustix::fd::OwnedFd, within: Duration) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    let mut fds = [PollFd::new(fd, PollFlags::IN)];
    let ts = Timespec {
        tv_sec: within.as_secs() as i64,
        tv_nsec: 0,
    };
    poll(&mut fds, Some(&ts)).is_ok_and(|n| n > 0)
}

/// Waits until `needle` occurs `n` times in the log; false after `within`.
fn log_count_reaches(log: &LogCapture, needle: &str, n: usize, within: Duration) -> bool {
    let start = std::time::Instant::now();
    while start.elapsed() < within {
        if log.text().matches(needle).count() >= n {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

/// The time of day of a log line (`2026-01-02T03:04:05.678901Z ...`), in seconds.
fn seconds_of_day(line: &str) -> Option<f64> {
    let stamp = line.split_whitespace().next()?;
    let time = stamp.split_once('T')?.1.trim_end_matches('Z');
    let mut parts = time.split(':');
    let h: f64 = parts.next()?.parse().ok()?;
    let m: f64 = parts.next()?.parse().ok()?;
    let s: f64 = parts.next()?.parse().ok()?;
    Some(h * 3600.0 + m * 60.0 + s)
}
