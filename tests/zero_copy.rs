//! Large blobs reach ranks as one sealed memory file mapped by every rank, and a
//! rank's large result comes back the same way.

mod common;

use common::*;
use rankexec::executor::MultiProcessExecutor;
use rankexec::protocol::{Shareable, Signal, Value};
use rankexec::sub_worker::builtins::checksum;

#[test]
fn big_blobs_are_shared_small_ones_inline() {
    let logs = tempfile::tempdir().unwrap();
    let exec =
        MultiProcessExecutor::new(config(3, "Digest", serde_json::json!({}), logs.path())).unwrap();
    let mut ctx = start(&exec);
    let big: Vec<u8> = (0..(4u32 << 20)).map(|i| (i * 7 + 3) as u8).collect();
    let small = vec![9u8; 1000];
    let input = Shareable::new()
        .with_blob("big", big.clone())
        .with_blob("small", small.clone());
    let out = exec
        .run_task("digest", input, &mut ctx, &Signal::new())
        .unwrap();
    assert_eq!(
        out.meta("shared:big"),
        Some(&Value::Bool(true)),
        "4 MiB went as a memory file"
    );
    assert_eq!(
        out.meta("shared:small"),
        Some(&Value::Bool(false)),
        "1 KB went inline"
    );
    assert_eq!(
        out.meta("digest:big"),
        Some(&Value::Int(checksum(&big) as i64))
    );
    assert_eq!(
        out.meta("digest:small"),
        Some(&Value::Int(checksum(&small) as i64))
    );
    exec.finalize().unwrap();
}

#[test]
fn big_results_come_back_shared() {
    let logs = tempfile::tempdir().unwrap();
    let exec =
        MultiProcessExecutor::new(config(2, "Echo", serde_json::json!({}), logs.path())).unwrap();
    let mut ctx = start(&exec);
    let big = vec![42u8; 1 << 20];
    let out = exec
        .run_task(
            "echo",
            Shareable::new().with_blob("m", big.clone()),
            &mut ctx,
            &Signal::new(),
        )
        .unwrap();
    let m = out.blob("m").unwrap();
    assert!(m.is_shared(), "rank 0's 1 MiB result is a memory file");
    assert_eq!(&m[..], &big[..]);
    // Forwarding the result to the next task passes the same file again.
    let again = exec
        .run_task("echo", out, &mut ctx, &Signal::new())
        .unwrap();
    assert_eq!(&again.blob("m").unwrap()[..], &big[..]);
    exec.finalize().unwrap();
}
