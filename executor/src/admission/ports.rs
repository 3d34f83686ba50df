//! The rendezvous port of a group (`MASTER_PORT`), reserved among this user's
//! executors on this host for the group's life.
//!
//! `portpicker` finds a port that nobody has bound *now*. Rank 0 binds it only when
//! its code calls `init_process_group`, which can be minutes later (a Client API
//! script receives its first task first). Two groups started on one host within that
//! time (the sites of one FLARE simulator, jobs side by side, a test suite) could be
//! handed the same port, and the second rank 0 to bind it fails with `EADDRINUSE`.
//! So each group holds an exclusive `flock(2)` on `ports/<port>` in the user's private
//! directory (the ledger's, see [`super::ledger`]) while it lives, and a port whose
//! lock another process holds is skipped. The lock goes with the process that holds
//! it, so a crashed executor frees its ports.
//!
//! Caveats:
//! - Only this user's executors coordinate through it; any other program is seen only
//!   by portpicker's bind test, and a port nobody reserved still goes to whoever binds
//!   it first.
//! - The lock files stay (one empty file per port ever used: at most the 10,000 of
//!   portpicker's range); removing one could race with a process taking it.
//! - Nothing here waits: a lock held elsewhere means another port. Where the directory
//!   cannot be used (not private, not writable), the port is picked as before, without
//!   a lock, and [`PortLease::locked`] says so.

use std::os::fd::OwnedFd;
use std::path::Path;

use rustix::fs::{FlockOperation, Mode, OFlags};
use rustix::io::Errno;

/// Picks at most this many ports before settling for one without a lock.
const TRIES: usize = 32;

/// Used when portpicker finds nothing (torch's default).
const FALLBACK: u16 = 29500;

/// A port picked for a group's rendezvous, and the lock that keeps other executors of
/// this user from picking it while the lease lives.
#[derive(Debug)]
pub struct PortLease {
    port: u16,
    lock: Option<OwnedFd>,
}

impl PortLease {
    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Whether other executors are kept off it (false: picked without a lock).
    pub fn locked(&self) -> bool {
        self.lock.is_some()
    }
}

/// A port for a group's rendezvous: free now (portpicker's bind test) and not held by
/// another executor of this user (its lock in `dir`, the user's private directory
/// opened by the ledger, `Ledger::open_private_dir`). With no `dir`, or when no
/// port can be locked within 32 tries, a port picked as before, unlocked.
pub fn reserve(dir: Option<&OwnedFd>) -> PortLease {
    reserve_from(dir, portpicker::pick_unused_port)
}

/// [`reserve`] with the candidates from `pick`.
fn reserve_from(dir: Option<&OwnedFd>, mut pick: impl FnMut() -> Option<u16>) -> PortLease {
    let Some(dir) = dir else {
        return unlocked();
    };
    let ports = match subdir(dir) {
        Ok(d) => d,
        Err(_) => return unlocked(),
    };
    for _ in 0..TRIES {
        let Some(port) = pick() else {
            break;
        };
        match take(&ports, port) {
            Ok(Some(lock)) => {
                return PortLease {
                    port,
                    lock: Some(lock),
                };
            }
            Ok(None) => continue, // another executor holds it
            Err(_) => break,
        }
    }
    unlocked()
}

fn unlocked() -> PortLease {
    PortLease {
        port: portpicker::pick_unused_port().unwrap_or(FALLBACK),
        lock: None,
    }
}

/// `ports/` under the private directory, created 0700, never through a symlink.
fn subdir(dir: &OwnedFd) -> Result<OwnedFd, Errno> {
    match rustix::fs::mkdirat(dir, "ports", Mode::from_raw_mode(0o700)) {
        Ok(()) | Err(Errno::EXIST) => {}
        Err(e) => return Err(e),
    }
    rustix::fs::openat(
        dir,
        "ports",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

/// The lock on `port`, or None when another process holds it.
fn take(ports: &OwnedFd, port: u16) -> Result<Option<OwnedFd>, Errno> {
    let fd = rustix::fs::openat(
        ports,
        Path::new(&port.to_string()),
        OFlags::RDWR | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )?;
    match rustix::fs::flock(&fd, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(Some(fd)),
        Err(Errno::WOULDBLOCK | Errno::INTR) => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn private_dir() -> (tempfile::TempDir, OwnedFd) {
        let t = tempfile::tempdir().unwrap();
        let fd = rustix::fs::open(
            t.path(),
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .unwrap();
        (t, fd)
    }

    #[test]
    fn a_reserved_port_is_locked_and_never_handed_out_twice_while_held() {
        let (t, dir) = private_dir();
        let leases: Vec<PortLease> = (0..64).map(|_| reserve(Some(&dir))).collect();
        let mut ports: Vec<u16> = leases.iter().map(PortLease::port).collect();
        assert!(leases.iter().all(PortLease::locked));
        ports.sort_unstable();
        ports.dedup();
        assert_eq!(ports.len(), 64, "a port was handed out twice");
        // The lock is what the OS says: another open file description cannot take it.
        let file = t.path().join("ports").join(leases[0].port().to_string());
        let other = std::fs::File::open(&file).unwrap();
        assert_eq!(
            rustix::fs::flock(&other, FlockOperation::NonBlockingLockExclusive),
            Err(Errno::WOULDBLOCK)
        );
        drop(leases);
        // Released with the lease.
        rustix::fs::flock(&other, FlockOperation::NonBlockingLockExclusive).unwrap();
    }

    #[test]
    fn a_port_held_by_another_process_is_skipped() {
        let (t, dir) = private_dir();
        std::fs::create_dir(t.path().join("ports")).unwrap();
        // Another holder's locks on 20001 and 20002 (an open file description of its
        // own: flock conflicts between descriptions, as between processes).
        let held: Vec<std::fs::File> = [20001u16, 20002]
            .iter()
            .map(|p| {
                let f = std::fs::File::create(t.path().join("ports").join(p.to_string())).unwrap();
                rustix::fs::flock(&f, FlockOperation::NonBlockingLockExclusive).unwrap();
                f
            })
            .collect();
        let mut candidates = vec![20001u16, 20002, 20003].into_iter();
        let lease = reserve_from(Some(&dir), || candidates.next());
        assert_eq!((lease.port(), lease.locked()), (20003, true));
        // Once the holder lets go, its port can be had again.
        drop(held);
        let mut again = vec![20001u16].into_iter();
        let lease2 = reserve_from(Some(&dir), || again.next());
        assert_eq!((lease2.port(), lease2.locked()), (20001, true));
    }

    #[test]
    fn without_a_directory_a_port_is_still_picked_unlocked() {
        let lease = reserve(None);
        assert!(!lease.locked());
        assert!(lease.port() > 0);
    }

    #[test]
    fn a_directory_that_cannot_hold_the_locks_gives_an_unlocked_port() {
        let (t, dir) = private_dir();
        // `ports` is a file, not a directory: refused (ENOTDIR), never followed.
        std::fs::write(t.path().join("ports"), b"").unwrap();
        let lease = reserve(Some(&dir));
        assert!(!lease.locked());
    }
}
