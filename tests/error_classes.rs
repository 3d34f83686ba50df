//! The host can tell failures apart by class, without reading messages: exception,
//! panic, exit code, signal, out of memory, timeout, aborted (protocol violations are
//! in `protocol_violation.rs`).

mod common;

use std::time::{Duration, Instant};

use common::*;
use rankexec::executor::{Dur, MultiProcessExecutor};
use rankexec::protocol::{ErrorClass, Shareable, Signal};

/// The class of the error a task of `path` ends with. `abort_when_sleeping`: the
/// controller aborts once rank 0 has begun the task (its `Sleep` logged "sleeping").
fn class_of(
    path: &str,
    args: serde_json::Value,
    abort_when_sleeping: bool,
    task_deadline: Option<Duration>,
) -> ErrorClass {
    let logs = tempfile::tempdir().unwrap();
    let mut cfg = config(2, path, args, logs.path());
    if let Some(d) = task_deadline {
        cfg.deadlines.task = Dur(d);
    }
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let mut ctx = start(&exec);
    let abort = Signal::new();
    std::thread::scope(|s| {
        let aborter = abort_when_sleeping.then(|| {
            let log = logs.path().join("rank-0/stderr.log");
            let a = abort.clone();
            s.spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(20);
                while !std::fs::read_to_string(&log).is_ok_and(|t| t.contains("sleeping")) {
                    if Instant::now() > deadline {
                        // Ends the task anyway; the assertion below fails the test.
                        a.trigger("rank 0 never began the task");
                        return false;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                a.trigger("test");
                true
            })
        });
        let err = exec
            .run_task("t", Shareable::new(), &mut ctx, &abort)
            .unwrap_err();
        if let Some(a) = aborter {
            assert!(a.join().unwrap(), "rank 0 never began the task");
        }
        err.class()
    })
}

#[test]
fn every_class_is_distinct() {
    let cases = [
        (
            class_of("Fail", serde_json::json!({"ranks": [1]}), false, None),
            ErrorClass::Exception,
        ),
        (
            class_of("Panic", serde_json::json!({"ranks": [1]}), false, None),
            ErrorClass::Panic,
        ),
        (
            class_of(
                "Exit",
                serde_json::json!({"ranks": [1], "code": 3}),
                false,
                None,
            ),
            ErrorClass::ExitCode,
        ),
        (
            class_of(
                "Exit",
                serde_json::json!({"ranks": [1], "signal": "SIGABRT"}),
                false,
                None,
            ),
            ErrorClass::Signal,
        ),
        (
            class_of(
                "Alloc",
                serde_json::json!({"bytes": 1u64 << 60}),
                false,
                None,
            ),
            ErrorClass::OutOfMemory,
        ),
        (
            class_of(
                "Sleep",
                serde_json::json!({"secs": 60}),
                false,
                Some(Duration::from_millis(300)),
            ),
            ErrorClass::Timeout,
        ),
        (
            class_of("Sleep", serde_json::json!({"secs": 60}), true, None),
            ErrorClass::Aborted,
        ),
    ];
    for (got, want) in cases {
        assert_eq!(got, want);
    }
}
