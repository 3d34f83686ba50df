//! Process facts a rank needs from the OS.
//!
//! - `die_with_parent`: `PR_SET_PDEATHSIG(SIGKILL)`
//!   ([prctl(2)](https://man7.org/linux/man-pages/man2/prctl.2.html)). The signal fires
//!   when the *thread* that forked us exits, which is why the executor spawns ranks from
//!   one long-lived thread. The parent may already have died before the `prctl` call, so
//!   the rank compares `getppid()` with the pid it was given right after.
//! - `mapped_inode`: the inode of the file mapped at an address (`/proc/self/maps`),
//!   so the `Digest` component can prove a blob is the parent's memory file itself.
//! - `exit_after`: `_exit(2)` after a last log line and flushing our own
//!   output (waited for briefly: a stalled reader of our stdout or stderr never keeps
//!   us), for exits from a thread while others run.
//! - `ignore_sigterm`: used only by the built-in `Sleep` component to play a rank that
//!   refuses to stop, so tests can prove the executor escalates to `SIGKILL`.
//! - `wait_readable`: `poll(2)` on a few descriptors, for a foreign rank's caller that
//!   waits for its exec channel and its doorbell at once.

use nix::sys::signal::{SigHandler, Signal};
use nix::unistd::{Pid, getpgrp, getpid, getppid};

/// Asks the kernel to `SIGKILL` this process when its parent thread exits, then checks
/// the parent is still `expected_parent`. Returns `false` if the parent is already gone.
pub(crate) fn die_with_parent(expected_parent: u32) -> std::io::Result<bool> {
    nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(std::io::Error::from)?;
    Ok(getppid() == Pid::from_raw(expected_parent as i32))
}

/// How long a dying rank waits for its last log line and its flushed output.
pub(crate) const LAST_WORDS: std::time::Duration = std::time::Duration::from_millis(200);

/// Runs `last_words` (a log line), flushes stdout and stderr, then ends the process at
/// once (`_exit(2)`): no `atexit` handler or static destructor runs. Service threads
/// exit this way while other threads (a task, a Python interpreter) are still running,
/// where `exit(3)` would run those handlers concurrently with code still using what
/// they tear down.
///
/// The words and the flush run on a helper thread, waited for at most
/// [`LAST_WORDS`]: stdout and stderr are pipes to whoever launched the rank (the host,
/// slurmstepd, torchrun, mpirun's daemon, a `| tee`), and when that reader is alive but
/// no longer reads, a full pipe would block the write forever (and a task blocked on
/// it holds stdout's lock), so a rank whose parent is gone would never leave.
pub(crate) fn exit_after(code: u8, last_words: impl FnOnce() + Send + 'static) -> ! {
    use std::io::Write as _;
    let (said, wait) = std::sync::mpsc::channel::<()>();
    let span = tracing::Span::current();
    // Handed back by a helper that cannot start, so the words are still said (here,
    // unbounded: a process that cannot start a thread is rarely also stalled on a pipe).
    let words = std::sync::Arc::new(std::sync::Mutex::new(Some(last_words)));
    let w = words.clone();
    let helper = std::thread::Builder::new()
        .name("rx-exit".into())
        .spawn(move || {
            let words = w.lock().ok().and_then(|mut g| g.take());
            if let Some(words) = words {
                span.in_scope(words);
            }
            let _ = std::io::stdout().flush();
            let _ = std::io::stderr().flush();
            let _ = said.send(());
        });
    if helper.is_ok() {
        // Done, panicked (the sender is dropped) or stuck: go either way.
        let _ = wait.recv_timeout(LAST_WORDS);
    } else if let Some(words) = words.lock().ok().and_then(|mut g| g.take()) {
        words();
        let _ = std::io::stderr().flush();
    }
    // SAFETY: `_exit(2)` takes a plain integer, touches no memory of ours and never
    // returns; it is unsafe only as a foreign call. Skipping `atexit` handlers is the
    // point. Exercised by the Python test of a rank whose host is SIGKILLed under
    // torchrun (a C `atexit` marker must not run) and by `tests/host_death_load.rs`
    // (a rank whose stderr reader stalls still leaves).
    unsafe { nix::libc::_exit(i32::from(code)) }
}

/// This process's pid.
pub(crate) fn pid() -> u32 {
    getpid().as_raw() as u32
}

/// This process's process group id.
pub(crate) fn pgid() -> u32 {
    getpgrp().as_raw() as u32
}

/// The host name, or `"localhost"` when it cannot be read.
pub(crate) fn hostname() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "localhost".to_owned())
}

/// Makes this process ignore `SIGTERM`.
pub(crate) fn ignore_sigterm() -> std::io::Result<()> {
    // SAFETY: `signal` is unsafe because a handler runs in signal context and must be
    // async-signal-safe. `SIG_IGN` installs no handler at all: the kernel discards the
    // signal, so no code of ours runs in signal context. Exercised by the executor's
    // forced-abort test, which asserts the rank survives SIGTERM and dies by SIGKILL.
    unsafe { nix::sys::signal::signal(Signal::SIGTERM, SigHandler::SigIgn) }
        .map(drop)
        .map_err(std::io::Error::from)
}

/// Sends `signal` (by name, e.g. `"SIGKILL"`) to this process.
pub(crate) fn kill_self(signal: &str) -> std::io::Result<()> {
    let sig: Signal = signal
        .parse()
        .map_err(|_| std::io::Error::other(format!("unknown signal {signal}")))?;
    nix::sys::signal::kill(getpid(), sig).map_err(std::io::Error::from)
}

/// The inode of the file mapped at `addr` in this process, from `/proc/self/maps`
/// (`None` for anonymous memory or when the table cannot be read).
pub(crate) fn mapped_inode(addr: usize) -> Option<u64> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|line| {
        let mut f = line.split_whitespace();
        let (lo, hi) = f.next()?.split_once('-')?;
        let (lo, hi) = (
            usize::from_str_radix(lo, 16).ok()?,
            usize::from_str_radix(hi, 16).ok()?,
        );
        if !(lo..hi).contains(&addr) {
            return None;
        }
        let inode: u64 = f.nth(3)?.parse().ok()?;
        (inode != 0).then_some(inode)
    })
}

/// Waits until one of `fds` is readable (or hung up) or `timeout` passes; which are.
/// An interrupted wait (a signal) answers "none", so the caller can check its signals;
/// a closed descriptor is an error (`EBADF`).
pub(crate) fn wait_readable<const N: usize>(
    fds: [std::os::fd::BorrowedFd<'_>; N],
    timeout: std::time::Duration,
) -> std::io::Result<[bool; N]> {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    let mut polled = fds.map(|fd| PollFd::new(fd, PollFlags::POLLIN));
    // Rounded up, so a wait shorter than a millisecond still waits.
    let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
    match poll(
        &mut polled,
        PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX),
    ) {
        Ok(_) => {}
        Err(nix::errno::Errno::EINTR) => return Ok([false; N]),
        Err(e) => return Err(e.into()),
    }
    let revents = polled.map(|p| p.revents().unwrap_or(PollFlags::empty()));
    // A descriptor closed under us (user code closing what it did not open): an error,
    // so the caller does not take it for readable and poll it again at once.
    if revents.iter().any(|r| r.contains(PollFlags::POLLNVAL)) {
        return Err(std::io::Error::from_raw_os_error(nix::libc::EBADF));
    }
    Ok(revents.map(|r| !r.is_empty()))
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::fd::{AsFd, BorrowedFd};
    use std::os::unix::net::UnixStream;
    use std::time::Duration;

    #[test]
    fn wait_readable_says_which_and_times_out() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let (c, _d) = UnixStream::pair().unwrap();
        let quiet = super::wait_readable([a.as_fd(), c.as_fd()], Duration::from_millis(5));
        assert_eq!(quiet.unwrap(), [false, false]);
        b.write_all(&[1]).unwrap();
        let one = super::wait_readable([a.as_fd(), c.as_fd()], Duration::from_secs(60));
        assert_eq!(one.unwrap(), [true, false]);
    }

    #[test]
    fn a_closed_descriptor_is_an_error_not_readable() {
        // SAFETY: no descriptor this high can be open (the kernel's `nr_open` ceiling is
        // far below it), so this borrows nothing anyone owns; `poll` only reads the
        // number and reports it invalid.
        let closed = unsafe { BorrowedFd::borrow_raw(i32::MAX - 1) };
        let got = super::wait_readable([closed], Duration::from_secs(60));
        assert_eq!(got.unwrap_err().raw_os_error(), Some(nix::libc::EBADF));
    }
}
