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
//! - A lease removes its lock file (and `ports/` once empty) before it lets go of the
//!   lock; a process that opened the file meanwhile sees, once it has the lock, that
//!   the path no longer names it, and tries again. An executor whose group is never
//!   dropped (SIGKILL, a host process that exits without tearing it down; seen once in
//!   two groups of a FLARE simulator run) leaves its empty file behind, unlocked, which
//!   the next taker of that port reuses: at most one file per port.
//! - Nothing here waits: a lock held elsewhere means another port. Where the directory
//!   cannot be used (not private, not writable), the port is picked as before, without
//!   a lock, and [`PortLease::locked`] says so.

use std::os::fd::OwnedFd;

use rustix::fs::{AtFlags, FlockOperation, Mode, OFlags};
use rustix::io::Errno;

/// Picks at most this many ports before settling for one without a lock.
const TRIES: usize = 32;

/// Used when portpicker finds nothing (torch's default).
const FALLBACK: u16 = 29500;

const DIR: &str = "ports";

/// A port picked for a group's rendezvous, and the lock that keeps other executors of
/// this user from picking it while the lease lives. Dropping it removes the lock file
/// (and `ports/` once empty) before letting go of the lock.
#[derive(Debug)]
pub struct PortLease {
    port: u16,
    lock: Option<Held>,
}

#[derive(Debug)]
struct Held {
    /// The private directory and its `ports/`.
    dir: OwnedFd,
    ports: OwnedFd,
    /// The locked file `ports/<port>`.
    file: OwnedFd,
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

impl Drop for PortLease {
    fn drop(&mut self) {
        if let Some(held) = self.lock.take() {
            // Unlinked while still locked: whoever opened the file before this sees, once
            // it has the lock, that its path no longer names it (see `take`), and tries
            // again. Failures only leave an empty file or directory behind.
            let _ = rustix::fs::unlinkat(&held.ports, self.port.to_string(), AtFlags::empty());
            let _ = rustix::fs::unlinkat(&held.dir, DIR, AtFlags::REMOVEDIR);
            drop(held.file);
        }
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
    for _ in 0..TRIES {
        let Some(port) = pick() else {
            break;
        };
        match take(dir, port) {
            Ok(Some(held)) => {
                return PortLease {
                    port,
                    lock: Some(held),
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

/// The lock on `ports/<port>` under the private directory `dir` (created 0700, never
/// through a symlink), or None when another process holds it. A file or directory
/// that a releasing lease removed while this opened it is tried again (a few times).
fn take(dir: &OwnedFd, port: u16) -> Result<Option<Held>, Errno> {
    let name = port.to_string();
    for _ in 0..4 {
        match rustix::fs::mkdirat(dir, DIR, Mode::from_raw_mode(0o700)) {
            Ok(()) | Err(Errno::EXIST) => {}
            Err(e) => return Err(e),
        }
        let ports = match rustix::fs::openat(
            dir,
            DIR,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => continue, // removed by a releasing lease just now
            Err(e) => return Err(e),
        };
        let file = match rustix::fs::openat(
            &ports,
            &name,
            OFlags::RDWR | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        ) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => continue, // its directory was removed
            Err(e) => return Err(e),
        };
        match rustix::fs::flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(Errno::WOULDBLOCK | Errno::INTR) => return Ok(None),
            Err(e) => return Err(e),
        }
        // Locked: but the holder before may have removed the file (or its directory)
        // between this open and this lock. Only the file the path names counts.
        let mine = rustix::fs::fstat(&file)?.st_ino;
        let named = rustix::fs::statat(&ports, &name, AtFlags::SYMLINK_NOFOLLOW).map(|s| s.st_ino);
        let dir_named = rustix::fs::statat(dir, DIR, AtFlags::SYMLINK_NOFOLLOW).map(|s| s.st_ino);
        let dir_mine = rustix::fs::fstat(&ports)?.st_ino;
        if named == Ok(mine) && dir_named == Ok(dir_mine) {
            let dir = rustix::io::fcntl_dupfd_cloexec(dir, 0)?;
            return Ok(Some(Held { dir, ports, file }));
        }
    }
    Err(Errno::AGAIN)
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
        // Released with the lease, and nothing left behind: the files and `ports/` go.
        rustix::fs::flock(&other, FlockOperation::NonBlockingLockExclusive).unwrap();
        assert!(!file.exists());
        assert!(!t.path().join("ports").exists(), "ports/ left behind");
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
