//! Platform code, behind one module. Only Unix (Linux) is supported.

#[cfg(unix)]
#[path = "unix.rs"]
mod imp;

pub use imp::{ExitStatus, TermSignal, signal_name};
pub(crate) use imp::{
    Waker, oom_kill_count, own_pid, pidfd_open, poll_readable, reap, signal_group, signal_pidfd,
};
