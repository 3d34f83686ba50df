//! The processes of a rank group, and the rule that keeps signals and reaping safe.
//!
//! Every process we track has a pidfd. Our own children are reaped only by
//! `ProcessTable::reap`, which holds the table lock, and signals are sent only while
//! holding the same lock and only to processes (or groups with a member) not yet
//! reaped. An unreaped child keeps its pid, and a process group with an unreaped member
//! keeps its id, so a signal can never reach an unrelated process that reused a pid.
//! Processes that are not our children (ranks started by torchrun or mpirun) are
//! signalled through their pidfds, which cannot be reused either.

use std::collections::BTreeSet;
use std::fmt;
use std::os::fd::OwnedFd;
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::os::{self, ExitStatus, TermSignal};

/// What a signal is sent to: one process, or a whole process group. The distinction
/// lives in the type, not in the sign of a number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ChildPid {
    /// One process.
    Process(u32),
    /// Every process of the group with this id.
    ProcessGroup(u32),
}

impl fmt::Display for ChildPid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChildPid::Process(p) => write!(f, "pid {p}"),
            ChildPid::ProcessGroup(g) => write!(f, "process group {g}"),
        }
    }
}

/// Which part of the group a process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A rank we spawned ourselves.
    Rank(u32),
    /// An external launcher we spawned (torchrun, mpirun, srun).
    Launcher,
    /// A rank started by a launcher: not our child; known from its hello.
    ExternalRank(u32),
}

struct Entry {
    role: Role,
    pid: u32,
    pgid: u32,
    pidfd: OwnedFd,
    child: bool,
    status: Option<ExitStatus>,
}

/// The processes of one group.
#[derive(Default)]
pub(crate) struct ProcessTable {
    entries: Mutex<Vec<Entry>>,
}

/// A tracked process, as seen from outside the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcInfo {
    /// Its role.
    pub role: Role,
    /// Its pid.
    pub pid: u32,
    /// Its process group.
    pub pgid: u32,
    /// How it ended, if it has.
    pub status: Option<ExitStatus>,
}

impl ProcessTable {
    fn lock(&self) -> MutexGuard<'_, Vec<Entry>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Tracks a process through a pidfd already opened for it. Returns its index and a
    /// duplicate pidfd for the exit watcher.
    pub(crate) fn add(
        &self,
        role: Role,
        pid: u32,
        pgid: u32,
        pidfd: OwnedFd,
        child: bool,
    ) -> std::io::Result<(usize, OwnedFd)> {
        let dup = pidfd.try_clone()?;
        let mut entries = self.lock();
        entries.push(Entry {
            role,
            pid,
            pgid,
            pidfd,
            child,
            status: None,
        });
        Ok((entries.len() - 1, dup))
    }

    /// Records that process `index` has exited (its pidfd is readable) and reaps it if
    /// it is our child. Returns its role, pid and status.
    pub(crate) fn reap(&self, index: usize) -> Option<(Role, u32, ExitStatus)> {
        let mut entries = self.lock();
        let e = entries.get_mut(index)?;
        if let Some(st) = e.status {
            return Some((e.role, e.pid, st));
        }
        let status = if e.child {
            match os::reap(&e.pidfd) {
                Ok(Some(st)) => st,
                // Readable but not yet reapable cannot happen for an exited child; treat
                // an error as unknown rather than spin.
                Ok(None) => return None,
                Err(_) => ExitStatus::Unknown,
            }
        } else {
            ExitStatus::Unknown
        };
        e.status = Some(status);
        Some((e.role, e.pid, status))
    }

    /// Sends `sig` to every group that still has a live member and to every live process
    /// that is not in one of those groups. Returns the targets signalled.
    pub(crate) fn signal_all(&self, sig: TermSignal) -> Vec<ChildPid> {
        let entries = self.lock();
        let live_groups: BTreeSet<u32> = entries
            .iter()
            .filter(|e| e.status.is_none() && e.child)
            .map(|e| e.pgid)
            .collect();
        let mut sent = Vec::new();
        for pgid in &live_groups {
            match os::signal_group(*pgid, sig) {
                Ok(()) => sent.push(ChildPid::ProcessGroup(*pgid)),
                Err(e) => tracing::debug!(pgid, error = %e, "group signal failed"),
            }
        }
        for e in entries.iter().filter(|e| e.status.is_none()) {
            if e.child && live_groups.contains(&e.pgid) {
                continue;
            }
            // Not our child: its own group (torchrun and mpirun give each rank one) may
            // hold its children too. Signal the group only while its leader is alive.
            if !e.child && e.pgid == e.pid {
                if os::signal_group(e.pgid, sig).is_ok() {
                    sent.push(ChildPid::ProcessGroup(e.pgid));
                }
                continue;
            }
            match os::signal_pidfd(&e.pidfd, sig) {
                Ok(()) => sent.push(ChildPid::Process(e.pid)),
                Err(err) => tracing::debug!(pid = e.pid, error = %err, "signal failed"),
            }
        }
        sent
    }

    /// Tracks a rank that an external launcher started, by what the kernel says of its
    /// connection (never by what its hello claims). A TCP peer (perhaps on another
    /// host), a process already gone, and the host itself are not tracked: nothing of
    /// theirs is ever signalled. Returns the index and a pidfd for the exit watcher.
    pub(crate) fn add_peer(
        &self,
        rank: u32,
        peer: crate::session::accept::PeerProcess,
    ) -> Option<(usize, OwnedFd)> {
        use crate::session::accept::PeerProcess;
        let PeerProcess::Local { pid, pgid, pidfd } = peer else {
            tracing::debug!(rank, ?peer, "rank not tracked: no local process to hold");
            return None;
        };
        if pid == os::own_pid() {
            tracing::warn!(
                rank,
                pid,
                "rank's connection comes from the host itself; not tracked"
            );
            return None;
        }
        match self.add(Role::ExternalRank(rank), pid, pgid, pidfd, false) {
            Ok(added) => Some(added),
            Err(e) => {
                tracing::warn!(rank, pid, error = %e, "cannot watch the rank's process");
                None
            }
        }
    }

    /// Whether every tracked process has exited.
    pub(crate) fn all_exited(&self) -> bool {
        self.lock().iter().all(|e| e.status.is_some())
    }

    /// Pids not yet seen to exit.
    pub(crate) fn live_pids(&self) -> Vec<u32> {
        self.lock()
            .iter()
            .filter(|e| e.status.is_none())
            .map(|e| e.pid)
            .collect()
    }

    /// Everything tracked.
    pub(crate) fn snapshot(&self) -> Vec<ProcInfo> {
        self.lock()
            .iter()
            .map(|e| ProcInfo {
                role: e.role,
                pid: e.pid,
                pgid: e.pgid,
                status: e.status,
            })
            .collect()
    }

    /// Whether a rank's process is tracked already.
    pub(crate) fn has_rank(&self, rank: u32) -> bool {
        self.lock()
            .iter()
            .any(|e| matches!(e.role, Role::Rank(r) | Role::ExternalRank(r) if r == rank))
    }
}
