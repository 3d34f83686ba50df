//! Platform code, behind one module. Only Unix (Linux) is supported.

#[cfg(unix)]
#[path = "unix.rs"]
mod imp;

pub use imp::{ExitStatus, OomCounter, TermSignal, signal_name};
pub(crate) use imp::{
    Waker, exited, is_stopped, oom_kills, own_pid, peek_exit, pgid_of, pidfd_open, poll_readable,
    reap, reset_signals_on_exec, sigchld_discards_children, signal_group, signal_pidfd,
    term_with_parent_on_exec,
};
