//! The README's five-minute tour, as a new user meets it: every ```` ```console ````
//! block of the "A five-minute tour" section runs as written, in order, in a fresh `git
//! clone` of this repository (its committed state), and what each command prints is
//! compared with every line the README shows. The notation is the guide's
//! (docs/CONVENTIONS.md, "Fenced blocks"): `$ ` a command (`\` continues it), `? N` its
//! exit code (default 0), then the lines it prints, stdout and stderr together, each
//! matching one whole line, `[..]` any text within a line, a line `...` any lines.
//! The clone's `target` is a link to this build's target directory, so only the
//! workspace's own crates are rebuilt (release).
//!
//! Caveats: cargo's own progress lines (`Compiling`, `Finished`, `Running`, ...) are
//! not compared, a reader's cargo prints them or not; blank lines are not compared. It
//! takes a few minutes: release builds of the workspace and `bench --quick`.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::console::{self, Step, line_matches, output_matches};
use common::*;

/// The `$ ` commands of the ```` ```console ```` blocks of the README's tour, in order.
fn tour_steps(readme: &str) -> Vec<Step> {
    let start = readme
        .find("## A five-minute tour")
        .expect("the README has a tour");
    let section = &readme[start..];
    let end = section[3..].find("\n## ").map_or(section.len(), |i| i + 3);
    let mut body: Vec<&str> = Vec::new();
    let mut in_block = false;
    for line in section[..end].lines() {
        if !in_block {
            in_block = line.trim_start() == "```console";
        } else if line.trim_start().starts_with("```") {
            in_block = false;
        } else {
            body.push(line);
        }
    }
    console::steps(body, "README tour")
}

/// cargo's own progress lines, which a reader's cargo prints or not.
fn is_cargo_progress(line: &str) -> bool {
    let t = line.trim_start();
    [
        "Compiling ",
        "Finished ",
        "Running ",
        "Blocking ",
        "Updating ",
        "Locking ",
        "Downloading ",
        "Downloaded ",
        "Fresh ",
    ]
    .iter()
    .any(|p| t.starts_with(p))
}

#[test]
fn the_notation() {
    let steps = tour_steps(
        "## A five-minute tour\n```console\n$ a \\\n  b\n? 1\nx [..] y\n...\n```\n\n```text\n$ no\n```\n## Next\n```console\n$ c\n```",
    );
    assert_eq!(
        steps,
        vec![Step {
            cmd: "a \n  b".into(),
            code: 1,
            lines: vec!["x [..] y".into(), "...".into()]
        }]
    );
    let want = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert!(output_matches(
        &want(&["x [..] y", "...", "z"]),
        &["x 1 2 y", "w", "z"]
    ));
    assert!(!output_matches(
        &want(&["x [..] y", "z"]),
        &["x 1 2 y", "w", "z"]
    ));
    assert!(!output_matches(
        &want(&["z", "...", "x [..] y"]),
        &["x 1 2 y", "z"]
    ));
    assert!(output_matches(&want(&["...", "b"]), &["a", "b"]));
    assert!(!output_matches(&want(&[]), &["a"]));
    assert!(line_matches("a [..]b[..] c", "a xbx c"));
    assert!(!line_matches("a [..] c", "a c"));
    assert!(!line_matches("a(b)", "a(b) x"));
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
    let steps = tour_steps(&readme);
    assert!(steps.len() >= 7, "{steps:?}");

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

    for (i, step) in steps.iter().enumerate() {
        let cmd = &step.cmd;
        let out_path = tmp.path().join(format!("step-{i}.out"));
        let out = std::fs::File::create(&out_path).unwrap();
        let t = Instant::now();
        let mut child = Command::new("bash")
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
            .filter(|l| !l.trim().is_empty() && !is_cargo_progress(l))
            .collect();
        eprintln!(
            "$ {cmd}\n  exit {:?} in {:.1} s; last lines:\n    {}",
            status.code(),
            t.elapsed().as_secs_f64(),
            shown[shown.len().saturating_sub(3)..].join("\n    ")
        );
        assert_eq!(
            status.code(),
            Some(step.code),
            "`{cmd}` exited {:?}, the README says {}:\n{text}",
            status.code(),
            step.code
        );
        assert!(
            output_matches(&step.lines, &shown),
            "`{cmd}` did not print what the README shows:\n{}\nit printed:\n{}",
            step.lines.join("\n"),
            shown.join("\n")
        );
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
