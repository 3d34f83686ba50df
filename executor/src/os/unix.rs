//! Process facts from the OS, for the executor.
//!
//! - **pidfds** ([pidfd_open(2)](https://man7.org/linux/man-pages/man2/pidfd_open.2.html)):
//!   a descriptor that becomes readable when its process exits. One thread polls every
//!   rank's pidfd, so exits are seen at once without polling on a timer, and a pidfd
//!   always names the process it was opened for, even after its pid is reused.
//! - **reaping** with `waitid(P_PIDFD, WEXITED | WNOHANG)`: only for our own children;
//!   with `WNOWAIT` to read an exit status while keeping the zombie (see
//!   [`peek_exit`]).
//! - **signals** to a process through its pidfd (race-free) and to a process group with
//!   `killpg` ([killpg(3)](https://man7.org/linux/man-pages/man3/killpg.3.html)).
//! - **an eventfd** to wake a thread blocked in `poll`.
//! - **the cgroup `oom_kill` counter**, to tell an OOM-killer death from any other
//!   `SIGKILL` without parsing logs.
//! - **a clean signal state for what we spawn**: `exec` keeps ignored signals and the
//!   blocked mask, so a host started as a script's background job (`cmd &` ignores
//!   `SIGINT` and `SIGQUIT`) would hand that on to every rank; see
//!   [`reset_signals_on_exec`].
//! - **a launcher that leaves with its host**: [`term_with_parent_on_exec`].

use std::fmt;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::Duration;

use nix::sys::signal::Signal;
use nix::unistd::Pid;
use rustix::event::{EventfdFlags, PollFd, PollFlags, Timespec};
use rustix::process::{PidfdFlags, WaitId, WaitIdOptions};

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitStatus {
    /// It exited with this code.
    Code(i32),
    /// A signal killed it.
    Signal {
        /// The signal number.
        signal: i32,
        /// Whether it dumped core.
        core_dumped: bool,
    },
    /// It is gone, but it was not our child, so its status is unknown.
    Unknown,
}

impl ExitStatus {
    /// Whether the process exited with code 0.
    pub fn success(&self) -> bool {
        matches!(self, ExitStatus::Code(0))
    }

    /// The signal that killed it, if one did.
    pub fn signal(&self) -> Option<i32> {
        match self {
            ExitStatus::Signal { signal, .. } => Some(*signal),
            _ => None,
        }
    }
}

/// The name of a signal number (`SIGKILL`), or `signal N`.
pub fn signal_name(signal: i32) -> String {
    Signal::try_from(signal).map_or_else(|_| format!("signal {signal}"), |s| s.as_str().to_owned())
}

impl fmt::Display for ExitStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExitStatus::Code(c) => write!(f, "exit code {c}"),
            ExitStatus::Signal {
                signal,
                core_dumped,
            } => {
                write!(f, "signal {signal} ({})", signal_name(*signal))?;
                if *core_dumped {
                    f.write_str(", core dumped")?;
                }
                Ok(())
            }
            ExitStatus::Unknown => f.write_str("an unknown status (not our child)"),
        }
    }
}

/// The signals teardown sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TermSignal {
    /// `SIGTERM`: please exit.
    Term,
    /// `SIGKILL`: exit now.
    Kill,
}

impl TermSignal {
    fn nix(self) -> Signal {
        match self {
            TermSignal::Term => Signal::SIGTERM,
            TermSignal::Kill => Signal::SIGKILL,
        }
    }

    fn rustix(self) -> rustix::process::Signal {
        match self {
            TermSignal::Term => rustix::process::Signal::TERM,
            TermSignal::Kill => rustix::process::Signal::KILL,
        }
    }

    /// The signal's name.
    pub fn name(self) -> &'static str {
        self.nix().as_str()
    }
}

/// Opens a pidfd for `pid`.
pub(crate) fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    let pid = rustix::process::Pid::from_raw(pid as i32)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "pid 0"))?;
    Ok(rustix::process::pidfd_open(pid, PidfdFlags::empty())?)
}

/// Reaps our exited child without blocking; `Ok(None)` if it is still running.
pub(crate) fn reap(pidfd: &OwnedFd) -> io::Result<Option<ExitStatus>> {
    wait_pidfd(pidfd, WaitIdOptions::empty())
}

/// Reads our exited child's status without reaping it (`WNOWAIT`): it stays a zombie,
/// so its pid, and the id of the process group it leads, cannot be reused while we
/// hold it. `Ok(None)` if it is still running; an error (`ECHILD`) once it has been
/// reaped, by us or by anyone else in this process.
pub(crate) fn peek_exit(pidfd: &OwnedFd) -> io::Result<Option<ExitStatus>> {
    wait_pidfd(pidfd, WaitIdOptions::NOWAIT)
}

fn wait_pidfd(pidfd: &OwnedFd, extra: WaitIdOptions) -> io::Result<Option<ExitStatus>> {
    let status = rustix::process::waitid(
        WaitId::PidFd(pidfd.as_fd()),
        WaitIdOptions::EXITED | WaitIdOptions::NOHANG | extra,
    )?;
    Ok(status.and_then(|s| {
        if let Some(code) = s.exit_status() {
            Some(ExitStatus::Code(code))
        } else {
            s.terminating_signal().map(|signal| ExitStatus::Signal {
                signal,
                core_dumped: s.dumped(),
            })
        }
    }))
}

/// Signals one process through its pidfd.
pub(crate) fn signal_pidfd(pidfd: &OwnedFd, sig: TermSignal) -> io::Result<()> {
    Ok(rustix::process::pidfd_send_signal(pidfd, sig.rustix())?)
}

/// Signals every process of a group. Refuses our own group (and group 0 or 1, which
/// `killpg` would read as "ours" or "everyone").
pub(crate) fn signal_group(pgid: u32, sig: TermSignal) -> io::Result<()> {
    if pgid <= 1 || pgid == own_pgid() {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("process group {pgid} is the host's own or not a group"),
        ));
    }
    nix::sys::signal::killpg(Pid::from_raw(pgid as i32), sig.nix()).map_err(io::Error::from)
}

/// Our process group.
pub(crate) fn own_pgid() -> u32 {
    rustix::process::getpgrp().as_raw_nonzero().get() as u32
}

/// The process group of `pid`, as the OS says.
pub(crate) fn pgid_of(pid: u32) -> io::Result<u32> {
    let pid = rustix::process::Pid::from_raw(pid as i32)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "pid 0"))?;
    Ok(rustix::process::getpgid(Some(pid))?.as_raw_nonzero().get() as u32)
}

/// Whether the process behind `pidfd` has exited (its pidfd is readable).
pub(crate) fn exited(pidfd: &OwnedFd) -> io::Result<bool> {
    Ok(poll_readable(&[pidfd.as_fd()], Some(Duration::ZERO))?[0])
}

/// Whether `SIGCHLD` is ignored or set to `SA_NOCLDWAIT`: the kernel then reaps our
/// children itself, so their exit status is lost and their pids may be reused while
/// we still hold them for signalling.
pub(crate) fn sigchld_discards_children() -> io::Result<bool> {
    let mut old = std::mem::MaybeUninit::<libc::sigaction>::zeroed();
    // SAFETY: `sigaction` with a null new action only reads the current disposition
    // into `old`, which is a valid, zeroed `struct sigaction` we own; it installs
    // nothing and runs nothing in signal context. Tested by
    // `sigchld_disposition_is_read` below and `tests/sigchld_ignored.rs`.
    let rc = unsafe { libc::sigaction(libc::SIGCHLD, std::ptr::null(), old.as_mut_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `sigaction` returned 0, so it filled `old`; it was zeroed before anyway.
    let old = unsafe { old.assume_init() };
    Ok(old.sa_sigaction == libc::SIG_IGN || old.sa_flags & libc::SA_NOCLDWAIT != 0)
}

/// Makes the process `cmd` spawns start with every signal at its default action and
/// none blocked, as service managers do. `exec` resets handlers but keeps ignored
/// signals and the blocked mask: without this, a host started with `&` from a script
/// (`SIGINT` and `SIGQUIT` ignored) would give every rank an ignored `SIGINT`, and
/// Python ranks would then install no `KeyboardInterrupt` handler.
pub(crate) fn reset_signals_on_exec(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt as _;
    // Realtime signals included; read in the parent (glibc's SIGRTMAX is a function).
    let last = libc::SIGRTMAX();
    // SAFETY: the closure runs in the child between fork and exec, where only
    // async-signal-safe calls are allowed: it calls `sigaction` and `sigprocmask`
    // (both on POSIX's list) and `sigemptyset` on its own stack values, allocates
    // nothing and takes no lock. Errors are ignored on purpose: `SIGKILL`, `SIGSTOP` and
    // the C library's reserved realtime signals refuse a new action (EINVAL), which
    // leaves them as they must be. Tested by `tests/signal_reset.rs` (ranks of a host
    // that ignores SIGINT/SIGQUIT and blocks SIGUSR1 have neither, per /proc).
    unsafe {
        cmd.pre_exec(move || {
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            libc::sigemptyset(&mut dfl.sa_mask);
            for sig in 1..=last {
                libc::sigaction(sig, &dfl, std::ptr::null_mut());
            }
            let mut none: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut none);
            libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
            Ok(())
        });
    }
}

/// Makes the process `cmd` spawns receive `SIGTERM` when the thread that spawned it
/// exits (`PR_SET_PDEATHSIG`, kept across `exec`), for an external launcher (srun,
/// torchrun, mpirun): it is not a rank, so nothing else tells it that a `SIGKILL`ed host
/// is gone, and it would keep its step, its workers' supervision and its allocation
/// until its workers' exit reached it. `SIGTERM` is each launcher's own way to stop
/// (srun cancels its step and gives its allocation back, torchrun and mpirun stop
/// their workers). If the host already died between `fork` and the `prctl`, the spawn
/// fails instead of starting an orphan.
pub(crate) fn term_with_parent_on_exec(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt as _;
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs in the child between fork and exec, where only
    // async-signal-safe calls are allowed: `prctl` and `getppid` are plain system calls
    // (no allocation, no lock); the error is built from an errno value without
    // allocating. Tested by `tests/host_death_load.rs` (a SIGKILLed host's torchrun
    // and mpirun leave with it).
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong) != 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

/// Our pid.
pub(crate) fn own_pid() -> u32 {
    std::process::id()
}

/// Wakes a thread blocked in [`poll_readable`].
pub(crate) struct Waker {
    fd: OwnedFd,
}

impl Waker {
    pub(crate) fn new() -> io::Result<Waker> {
        Ok(Waker {
            fd: rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?,
        })
    }

    /// Makes the waker readable.
    pub(crate) fn wake(&self) {
        let _ = rustix::io::write(&self.fd, &1u64.to_ne_bytes());
    }

    /// Resets it.
    pub(crate) fn drain(&self) {
        let mut buf = [0u8; 8];
        let _ = rustix::io::read(&self.fd, &mut buf);
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Waits until any of `fds` is readable (or hung up); returns which are. `None` waits
/// without a deadline: callers always include a [`Waker`] so they can be stopped.
pub(crate) fn poll_readable(
    fds: &[BorrowedFd<'_>],
    timeout: Option<Duration>,
) -> io::Result<Vec<bool>> {
    let mut pfds: Vec<PollFd<'_>> = fds
        .iter()
        .map(|fd| PollFd::from_borrowed_fd(*fd, PollFlags::IN))
        .collect();
    let ts = timeout.map(|d| Timespec {
        tv_sec: d.as_secs() as i64,
        tv_nsec: d.subsec_nanos() as i64,
    });
    loop {
        match rustix::event::poll(&mut pfds, ts.as_ref()) {
            Ok(_) => break,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(pfds.iter().map(|p| !p.revents().is_empty()).collect())
}

/// The OOM-kill counter of a process's memory cgroup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OomCounter {
    /// The file the counter is read from.
    pub file: std::path::PathBuf,
    /// How many processes the kernel's OOM killer had killed in that cgroup.
    pub kills: u64,
}

fn oom_field(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|v| v.trim().parse::<u64>().ok())
}

/// Finds and reads the OOM-kill counter of `pid`'s memory cgroup: `memory.oom_control`
/// on cgroup v1, `memory.events` on v2. Read it while the process lives (a dead
/// process leaves its cgroup), then [`OomCounter::reread`] it after a `SIGKILL`.
pub(crate) fn oom_kills(pid: u32) -> Option<OomCounter> {
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let mut candidates = Vec::new();
    for line in cgroups.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if controllers.split(',').any(|c| c == "memory") {
            candidates.push(std::path::PathBuf::from(format!(
                "/sys/fs/cgroup/memory{path}/memory.oom_control"
            )));
        } else if controllers.is_empty() {
            candidates.push(std::path::PathBuf::from(format!(
                "/sys/fs/cgroup{path}/memory.events"
            )));
        }
    }
    candidates.into_iter().find_map(|file| {
        let kills = oom_field(&std::fs::read_to_string(&file).ok()?)?;
        Some(OomCounter { file, kills })
    })
}

impl OomCounter {
    /// The counter now, from the same file.
    pub(crate) fn reread(&self) -> Option<u64> {
        oom_field(&std::fs::read_to_string(&self.file).ok()?)
    }
}

/// Whether `pid` is stopped (`SIGSTOP`, `SIGTSTP`, or a tracer): such a process
/// answers nothing and acts on no signal but `SIGKILL` until it is continued. False
/// when the process cannot be read (gone, or another's).
pub(crate) fn is_stopped(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The state follows the command name, which is in parentheses and may hold any byte.
    stat.rfind(')')
        .and_then(|i| stat[i + 1..].split_whitespace().next())
        .is_some_and(|state| state == "T" || state == "t")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;
    use std::process::Command;
    use std::time::Instant;

    #[test]
    #[expect(
        clippy::zombie_processes,
        reason = "reaped through the pidfd, not Child::wait"
    )]
    fn pidfd_sees_exit_and_reaps_status() {
        let child = Command::new("sh").args(["-c", "exit 7"]).spawn().unwrap();
        let fd = pidfd_open(child.id()).unwrap();
        let ready = poll_readable(&[fd.as_fd()], Some(Duration::from_secs(10))).unwrap();
        assert!(ready[0]);
        assert_eq!(reap(&fd).unwrap(), Some(ExitStatus::Code(7)));
    }

    #[test]
    #[expect(
        clippy::zombie_processes,
        reason = "reaped through the pidfd, not Child::wait"
    )]
    fn group_signal_reaches_every_member() {
        let child = Command::new("sh")
            .args(["-c", "sleep 30 & sleep 30; wait"])
            .process_group(0)
            .spawn()
            .unwrap();
        let fd = pidfd_open(child.id()).unwrap();
        assert_eq!(reap(&fd).unwrap(), None, "still running");
        signal_group(child.id(), TermSignal::Kill).unwrap();
        let t = Instant::now();
        poll_readable(&[fd.as_fd()], Some(Duration::from_secs(10))).unwrap();
        assert!(t.elapsed() < Duration::from_secs(10));
        let st = reap(&fd).unwrap().unwrap();
        assert_eq!(st.signal(), Some(9));
        assert_eq!(st.to_string(), "signal 9 (SIGKILL)");
    }

    #[test]
    #[expect(
        clippy::zombie_processes,
        reason = "reaped through the pidfd, not Child::wait"
    )]
    fn a_stopped_process_reads_as_stopped() {
        let child = Command::new("sleep").arg("30").spawn().unwrap();
        let fd = pidfd_open(child.id()).unwrap();
        assert!(!is_stopped(child.id()));
        // Our unreaped child: its pid cannot have been reused.
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            Signal::SIGSTOP,
        )
        .unwrap();
        let t = Instant::now();
        while !is_stopped(child.id()) {
            assert!(t.elapsed() < Duration::from_secs(10), "never seen stopped");
            std::thread::sleep(Duration::from_millis(5));
        }
        signal_pidfd(&fd, TermSignal::Kill).unwrap();
        poll_readable(&[fd.as_fd()], Some(Duration::from_secs(10))).unwrap();
        reap(&fd).unwrap();
        assert!(!is_stopped(child.id()), "a reaped process is not stopped");
    }

    #[test]
    #[expect(
        clippy::zombie_processes,
        reason = "reaped through the pidfd, not Child::wait"
    )]
    fn a_peeked_leader_keeps_its_group_until_reaped() {
        // The leader exits at once and leaves a member behind in its group.
        let child = Command::new("sh")
            .args(["-c", "sleep 30 >/dev/null & echo $!"])
            .stdout(std::process::Stdio::piped())
            .process_group(0)
            .spawn()
            .unwrap();
        let leader = child.id();
        let mut out = String::new();
        // The member's output goes elsewhere, so the pipe ends with the leader.
        std::io::Read::read_to_string(&mut child.stdout.unwrap(), &mut out).unwrap();
        let member: u32 = out.trim().parse().unwrap();
        let fd = pidfd_open(leader).unwrap();
        poll_readable(&[fd.as_fd()], Some(Duration::from_secs(10))).unwrap();
        // Peeking twice reads the same status and reaps nothing.
        assert_eq!(peek_exit(&fd).unwrap(), Some(ExitStatus::Code(0)));
        assert_eq!(peek_exit(&fd).unwrap(), Some(ExitStatus::Code(0)));
        assert_eq!(pgid_of(member).unwrap(), leader);
        // The zombie leader pins the group id: the member is signalled through it.
        let member_fd = pidfd_open(member).unwrap();
        signal_group(leader, TermSignal::Kill).unwrap();
        let ready = poll_readable(&[member_fd.as_fd()], Some(Duration::from_secs(10))).unwrap();
        assert!(ready[0], "the member outlived SIGKILL to its group");
        assert_eq!(reap(&fd).unwrap(), Some(ExitStatus::Code(0)));
        // Reaped: a peek now fails, which is how a reaped leader is told apart.
        assert!(peek_exit(&fd).is_err());
    }

    #[test]
    fn sigchld_disposition_is_read() {
        // The test harness leaves SIGCHLD at its default.
        assert!(!sigchld_discards_children().unwrap());
    }

    #[test]
    fn own_group_is_never_signalled() {
        let e = signal_group(own_pgid(), TermSignal::Term).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied);
        assert!(signal_group(1, TermSignal::Term).is_err());
        assert_eq!(pgid_of(std::process::id()).unwrap(), own_pgid());
    }

    #[test]
    fn waker_interrupts_poll() {
        let w = Waker::new().unwrap();
        w.wake();
        let r = poll_readable(&[w.fd()], Some(Duration::from_secs(5))).unwrap();
        assert!(r[0]);
        w.drain();
        let r = poll_readable(&[w.fd()], Some(Duration::from_millis(10))).unwrap();
        assert!(!r[0]);
    }
}
