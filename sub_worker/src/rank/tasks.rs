//! Which task runs, and aborts that arrive before their task starts.

use rankexec_protocol::Signal;
use tracing::{debug, info};

/// The most aborts remembered for tasks whose Execute is still on its way.
pub(super) const MAX_EARLY_ABORTS: usize = 64;

/// Which task runs, and aborts that arrived before their task started.
///
/// The handle thread can read an `Abort` while the exec thread is still reading that
/// task's `Execute` (a large input takes a while to arrive and map). Task ids only
/// grow, so an abort for an id above the last one started is for a task still on its
/// way: it is remembered and fires the task's signal as the task starts, instead of
/// being dropped.
#[derive(Default)]
pub(super) struct Tasks {
    pub(super) current: Option<(u64, Signal)>,
    /// The highest task id the exec thread has taken up.
    pub(super) last_started: u64,
    /// Reasons of aborts for ids above `last_started`.
    pub(super) early: std::collections::BTreeMap<u64, String>,
}

impl Tasks {
    /// Registers task `id` and returns its signal, already triggered if an abort for it
    /// came first (or the group is closing).
    pub(super) fn start(&mut self, id: u64, closing: Option<&str>) -> Signal {
        let signal = Signal::new();
        self.last_started = self.last_started.max(id);
        if let Some(reason) = self.early.remove(&id) {
            info!(task_id = id, %reason, "abort arrived before the task started; starting it aborted");
            signal.trigger(reason);
        } else if let Some(reason) = closing {
            signal.trigger(reason.to_owned());
        }
        let last = self.last_started;
        self.early.retain(|k, _| *k > last);
        self.current = Some((id, signal.clone()));
        signal
    }

    /// Marks task `id` taken up without running it (its input could not be unpacked).
    pub(super) fn skip(&mut self, id: u64) {
        self.last_started = self.last_started.max(id);
        let last = self.last_started;
        self.early.retain(|k, _| *k > last);
    }

    pub(super) fn finish(&mut self) {
        self.current = None;
    }

    /// Fires the running task's signal, or remembers an abort for a task on its way.
    pub(super) fn abort(&mut self, id: u64, reason: String) {
        match &self.current {
            Some((current, signal)) if *current == id => {
                info!(task_id = id, %reason, "abort requested");
                signal.trigger(reason);
            }
            _ if id > self.last_started => {
                debug!(task_id = id, "abort for a task not started yet; remembered");
                if self.early.len() >= MAX_EARLY_ABORTS {
                    self.early.pop_first();
                }
                self.early.insert(id, reason);
            }
            _ => debug!(task_id = id, "abort for a task that already ended"),
        }
    }

    /// Fires the running task's signal because the group closes.
    pub(super) fn close(&mut self, reason: &str) {
        if let Some((_, signal)) = &self.current {
            signal.trigger(format!("closing: {reason}"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Tasks;

    #[test]
    fn abort_before_the_task_starts_is_kept_and_fires_at_start() {
        let mut t = Tasks::default();
        t.abort(1, "early".into());
        let s = t.start(1, None);
        assert_eq!(s.reason().as_deref(), Some("early"));
        t.finish();
        // The next task starts clean.
        assert!(!t.start(2, None).is_triggered());
    }

    #[test]
    fn abort_of_a_running_task_fires_and_stale_ones_are_ignored() {
        let mut t = Tasks::default();
        let s = t.start(5, None);
        t.abort(4, "stale".into());
        assert!(!s.is_triggered());
        assert!(t.early.is_empty(), "an abort for an ended task is not kept");
        t.abort(5, "now".into());
        assert_eq!(s.reason().as_deref(), Some("now"));
    }

    #[test]
    fn early_aborts_are_bounded_and_pruned() {
        let mut t = Tasks::default();
        for id in 1..=200 {
            t.abort(id, format!("a{id}"));
        }
        assert_eq!(t.early.len(), super::MAX_EARLY_ABORTS);
        t.start(190, None);
        assert!(t.early.keys().all(|k| *k > 190));
        t.skip(200);
        assert!(t.early.is_empty());
    }

    #[test]
    fn a_task_that_starts_while_closing_starts_aborted() {
        let mut t = Tasks::default();
        assert!(t.start(1, Some("closing")).is_triggered());
    }
}
