//! The processes of a rank group, and the rule that keeps signals and reaping safe.
//!
//! Every process we track has a pidfd. Our own children are reaped only by the table,
//! which holds its lock, and signals are sent only while holding the same lock and only
//! to processes (or groups with a member) not yet reaped. An unreaped child keeps its
//! pid, and a process group with an unreaped member keeps its id, so a signal can never
//! reach an unrelated process that reused a pid.
//!
//! A child that leads a process group (rank 0 of the built-in launcher, a rank in a
//! group of its own, an external launcher) is **not reaped when it exits**: its status
//! is read with `WNOWAIT` and it stays a zombie, which pins the group id. Whatever it
//! left behind in its group (a DataLoader worker, a `sleep &`) can then still be
//! signalled through the group by every teardown stage, and `ProcessTable::release`
//! sends the group a last `SIGKILL` before it finally reaps the leader. Before a dead
//! leader's group is signalled, the leader is checked to be still unreaped (someone
//! else in the host, say a stray `waitpid(-1)`, may have reaped it); if it is not, its
//! group is never signalled.
//!
//! Processes that are not our children (ranks started by torchrun or mpirun) are
//! signalled through their pidfds, which cannot be reused either, and their group only
//! while they are alive: their zombies are not ours to keep, so a child such a rank
//! leaves behind after it dies escapes (README, "Caveats").

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
    /// Our child, reaped: its pid (and group id, if it led one) may be reused.
    reaped: bool,
}

impl Entry {
    fn leads_group(&self) -> bool {
        self.pid == self.pgid
    }

    /// Whether this is our child, leads its group, and is an unreaped zombie now: its
    /// group id cannot have been reused. Asks the kernel, so a leader reaped behind our
    /// back reads as not held.
    fn holds_dead_group(&self) -> bool {
        self.child
            && self.leads_group()
            && self.status.is_some()
            && !self.reaped
            && matches!(os::peek_exit(&self.pidfd), Ok(Some(_)))
    }
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

impl Drop for ProcessTable {
    /// A table dropped without teardown's end (a panic, an early return) still leaves
    /// no zombie leader and nothing its dead ranks left behind.
    fn drop(&mut self) {
        let sent = self.release();
        if !sent.is_empty() {
            tracing::debug!(targets = ?sent, "sent SIGKILL to dead leaders' groups on drop");
        }
    }
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
            reaped: false,
        });
        Ok((entries.len() - 1, dup))
    }

    /// Records that process `index` has exited (its pidfd is readable) and, if it is
    /// our child, reads its status. A child that leads its group stays an unreaped
    /// zombie (see the module docs and [`ProcessTable::release`]); any other child is
    /// reaped. Returns its role, pid and status.
    pub(crate) fn reap(&self, index: usize) -> Option<(Role, u32, ExitStatus)> {
        let mut entries = self.lock();
        let e = entries.get_mut(index)?;
        if let Some(st) = e.status {
            return Some((e.role, e.pid, st));
        }
        let status = if e.child {
            let keep = e.leads_group();
            let read = if keep {
                os::peek_exit(&e.pidfd)
            } else {
                os::reap(&e.pidfd)
            };
            match read {
                Ok(Some(st)) => {
                    e.reaped = !keep;
                    st
                }
                // Readable but not yet reapable cannot happen for an exited child; treat
                // an error as unknown rather than spin.
                Ok(None) => return None,
                Err(_) => {
                    // Reaped by someone else: its ids are no longer ours.
                    e.reaped = true;
                    ExitStatus::Unknown
                }
            }
        } else {
            ExitStatus::Unknown
        };
        e.status = Some(status);
        Some((e.role, e.pid, status))
    }

    /// Sends `SIGKILL` to the group of every dead group leader still held as a zombie
    /// (what its members left behind), then reaps the leader. Call once no rank of the
    /// group should live (teardown's end); idempotent. Returns the groups signalled.
    pub(crate) fn release(&self) -> Vec<ChildPid> {
        let mut entries = self.lock();
        let mut sent = Vec::new();
        for e in entries.iter_mut() {
            if !(e.child && e.status.is_some() && !e.reaped) {
                continue;
            }
            // Signal first: once the leader is reaped, its group id may be reused.
            if e.holds_dead_group() {
                match os::signal_group(e.pgid, TermSignal::Kill) {
                    Ok(()) => sent.push(ChildPid::ProcessGroup(e.pgid)),
                    Err(err) => tracing::debug!(pgid = e.pgid, error = %err, "group signal failed"),
                }
            }
            if let Err(err) = os::reap(&e.pidfd) {
                tracing::debug!(pid = e.pid, error = %err, "reaping a group leader failed");
            }
            e.reaped = true;
        }
        sent
    }

    /// Sends `sig` to every group that still has a live member of ours or a dead leader
    /// we hold as a zombie (what the dead left behind), and to every live process that
    /// is not in one of those groups. Returns the targets signalled.
    pub(crate) fn signal_all(&self, sig: TermSignal) -> Vec<ChildPid> {
        let entries = self.lock();
        let live_groups: BTreeSet<u32> = entries
            .iter()
            .filter(|e| (e.status.is_none() && e.child) || e.holds_dead_group())
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};
    use std::time::Duration;

    /// A group leader that exits at once, leaving a `sleep` in its group. Returns the
    /// leader's pid and pidfd, and the member's pid and pidfd (opened while the leader
    /// is unreaped, so they name the right processes).
    #[expect(
        clippy::zombie_processes,
        reason = "reaped through the pidfd, not Child::wait"
    )]
    fn leader_leaving_a_member() -> (u32, OwnedFd, u32, OwnedFd) {
        let child = Command::new("sh")
            .args(["-c", "sleep 30 >/dev/null & echo $!"])
            .stdout(Stdio::piped())
            .process_group(0)
            .spawn()
            .unwrap();
        let leader = child.id();
        let fd = os::pidfd_open(leader).unwrap();
        let mut out = String::new();
        // The member's output goes elsewhere, so the pipe ends with the leader.
        std::io::Read::read_to_string(&mut child.stdout.unwrap(), &mut out).unwrap();
        let member: u32 = out.trim().parse().unwrap();
        let member_fd = os::pidfd_open(member).unwrap();
        assert_eq!(os::pgid_of(member).unwrap(), leader);
        let ready = os::poll_readable(&[fd.as_fd()], Some(Duration::from_secs(10))).unwrap();
        assert!(ready[0], "the leader never exited");
        (leader, fd, member, member_fd)
    }

    fn exits_within(fd: &OwnedFd, within: Duration) -> bool {
        os::poll_readable(&[fd.as_fd()], Some(within)).unwrap()[0]
    }

    #[test]
    fn a_dead_leader_is_held_and_its_group_signalled_before_it_is_reaped() {
        let (leader, fd, _member, member_fd) = leader_leaving_a_member();
        let table = ProcessTable::default();
        let (i, _dup) = table.add(Role::Rank(0), leader, leader, fd, true).unwrap();
        let (_, pid, status) = table.reap(i).unwrap();
        assert_eq!((pid, status), (leader, ExitStatus::Code(0)));
        assert!(table.all_exited());
        // Still a zombie: its status can be read again, so its pid and group are held.
        let held = table.lock()[i].holds_dead_group();
        assert!(held, "the dead leader was reaped");
        // A teardown stage reaches what it left behind through the held group.
        let sent = table.signal_all(TermSignal::Term);
        assert_eq!(sent, vec![ChildPid::ProcessGroup(leader)]);
        assert!(
            exits_within(&member_fd, Duration::from_secs(10)),
            "the member outlived SIGTERM to its group"
        );
        // The end of teardown: one last SIGKILL, then the leader is reaped, once.
        assert_eq!(table.release(), vec![ChildPid::ProcessGroup(leader)]);
        assert!(os::peek_exit(&table.lock()[i].pidfd).is_err(), "not reaped");
        assert!(table.release().is_empty());
        assert!(table.signal_all(TermSignal::Kill).is_empty());
    }

    #[test]
    fn a_leader_reaped_behind_the_tables_back_never_has_its_group_signalled() {
        let (leader, fd, member, member_fd) = leader_leaving_a_member();
        let outside = fd.try_clone().unwrap();
        let table = ProcessTable::default();
        let (i, _dup) = table.add(Role::Rank(0), leader, leader, fd, true).unwrap();
        table.reap(i).unwrap();
        // Someone else in the host reaps it (a stray `waitpid(-1)`): from now on its
        // group id may be reused, so the table must not signal it.
        assert_eq!(os::reap(&outside).unwrap(), Some(ExitStatus::Code(0)));
        assert!(table.signal_all(TermSignal::Kill).is_empty());
        assert!(table.release().is_empty());
        assert!(
            !exits_within(&member_fd, Duration::ZERO),
            "the member {member} was signalled through an unheld group"
        );
        os::signal_pidfd(&member_fd, TermSignal::Kill).unwrap();
        assert!(exits_within(&member_fd, Duration::from_secs(10)));
    }

    #[test]
    #[expect(
        clippy::zombie_processes,
        reason = "reaped through the pidfd, not Child::wait"
    )]
    fn a_dead_member_rank_is_reaped_at_once() {
        let leader = Command::new("sleep")
            .arg("30")
            .process_group(0)
            .spawn()
            .unwrap();
        let lpid = leader.id();
        let lfd = os::pidfd_open(lpid).unwrap();
        let member = Command::new("true")
            .process_group(lpid as i32)
            .spawn()
            .unwrap();
        let mpid = member.id();
        let mfd = os::pidfd_open(mpid).unwrap();
        let table = ProcessTable::default();
        let (li, _) = table.add(Role::Rank(0), lpid, lpid, lfd, true).unwrap();
        let (mi, _) = table.add(Role::Rank(1), mpid, lpid, mfd, true).unwrap();
        assert!(exits_within(
            &table.lock()[mi].pidfd,
            Duration::from_secs(10)
        ));
        table.reap(mi).unwrap();
        assert!(
            table.lock()[mi].reaped,
            "a member pins nothing: reaped at once"
        );
        // The live leader's group is signalled as before.
        assert_eq!(
            table.signal_all(TermSignal::Kill),
            vec![ChildPid::ProcessGroup(lpid)]
        );
        assert!(exits_within(
            &table.lock()[li].pidfd,
            Duration::from_secs(10)
        ));
        let (_, _, st) = table.reap(li).unwrap();
        assert_eq!(st.signal(), Some(9));
        // The killed leader was held until the end; then reaped.
        assert!(!table.lock()[li].reaped);
        assert_eq!(table.release(), vec![ChildPid::ProcessGroup(lpid)]);
        assert!(table.lock()[li].reaped);
    }
}
