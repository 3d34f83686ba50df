//! The README's five-minute tour, as a new user meets it: every `$ ` command of the
//! "A five-minute tour" section runs as written, in order, in a fresh `git clone` of
//! this repository (its committed state). The clone's `target` is a link to this
//! build's target directory, so only the workspace's own crates are rebuilt (release).
//!
//! It takes a few minutes: release builds of the workspace and `bench --quick`.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// The `$ ` commands of the README's tour section, in order.
fn tour_commands(readme: &str) -> Vec<String> {
    let start = readme
        .find("## A five-minute tour")
        .expect("the README has a tour");
    let section = &readme[start..];
    let end = section[3..].find("\n## ").map_or(section.len(), |i| i + 3);
    section[..end]
        .lines()
        .filter_map(|l| l.strip_prefix("$ "))
        .map(str::to_owned)
        .collect()
}

/// What each command must do: its exit code and a line its output contains.
fn expectation(cmd: &str) -> (i32, &'static str) {
    let table: [(&str, i32, &str); 8] = [
        ("simulate examples/jobs/fedavg", 0, "status: completed"),
        ("simulate examples/jobs/timeout", 1, "status: aborted"),
        ("--component Echo", 0, r#"round 2: ok in"#),
        (
            "--component Fail",
            1,
            "round 0: failed: rank 2 failed: exception: bad batch",
        ),
        (
            "--component Exit",
            1,
            "round 0: failed: rank 1 failed: pid ",
        ),
        ("rankexec gpus", 0, "GPU"),
        ("cargo build --release --workspace", 0, ""),
        ("rankexec bench --quick", 0, "done in"),
    ];
    table
        .iter()
        .find(|(k, _, _)| cmd.contains(k))
        .map(|(_, code, text)| (*code, *text))
        .unwrap_or_else(|| panic!("the tour test does not know what `{cmd}` should do"))
}

fn git(args: &[&str], dir: &Path) {
    let st = Command::new("git")
        .args(args)
        .current_dir(dir)
        .status()
        .unwrap();
    assert!(st.success(), "git {args:?}");
}

#[test]
fn the_readme_tour_works_in_order_in_a_fresh_clone() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(repo.join("README.md")).unwrap();
    let commands = tour_commands(&readme);
    assert!(commands.len() >= 7, "{commands:?}");

    let tmp = tempfile::tempdir().unwrap();
    let clone = tmp.path().join("rankexec");
    git(
        &[
            "clone",
            "-q",
            &repo.display().to_string(),
            &clone.display().to_string(),
        ],
        tmp.path(),
    );
    // This build's target directory (target/debug/rankexec -> target), shared.
    let target: PathBuf = rankexec_bin()
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .to_owned();
    std::os::unix::fs::symlink(&target, clone.join("target")).unwrap();
    let (xdg, scratch) = (tmp.path().join("xdg"), tmp.path().join("tmp"));
    std::fs::create_dir_all(&xdg).unwrap();
    std::fs::create_dir_all(&scratch).unwrap();

    for (i, cmd) in commands.iter().enumerate() {
        let (want_code, want_text) = expectation(cmd);
        let out_path = tmp.path().join(format!("step-{i}.out"));
        let out = std::fs::File::create(&out_path).unwrap();
        let t = Instant::now();
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(cmd)
            .current_dir(&clone)
            .env_remove("CARGO_TARGET_DIR")
            .env_remove("RANKEXEC_LOG")
            .env_remove("RUST_LOG")
            .env("XDG_RUNTIME_DIR", &xdg)
            .env("TMPDIR", &scratch)
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap();
        // A bound, not a duration: the first step builds the workspace in release (and
        // waits on cargo's lock while another build holds it); with the CPUs saturated
        // (`scripts/load-test.sh`) that took over 900 s on 2 cores.
        let status = wait_exit(&mut child, Duration::from_secs(2400));
        let text = std::fs::read_to_string(&out_path).unwrap_or_default();
        let shown: Vec<&str> = text
            .lines()
            .filter(|l| !l.trim_start().starts_with("Compiling"))
            .collect();
        eprintln!(
            "$ {cmd}\n  exit {:?} in {:.1} s; last lines:\n    {}",
            status.code(),
            t.elapsed().as_secs_f64(),
            shown[shown.len().saturating_sub(3)..].join("\n    ")
        );
        assert_eq!(status.code(), Some(want_code), "`{cmd}`:\n{text}");
        assert!(text.contains(want_text), "`{cmd}` printed:\n{text}");
    }
    // Nothing left behind: no run directory, and rank logs only where a round failed.
    assert_eq!(entries(&xdg.join("rankexec")), Vec::<String>::new());
    let kept = entries(&scratch);
    assert_eq!(
        kept.iter()
            .filter(|e| e.starts_with("rankexec-run-"))
            .count(),
        2,
        "the two failed `run`s keep their logs: {kept:?}"
    );
    assert!(
        clone
            .join("workspace/fedavg-digits/server/global_model.safetensors")
            .exists()
    );
}
