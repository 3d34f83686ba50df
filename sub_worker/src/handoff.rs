//! A one-shot answer between two threads, and a doorbell, that park at once, without
//! spinning.
//!
//! A foreign rank hands every task to the caller's thread and waits for its answer
//! ([`embed`](crate::embed)). A general-purpose channel spins and yields the CPU a few
//! times before it parks; on a machine with fewer cores than busy threads (eight ranks
//! on two cores) those yields are context switches that delay every other rank, twice
//! per task. A mutex and a condition variable park at once, and the one wake-up is the
//! only cost. The caller waits for its requests on a [`Bell`] its senders ring.
//!
//! # Caveats
//!
//! - [`Answer::wait`] has no deadline of its own: its callers document what bounds it
//!   (the executor's task, event and start-up deadlines end a rank whose caller never
//!   answers).
//! - A [`Slot`] dropped without [`Slot::send`] answers `None`, so a waiter never waits
//!   for an answer nobody can give.

use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Instant;

/// A doorbell: senders [`ring`](Bell::ring) it after they put something where the
/// waiter looks; [`wait_until`](Bell::wait_until) returns once it rang since the last
/// wait (at once if it already had), or at the deadline. It is a socket pair, so a
/// waiter can wait for it and for another descriptor at once ([`Bell::fd`]).
pub struct Bell {
    rx: UnixStream,
    tx: UnixStream,
}

impl Bell {
    /// A bell that has not rung.
    pub fn new() -> std::io::Result<Bell> {
        let (rx, tx) = UnixStream::pair()?;
        rx.set_nonblocking(true)?;
        tx.set_nonblocking(true)?;
        Ok(Bell { rx, tx })
    }

    /// Wakes the waiter, or the next wait.
    pub fn ring(&self) {
        // Full (WouldBlock): it has rung already and nobody has looked yet.
        let _ = (&self.tx).write(&[1]);
    }

    /// Waits until the bell rang or `deadline` passed; `true` when it rang.
    pub fn wait_until(&self, deadline: Instant) -> bool {
        loop {
            if self.take() {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            // An error (none is expected on a socket pair): the wait lasts its time
            // rather than returning at once to a caller that would wait again.
            if crate::os::wait_readable([self.rx.as_fd()], left).is_err() {
                std::thread::sleep(left);
                return false;
            }
        }
    }

    /// The descriptor that turns readable when the bell rang.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.rx.as_fd()
    }

    /// Whether the bell rang since the last look (and forgets it).
    pub fn take(&self) -> bool {
        let mut buf = [0u8; 64];
        let mut rang = false;
        while let Ok(n) = (&self.rx).read(&mut buf) {
            if n == 0 {
                break;
            }
            rang = true;
        }
        rang
    }
}

enum State<A> {
    Waiting,
    Sent(A),
    Taken,
    Dropped,
}

struct Shared<A> {
    state: Mutex<State<A>>,
    ready: Condvar,
}

impl<A> Shared<A> {
    fn set(&self, to: State<A>) {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if matches!(*s, State::Waiting) {
            *s = to;
            self.ready.notify_one();
        }
    }
}

/// The sending end: answers once; dropped unanswered, the waiter gets `None`.
pub struct Slot<A>(Option<Arc<Shared<A>>>);

/// The waiting end.
pub struct Answer<A>(Arc<Shared<A>>);

/// A slot and the answer it fills.
pub fn oneshot<A>() -> (Slot<A>, Answer<A>) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State::Waiting),
        ready: Condvar::new(),
    });
    (Slot(Some(shared.clone())), Answer(shared))
}

impl<A> Slot<A> {
    /// Answers; `false` when nobody waits for it any more.
    pub fn send(mut self, value: A) -> bool {
        let Some(shared) = self.0.take() else {
            return false;
        };
        // The waiter holds the other reference until it has its answer.
        let waited = Arc::strong_count(&shared) > 1;
        shared.set(State::Sent(value));
        waited
    }
}

impl<A> Drop for Slot<A> {
    fn drop(&mut self) {
        if let Some(shared) = self.0.take() {
            shared.set(State::Dropped);
        }
    }
}

impl<A> std::fmt::Debug for Slot<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Slot")
    }
}

impl<A> Answer<A> {
    /// Waits for the answer; `None` when the slot was dropped unanswered.
    pub fn wait(self) -> Option<A> {
        let mut s = self.0.state.lock().unwrap_or_else(PoisonError::into_inner);
        while matches!(*s, State::Waiting) {
            s = self.0.ready.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
        match std::mem::replace(&mut *s, State::Taken) {
            State::Sent(v) => Some(v),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_answer_crosses_threads() {
        let (slot, answer) = oneshot();
        let t = std::thread::spawn(move || slot.send(7));
        assert_eq!(answer.wait(), Some(7));
        assert!(t.join().unwrap());
    }

    #[test]
    fn a_slot_dropped_unanswered_answers_none() {
        let (slot, answer) = oneshot::<u8>();
        let t = std::thread::spawn(move || drop(slot));
        assert_eq!(answer.wait(), None);
        t.join().unwrap();
    }

    #[test]
    fn a_bell_wakes_its_waiter_and_a_silent_one_times_out() {
        use std::time::Duration;
        let bell = Arc::new(Bell::new().unwrap());
        assert!(!bell.wait_until(Instant::now() + Duration::from_millis(10)));
        let ringer = std::thread::spawn({
            let bell = bell.clone();
            move || bell.ring()
        });
        assert!(bell.wait_until(Instant::now() + Duration::from_secs(60)));
        ringer.join().unwrap();
        // A ring is consumed by the wait that saw it.
        assert!(!bell.wait_until(Instant::now()));
    }

    #[test]
    fn sending_to_a_gone_waiter_says_so() {
        let (slot, answer) = oneshot::<u8>();
        drop(answer);
        assert!(!slot.send(1));
    }
}
