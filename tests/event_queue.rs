//! A rank queues a bounded number of events for its handlers: an event beyond the
//! queue is refused at once with an error naming the rank, and every event accepted is
//! handled (none is dropped silently).

mod common;

use std::time::Duration;

use common::*;
use rankexec::executor::{Dur, EventError, MultiProcessExecutor};
use rankexec::protocol::{EventType, FlContext};

/// `rankexec_sub_worker::rank::EVENT_QUEUE`.
const EVENT_QUEUE: usize = rankexec::sub_worker::rank::EVENT_QUEUE;

#[test]
fn a_full_event_queue_refuses_events_naming_the_rank() {
    let logs = tempfile::tempdir().unwrap();
    let mut cfg = with_component(
        config(1, "Echo", serde_json::json!({}), logs.path()),
        "slow",
        "EventLog",
        serde_json::json!({"delay_ms": 1000}),
    );
    // Every accepted event is handled within the deadline, one second each.
    cfg.deadlines.event = Dur(Duration::from_secs(300));
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    exec.start(&FlContext::new()).unwrap();
    let pids = exec.live_pids();

    let n = 2 * EVENT_QUEUE;
    let results: Vec<Result<(), EventError>> = std::thread::scope(|s| {
        let fired: Vec<_> = (0..n)
            .map(|_| s.spawn(|| exec.fire_to_ranks(&EventType::new("tick"), &mut FlContext::new())))
            .collect();
        fired.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let refused: Vec<&EventError> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    println!(
        "{} of {n} events refused; first: {:?}",
        refused.len(),
        refused.first().map(|e| rankexec::protocol::error_chain(*e))
    );
    assert!(!refused.is_empty(), "a rank took {n} events at once");
    for e in &refused {
        assert!(matches!(e, EventError::Rank { rank: 0, .. }), "{e:?}");
        let text = rankexec::protocol::error_chain(*e);
        assert!(text.contains("event queue is full"), "{text}");
    }
    let log = std::fs::read_to_string(logs.path().join("rank-0/events.log")).unwrap();
    let handled = log.lines().filter(|l| *l == "tick").count();
    assert_eq!(
        handled,
        n - refused.len(),
        "every accepted event was handled"
    );
    assert_eq!(exec.live_pids(), pids, "the rank lives on");
}
