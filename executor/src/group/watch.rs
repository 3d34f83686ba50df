//! The exit watcher: one thread that sees every tracked process exit.
//!
//! It blocks in `poll(2)` on every pidfd plus a waker, so an exit is noticed the moment
//! it happens and nothing runs while nothing happens. On each exit it reaps (through
//! the [`ProcessTable`]) and reports to the dispatcher. Processes that start later
//! (ranks reported by an external launcher) are added through [`ExitWatcher::watch`].

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use crossbeam_channel::Sender;

use super::process::{ProcessTable, Role};
use crate::os::{self, ExitStatus, Waker};

/// An exit, as reported to the dispatcher.
#[derive(Debug, Clone)]
pub(crate) struct Exited {
    pub(crate) role: Role,
    pub(crate) pid: u32,
    pub(crate) status: ExitStatus,
}

struct Shared {
    waker: Waker,
    added: Mutex<Vec<(usize, OwnedFd)>>,
    stop: AtomicBool,
}

/// Handle to the watcher thread; stops it when dropped.
pub(crate) struct ExitWatcher {
    shared: Arc<Shared>,
}

impl ExitWatcher {
    /// Starts the thread. `report` receives each exit, wrapped by `wrap`.
    pub(crate) fn start<T: Send + 'static>(
        table: Arc<ProcessTable>,
        report: Sender<T>,
        wrap: impl Fn(Exited) -> T + Send + 'static,
    ) -> std::io::Result<ExitWatcher> {
        let shared = Arc::new(Shared {
            waker: Waker::new()?,
            added: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
        });
        let s = shared.clone();
        let span = tracing::Span::current();
        std::thread::Builder::new()
            .name("rx-exit-watch".into())
            .spawn(move || span.in_scope(|| watch_loop(&s, &table, &report, &wrap)))?;
        Ok(ExitWatcher { shared })
    }

    /// Watches one more process (its table index and a pidfd).
    pub(crate) fn watch(&self, index: usize, pidfd: OwnedFd) {
        self.shared
            .added
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((index, pidfd));
        self.shared.waker.wake();
    }
}

impl Drop for ExitWatcher {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.waker.wake();
    }
}

fn watch_loop<T>(
    shared: &Shared,
    table: &ProcessTable,
    report: &Sender<T>,
    wrap: &impl Fn(Exited) -> T,
) {
    let mut watched: Vec<(usize, OwnedFd)> = Vec::new();
    loop {
        watched.append(&mut shared.added.lock().unwrap_or_else(PoisonError::into_inner));
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let mut fds: Vec<BorrowedFd<'_>> = vec![shared.waker.fd()];
        fds.extend(watched.iter().map(|(_, fd)| fd.as_fd()));
        let ready = match os::poll_readable(&fds, None) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, "exit watcher cannot poll; exits will be seen as closed connections");
                return;
            }
        };
        if ready[0] {
            shared.waker.drain();
        }
        let exited: Vec<usize> = ready[1..]
            .iter()
            .enumerate()
            .filter(|(_, r)| **r)
            .map(|(i, _)| i)
            .collect();
        for i in exited.iter().rev() {
            let (index, _) = watched.remove(*i);
            if let Some((role, pid, status)) = table.reap(index)
                && report.send(wrap(Exited { role, pid, status })).is_err()
            {
                return;
            }
        }
    }
}
