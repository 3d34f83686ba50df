//! Out of memory as its own failure class: a rank that reports an allocation failure,
//! a retry budget per stage, and a rank killed by the kernel's OOM killer.
//!
//! The OOM-killer test needs a memory cgroup it can make (root, or a delegated cgroup
//! v2 subtree; v1 and v2 are both handled). Where it cannot, it says SKIPPED on stderr
//! in a banner; with `RANKEXEC_REQUIRE_OOM_TEST=1` (CI on a machine that can) a skip
//! is a failure instead.

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

/// A memory cgroup of this process's in which a child cgroup with a small limit can be
/// made: its directory and the file that holds the limit (`memory.limit_in_bytes` on
/// v1, `memory.max` on v2).
fn memory_cgroup() -> Result<(PathBuf, &'static str), String> {
    let cg = std::fs::read_to_string("/proc/self/cgroup").map_err(|e| e.to_string())?;
    let mut v2 = None;
    for l in cg.lines() {
        let mut p = l.splitn(3, ':');
        let (Some(_), Some(ctrl), Some(path)) = (p.next(), p.next(), p.next()) else {
            continue;
        };
        if ctrl.split(',').any(|c| c == "memory") {
            let dir = PathBuf::from(format!("/sys/fs/cgroup/memory{path}"));
            if dir.join("memory.limit_in_bytes").exists() {
                return Ok((dir, "memory.limit_in_bytes"));
            }
        } else if ctrl.is_empty() {
            v2 = Some(PathBuf::from(format!("/sys/fs/cgroup{path}")));
        }
    }
    let dir = v2.ok_or("no memory cgroup (v1 or v2) for this process")?;
    let controllers =
        std::fs::read_to_string(dir.join("cgroup.subtree_control")).unwrap_or_default();
    if !controllers.split_whitespace().any(|c| c == "memory") {
        return Err(format!(
            "cgroup v2 {} does not delegate the memory controller to children",
            dir.display()
        ));
    }
    Ok((dir, "memory.max"))
}

fn skip(why: &str) {
    if std::env::var_os("RANKEXEC_REQUIRE_OOM_TEST").is_some() {
        panic!("RANKEXEC_REQUIRE_OOM_TEST is set but the OOM-killer test cannot run: {why}");
    }
    eprintln!(
        "\n********************************************************************\n\
         SKIPPED oom_killer_is_recognised: {why}\n\
         (nothing was tested; set RANKEXEC_REQUIRE_OOM_TEST=1 to make this a failure)\n\
         ********************************************************************\n"
    );
}

struct CgroupGuard(PathBuf);

impl Drop for CgroupGuard {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

#[test]
fn oom_killer_is_recognised() {
    let (parent, limit_file) = match memory_cgroup() {
        Ok(found) => found,
        Err(why) => return skip(&why),
    };
    let child = parent.join(format!("rankexec-oom-test-{}", std::process::id()));
    if let Err(e) = std::fs::create_dir(&child) {
        return skip(&format!(
            "cannot create {} ({e}): needs root or a delegated cgroup",
            child.display()
        ));
    }
    let _guard = CgroupGuard(child.clone());
    std::fs::write(child.join(limit_file), (96u64 << 20).to_string()).unwrap();
    // No swap to escape to (v2 only; v1's memsw limit is optional).
    let _ = std::fs::write(child.join("memory.swap.max"), "0");
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
    eprintln!(
        "OOM killer in a 96 MiB cgroup ({}): {}",
        limit_file,
        stdout
            .lines()
            .find(|l| l.contains("OOM killer"))
            .unwrap_or_default()
    );
}
