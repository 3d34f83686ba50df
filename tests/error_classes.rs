//! The host can tell failures apart by class, without reading messages: exception,
//! panic, exit code, signal, out of memory, timeout, aborted (protocol violations are
//! in `protocol_violation.rs`).

mod common;

use std::time::Duration;

use common::*;
use rankexec::executor::{Dur, MultiProcessExecutor};
use rankexec::protocol::{ErrorClass, Shareable, Signal};

fn class_of(
    path: &str,
    args: serde_json::Value,
    abort_after: Option<Duration>,
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
    if let Some(after) = abort_after {
        let a = abort.clone();
        std::thread::spawn(move || {
            std::thread::sleep(after);
            a.trigger("test");
        });
    }
    let err = exec
        .run_task("t", Shareable::new(), &mut ctx, &abort)
        .unwrap_err();
    err.class()
}

#[test]
fn every_class_is_distinct() {
    let cases = [
        (
            class_of("Fail", serde_json::json!({"ranks": [1]}), None, None),
            ErrorClass::Exception,
        ),
        (
            class_of("Panic", serde_json::json!({"ranks": [1]}), None, None),
            ErrorClass::Panic,
        ),
        (
            class_of(
                "Exit",
                serde_json::json!({"ranks": [1], "code": 3}),
                None,
                None,
            ),
            ErrorClass::ExitCode,
        ),
        (
            class_of(
                "Exit",
                serde_json::json!({"ranks": [1], "signal": "SIGABRT"}),
                None,
                None,
            ),
            ErrorClass::Signal,
        ),
        (
            class_of(
                "Alloc",
                serde_json::json!({"bytes": 1u64 << 60}),
                None,
                None,
            ),
            ErrorClass::OutOfMemory,
        ),
        (
            class_of(
                "Sleep",
                serde_json::json!({"secs": 60}),
                None,
                Some(Duration::from_millis(300)),
            ),
            ErrorClass::Timeout,
        ),
        (
            class_of(
                "Sleep",
                serde_json::json!({"secs": 60}),
                Some(Duration::from_millis(200)),
                None,
            ),
            ErrorClass::Aborted,
        ),
    ];
    for (got, want) in cases {
        assert_eq!(got, want);
    }
}
