//! A value nested deeper than the ranks decode is refused where it is sent, naming its
//! path, and the group keeps its processes: before, it reached every rank, each broke
//! the protocol and the group was torn down.

mod common;

use std::collections::BTreeMap;

use common::*;
use rankexec::executor::{ExecuteError, MultiProcessExecutor};
use rankexec::protocol::value::MAX_DEPTH;
use rankexec::protocol::wire::PackError;
use rankexec::protocol::{Blob, PropFlags, Shareable, Signal, Value};

/// `levels` nested maps around an integer (`{"a": {"a": ... 1}}`).
fn nested(levels: u32) -> Value {
    let mut v = Value::Int(1);
    for _ in 0..levels {
        v = Value::Map(BTreeMap::from([("a".to_owned(), v)]));
    }
    v
}

fn assert_too_deep(err: &ExecuteError, path_prefix: &str) {
    let ExecuteError::Input(e) = err else {
        panic!("expected ExecuteError::Input, got {err:?}")
    };
    assert!(matches!(&**e, PackError::Value(_)), "{e:?}");
    let text = e.to_string();
    assert!(
        text.starts_with(path_prefix) && text.ends_with(": nested deeper than 64"),
        "{text}"
    );
}

#[test]
fn too_deep_meta_or_props_fail_the_task_and_the_group_survives() {
    let logs = tempfile::tempdir().unwrap();
    let exec =
        MultiProcessExecutor::new(config(2, "Echo", serde_json::json!({}), logs.path())).unwrap();
    let mut ctx = start(&exec);
    let pids = exec.live_pids();
    assert_eq!(pids.len(), 2);

    // Meta, small input (packed on the dispatcher thread).
    let input = Shareable::new().with_meta("deep", nested(MAX_DEPTH + 1));
    let err = exec
        .run_task("train", input, &mut ctx, &Signal::new())
        .unwrap_err();
    assert_too_deep(&err, "meta.deep.a.a");

    // Meta with a large blob (packed on the work thread).
    let input = Shareable::new()
        .with_meta("deep", nested(MAX_DEPTH + 1))
        .with_blob("w", Blob::from(vec![7u8; 1 << 20]));
    let err = exec
        .run_task("train", input, &mut ctx, &Signal::new())
        .unwrap_err();
    assert_too_deep(&err, "meta.deep.a.a");

    // A context property.
    let mut deep_ctx = ctx.clone();
    deep_ctx
        .set_prop("cfg", nested(MAX_DEPTH + 1), PropFlags::PUBLIC)
        .unwrap();
    let err = exec
        .run_task("train", Shareable::new(), &mut deep_ctx, &Signal::new())
        .unwrap_err();
    assert_too_deep(&err, "props.cfg.a.a");

    // The limit itself travels, on the same processes.
    let out = exec
        .run_task(
            "train",
            Shareable::new().with_meta("ok", nested(MAX_DEPTH)),
            &mut ctx,
            &Signal::new(),
        )
        .unwrap();
    assert_eq!(out.meta("ok"), Some(&nested(MAX_DEPTH)));
    assert_eq!(exec.live_pids(), pids);
    exec.finalize().unwrap();
    assert_gone(&pids, "after finalize");
}
