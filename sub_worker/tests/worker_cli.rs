//! The `rankexec-worker` binary: its command line, its start-up errors, and what it
//! links.

use std::process::Command;

fn worker() -> Command {
    Command::new(env!("CARGO_BIN_EXE_rankexec-worker"))
}

#[test]
fn lists_its_components() {
    let out = worker().arg("--list-components").output().unwrap();
    assert!(out.status.success());
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let paths: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["path"].as_str().unwrap())
        .collect();
    for p in [
        "Echo",
        "Sum",
        "Sleep",
        "Fail",
        "Panic",
        "Exit",
        "FireEvent",
        "EventLog",
    ] {
        assert!(paths.contains(&p), "{p} missing from {paths:?}");
    }
}

#[test]
fn checks_component_configs_without_building_them() {
    let ok = worker()
        .args([
            "--check-components",
            r#"[{"id": "s", "path": "Sleep", "args": {"secs": 1}}]"#,
        ])
        .output()
        .unwrap();
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stdout)
    );
    let bad = worker()
        .args([
            "--check-components",
            r#"[{"id": "s", "path": "Sleep", "args": {"secs": "long"}}, {"id": "x", "path": "Nope"}]"#,
        ])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(1));
    let report: serde_json::Value = serde_json::from_slice(&bad.stdout).unwrap();
    let errors = report["errors"].as_array().unwrap();
    assert_eq!(errors.len(), 2);
    assert!(
        errors[0]["error"]
            .as_str()
            .unwrap()
            .contains("invalid type: string \"long\", expected f64"),
        "{report}"
    );
    assert!(
        errors[1]["error"]
            .as_str()
            .unwrap()
            .contains("unknown path `Nope`"),
        "{report}"
    );
}

#[test]
fn without_an_executor_it_says_why_and_exits_1() {
    let out = worker().env_clear().output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot determine this rank: no rank in the environment"),
        "{err}"
    );
}

#[test]
fn refuses_unknown_arguments() {
    let out = worker().arg("--frobnicate").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn does_not_link_nvml() {
    let bytes = std::fs::read(env!("CARGO_BIN_EXE_rankexec-worker")).unwrap();
    let needle = b"libnvidia-ml";
    assert!(
        !bytes.windows(needle.len()).any(|w| w == needle),
        "the worker binary must not carry NVML (it learns its GPU from CUDA_VISIBLE_DEVICES)"
    );
}
