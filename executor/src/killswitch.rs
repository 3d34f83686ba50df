//! The last resort for a host that must stop *now* (a second Ctrl-C).
//!
//! Every group registers its process table here. [`kill_all`] sends `SIGKILL` to every
//! live group of this process at once, without waiting for grace periods. The library
//! never calls it by itself and installs no signal handler: the binary decides (see
//! `rankexec`'s Ctrl-C handling).

use std::sync::{Arc, Mutex, PoisonError, Weak};

use crate::group::process::ProcessTable;
use crate::os::TermSignal;

static TABLES: Mutex<Vec<Weak<ProcessTable>>> = Mutex::new(Vec::new());

pub(crate) fn register(table: &Arc<ProcessTable>) {
    let mut tables = TABLES.lock().unwrap_or_else(PoisonError::into_inner);
    tables.retain(|t| t.strong_count() > 0);
    tables.push(Arc::downgrade(table));
}

/// Sends `SIGKILL` to every rank group this process has alive. Returns how many
/// processes or groups were signalled. Safe to call from any thread.
pub fn kill_all() -> usize {
    let tables: Vec<Arc<ProcessTable>> = TABLES
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .iter()
        .filter_map(Weak::upgrade)
        .collect();
    tables
        .iter()
        .map(|t| t.signal_all(TermSignal::Kill).len())
        .sum()
}
