//! Events both ways: engine events reach every rank and rank 0's context comes back;
//! events fired in a rank reach the parent's engine tagged with the rank, in a fresh
//! context, and the updated context goes back to the rank.

mod common;

use common::*;
use rankexec::executor::MultiProcessExecutor;
use rankexec::protocol::{
    EventType, FlComponent, FlContext, PropFlags, Shareable, Signal, Value, keys,
};

#[test]
fn events_travel_both_ways_with_context_merge() {
    let logs = tempfile::tempdir().unwrap();
    let cfg = with_component(
        config(
            3,
            "FireEvent",
            serde_json::json!({"event": "metrics", "count": 2}),
            logs.path(),
        ),
        "log",
        "EventLog",
        serde_json::json!({"set": {"handled_in_rank": true}}),
    );
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let engine = RecordingEngine::new(logs.path());
    let mut ctx = FlContext::with_engine(engine.clone());
    ctx.set_prop("from_host", "yes", PropFlags::PUBLIC).unwrap();
    exec.handle_event(&EventType::START_RUN, &mut ctx).unwrap();

    // Parent -> ranks: every rank's handlers run; the prop rank 0's handler set comes
    // back into the caller's context (START_RUN already merged it once).
    ctx.remove_prop("handled_in_rank");
    exec.fire_to_ranks(&EventType::new("round_started"), &mut ctx)
        .unwrap();
    assert_eq!(ctx.get_prop("handled_in_rank"), Some(&Value::Bool(true)));
    assert!(!ctx.prop("handled_in_rank").unwrap().private);

    // Rank -> parent: each rank fires `metrics` twice.
    let out = exec
        .run_task("train", Shareable::new(), &mut ctx, &Signal::new())
        .unwrap();
    assert_eq!(out.meta("fired"), Some(&Value::Int(2)));
    assert_eq!(
        out.meta("ctx:seen_by_host"),
        Some(&Value::Bool(true)),
        "the context the host's handlers updated went back to the rank"
    );
    let events = engine.events.lock().unwrap().clone();
    let metrics: Vec<_> = events.iter().filter(|(e, _, _)| e == "metrics").collect();
    assert_eq!(metrics.len(), 6, "3 ranks x 2 events");
    let mut from: Vec<i64> = metrics
        .iter()
        .map(|(_, r, _)| r.expect("tagged with the rank"))
        .collect();
    from.sort();
    assert_eq!(from, [0, 0, 1, 1, 2, 2]);
    for (_, _, props) in &metrics {
        assert_eq!(
            props.get("from_host"),
            Some(&Value::from("yes")),
            "the rank's task context came along"
        );
        assert_eq!(
            props.get(keys::EVENT_ORIGIN_SITE),
            Some(&Value::from("rank"))
        );
    }
    // A fresh context per relayed event: what the host's handler set for one rank does
    // not leak into another rank's event. Each rank's first event arrives without it;
    // its second carries it only because the reply merged it into that rank's context.
    for rank in 0..3 {
        let mine: Vec<_> = metrics
            .iter()
            .filter(|(_, r, _)| *r == Some(rank))
            .collect();
        assert!(
            !mine[0].2.contains_key("seen_by_host"),
            "rank {rank}'s first event"
        );
        assert_eq!(
            mine[1].2.get("seen_by_host"),
            Some(&Value::Bool(true)),
            "rank {rank}'s second event"
        );
    }
    exec.handle_event(&EventType::END_RUN, &mut ctx).unwrap();
}

/// A host whose handlers are slow (longer than the heartbeat timeout) or panic.
struct TroubledEngine {
    workspace: std::path::PathBuf,
}

impl rankexec::protocol::Engine for TroubledEngine {
    fn fire_event(
        &self,
        event: &EventType,
        _: &mut FlContext,
    ) -> Result<(), rankexec::protocol::FireEventError> {
        match event.to_string().as_str() {
            "slow" => std::thread::sleep(std::time::Duration::from_millis(1500)),
            "boom" => panic!("host handler exploded"),
            _ => {}
        }
        Ok(())
    }
    fn identity(&self) -> &str {
        "site-test"
    }
    fn job_id(&self) -> &str {
        "job-test"
    }
    fn workspace(&self) -> &std::path::Path {
        &self.workspace
    }
}

#[test]
fn slow_or_panicking_host_handlers_do_not_break_the_group() {
    let logs = tempfile::tempdir().unwrap();
    let mut cfg = config(
        2,
        "FireEvent",
        serde_json::json!({"event": "slow", "count": 1}),
        logs.path(),
    );
    // Heartbeats every 100 ms, silence for 600 ms is death: a handler taking 1.5 s on
    // the reader that also reads heartbeats would have the ranks declared unresponsive.
    cfg.deadlines.heartbeat_interval =
        rankexec::executor::Dur(std::time::Duration::from_millis(100));
    cfg.deadlines.heartbeat_timeout =
        rankexec::executor::Dur(std::time::Duration::from_millis(600));
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let engine = std::sync::Arc::new(TroubledEngine {
        workspace: logs.path().to_owned(),
    });
    let mut ctx = FlContext::with_engine(engine.clone());
    exec.handle_event(&EventType::START_RUN, &mut ctx).unwrap();
    let pids = exec.live_pids();
    let out = exec
        .run_task("train", Shareable::new(), &mut ctx, &Signal::new())
        .unwrap();
    assert_eq!(out.meta("fired"), Some(&Value::Int(1)));
    assert_eq!(exec.live_pids(), pids, "no rank was declared dead");

    exec.handle_event(&EventType::END_RUN, &mut ctx).unwrap();
    assert_gone(&pids, "after END_RUN");

    // A panicking host handler is the firing rank's error, not a dead reader thread.
    let cfg = config(
        1,
        "FireEvent",
        serde_json::json!({"event": "boom", "count": 1}),
        logs.path(),
    );
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let mut ctx = FlContext::with_engine(engine.clone());
    exec.handle_event(&EventType::START_RUN, &mut ctx).unwrap();
    let pids = exec.live_pids();
    let err = exec
        .run_task("train", Shareable::new(), &mut ctx, &Signal::new())
        .unwrap_err();
    let text = chain(&err);
    assert!(
        text.starts_with("rank 0 failed: exception: event relay failed"),
        "{text}"
    );
    assert!(
        text.contains("a host handler of `boom` panicked: host handler exploded"),
        "{text}"
    );
    assert_eq!(
        exec.live_pids(),
        pids,
        "the group survives a host handler's panic"
    );
    exec.handle_event(&EventType::END_RUN, &mut ctx).unwrap();
    assert_gone(&pids, "after END_RUN");
}
