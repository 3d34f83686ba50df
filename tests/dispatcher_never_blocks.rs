//! Nothing blocks the dispatcher. Admission runs on its own thread: while another
//! process holds the reservation ledger's lock, `status()` is answered (phase
//! `admitting`), the start completes once the lock is released, and a lock that is
//! never released ends in the admission deadline's error, not a hang.

mod common;

use std::fs::File;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use rankexec::executor::admission::Admission;
use rankexec::executor::admission::host::SysinfoHost;
use rankexec::executor::admission::ledger::Ledger;
use rankexec::executor::gpu::NvmlProbe;
use rankexec::executor::{ByteSize, Dur, MultiProcessExecutor, StartError, Status};
use rankexec::protocol::FlContext;

/// Holds an exclusive `flock` on the ledger file and on the lock file beside it (which
/// of the two the ledger locks is its own business), as another executor would.
/// Dropping it releases both.
struct HeldLock(#[allow(dead_code)] Vec<nix::fcntl::Flock<File>>);

fn hold_ledger_lock(ledger: &Path) -> HeldLock {
    let mut held = Vec::new();
    for path in [
        ledger.to_owned(),
        ledger.parent().unwrap().join("ledger.lock"),
    ] {
        let f = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .unwrap();
        let lock = nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock)
            .map_err(|(_, e)| e)
            .unwrap();
        held.push(lock);
    }
    HeldLock(held)
}

fn executor(
    dir: &Path,
    admission_deadline: Duration,
) -> (Arc<MultiProcessExecutor>, std::path::PathBuf) {
    let mut cfg = config(1, "Echo", serde_json::json!({}), &dir.join("logs"));
    // An estimate makes admission a ledger transaction.
    cfg.resources.host_memory = Some(ByteSize(1 << 20));
    cfg.deadlines.admission = Dur(admission_deadline);
    let cfg = Arc::new(cfg);
    let ledger_dir = dir.join("ledger");
    std::fs::create_dir_all(&ledger_dir).unwrap();
    std::fs::set_permissions(
        &ledger_dir,
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .unwrap();
    let ledger = ledger_dir.join("ledger.json");
    let admission = Admission::with_probes(
        cfg.clone(),
        Arc::new(NvmlProbe),
        Arc::new(SysinfoHost::new()),
        Ledger::at(&ledger),
    );
    (
        Arc::new(MultiProcessExecutor::with_admission(cfg, admission).unwrap()),
        ledger,
    )
}

/// `status()`, failing the test if it is not answered within a generous bound (a
/// blocked dispatcher never answers while the lock is held).
fn status_within(exec: &Arc<MultiProcessExecutor>) -> Status {
    let (tx, rx) = crossbeam_channel::bounded(1);
    let e = exec.clone();
    std::thread::spawn(move || drop(tx.send(e.status())));
    rx.recv_timeout(Duration::from_secs(30))
        .expect("status() was not answered while the ledger was locked")
}

#[test]
fn status_is_answered_while_the_ledger_is_locked() {
    let dir = tempfile::tempdir().unwrap();
    let (exec, ledger) = executor(dir.path(), Duration::from_secs(60));
    let lock = hold_ledger_lock(&ledger);
    let start = std::thread::spawn({
        let exec = exec.clone();
        move || exec.start(&FlContext::new())
    });
    let t = std::time::Instant::now();
    let mut status = status_within(&exec);
    while status.phase != "admitting" {
        assert!(t.elapsed() < Duration::from_secs(30), "{status:?}");
        status = status_within(&exec);
    }
    println!(
        "status() answered `{}` in {:.1} ms while the ledger was locked",
        status.phase,
        t.elapsed().as_secs_f64() * 1e3
    );
    assert!(
        !start.is_finished(),
        "admission cannot finish under the lock"
    );
    drop(lock);
    start.join().unwrap().unwrap();
    assert_eq!(status_within(&exec).phase, "ready");
    exec.finalize().unwrap();
}

#[test]
fn a_ledger_locked_for_good_ends_in_the_admission_error() {
    let dir = tempfile::tempdir().unwrap();
    let (exec, ledger) = executor(dir.path(), Duration::from_secs(1));
    let lock = hold_ledger_lock(&ledger);
    let start = std::thread::spawn({
        let exec = exec.clone();
        move || exec.start(&FlContext::new())
    });
    let status = status_within(&exec);
    assert!(matches!(status.phase, "admitting" | "idle"), "{status:?}");
    let err = start.join().unwrap().unwrap_err();
    assert!(matches!(err, StartError::Admission(_)), "{err:?}");
    println!("a ledger locked for good: {}", chain(&err));
    assert_eq!(status_within(&exec).phase, "idle");
    drop(lock);
    // The abandoned attempt finishes on its own thread; a new start then works.
    exec.start(&FlContext::new()).unwrap();
    exec.finalize().unwrap();
}
