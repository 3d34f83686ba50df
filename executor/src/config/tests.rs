//! Validation cases.

use std::time::Duration;

use super::*;
use crate::units::Dur;

fn base() -> ExecutorConfig {
    let mut c = ExecutorConfig::simple(2, "Echo", serde_json::Value::Null);
    c.worker.program = "/bin/sh".into();
    c
}

#[test]
fn validation_names_the_field() {
    let mut c = base();
    c.num_of_processes = 0;
    assert_eq!(c.validate().unwrap_err().path, "num_of_processes");
    let mut c = base();
    c.executor_id = "nope".into();
    let e = c.validate().unwrap_err();
    assert_eq!(
        e.to_string(),
        "executor_id: `nope` is not the id of any component (ids: executor)"
    );
    let mut c = base();
    c.components.push(c.components[0].clone());
    assert_eq!(c.validate().unwrap_err().path, "components[1].id");
    let e = resolve_program("definitely-not-a-program-xyz").unwrap_err();
    assert!(e.contains("not found"), "{e}");
    assert!(resolve_program("/bin/sh").is_ok());
    let mut c = base();
    c.deadlines.heartbeat_timeout = Dur(Duration::from_millis(100));
    assert_eq!(
        c.validate().unwrap_err().path,
        "deadlines.heartbeat_timeout"
    );
    assert!(base().validate().is_ok());
    // Deadlines are added to the current time: a huge one is refused, not a panic.
    let mut c = base();
    c.deadlines.task = Dur(Duration::from_secs(u64::MAX));
    let e = c.validate().unwrap_err();
    assert_eq!(e.path, "deadlines.task");
    let e = serde_json::from_value::<ExecutorConfig>(serde_json::json!({
        "executor_id": "e", "components": [], "deadlines": {"task": 1e12}
    }))
    .unwrap_err();
    assert!(
        e.to_string().contains("longer than the 366 days allowed"),
        "{e}"
    );
}

#[test]
fn unknown_keys_and_wrong_types_are_refused() {
    let e = serde_json::from_value::<ExecutorConfig>(serde_json::json!({
        "executor_id": "e", "components": [], "num_of_procs": 2
    }))
    .unwrap_err();
    assert!(
        e.to_string().contains("unknown field `num_of_procs`"),
        "{e}"
    );
    let e = serde_json::from_value::<ExecutorConfig>(serde_json::json!({
        "executor_id": "e", "components": [], "num_of_processes": "two"
    }))
    .unwrap_err();
    assert!(e.to_string().contains("invalid type"), "{e}");
}

#[test]
fn launchers_parse_in_both_forms() {
    let l: LauncherConfig = serde_json::from_str("\"builtin\"").unwrap();
    assert_eq!(l, LauncherConfig::Builtin);
    let l: LauncherConfig =
        serde_json::from_str(r#"{"mpirun": {"extra_args": ["--oversubscribe"]}}"#).unwrap();
    assert!(matches!(l, LauncherConfig::Mpirun { .. }));
}
