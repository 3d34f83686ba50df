//! Sizes are checked by the sender. An input whose header is over the codec's limit is
//! the caller's error (`ExecuteError::Input`), not a dead rank; a rank honours the
//! group's `max_frame` (inline bytes: memory files are not counted) and turns an
//! oversized result into a clear protocol error for the task, and lives on.

mod common;

use common::*;
use rankexec::executor::{ByteSize, ExecuteError, MultiProcessExecutor, TransportConfig};
use rankexec::protocol::{ErrorClass, Shareable, Signal, Value};

#[test]
fn an_oversized_input_header_is_the_callers_error() {
    let logs = tempfile::tempdir().unwrap();
    let exec =
        MultiProcessExecutor::new(config(2, "Echo", serde_json::json!({}), logs.path())).unwrap();
    let mut ctx = start(&exec);
    let pids = exec.live_pids();
    let huge = "x".repeat(65 << 20);
    let err = exec
        .run_task(
            "t",
            Shareable::new().with_meta("big", huge),
            &mut ctx,
            &Signal::new(),
        )
        .unwrap_err();
    assert!(matches!(err, ExecuteError::Input(_)), "{err:?}");
    let text = chain(&err);
    assert!(text.contains("exceeds the limit"), "{text}");
    // No rank saw it, none died, and the group works.
    let out = exec
        .run_task("t", Shareable::new(), &mut ctx, &Signal::new())
        .unwrap();
    assert_eq!(out.meta("rank"), Some(&Value::Int(0)));
    assert_eq!(exec.live_pids(), pids);
    eprintln!("65 MiB meta value: {text}");
    exec.finalize().unwrap();
}

fn group_with_1mib_frames(tcp: bool, logs: &std::path::Path) -> MultiProcessExecutor {
    let mut cfg = config(2, "Echo", serde_json::json!({}), logs);
    cfg.max_frame = ByteSize(1 << 20);
    if tcp {
        cfg.transport = TransportConfig::Tcp {
            bind: "127.0.0.1:0".into(),
            advertise: None,
        };
    }
    MultiProcessExecutor::new(cfg).unwrap()
}

#[test]
fn an_oversized_inline_result_is_refused_by_the_rank() {
    let logs = tempfile::tempdir().unwrap();
    let exec = group_with_1mib_frames(true, logs.path());
    let mut ctx = start(&exec);
    let pids = exec.live_pids();
    // 2 MiB goes to the ranks inline (their limit on the parent is generous); rank 0
    // echoes it back, over the group's 1 MiB.
    let err = exec
        .run_task(
            "t",
            Shareable::new().with_blob("m", vec![7u8; 2 << 20]),
            &mut ctx,
            &Signal::new(),
        )
        .unwrap_err();
    let text = chain(&err);
    assert_eq!(err.class(), ErrorClass::Protocol, "{text}");
    assert!(
        text.contains("larger than the parent accepts")
            && text.contains("exceeds the limit of 1048576"),
        "{text}"
    );
    // The rank was not torn down for it: the same processes run the next task.
    let out = exec
        .run_task(
            "t",
            Shareable::new().with_blob("m", vec![7u8; 1000]),
            &mut ctx,
            &Signal::new(),
        )
        .unwrap();
    assert_eq!(out.blob("m").map(|b| b.len()), Some(1000));
    assert_eq!(exec.live_pids(), pids);
    eprintln!("tcp: 2 MiB result over max_frame 1 MiB: {text}");
    exec.finalize().unwrap();
}

#[test]
fn a_shared_result_over_max_frame_comes_back() {
    // Memory files are not counted against max_frame: their pages exist already, the
    // parent only maps them. 8 MiB in 40 blobs, with 1 MiB frames.
    let logs = tempfile::tempdir().unwrap();
    let exec = group_with_1mib_frames(false, logs.path());
    let mut ctx = start(&exec);
    let mut input = Shareable::new();
    for i in 0..40u8 {
        input.set_blob(format!("h.{i}.w"), vec![i; 200 << 10]);
    }
    let out = exec.run_task("t", input, &mut ctx, &Signal::new()).unwrap();
    for i in 0..40u8 {
        let b = out.blob(&format!("h.{i}.w")).unwrap();
        assert!(b.is_shared() && b.len() == 200 << 10 && b[0] == i && b[b.len() - 1] == i);
    }
    exec.finalize().unwrap();
}
