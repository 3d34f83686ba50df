//! Out of memory as its own failure class: a rank that reports an allocation failure,
//! a retry budget per stage, and a rank killed by the kernel's OOM killer.

mod common;

use std::path::PathBuf;

use common::*;
use rankexec::executor::MultiProcessExecutor;
use rankexec::protocol::{ErrorClass, Shareable, Signal};

#[test]
fn reported_oom_is_retried_within_its_budget() {
    let log = LogCapture::install();
    let logs = tempfile::tempdir().unwrap();
    let mut cfg = config(
        2,
        "Fail",
        serde_json::json!({"ranks": [0], "class": "out_of_memory", "message": "CUDA out of memory"}),
        logs.path(),
    );
    cfg.resources.oom_retries.execute = 2;
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let mut ctx = start(&exec);
    let err = exec
        .run_task("t", Shareable::new(), &mut ctx, &Signal::new())
        .unwrap_err();
    assert_eq!(err.class(), ErrorClass::OutOfMemory);
    let retries = log
        .text()
        .matches("relaunching the group with larger estimates and retrying the task")
        .count();
    assert_eq!(retries, 2, "two retries, then the failure is returned");
    exec.finalize().unwrap();
}

/// The memory cgroup of this process (v1), where a child with a small limit can be made.
fn memory_cgroup() -> Option<PathBuf> {
    let cg = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = cg.lines().find_map(|l| {
        let mut p = l.splitn(3, ':');
        let (_, ctrl, path) = (p.next()?, p.next()?, p.next()?);
        ctrl.split(',')
            .any(|c| c == "memory")
            .then(|| path.to_owned())
    })?;
    let dir = PathBuf::from(format!("/sys/fs/cgroup/memory{path}"));
    dir.join("memory.limit_in_bytes").exists().then_some(dir)
}

struct CgroupGuard(PathBuf);

impl Drop for CgroupGuard {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

#[test]
fn oom_killer_is_recognised() {
    let Some(parent) = memory_cgroup().filter(|_| nix::unistd::geteuid().is_root()) else {
        eprintln!(
            "skipping: needs root and a cgroup v1 memory hierarchy to make a small memory cgroup"
        );
        return;
    };
    let child = parent.join(format!("rankexec-oom-test-{}", std::process::id()));
    if std::fs::create_dir(&child).is_err() {
        eprintln!("skipping: cannot create {}", child.display());
        return;
    }
    let _guard = CgroupGuard(child.clone());
    std::fs::write(
        child.join("memory.limit_in_bytes"),
        (96u64 << 20).to_string(),
    )
    .unwrap();
    // The host joins the 96 MiB cgroup before it starts, so its rank is born there;
    // touching 1 GiB wakes the OOM killer, which kills the rank (the biggest process).
    let logs = tempfile::tempdir().unwrap();
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "echo $$ > {}/cgroup.procs && exec {} run -n 1 --component Alloc --args '{{\"bytes\": 1073741824, \"touch\": true}}' --worker {} --log-dir {}",
            child.display(),
            rankexec_bin().display(),
            worker_bin().display(),
            logs.path().display()
        ))
        .env("RANKEXEC_LOG", "warn")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "the task fails: {stdout}");
    assert!(
        stdout.contains("was killed by the kernel OOM killer"),
        "the failure names the OOM killer:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
