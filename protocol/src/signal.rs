//! `Signal`: a one-shot, cloneable abort flag that can be waited on with a deadline.
//!
//! A task's component receives a `&Signal`. Long-running work checks
//! [`Signal::is_triggered`] between steps, or sleeps with [`Signal::wait_timeout`] so
//! that an abort wakes it at once. Executors subscribe with [`Signal::on_trigger`] to
//! react without polling.

use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

type Callback = Box<dyn FnOnce() + Send>;

struct State {
    reason: Option<String>,
    callbacks: Vec<(u64, Callback)>,
    next_id: u64,
}

struct Inner {
    state: Mutex<State>,
    cv: Condvar,
}

/// An abort signal shared by everyone who holds a clone.
///
/// ```
/// use std::time::Duration;
/// use rankexec_protocol::Signal;
/// let s = Signal::new();
/// let t = s.clone();
/// std::thread::spawn(move || t.trigger("stop"));
/// assert!(s.wait_timeout(Duration::from_secs(5)));
/// assert_eq!(s.reason().as_deref(), Some("stop"));
/// ```
#[derive(Clone)]
pub struct Signal {
    inner: Arc<Inner>,
}

impl Default for Signal {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for Signal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Signal")
            .field("reason", &self.reason())
            .finish()
    }
}

impl Signal {
    /// A signal that has not fired.
    pub fn new() -> Self {
        Signal {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    reason: None,
                    callbacks: Vec::new(),
                    next_id: 0,
                }),
                cv: Condvar::new(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Fires the signal. Later calls keep the first reason and do nothing else.
    pub fn trigger(&self, reason: impl Into<String>) {
        let callbacks = {
            let mut st = self.lock();
            if st.reason.is_some() {
                return;
            }
            st.reason = Some(reason.into());
            std::mem::take(&mut st.callbacks)
        };
        self.inner.cv.notify_all();
        for (_, cb) in callbacks {
            cb();
        }
    }

    /// Whether the signal has fired.
    pub fn is_triggered(&self) -> bool {
        self.lock().reason.is_some()
    }

    /// Why the signal fired, if it has.
    pub fn reason(&self) -> Option<String> {
        self.lock().reason.clone()
    }

    /// Waits until the signal fires or `timeout` passes; returns whether it fired.
    pub fn wait_timeout(&self, timeout: Duration) -> bool {
        self.wait_until(Instant::now() + timeout)
    }

    /// Waits until the signal fires or `deadline` passes; returns whether it fired.
    pub fn wait_until(&self, deadline: Instant) -> bool {
        let mut st = self.lock();
        loop {
            if st.reason.is_some() {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            st = self
                .inner
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Runs `f` once when the signal fires (at once, on this thread, if it already has).
    /// Dropping the returned subscription before that cancels it.
    pub fn on_trigger(&self, f: impl FnOnce() + Send + 'static) -> Subscription {
        let mut st = self.lock();
        if st.reason.is_some() {
            drop(st);
            f();
            return Subscription {
                signal: None,
                id: 0,
            };
        }
        let id = st.next_id;
        st.next_id += 1;
        st.callbacks.push((id, Box::new(f)));
        Subscription {
            signal: Some(self.clone()),
            id,
        }
    }
}

/// Cancels an [`Signal::on_trigger`] callback when dropped.
#[must_use = "dropping the subscription cancels the callback"]
pub struct Subscription {
    signal: Option<Signal>,
    id: u64,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        if let Some(signal) = self.signal.take() {
            signal.lock().callbacks.retain(|(id, _)| *id != self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn callbacks_run_once_and_dropped_subscriptions_do_not_run() {
        let s = Signal::new();
        let hits = Arc::new(AtomicUsize::new(0));
        let h = hits.clone();
        let _kept = s.on_trigger(move || {
            h.fetch_add(1, Ordering::SeqCst);
        });
        let h = hits.clone();
        drop(s.on_trigger(move || {
            h.fetch_add(100, Ordering::SeqCst);
        }));
        s.trigger("a");
        s.trigger("b");
        assert_eq!(hits.load(Ordering::SeqCst), 1);
        assert_eq!(s.reason().as_deref(), Some("a"));
        // Subscribing after the fact runs at once.
        let h = hits.clone();
        let _late = s.on_trigger(move || {
            h.fetch_add(10, Ordering::SeqCst);
        });
        assert_eq!(hits.load(Ordering::SeqCst), 11);
    }

    #[test]
    fn wait_times_out_when_not_triggered() {
        let s = Signal::new();
        assert!(!s.wait_timeout(Duration::from_millis(10)));
        assert!(!s.is_triggered());
    }
}
