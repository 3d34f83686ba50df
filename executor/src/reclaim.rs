//! Releasing large buffers off the hot path.
//!
//! Dropping the last reference to a large memory file frees every one of its pages,
//! which takes milliseconds per hundred MiB. [`Deferred`] hands such a value to one
//! background thread to drop, so neither the dispatcher (which would delay the next
//! report it handles) nor a caller waiting for a result pays for it.
//!
//! Caveat: the thread is started on first use and lives as long as the process; if it
//! cannot be started, values are dropped where they are.

use std::sync::OnceLock;

use crossbeam_channel::Sender;

type Garbage = Box<dyn Send>;

fn reclaimer() -> Option<&'static Sender<Garbage>> {
    static TX: OnceLock<Option<Sender<Garbage>>> = OnceLock::new();
    TX.get_or_init(|| {
        let (tx, rx) = crossbeam_channel::unbounded::<Garbage>();
        std::thread::Builder::new()
            .name("rx-reclaim".into())
            // Each value is dropped as it arrives; the loop ends only with the process.
            .spawn(move || rx.iter().for_each(drop))
            .map_err(|e| tracing::debug!("no reclaim thread, dropping in place: {e}"))
            .ok()
            .map(|_| tx)
    })
    .as_ref()
}

/// A value that is dropped on the reclaim thread instead of where it goes out of scope.
pub(crate) struct Deferred<T: Send + 'static>(Option<T>);

impl<T: Send + 'static> Deferred<T> {
    pub(crate) fn new(value: T) -> Self {
        Deferred(Some(value))
    }
}

impl<T: Send + 'static> Drop for Deferred<T> {
    fn drop(&mut self) {
        let Some(value) = self.0.take() else { return };
        if let Some(tx) = reclaimer() {
            // A send only fails once the thread is gone; the value then drops here.
            let _ = tx.send(Box::new(value));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    struct Witness(crossbeam_channel::Sender<String>);
    impl Drop for Witness {
        fn drop(&mut self) {
            let name = std::thread::current().name().unwrap_or("?").to_owned();
            let _ = self.0.send(name);
        }
    }

    #[test]
    fn values_are_dropped_on_the_reclaim_thread() {
        let (tx, rx) = crossbeam_channel::bounded(1);
        drop(Deferred::new(Witness(tx)));
        let on = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(on, "rx-reclaim");
    }
}
