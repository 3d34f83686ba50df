//! Work the dispatcher hands off so that it never blocks.
//!
//! The dispatcher owns the executor's state and must answer every command and report at
//! once. Anything that can take long runs on an [`Offload`] thread instead and comes back
//! as a report: admission (a ledger `flock` another process may hold, a CPU sample,
//! NVML), the ledger updates of a reservation, packing a task's input into memory files,
//! and the gather reduce. Jobs on one thread run in order, so a slow one delays only the
//! jobs behind it, never the dispatcher.
//!
//! Caveat: a job that blocks forever (a ledger lock held by a stopped process) keeps its
//! thread; the dispatcher's own deadlines (admission, task) still fire and report the
//! failure, and the thread ends when the job does.

use crossbeam_channel::{Sender, unbounded};

type Job = Box<dyn FnOnce() + Send>;

/// One background thread running jobs in order; it ends when every handle is dropped
/// and its queue has drained.
#[derive(Clone)]
pub(crate) struct Offload {
    tx: Sender<Job>,
}

impl Offload {
    /// Starts the thread.
    pub(crate) fn start(name: String) -> std::io::Result<Offload> {
        let (tx, rx) = unbounded::<Job>();
        let span = tracing::Span::current();
        std::thread::Builder::new()
            .name(name)
            .spawn(move || span.in_scope(|| rx.iter().for_each(|job| job())))?;
        Ok(Offload { tx })
    }

    /// Runs `job` on the thread; runs it here only if the thread is gone (it never
    /// ends while this handle lives, unless a job panicked).
    pub(crate) fn run(&self, job: impl FnOnce() + Send + 'static) {
        if let Err(e) = self.tx.send(Box::new(job)) {
            tracing::warn!("offload thread gone; running a job in place");
            (e.into_inner())();
        }
    }
}

/// A value dropped on an [`Offload`] thread instead of where it goes out of scope (a
/// ledger reservation, whose release takes the ledger's lock).
pub(crate) struct DropThere<T: Send + 'static> {
    value: Option<T>,
    via: Offload,
}

impl<T: Send + 'static> DropThere<T> {
    pub(crate) fn new(value: T, via: &Offload) -> Self {
        DropThere {
            value: Some(value),
            via: via.clone(),
        }
    }

    pub(crate) fn get(&self) -> Option<&T> {
        self.value.as_ref()
    }
}

impl<T: Send + 'static> Drop for DropThere<T> {
    fn drop(&mut self) {
        if let Some(v) = self.value.take() {
            self.via.run(move || drop(v));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn jobs_run_in_order_on_the_named_thread() {
        let w = Offload::start("rx-test-offload".into()).unwrap();
        let (tx, rx) = crossbeam_channel::unbounded();
        for i in 0..3 {
            let tx = tx.clone();
            w.run(move || {
                let name = std::thread::current().name().unwrap_or("?").to_owned();
                let _ = tx.send((i, name));
            });
        }
        for i in 0..3 {
            let (j, name) = rx.recv_timeout(Duration::from_secs(5)).unwrap();
            assert_eq!((j, name.as_str()), (i, "rx-test-offload"));
        }
    }

    #[test]
    fn drop_there_drops_on_the_thread() {
        struct Witness(crossbeam_channel::Sender<String>);
        impl Drop for Witness {
            fn drop(&mut self) {
                let name = std::thread::current().name().unwrap_or("?").to_owned();
                let _ = self.0.send(name);
            }
        }
        let w = Offload::start("rx-test-drop".into()).unwrap();
        let (tx, rx) = crossbeam_channel::bounded(1);
        drop(DropThere::new(Witness(tx), &w));
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(5)).unwrap(),
            "rx-test-drop"
        );
    }

    #[test]
    fn a_blocked_job_does_not_block_the_caller() {
        let w = Offload::start("rx-test-offload-2".into()).unwrap();
        let (release_tx, release_rx) = crossbeam_channel::bounded::<()>(1);
        let (done_tx, done_rx) = crossbeam_channel::bounded(1);
        w.run(move || {
            let _ = release_rx.recv_timeout(Duration::from_secs(30));
        });
        w.run(move || {
            let _ = done_tx.send(());
        });
        // The caller returned although the first job blocks; the second waits behind it.
        assert!(done_rx.try_recv().is_err());
        release_tx.send(()).unwrap();
        done_rx.recv_timeout(Duration::from_secs(5)).unwrap();
    }
}
