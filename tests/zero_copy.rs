//! Large blobs reach ranks as one sealed memory file mapped by every rank, and a
//! rank's large result comes back the same way. "The same file" is checked by inode:
//! each rank reports the inode of the file mapped under the bytes it read
//! (`/proc/self/maps`), and the parent compares it with its own memory file's.

mod common;

use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

use common::*;
use rankexec::executor::MultiProcessExecutor;
use rankexec::protocol::{Blob, Shareable, Signal, Value};
use rankexec::sub_worker::builtins::checksum;

/// The inode of a shared blob's memory file, as the parent holds it.
fn inode(blob: &Blob) -> u64 {
    let fd = blob.memfd().expect("a shared blob has a memory file");
    std::fs::File::from(fd.try_clone().unwrap())
        .metadata()
        .unwrap()
        .ino()
}

/// Waits until rank `r`'s log reports the inode it read `blob` from; returns it.
fn rank_inode(logs: &std::path::Path, r: u32, blob: &str) -> u64 {
    let file = logs.join(format!("rank-{r}/stderr.log"));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        let found = text.lines().find_map(|l| {
            (l.contains("digest reads a mapped file") && l.contains(&format!("blob={blob} ")))
                .then(|| {
                    l.split("inode=")
                        .nth(1)?
                        .split_whitespace()
                        .next()?
                        .parse()
                        .ok()
                })
                .flatten()
        });
        if let Some(i) = found {
            return i;
        }
        assert!(
            Instant::now() < deadline,
            "rank {r} never reported the inode of `{blob}`:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn big_blobs_are_shared_small_ones_inline() {
    let logs = tempfile::tempdir().unwrap();
    let mut cfg = config(3, "Digest", serde_json::json!({}), logs.path());
    cfg.env.set.insert("RANKEXEC_LOG".into(), "info".into());
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let mut ctx = start(&exec);
    let big = Blob::shared_with(4 << 20, |b| {
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i * 7 + 3) as u8;
        }
    })
    .unwrap();
    let parent_inode = inode(&big);
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
    assert_eq!(out.meta("inode:small"), None, "inline bytes map no file");
    assert_eq!(
        out.meta("digest:big"),
        Some(&Value::Int(checksum(&big) as i64))
    );
    assert_eq!(
        out.meta("digest:small"),
        Some(&Value::Int(checksum(&small) as i64))
    );
    let ranks: Vec<u64> = (0..3).map(|r| rank_inode(logs.path(), r, "big")).collect();
    assert_eq!(
        ranks,
        vec![parent_inode; 3],
        "every rank reads the parent's memory file itself"
    );
    assert_eq!(
        out.meta("inode:big"),
        Some(&Value::Int(parent_inode as i64))
    );
    eprintln!(
        "4 MiB blob: parent memfd inode {parent_inode}; ranks 0..3 read mapped inodes {ranks:?}"
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
    let first = inode(m);
    // Forwarding the result to the next task passes the same file again: the rank
    // echoes the very file it was sent.
    let again = exec
        .run_task("echo", out, &mut ctx, &Signal::new())
        .unwrap();
    let m2 = again.blob("m").unwrap();
    assert_eq!(&m2[..], &big[..]);
    assert_eq!(
        inode(m2),
        first,
        "the forwarded result is the same memory file"
    );
    eprintln!(
        "1 MiB result: memfd inode {first}, forwarded and echoed back as inode {}",
        inode(m2)
    );
    exec.finalize().unwrap();
}
