//! The service threads: handle (aborts, close, and events into the queue), events
//! (the components' handlers), event relay replies, heartbeat.

use rankexec_protocol::error_chain as chain;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::Ordering;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender, TrySendError};
use rankexec_protocol::wire::envelope::{self};
use rankexec_protocol::wire::message::RankError;
use rankexec_protocol::wire::{FrameError, Message, frame::read_frame};
use rankexec_protocol::{Component, ErrorClass, EventType, Signal};
use tracing::{debug, info_span, warn};

use super::*;

/// The most events waiting for the rank's handlers. An event beyond it is refused at
/// once (its `EventAck` says the queue is full), so a flood of events cannot grow a
/// rank's memory without bound, and the host learns which rank could not keep up.
pub const EVENT_QUEUE: usize = 16;

/// An event from the parent, waiting for the events thread.
pub(super) struct Queued {
    event_id: u64,
    event: EventType,
    props: Props,
}

/// The handle thread: aborts and `Close` take effect here at once; events are queued
/// for the events thread, so no handler (however slow) delays an abort.
pub(super) fn handle_loop(rank: &Rank, events: Sender<Queued>) {
    loop {
        let frame = match read_frame(&rank.handle.conn, &parent_limits()) {
            Ok(f) => f,
            Err(FrameError::Closed) if rank.closing() => return,
            Err(FrameError::Closed) => parent_gone("handle"),
            Err(e) => protocol_violation("handle", &chain(&e)),
        };
        let msg = match envelope::decode(&frame) {
            Ok(m) => m,
            Err(e) => protocol_violation("handle", &chain(&e)),
        };
        match msg {
            Message::HandleEvent {
                event_id,
                event,
                props,
            } => {
                let refused = match events.try_send(Queued {
                    event_id,
                    event,
                    props,
                }) {
                    Ok(()) => continue,
                    Err(TrySendError::Full(q)) => (
                        q,
                        format!(
                            "the rank's event queue is full ({EVENT_QUEUE} events wait for its \
                             handlers, behind a long task or a slow handler)"
                        ),
                    ),
                    Err(TrySendError::Disconnected(q)) => {
                        (q, "the rank's events thread has stopped".to_owned())
                    }
                };
                let (q, message) = refused;
                warn!(event = %q.event, "event refused: {message}");
                let reply = Message::EventAck {
                    event_id: q.event_id,
                    result: Err(RankError {
                        class: ErrorClass::Exception,
                        message,
                    }),
                };
                if rank.handle.send(&reply).is_err() && !rank.closing() {
                    parent_gone("handle");
                }
            }
            Message::Abort { task_id, reason } => rank.tasks().abort(task_id, reason),
            Message::Close { reason } => {
                // The exec thread may be inside a task: stop it, then the exec channel's
                // own Close (or its end of file) ends the rank.
                let mut tasks = rank.tasks();
                rank.closing.store(true, Ordering::SeqCst);
                tasks.close(&reason);
                return;
            }
            other => protocol_violation("handle", &format!("unexpected {}", other.kind())),
        }
    }
}

/// The events thread: every component's handler for each queued event, in order, then
/// the `EventAck`. Events still queued when the group closes are not handled.
pub(super) fn events_loop(
    rank: &Rank,
    queue: &Receiver<Queued>,
    components: &[(String, Component)],
) {
    while let Ok(Queued {
        event_id,
        event,
        props,
    }) = queue.recv()
    {
        if rank.closing() {
            debug!(event = %event, "closing: queued event not handled");
            continue;
        }
        let span = info_span!("event", event = %event);
        let _enter = span.enter();
        let mut ctx = rank.rank_ctx(props);
        let mut result = Ok(());
        for (id, c) in components {
            let r = catch_unwind(AssertUnwindSafe(|| {
                c.handler().handle_event(&event, &mut ctx)
            }));
            let err = match r {
                Ok(Ok(())) => continue,
                Ok(Err(e)) => RankError {
                    class: e.class(),
                    message: format!("component `{id}`: {}", e.chain_text()),
                },
                Err(p) => RankError {
                    class: ErrorClass::Panic,
                    message: format!("component `{id}`: {}", panic_text(&p)),
                },
            };
            result = Err(err);
            break;
        }
        let reply = Message::EventAck {
            event_id,
            result: result.map(|()| ctx.props().clone()),
        };
        if rank.handle.send(&reply).is_err() && !rank.closing() {
            parent_gone("handle");
        }
    }
}

pub(super) fn event_loop(rank: &Rank) {
    loop {
        let frame = match read_frame(&rank.event.conn, &parent_limits()) {
            Ok(f) => f,
            Err(FrameError::Closed) if rank.closing() => {
                rank.engine.fail_all();
                return;
            }
            Err(FrameError::Closed) => parent_gone("event"),
            Err(e) => protocol_violation("event", &chain(&e)),
        };
        match envelope::decode(&frame) {
            Ok(Message::EventReply { request_id, result }) => {
                if !rank.engine.complete(request_id, result) {
                    debug!(request_id, "late event reply ignored");
                }
            }
            Ok(other) => protocol_violation("event", &format!("unexpected {}", other.kind())),
            Err(e) => protocol_violation("event", &chain(&e)),
        }
    }
}

pub(super) fn heartbeat_loop(rank: &Rank, stop: &Signal, every: Duration) {
    let mut seq = 0u64;
    while !stop.wait_timeout(every) {
        seq += 1;
        if rank.event.send(&Message::Heartbeat { seq }).is_err() {
            if rank.closing() {
                return;
            }
            parent_gone("event");
        }
    }
}
