//! A connection that does not hold the launch's secret is refused and logged, and the
//! group still starts. The real secret (read here from the rank's pipe, as any process
//! of the rank could) appears in no log: the host's, or any rank's.

mod common;

use std::os::unix::fs::PermissionsExt;

use common::*;
use rankexec::executor::MultiProcessExecutor;
use rankexec::protocol::{Shareable, Signal, Value};

#[test]
fn impostor_is_refused_and_group_starts() {
    let log = LogCapture::install();
    let dir = tempfile::tempdir().unwrap();
    // Each rank's program takes the real secret from its pipe (rank 0 keeps a copy for
    // the test); rank 0 first runs an impostor (same user, wrong secret), then both
    // become real ranks with the secret in their environment.
    let script = dir.path().join("worker.sh");
    let secret_file = dir.path().join("secret");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nsecret=$(cat /dev/fd/$RANKEXEC_SECRET_FD)\n\
             if [ \"$RANKEXEC_RANK\" = 0 ]; then echo \"$secret\" > {f}; \
             env -u RANKEXEC_SECRET_FD -u RANKEXEC_PARENT_PID RANKEXEC_SECRET={} {w}; fi\n\
             RANKEXEC_SECRET=$secret exec env -u RANKEXEC_SECRET_FD {w}\n",
            "0".repeat(64),
            f = secret_file.display(),
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
    let secret = std::fs::read_to_string(&secret_file).unwrap();
    let secret = secret.trim();
    assert_eq!(secret.len(), 64, "the real secret was read from the pipe");
    exec.finalize().unwrap();
    assert!(
        !log.text().contains(secret),
        "the real secret appears in the host's log"
    );
    for r in 0..2 {
        for stream in ["stdout", "stderr"] {
            let f = dir.path().join(format!("rank-{r}/{stream}.log"));
            let text = std::fs::read_to_string(&f).unwrap_or_default();
            assert!(
                !text.contains(secret),
                "the real secret is in {}",
                f.display()
            );
        }
    }
    eprintln!(
        "impostor refused; the real secret (64 hex digits) is in none of {} bytes of host log and the ranks' logs",
        log.text().len()
    );
}
