//! The reservation ledger: what executors on this host have promised their ranks.
//!
//! Free memory is measured before ranks allocate, so two executors starting at once
//! would both count the same free bytes (fedflow sleeps between admissions for this).
//! Each admission therefore runs as a transaction on a small JSON file, under an
//! exclusive `flock(2)` on a lock file beside it, in the user's private directory: read
//! the live reservations, decide, and record the new one before the lock is released.
//!
//! A reservation counts only what its ranks have *not yet* allocated:
//! `max(0, reserved - measured)`, where `measured` is the ranks' resident memory (host)
//! or their NVML-reported usage (GPU), so memory is never subtracted twice. Entries of
//! processes that died (pid gone, or reused: the start time differs) are dropped.
//! A reservation is removed when its [`Reservation`] is dropped, i.e. when the group
//! stops.
//!
//! # Trust
//!
//! The directory must be ours and private (owner = our effective uid, no group or
//! other write permission; we create it 0700); it is opened with `O_NOFOLLOW` and every file in it is
//! opened relative to it with `O_NOFOLLOW`, so a planted symlink is refused, never
//! followed. A new ledger is written to a fresh temporary file and renamed over the
//! old one, so a reader never sees half a ledger. A ledger that does not parse is an
//! error (fail closed): reading it as empty would let every executor overcommit.
//!
//! # Caveats
//!
//! - The lock wait is bounded ([`LOCK_WAIT`]): `flock` is retried without blocking,
//!   with a doubling back-off, and a holder that keeps it longer (a stopped process)
//!   makes the transaction fail with [`LedgerError::Busy`] instead of hanging.
//! - The rename is not followed by `fsync`: the ledger describes live processes, so
//!   after a crash of the machine there is nothing in it worth keeping.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::fs::{FlockOperation, Mode, OFlags};
use rustix::io::Errno;
use serde::{Deserialize, Serialize};

/// The longest a transaction waits for another process's lock.
pub const LOCK_WAIT: Duration = Duration::from_secs(2);

const FILE: &str = "ledger.json";
const LOCK: &str = "ledger.lock";

/// Why the ledger cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// The directory is not private to us.
    #[error("directory {path} is not private: {reason}")]
    NotPrivate {
        /// The directory.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A file operation failed.
    #[error("cannot {what} {path}")]
    Io {
        /// The operation.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The ledger does not parse; it is left as it is.
    #[error("{path} is not a valid ledger (left untouched; remove it if no executor runs)")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// Another process held the lock for longer than [`LOCK_WAIT`].
    #[error("{path} stayed locked by another process for {waited:?}")]
    Busy {
        /// The lock file.
        path: PathBuf,
        /// How long we waited.
        waited: Duration,
    },
}

/// One executor's reservation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// Unique id.
    pub id: String,
    /// The executor's pid.
    pub pid: u32,
    /// The executor's start time (clock ticks since boot), to detect pid reuse.
    pub start: u64,
    /// Host memory reserved, bytes.
    pub host: u64,
    /// GPU memory reserved per GPU UUID, bytes.
    pub gpu: BTreeMap<String, u64>,
    /// The ranks' pids, once known, to measure what they already use.
    #[serde(default)]
    pub rank_pids: Vec<u32>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Doc {
    entries: Vec<Entry>,
}

/// The start time of a process, from `/proc/<pid>/stat`.
pub(crate) fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Field 22, counting after the command name, which may contain spaces.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

fn alive(e: &Entry) -> bool {
    start_time(e.pid) == Some(e.start)
}

/// The ledger file.
#[derive(Debug, Clone)]
pub struct Ledger {
    path: PathBuf,
}

/// A live reservation; dropping it releases it.
#[derive(Debug)]
pub struct Reservation {
    ledger: Ledger,
    id: String,
}

impl Reservation {
    /// Records the ranks' pids so others can measure what they already use.
    pub fn set_rank_pids(&self, pids: &[u32]) {
        let id = self.id.clone();
        let pids = pids.to_vec();
        let _ = self.ledger.update(|doc| {
            if let Some(e) = doc.entries.iter_mut().find(|e| e.id == id) {
                e.rank_pids = pids;
            }
        });
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let id = self.id.clone();
        if let Err(e) = self.ledger.update(|doc| doc.entries.retain(|e| e.id != id)) {
            tracing::warn!(error = %e, "cannot release a memory reservation");
        }
    }
}

impl Ledger {
    /// The ledger at `path` (created on first use).
    pub fn at(path: impl Into<PathBuf>) -> Ledger {
        Ledger { path: path.into() }
    }

    /// The user's default ledger, next to the run directories.
    pub fn default_for_user() -> Ledger {
        let base = match std::env::var_os("XDG_RUNTIME_DIR") {
            Some(x) => PathBuf::from(x).join("rankexec"),
            None => PathBuf::from(format!(
                "/tmp/rankexec-{}",
                rustix::process::geteuid().as_raw()
            )),
        };
        Ledger::at(base.join("ledger.json"))
    }

    /// Where the ledger lives.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn dir(&self) -> &Path {
        self.path.parent().unwrap_or(Path::new("."))
    }

    fn file_name(&self) -> &std::ffi::OsStr {
        self.path.file_name().unwrap_or(std::ffi::OsStr::new(FILE))
    }

    fn io(&self, what: &'static str, path: PathBuf) -> impl FnOnce(Errno) -> LedgerError {
        move |e| LedgerError::Io {
            what,
            path,
            source: e.into(),
        }
    }

    /// Opens (creating it 0700 if absent) the ledger's directory and checks it is ours
    /// and private.
    fn open_dir(&self) -> Result<OwnedFd, LedgerError> {
        let dir = self.dir();
        use std::os::unix::fs::DirBuilderExt;
        match std::fs::DirBuilder::new()
            .mode(0o700)
            .recursive(true)
            .create(dir)
        {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(source) => {
                return Err(LedgerError::Io {
                    what: "create",
                    path: dir.to_owned(),
                    source,
                });
            }
        }
        let fd = rustix::fs::open(
            dir,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| {
            if e == Errno::LOOP || e == Errno::NOTDIR {
                LedgerError::NotPrivate {
                    path: dir.to_owned(),
                    reason: "it is a symbolic link or not a directory".into(),
                }
            } else {
                self.io("open", dir.to_owned())(e)
            }
        })?;
        let st = rustix::fs::fstat(&fd).map_err(self.io("inspect", dir.to_owned()))?;
        let me = rustix::process::geteuid().as_raw();
        if st.st_uid != me {
            return Err(LedgerError::NotPrivate {
                path: dir.to_owned(),
                reason: format!("owned by uid {}, not {me}", st.st_uid),
            });
        }
        if st.st_mode & 0o022 != 0 {
            return Err(LedgerError::NotPrivate {
                path: dir.to_owned(),
                reason: format!("mode {:o} lets others write in it", st.st_mode & 0o7777),
            });
        }
        Ok(fd)
    }

    /// Takes the exclusive lock, waiting at most [`LOCK_WAIT`].
    fn lock(&self, dir: &OwnedFd) -> Result<OwnedFd, LedgerError> {
        let path = self.dir().join(LOCK);
        let fd = rustix::fs::openat(
            dir,
            LOCK,
            OFlags::RDWR | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map_err(self.io("open", path.clone()))?;
        let start = Instant::now();
        let mut pause = Duration::from_millis(1);
        loop {
            match rustix::fs::flock(&fd, FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => return Ok(fd),
                Err(Errno::WOULDBLOCK | Errno::INTR) => {}
                Err(e) => return Err(self.io("lock", path)(e)),
            }
            let waited = start.elapsed();
            if waited >= LOCK_WAIT {
                return Err(LedgerError::Busy { path, waited });
            }
            std::thread::sleep(pause.min(LOCK_WAIT - waited));
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }

    /// Reads the ledger (absent: empty); refuses a symlink and a ledger that does not
    /// parse.
    fn read(&self, dir: &OwnedFd) -> Result<Doc, LedgerError> {
        let fd = match rustix::fs::openat(
            dir,
            self.file_name(),
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => return Ok(Doc::default()),
            Err(e) => return Err(self.io("open", self.path.clone())(e)),
        };
        let mut text = String::new();
        File::from(fd)
            .read_to_string(&mut text)
            .map_err(|source| LedgerError::Io {
                what: "read",
                path: self.path.clone(),
                source,
            })?;
        if text.trim().is_empty() {
            return Ok(Doc::default());
        }
        serde_json::from_str(&text).map_err(|source| LedgerError::Corrupt {
            path: self.path.clone(),
            source,
        })
    }

    /// Writes `doc` to a fresh file and renames it over the ledger.
    fn write(&self, dir: &OwnedFd, doc: &Doc) -> Result<(), LedgerError> {
        let text = serde_json::to_string_pretty(doc).map_err(|e| LedgerError::Io {
            what: "encode",
            path: self.path.clone(),
            source: std::io::Error::other(e),
        })?;
        let tmp_name = format!("{}.{}.tmp", FILE, std::process::id());
        let tmp_path = self.dir().join(&tmp_name);
        // A leftover of a crashed writer with our pid: ours to replace.
        let _ = rustix::fs::unlinkat(dir, &tmp_name, rustix::fs::AtFlags::empty());
        let fd = rustix::fs::openat(
            dir,
            &tmp_name,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map_err(self.io("create", tmp_path.clone()))?;
        let written = File::from(fd).write_all(text.as_bytes());
        if let Err(source) = written {
            let _ = rustix::fs::unlinkat(dir, &tmp_name, rustix::fs::AtFlags::empty());
            return Err(LedgerError::Io {
                what: "write",
                path: tmp_path,
                source,
            });
        }
        rustix::fs::renameat(dir, &tmp_name, dir, self.file_name())
            .map_err(self.io("replace", self.path.clone()))
    }

    fn update(&self, change: impl FnOnce(&mut Doc)) -> Result<(), LedgerError> {
        let dir = self.open_dir()?;
        let _lock = self.lock(&dir)?;
        let mut doc = self.read(&dir)?;
        doc.entries.retain(alive);
        change(&mut doc);
        self.write(&dir, &doc)
    }

    /// Runs `decide` on the other live reservations under the lock; if it returns an
    /// entry, records it and returns its [`Reservation`].
    pub fn transaction<T, E>(
        &self,
        decide: impl FnOnce(&[Entry]) -> Result<(T, Option<Entry>), E>,
    ) -> Result<Result<(T, Option<Reservation>), E>, LedgerError> {
        let dir = self.open_dir()?;
        let _lock = self.lock(&dir)?;
        let mut doc = self.read(&dir)?;
        let before = doc.entries.len();
        doc.entries.retain(alive);
        let pruned = doc.entries.len() != before;
        match decide(&doc.entries) {
            Ok((value, Some(entry))) => {
                let id = entry.id.clone();
                doc.entries.push(entry);
                self.write(&dir, &doc)?;
                Ok(Ok((
                    value,
                    Some(Reservation {
                        ledger: self.clone(),
                        id,
                    }),
                )))
            }
            Ok((value, None)) => {
                if pruned {
                    self.write(&dir, &doc)?;
                }
                Ok(Ok((value, None)))
            }
            Err(v) => {
                if pruned {
                    self.write(&dir, &doc)?;
                }
                Ok(Err(v))
            }
        }
    }

    /// Every live reservation (for `rankexec gpus` and tests).
    pub fn entries(&self) -> Result<Vec<Entry>, LedgerError> {
        let dir = self.open_dir()?;
        let _lock = self.lock(&dir)?;
        let mut doc = self.read(&dir)?;
        doc.entries.retain(alive);
        Ok(doc.entries)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: &str, host: u64) -> Entry {
        let pid = std::process::id();
        Entry {
            id: id.into(),
            pid,
            start: start_time(pid).unwrap(),
            host,
            gpu: BTreeMap::new(),
            rank_pids: vec![],
        }
    }

    #[test]
    fn reservations_are_seen_by_the_next_transaction_and_released_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::at(dir.path().join("ledger.json"));
        let first = ledger
            .transaction(|others| {
                assert!(others.is_empty());
                Ok::<_, ()>(((), Some(entry("a", 100))))
            })
            .unwrap()
            .unwrap()
            .1
            .unwrap();
        ledger
            .transaction(|others| {
                assert_eq!(others.len(), 1);
                assert_eq!(others[0].host, 100);
                Ok::<_, ()>(((), None))
            })
            .unwrap()
            .unwrap();
        drop(first);
        assert!(ledger.entries().unwrap().is_empty());
    }

    #[test]
    fn dead_processes_are_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::at(dir.path().join("ledger.json"));
        let mut stale = entry("stale", 1);
        stale.start += 1; // a reused pid: same number, another process
        std::fs::write(
            ledger.path(),
            serde_json::to_string(&Doc {
                entries: vec![stale],
            })
            .unwrap(),
        )
        .unwrap();
        assert!(ledger.entries().unwrap().is_empty());
    }

    fn refused(ledger: &Ledger) -> LedgerError {
        ledger
            .transaction(|_| Ok::<_, ()>(((), Some(entry("x", 1)))))
            .map(drop)
            .unwrap_err()
    }

    #[test]
    fn a_planted_symlink_is_refused_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "precious").unwrap();
        let private = dir.path().join("private");
        std::fs::create_dir(&private).unwrap();
        std::os::unix::fs::symlink(&victim, private.join(FILE)).unwrap();
        let e = refused(&Ledger::at(private.join(FILE)));
        assert!(matches!(e, LedgerError::Io { what: "open", .. }), "{e}");
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        // A symlink in place of the directory is refused too.
        let linked = dir.path().join("linked");
        std::os::unix::fs::symlink(&private, &linked).unwrap();
        let e = refused(&Ledger::at(linked.join(FILE)));
        assert!(matches!(e, LedgerError::NotPrivate { .. }), "{e}");
        eprintln!("planted symlink: {}", rankexec_protocol::error_chain(&e));
    }

    #[test]
    fn a_garbage_ledger_fails_closed_and_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::at(dir.path().join(FILE));
        std::fs::write(ledger.path(), "{\"entries\": [garbage").unwrap();
        let e = refused(&ledger);
        assert!(matches!(e, LedgerError::Corrupt { .. }), "{e}");
        assert!(ledger.entries().is_err());
        assert_eq!(
            std::fs::read_to_string(ledger.path()).unwrap(),
            "{\"entries\": [garbage"
        );
        eprintln!("garbage ledger: {}", rankexec_protocol::error_chain(&e));
    }

    #[test]
    fn a_directory_that_is_not_ours_and_private_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let open = dir.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = refused(&Ledger::at(open.join(FILE)));
        assert!(matches!(e, LedgerError::NotPrivate { .. }), "{e}");
        assert!(!open.join(FILE).exists());
        // Owned by someone else: as root, give a directory away; otherwise /tmp is
        // root's (and world-writable).
        let foreign = if rustix::process::geteuid().is_root() {
            let d = dir.path().join("foreign");
            std::fs::create_dir(&d).unwrap();
            std::os::unix::fs::chown(&d, Some(65534), Some(65534)).unwrap();
            d
        } else {
            PathBuf::from("/tmp")
        };
        let e = refused(&Ledger::at(foreign.join("rankexec-test-ledger.json")));
        assert!(matches!(e, LedgerError::NotPrivate { .. }), "{e}");
        assert!(!foreign.join("rankexec-test-ledger.json").exists());
        eprintln!("foreign directory: {}", rankexec_protocol::error_chain(&e));
    }

    #[test]
    fn a_held_lock_ends_in_busy_not_a_hang() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::at(dir.path().join(FILE));
        ledger.entries().unwrap();
        // Another open file description of the lock file holds the lock.
        let holder = File::open(dir.path().join(LOCK)).unwrap();
        rustix::fs::flock(&holder, FlockOperation::LockExclusive).unwrap();
        let e = refused(&ledger);
        assert!(matches!(e, LedgerError::Busy { .. }), "{e}");
        drop(holder);
        assert!(ledger.entries().is_ok());
        eprintln!("held lock: {}", rankexec_protocol::error_chain(&e));
    }

    #[test]
    fn writes_replace_the_file_instead_of_truncating_it() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::at(dir.path().join(FILE));
        let first = ledger
            .transaction(|_| Ok::<_, ()>(((), Some(entry("a", 1)))))
            .unwrap()
            .unwrap()
            .1;
        let inode = std::fs::metadata(ledger.path()).unwrap().ino();
        drop(first);
        assert_ne!(std::fs::metadata(ledger.path()).unwrap().ino(), inode);
        assert!(ledger.entries().unwrap().is_empty());
        let leftovers: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }
}
