//! How many rank groups may be alive at once (`--max-groups`), fedflow's task-group
//! scheduling for more clients than a machine holds.
//!
//! A client takes a [`Slot`] before its group runs a task and gives it back after
//! parking the group. Waiting clients block on a condition variable (no polling) and are
//! woken when a slot frees or the job is aborted. When hardware admission is configured
//! on the executors, it then decides, inside the executor, when the group may start.

use std::sync::{Arc, Condvar, Mutex, PoisonError};

use rankexec_protocol::Signal;

#[derive(Debug)]
struct State {
    free: usize,
    waiting: usize,
}

/// A counting gate for rank groups.
#[derive(Debug)]
pub struct GroupGate {
    limit: Option<usize>,
    state: Mutex<State>,
    cv: Condvar,
}

/// A held place; dropping it frees the place.
#[derive(Debug)]
pub struct Slot {
    gate: Option<Arc<GroupGate>>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(g) = self.gate.take() {
            g.state.lock().unwrap_or_else(PoisonError::into_inner).free += 1;
            g.cv.notify_one();
        }
    }
}

impl GroupGate {
    /// A gate with `limit` places (`None`: unlimited).
    pub fn new(limit: Option<usize>) -> Arc<Self> {
        Arc::new(GroupGate {
            limit,
            state: Mutex::new(State {
                free: limit.unwrap_or(usize::MAX),
                waiting: 0,
            }),
            cv: Condvar::new(),
        })
    }

    /// Whether groups must be parked between tasks to share the places.
    pub fn limited(&self) -> bool {
        self.limit.is_some()
    }

    /// How many clients are waiting for a place.
    pub fn waiting(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .waiting
    }

    /// Wakes every waiter (they re-check the abort signal). The lock is taken first so a
    /// waiter between its check and its wait cannot miss the wake-up.
    pub fn wake_all(&self) {
        let _st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        self.cv.notify_all();
    }

    /// Takes a place, waiting for one; `None` if `abort` fires first.
    pub fn acquire(self: &Arc<Self>, abort: &Signal) -> Option<Slot> {
        if self.limit.is_none() {
            return Some(Slot { gate: None });
        }
        let me = self.clone();
        let _wake = abort.on_trigger(move || me.wake_all());
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.waiting += 1;
        while st.free == 0 && !abort.is_triggered() {
            st = self.cv.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
        st.waiting -= 1;
        if abort.is_triggered() {
            // A place freed for us goes to the next waiter instead.
            if st.free > 0 {
                self.cv.notify_one();
            }
            return None;
        }
        st.free -= 1;
        Some(Slot {
            gate: Some(self.clone()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn waits_without_polling_and_aborts() {
        let gate = GroupGate::new(Some(1));
        let abort = Signal::new();
        let held = gate.acquire(&abort).unwrap();
        let (g, a) = (gate.clone(), abort.clone());
        let waiter = std::thread::spawn(move || g.acquire(&a).is_some());
        while gate.waiting() == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(held);
        assert!(waiter.join().unwrap(), "the freed place goes to the waiter");
        let _again = gate.acquire(&abort);
        let (g, a) = (gate.clone(), abort.clone());
        let waiter = std::thread::spawn(move || g.acquire(&a).is_some());
        while gate.waiting() == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        abort.trigger("job aborted");
        assert!(
            !waiter.join().unwrap(),
            "an abort releases the waiter empty-handed"
        );
    }
}
