//! The reservation ledger: what executors on this host have promised their ranks.
//!
//! Free memory is measured before ranks allocate, so two executors starting at once
//! would both count the same free bytes (fedflow sleeps between admissions for this).
//! Each admission therefore runs as a transaction on a small JSON file, under an
//! exclusive `flock(2)`, in the user's private run directory: read the live
//! reservations, decide, and record the new one before the lock is released.
//!
//! A reservation counts only what its ranks have *not yet* allocated:
//! `max(0, reserved - measured)`, where `measured` is the ranks' resident memory (host)
//! or their NVML-reported usage (GPU), so memory is never subtracted twice. Entries of
//! processes that died (pid gone, or reused: the start time differs) are dropped.
//! A reservation is removed when its [`Reservation`] is dropped, i.e. when the group
//! stops.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use rustix::fs::FlockOperation;
use serde::{Deserialize, Serialize};

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

    fn open(&self) -> std::io::Result<File> {
        if let Some(dir) = self.path.parent() {
            use std::os::unix::fs::DirBuilderExt;
            match std::fs::DirBuilder::new()
                .mode(0o700)
                .recursive(true)
                .create(dir)
            {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e),
            }
        }
        use std::os::unix::fs::OpenOptionsExt;
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&self.path)?;
        rustix::fs::flock(&f, FlockOperation::LockExclusive)?;
        Ok(f)
    }

    fn read(f: &mut File) -> Doc {
        let mut s = String::new();
        let _ = f.read_to_string(&mut s);
        serde_json::from_str(&s).unwrap_or_default()
    }

    fn write(f: &mut File, doc: &Doc) -> std::io::Result<()> {
        let text = serde_json::to_string_pretty(doc).map_err(std::io::Error::other)?;
        f.seek(SeekFrom::Start(0))?;
        f.set_len(0)?;
        f.write_all(text.as_bytes())?;
        f.sync_data()
    }

    fn update(&self, change: impl FnOnce(&mut Doc)) -> std::io::Result<()> {
        let mut f = self.open()?;
        let mut doc = Self::read(&mut f);
        doc.entries.retain(alive);
        change(&mut doc);
        Self::write(&mut f, &doc)
    }

    /// Runs `decide` on the other live reservations under the lock; if it returns an
    /// entry, records it and returns its [`Reservation`].
    pub fn transaction<T, E>(
        &self,
        decide: impl FnOnce(&[Entry]) -> Result<(T, Option<Entry>), E>,
    ) -> std::io::Result<Result<(T, Option<Reservation>), E>> {
        let mut f = self.open()?;
        let mut doc = Self::read(&mut f);
        doc.entries.retain(alive);
        match decide(&doc.entries) {
            Ok((value, Some(entry))) => {
                let id = entry.id.clone();
                doc.entries.push(entry);
                Self::write(&mut f, &doc)?;
                Ok(Ok((
                    value,
                    Some(Reservation {
                        ledger: self.clone(),
                        id,
                    }),
                )))
            }
            Ok((value, None)) => {
                Self::write(&mut f, &doc)?;
                Ok(Ok((value, None)))
            }
            Err(v) => {
                Self::write(&mut f, &doc)?;
                Ok(Err(v))
            }
        }
    }

    /// Every live reservation (for `rankexec gpus` and tests).
    pub fn entries(&self) -> std::io::Result<Vec<Entry>> {
        let mut f = self.open()?;
        let mut doc = Self::read(&mut f);
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
}
