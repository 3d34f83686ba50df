//! END_RUN reaches every rank before the group is torn down (FLARE's finalize ran first
//! and the ranks never saw it).

mod common;

use common::*;
use rankexec::executor::MultiProcessExecutor;
use rankexec::protocol::{EventType, FlComponent};

#[test]
fn end_run_reaches_every_rank() {
    let logs = tempfile::tempdir().unwrap();
    let cfg = with_component(
        config(3, "Echo", serde_json::json!({}), logs.path()),
        "log",
        "EventLog",
        serde_json::json!({}),
    );
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let mut ctx = start(&exec);
    let pids = exec.live_pids();
    exec.handle_event(&EventType::END_RUN, &mut ctx).unwrap();
    assert_gone(&pids, "after END_RUN");
    for r in 0..3 {
        let seen =
            std::fs::read_to_string(logs.path().join(format!("rank-{r}/events.log"))).unwrap();
        let seen: Vec<&str> = seen.lines().collect();
        assert_eq!(seen, ["_start_run", "_end_run"], "rank {r}");
    }
}
