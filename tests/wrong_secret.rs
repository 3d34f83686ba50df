//! A connection that does not hold the launch's secret is refused and logged, and the
//! group still starts.

mod common;

use std::os::unix::fs::PermissionsExt;

use common::*;
use rankexec::executor::MultiProcessExecutor;
use rankexec::protocol::{Shareable, Signal, Value};

#[test]
fn impostor_is_refused_and_group_starts() {
    let log = LogCapture::install();
    let dir = tempfile::tempdir().unwrap();
    // Rank 0's program first runs an impostor (same user, wrong secret), then becomes
    // the real rank.
    let script = dir.path().join("worker.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nif [ \"$RANKEXEC_RANK\" = 0 ]; then env -u RANKEXEC_PARENT_PID RANKEXEC_SECRET={} {w}; fi\nexec {w}\n",
            "0".repeat(64),
            w = worker_bin().display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut cfg = config(2, "Echo", serde_json::json!({}), dir.path());
    cfg.worker.program = script.display().to_string();
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let mut ctx = start(&exec);
    assert!(
        log.wait_for(
            "refused connection: authentication failed",
            std::time::Duration::from_secs(5)
        ),
        "the refusal is logged with its reason"
    );
    let out = exec
        .run_task("t", Shareable::new(), &mut ctx, &Signal::new())
        .unwrap();
    assert_eq!(out.meta("rank"), Some(&Value::Int(0)));
    let rank0 = std::fs::read_to_string(dir.path().join("rank-0/stderr.log")).unwrap();
    assert!(
        rank0.contains("refused by the parent: authentication failed"),
        "the impostor was told why: {rank0}"
    );
    assert!(
        !log.text().contains(&"0".repeat(64)),
        "the secret never appears in logs"
    );
    exec.finalize().unwrap();
}
