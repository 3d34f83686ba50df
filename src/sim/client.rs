//! A simulated site as the controller sees it.
//!
//! Before each task it takes a place from the [`GroupGate`] (shown as queued while it
//! waits), fires `START_RUN` the first time (so a capped simulation never launches more
//! groups than allowed), runs the task, and parks its rank groups again when places are
//! capped.

use rankexec_protocol::error_chain as chain;
use std::sync::{Arc, Mutex, PoisonError};

use rankexec_protocol::{ErrorClass, Shareable, Signal};

use crate::host::{ClientRuntime, GroupGate};
use crate::server::{ClientState, FedClient, Observer};

/// One simulated site.
pub struct SimClient {
    runtime: ClientRuntime,
    gate: Arc<GroupGate>,
    started: Mutex<Option<Result<(), String>>>,
}

impl SimClient {
    /// A site sharing `gate` with the others.
    pub fn new(runtime: ClientRuntime, gate: Arc<GroupGate>) -> Self {
        SimClient {
            runtime,
            gate,
            started: Mutex::new(None),
        }
    }

    /// The runtime.
    pub fn runtime(&self) -> &ClientRuntime {
        &self.runtime
    }
}

impl FedClient for SimClient {
    fn name(&self) -> &str {
        self.runtime.site()
    }

    fn run(
        &self,
        task: &str,
        input: Shareable,
        round: u32,
        abort: &Signal,
        obs: &dyn Observer,
    ) -> Result<Shareable, (ErrorClass, String)> {
        obs.client_state(self.name(), ClientState::Queued);
        let Some(slot) = self.gate.acquire(abort) else {
            return Err((
                ErrorClass::Aborted,
                format!("{}: aborted while waiting for a place to run", self.name()),
            ));
        };
        obs.client_state(self.name(), ClientState::Running);
        {
            let mut started = self.started.lock().unwrap_or_else(PoisonError::into_inner);
            if started.is_none() {
                *started = Some(self.runtime.start().map_err(|e| chain(&e)));
            }
            if let Some(Err(e)) = started.as_ref() {
                return Err((ErrorClass::Exception, e.clone()));
            }
        }
        let result = self.runtime.run_task(task, input, round, abort);
        if self.gate.limited() {
            self.runtime.park();
        }
        drop(slot);
        result.map_err(|e| (e.class().unwrap_or(ErrorClass::Exception), chain(&e)))
    }
}
