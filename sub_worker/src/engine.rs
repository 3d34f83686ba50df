//! The engine inside a rank: local delivery, then relay to the parent.
//!
//! A component that fires an event in a rank reaches, in order, every component of the
//! rank, then the parent's engine over the event channel. The parent fires the event in
//! a fresh context tagged with this rank's number and sends the resulting properties
//! back; they are merged into the caller's context by the merge rule of
//! [`FlContext`](rankexec_protocol::FlContext). The wait for the parent's answer has a
//! deadline (the executor's event timeout).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use crossbeam_channel::{RecvTimeoutError, Sender, bounded};
use rankexec_protocol::wire::Message;
use rankexec_protocol::wire::message::Props;
use rankexec_protocol::{Component, Engine, EventType, FireEventError, FlContext};

use crate::link::{Link, SendError};

type Pending = Mutex<HashMap<u64, Sender<Result<Props, String>>>>;

/// The [`Engine`] a rank's components fire events into.
pub struct RankEngine {
    identity: String,
    job_id: String,
    workspace: PathBuf,
    event_timeout: Duration,
    link: Arc<Link>,
    pending: Pending,
    next_id: AtomicU64,
    components: OnceLock<Vec<(String, Component)>>,
}

impl RankEngine {
    pub(crate) fn new(
        identity: String,
        job_id: String,
        workspace: PathBuf,
        event_timeout: Duration,
        link: Arc<Link>,
    ) -> Self {
        RankEngine {
            identity,
            job_id,
            workspace,
            event_timeout,
            link,
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            components: OnceLock::new(),
        }
    }

    /// Sets the components that receive locally fired events (once, after init).
    pub(crate) fn set_components(&self, components: Vec<(String, Component)>) {
        let _ = self.components.set(components);
    }

    /// Delivers the parent's answer to a waiting `fire_event`.
    pub(crate) fn complete(&self, request_id: u64, result: Result<Props, String>) -> bool {
        let tx = self
            .pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&request_id);
        match tx {
            Some(tx) => {
                let _ = tx.send(result);
                true
            }
            None => false,
        }
    }

    /// Fails every waiting `fire_event` (the parent is gone).
    pub(crate) fn fail_all(&self) {
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }
}

impl Engine for RankEngine {
    fn fire_event(&self, event: &EventType, ctx: &mut FlContext) -> Result<(), FireEventError> {
        if let Some(components) = self.components.get() {
            for (id, c) in components {
                c.handler()
                    .handle_event(event, ctx)
                    .map_err(|source| FireEventError::Handler {
                        component: id.clone(),
                        event: event.to_string(),
                        source,
                    })?;
            }
        }
        let request_id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = bounded(1);
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(request_id, tx);
        let msg = Message::FireEvent {
            request_id,
            event: event.clone(),
            props: ctx.props().clone(),
        };
        if let Err(e) = self.link.send(&msg) {
            self.complete(request_id, Err(String::new()));
            return Err(match e {
                SendError::Frame(..) => FireEventError::Disconnected,
                e => FireEventError::Send {
                    event: event.to_string(),
                    source: Box::new(e),
                },
            });
        }
        match rx.recv_timeout(self.event_timeout) {
            Ok(Ok(props)) => {
                for conflict in ctx.merge_from(props) {
                    tracing::warn!(event = %event, "{conflict}");
                }
                Ok(())
            }
            Ok(Err(message)) => Err(FireEventError::Remote {
                event: event.to_string(),
                message,
            }),
            Err(RecvTimeoutError::Timeout) => {
                self.complete(request_id, Err(String::new()));
                Err(FireEventError::Timeout {
                    event: event.to_string(),
                    timeout_ms: self.event_timeout.as_millis() as u64,
                })
            }
            Err(RecvTimeoutError::Disconnected) => Err(FireEventError::Disconnected),
        }
    }

    fn identity(&self) -> &str {
        &self.identity
    }

    fn job_id(&self) -> &str {
        &self.job_id
    }

    fn workspace(&self) -> &Path {
        &self.workspace
    }
}
