//! The client's task abort reaches the ranks first and never waits on a round trip.
//! The ranks' `ABORT_TASK` handler never finishes within the test (a rank that does
//! not acknowledge the event): the controller's `trigger()` must still return while
//! that event is in flight (the group is still up, which an event timeout would have
//! torn down), and the ranks' abort signals must fire (`forced: false`), which they
//! can only if `Abort` reached each rank before the event it is stuck in.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use rankexec::host::ClientRuntime;
use rankexec::protocol::{ErrorClass, Shareable, Signal};

const EVENT_DEADLINE_SECS: u64 = 20;

fn write_job(dir: &std::path::Path, logs: &std::path::Path) {
    std::fs::create_dir_all(dir.join("app/config")).unwrap();
    std::fs::write(
        dir.join("meta.json"),
        r#"{"name": "client-abort", "min_clients": 1}"#,
    )
    .unwrap();
    let client = serde_json::json!({
        "format_version": 2,
        "executors": [{
            "tasks": ["train"],
            "executor": {
                "id": "group",
                "path": "MultiProcessExecutor",
                "args": {
                    "executor_id": "sleeper",
                    "num_of_processes": 2,
                    "worker": {"program": worker_bin().display().to_string()},
                    "log_dir": logs.display().to_string(),
                    "deadlines": {
                        "abort_grace": "60s",
                        "event": format!("{EVENT_DEADLINE_SECS}s"),
                        "shutdown_grace": "1s",
                        "term_grace": "1s"
                    },
                    "components": [
                        {"id": "sleeper", "path": "Sleep", "args": {"secs": 600}},
                        {"id": "stuck", "path": "EventLog",
                         "args": {"delay_ms": 600000, "delay_events": ["_abort_task"]}}
                    ]
                }
            }
        }]
    });
    std::fs::write(
        dir.join("app/config/config_fed_client.json"),
        client.to_string(),
    )
    .unwrap();
    let server = serde_json::json!({
        "format_version": 2,
        "workflows": [{"id": "sag", "path": "ScatterAndGather",
                       "args": {"num_rounds": 1, "min_clients": 1}}]
    });
    std::fs::write(
        dir.join("app/config/config_fed_server.json"),
        server.to_string(),
    )
    .unwrap();
}

fn rank_log(logs: &std::path::Path, rank: u32) -> String {
    std::fs::read_to_string(logs.join(format!("rank-{rank}/stderr.log"))).unwrap_or_default()
}

#[test]
fn task_abort_reaches_ranks_first_and_does_not_wait_for_abort_task_acks() {
    let tmp = tempfile::tempdir().unwrap();
    let (job_dir, logs, ws) = (
        tmp.path().join("job"),
        tmp.path().join("logs"),
        tmp.path().join("ws"),
    );
    write_job(&job_dir, &logs);
    let registry = rankexec_examples::worker_registry();
    let job = rankexec::job::load(&job_dir, &registry).unwrap();
    let client = Arc::new(ClientRuntime::build(&job, 0, 1, &ws, &registry).unwrap());
    client.start().unwrap();
    let pids = client.live_pids();
    assert_eq!(pids.len(), 2);
    let abort = Signal::new();
    let task = std::thread::spawn({
        let (client, abort) = (client.clone(), abort.clone());
        move || client.run_task("train", Shareable::new(), 1, &abort)
    });
    let t = Instant::now();
    while !(rank_log(&logs, 0).contains("sleeping") && rank_log(&logs, 1).contains("sleeping")) {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the task never reached the ranks"
        );
        std::thread::sleep(Duration::from_millis(5));
    }

    let t = Instant::now();
    abort.trigger("task timed out");
    let trigger_took = t.elapsed();
    // The ABORT_TASK round trip cannot have ended: the ranks' handlers sleep for 10
    // minutes, and the event's timeout would have torn the group down.
    assert_eq!(
        client.live_pids(),
        pids,
        "trigger() returned only after the ABORT_TASK round trip ended"
    );
    // Each rank's signal fired and its task returned `aborted`: the Abort reached it
    // before the ABORT_TASK event, whose handler is now stuck.
    let t_ranks = Instant::now();
    for r in 0..2 {
        while !(rank_log(&logs, r).contains("abort requested")
            && rank_log(&logs, r).contains("class=aborted"))
        {
            assert!(
                t_ranks.elapsed() < Duration::from_secs(EVENT_DEADLINE_SECS / 2),
                "rank {r}'s task did not stop cooperatively: {}",
                rank_log(&logs, r)
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let task_took = t.elapsed();
    // The task's own answer is `aborted`, unless AFTER_TASK_EXECUTION, which the
    // client fires next, reached the ranks behind the stuck handler: then that event
    // fails at its deadline (a rank that never acknowledges fails the events after it).
    let err = task.join().unwrap().unwrap_err();
    let text = chain(&err);
    assert!(
        err.class() == Some(ErrorClass::Aborted) && text.contains("task timed out")
            || text.contains("_after_task_execution"),
        "{text}"
    );
    assert!(!text.contains("killed"), "{text}");
    println!(
        "trigger() returned in {:.3} ms; both ranks' tasks returned aborted (cooperatively) within {:.1} ms of the trigger, with their ABORT_TASK handlers still running",
        trigger_took.as_secs_f64() * 1e3,
        task_took.as_secs_f64() * 1e3
    );
    // The stuck handlers then cost the event deadline, and END_RUN tears the group down.
    let _ = client.end();
    assert_gone(&pids, "after END_RUN");
}
