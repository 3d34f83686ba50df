//! Errors a new user meets on `rankexec simulate`: each names the cause and the path
//! at fault, says it once, and leaks no internal event names.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

fn fedavg() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/jobs/fedavg")
}

/// `rankexec simulate JOB -w WS`: exit code and stderr.
fn simulate(job: &Path, ws: &Path) -> (Option<i32>, String, String) {
    let out = Command::new(rankexec_bin())
        .args(["simulate", "--no-progress", "-w"])
        .arg(ws)
        .arg(job)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("-w {}: {}", ws.display(), stderr.trim());
    (out.status.code(), stdout, stderr)
}

#[test]
fn a_workspace_that_is_a_file_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ws");
    std::fs::write(&file, "").unwrap();
    let (code, _, err) = simulate(&fedavg(), &file);
    assert_eq!(code, Some(1));
    assert_eq!(
        err.trim(),
        format!(
            "error: the workspace {0} cannot be a directory: {0} is not a directory",
            file.display()
        )
    );
    let (_, _, err) = simulate(&fedavg(), &file.join("sub"));
    assert!(
        err.contains(&format!("{} is not a directory", file.display())),
        "{err}"
    );
}

#[test]
fn a_workspace_that_cannot_be_created_names_where() {
    let (code, _, err) = simulate(&fedavg(), Path::new("/proc/ws"));
    assert_eq!(code, Some(1));
    assert!(
        err.starts_with("error: cannot create the workspace directory /proc/ws in /proc: "),
        "{err}"
    );
}

/// Makes a directory read-only for this user: `chattr +i` as root (root ignores mode
/// bits), mode 0555 otherwise. Undone on drop, even when the test fails.
struct ReadOnly(PathBuf, bool);

impl ReadOnly {
    fn new(p: &Path) -> ReadOnly {
        if nix::unistd::geteuid().is_root() {
            let ok = Command::new("chattr")
                .arg("+i")
                .arg(p)
                .status()
                .is_ok_and(|s| s.success());
            assert!(
                ok,
                "as root, this test needs chattr to make a read-only directory"
            );
            ReadOnly(p.to_owned(), true)
        } else {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o555)).unwrap();
            ReadOnly(p.to_owned(), false)
        }
    }
}

impl Drop for ReadOnly {
    fn drop(&mut self) {
        if self.1 {
            let _ = Command::new("chattr").arg("-i").arg(&self.0).status();
        } else {
            use std::os::unix::fs::PermissionsExt as _;
            let _ = std::fs::set_permissions(&self.0, std::fs::Permissions::from_mode(0o755));
        }
    }
}

#[test]
fn a_read_only_workspace_names_the_file_it_cannot_write() {
    let dir = tempfile::tempdir().unwrap();
    let ws = dir.path().join("ws");
    std::fs::create_dir(&ws).unwrap();
    let _ro = ReadOnly::new(&ws);
    let (code, _, err) = simulate(&fedavg(), &ws);
    assert_eq!(code, Some(1));
    assert!(
        err.starts_with(&format!(
            "error: cannot write {}: ",
            ws.join("summary.json").display()
        )),
        "{err}"
    );
}

#[test]
fn a_worker_that_exits_0_at_once_is_reported_as_such() {
    let job = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(job.path().join("app/config")).unwrap();
    for f in ["meta.json", "app/config/config_fed_server.json"] {
        std::fs::copy(fedavg().join(f), job.path().join(f)).unwrap();
    }
    let client = std::fs::read_to_string(fedavg().join("app/config/config_fed_client.json"))
        .unwrap()
        .replace(
            r#""worker": {"program": "rankexec", "args": ["worker"]}"#,
            r#""worker": {"program": "/bin/true"}"#,
        );
    assert!(client.contains("/bin/true"));
    std::fs::write(job.path().join("app/config/config_fed_client.json"), client).unwrap();
    let ws = tempfile::tempdir().unwrap();
    let (code, stdout, _) = simulate(job.path(), ws.path());
    eprintln!("{stdout}");
    assert_eq!(code, Some(1));
    let reason = stdout
        .lines()
        .find_map(|l| l.strip_prefix("reason: "))
        .unwrap_or_else(|| panic!("{stdout}"));
    for site in ["site-1", "site-2"] {
        assert_eq!(
            reason.matches(site).count(),
            1,
            "{site} named once: {reason}"
        );
    }
    assert!(
        reason.contains("site-1: executor `trainer` could not start: rank ")
            && reason.contains("exited with code 0 before connecting back"),
        "{reason}"
    );
    assert!(
        !reason.contains("_start_run"),
        "no internal event names: {reason}"
    );
}
