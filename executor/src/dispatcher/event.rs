//! Events to the ranks: fan-out, acknowledgements, the event deadline.

use std::sync::Arc;
use std::time::Instant;

use rankexec_protocol::wire::envelope;
use rankexec_protocol::wire::message::{Props, RankError};
use rankexec_protocol::wire::{Channel, Message};
use tracing::warn;

use crate::error::{EventError, FailureCause, RemoteError};

use super::state::*;
use super::task::missing_ranks;

impl Dispatcher {
    pub(super) fn cmd_event(&mut self, c: EventCmd) {
        if self.finalized {
            let _ = c.reply.send(Err(EventError::Finalized));
            return;
        }
        // An abort of the running task that has not reached us yet (its report may
        // trail this command, as when an `ABORT_TASK` handler forwards the event) goes
        // to the ranks first: a rank busy in an event handler would read it late.
        if let Some(t) = &self.task
            && t.aborting.is_none()
            && let Some(reason) = t.cmd.abort.reason()
        {
            self.abort_task(t.id, reason);
        }
        if self.group.is_none() {
            // No ranks to tell (never started, parked, or torn down).
            let _ = c.reply.send(Ok(c.props));
            return;
        }
        self.start_event(c);
    }

    pub(super) fn start_event(&mut self, c: EventCmd) {
        let Some(g) = &self.group else { return };
        let id = self.next_event_id;
        self.next_event_id += 1;
        let frame = match envelope::plain(&Message::HandleEvent {
            event_id: id,
            event: c.event.clone(),
            props: c.props.clone(),
        }) {
            Ok(f) => Arc::new(f),
            Err(e) => {
                let _ = c.reply.send(Err(EventError::Encode {
                    event: c.event.to_string(),
                    source: Arc::new(e),
                }));
                return;
            }
        };
        for link in &g.links {
            link.send(Channel::Handle, frame.clone());
        }
        // A Python rank handles events on the thread that runs its tasks, once the
        // running task is done: an event sent during a task gets the event deadline
        // from the end of the task's (it is still bounded; Rust ranks answer at once).
        let now = Instant::now();
        let event_deadline = self.cfg.deadlines.event.0;
        let deadline = match &self.task {
            Some(t) => (now + event_deadline).max(t.deadline + event_deadline),
            None => now + event_deadline,
        };
        self.events.insert(
            id,
            EventOp {
                deadline,
                allowed: deadline.saturating_duration_since(now),
                acks: vec![None; self.cfg.num_of_processes as usize],
                cmd: c,
            },
        );
    }

    pub(super) fn on_event_ack(
        &mut self,
        rank: u32,
        event_id: u64,
        result: Result<Props, RankError>,
    ) {
        let Some(op) = self.events.get_mut(&event_id) else {
            return;
        };
        op.acks[rank as usize] = Some(result);
        if !op.acks.iter().all(Option::is_some) {
            return;
        }
        let Some(op) = self.events.remove(&event_id) else {
            return;
        };
        let event = op.cmd.event.to_string();
        let mut rank0 = None;
        for (r, a) in op.acks.into_iter().enumerate() {
            match a {
                Some(Err(error)) => {
                    let _ = op.cmd.reply.send(Err(EventError::Rank {
                        rank: r as u32,
                        event,
                        error: RemoteError(error),
                    }));
                    return;
                }
                Some(Ok(p)) if r == 0 => rank0 = Some(p),
                _ => {}
            }
        }
        let _ = op.cmd.reply.send(Ok(rank0.unwrap_or_default()));
    }

    pub(super) fn event_timeout(&mut self, id: u64) {
        let Some(op) = self.events.remove(&id) else {
            return;
        };
        let pending = missing_ranks(&op.acks);
        let err = EventError::Timeout {
            event: op.cmd.event.to_string(),
            timeout: op.allowed,
            pending: pending.clone(),
        };
        warn!("{err}");
        self.note_failure();
        let reply = op.cmd.reply;
        // Tasks in flight fail with the silent rank named.
        let rank = pending.first().copied().unwrap_or(0);
        let f = self.failure(rank, FailureCause::Unresponsive(op.allowed));
        let mut after = self.fail_inflight(&f, false);
        after.push(After::FailEvent(reply, err));
        self.begin_stop("event deadline", after);
    }
}
