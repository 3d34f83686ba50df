//! A task handed over with `submit_task` is waited for on the caller's own thread, in
//! slices: nothing while the ranks work, the result once they answered, an abort fired
//! between slices ends it, and a finalized executor refuses it.

mod common;

use std::time::{Duration, Instant};

use common::*;
use rankexec::executor::{ExecuteError, MultiProcessExecutor};
use rankexec::protocol::{FlContext, Shareable, Signal, Value};

/// Waits in slices of `slice` (at most `within` in all), counting the empty ones.
fn wait_sliced(
    pending: &rankexec::executor::PendingTask,
    slice: Duration,
    within: Duration,
) -> (usize, Option<Result<Shareable, ExecuteError>>) {
    let mut ctx = FlContext::new();
    let deadline = Instant::now() + within;
    let mut empty = 0;
    while Instant::now() < deadline {
        match pending.wait_timeout(slice, &mut ctx) {
            Some(r) => return (empty, Some(r)),
            None => empty += 1,
        }
    }
    (empty, None)
}

#[test]
fn a_submitted_task_is_waited_for_in_slices_and_can_be_aborted_between_them() {
    let logs = tempfile::tempdir().unwrap();
    let exec = MultiProcessExecutor::new(config(
        2,
        "Sleep",
        serde_json::json!({"secs": 60}),
        logs.path(),
    ))
    .unwrap();
    let ctx = start(&exec);
    let pids = exec.live_pids();

    // The ranks sleep 0.5 s: slices of 10 ms see nothing first, then the result.
    let pending = exec
        .submit_task(
            "train",
            Shareable::new().with_meta("secs", 0.5),
            &ctx,
            &Signal::new(),
        )
        .unwrap();
    let (empty, out) = wait_sliced(&pending, Duration::from_millis(10), Duration::from_secs(60));
    let out = out.expect("no result within 60 s").unwrap();
    assert!(
        empty > 0,
        "the first slices returned before the ranks answered"
    );
    assert_eq!(out.meta("rank"), Some(&Value::Int(0)));

    // The ranks sleep 60 s; the caller fires the abort after a few empty slices.
    let abort = Signal::new();
    let pending = exec
        .submit_task("train", Shareable::new(), &ctx, &abort)
        .unwrap();
    assert!(
        pending
            .wait_timeout(Duration::from_millis(50), &mut FlContext::new())
            .is_none()
    );
    abort.trigger("caller gave up");
    let (_, out) = wait_sliced(&pending, Duration::from_millis(10), Duration::from_secs(60));
    let err = out.expect("the aborted task never ended").unwrap_err();
    assert!(
        matches!(&err, ExecuteError::Aborted { reason, .. } if reason == "caller gave up"),
        "{err:?}"
    );
    assert_eq!(
        exec.live_pids(),
        pids,
        "a cooperative abort keeps the group"
    );

    exec.finalize().unwrap();
    assert_gone(&pids, "after finalize");
    let pending = exec
        .submit_task("train", Shareable::new(), &ctx, &Signal::new())
        .unwrap();
    let (_, out) = wait_sliced(&pending, Duration::from_millis(10), Duration::from_secs(30));
    let err = out
        .expect("a finalized executor never answered")
        .unwrap_err();
    assert!(
        matches!(err, ExecuteError::Finalized | ExecuteError::DispatcherGone),
        "{err:?}"
    );
}
