//! A simulated site as the controller sees it.
//!
//! Before each task it takes a place from the [`GroupGate`] (shown as queued while it
//! waits), fires `START_RUN` the first time (so a capped simulation never launches more
//! groups than allowed), runs the task, and parks its rank groups again when places are
//! capped.

use rankexec_protocol::error_chain as chain;
use std::sync::{Arc, Mutex, PoisonError};

use rankexec_protocol::{ErrorClass, FireEventError, Shareable, Signal};

use crate::host::{ClientError, ClientRuntime, GroupGate};
use crate::server::{ClientState, FedClient, Observer};

/// One simulated site.
pub struct SimClient {
    runtime: ClientRuntime,
    gate: Arc<GroupGate>,
    started: Mutex<Option<Result<(), (ErrorClass, String)>>>,
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
                *started = Some(
                    self.runtime
                        .start()
                        .map_err(|e| start_failure(self.name(), &e)),
                );
            }
            if let Some(Err(e)) = started.as_ref() {
                return Err(e.clone());
            }
        }
        let result = self.runtime.run_task(task, input, round, abort);
        if self.gate.limited() {
            self.runtime.park();
        }
        drop(slot);
        result.map_err(|e| {
            (
                e.class().unwrap_or(ErrorClass::Exception),
                without_site(self.name(), &chain(&e)),
            )
        })
    }
}

/// The controller names the site in front of every client error: drop the runtime's own.
fn without_site(site: &str, text: &str) -> String {
    text.strip_prefix(site)
        .and_then(|t| t.strip_prefix(": "))
        .unwrap_or(text)
        .to_owned()
}

/// What a user can act on when a site's executors did not start: the executor and its
/// own error, without the engine's event plumbing (`_start_run`, handler) around it.
///
/// Caveat: the executor's start-up error reaches the engine as text (the component
/// contract carries a message), so a rank that exited with code 0 during start-up is
/// recognised from that text.
fn start_failure(site: &str, e: &ClientError) -> (ErrorClass, String) {
    if let ClientError::Event { source: fired, .. } = e
        && let FireEventError::Handler {
            component, source, ..
        } = fired.as_ref()
    {
        let mut text = format!("executor `{component}` could not start: {}", chain(source));
        if text.contains("during start-up") && text.ends_with("exited with code 0") {
            text.push_str(
                " before connecting back (is the executor's `worker.program` a rankexec \
                 worker?)",
            );
        }
        return (source.class(), text);
    }
    (ErrorClass::Exception, without_site(site, &chain(e)))
}
