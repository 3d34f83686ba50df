//! Start-up failures are clear and fast: they name the rank and the cause, and never
//! wait for the start-up deadline.

mod common;

use common::*;
use rankexec::executor::{ExitStatus, FailureCause, MultiProcessExecutor, StartError};
use rankexec::protocol::{ErrorClass, FlContext};

fn start_err(exec: &MultiProcessExecutor) -> StartError {
    exec.start(&FlContext::new())
        .expect_err("start-up must fail")
}

#[test]
fn unknown_component_path() {
    let _serial = serial();
    let logs = tempfile::tempdir().unwrap();
    let exec = MultiProcessExecutor::new(config(
        2,
        "NoSuchComponent",
        serde_json::json!({}),
        logs.path(),
    ))
    .unwrap();
    let err = start_err(&exec);
    let StartError::Build { rank, error } = &err else {
        panic!("{err:?}")
    };
    assert!(*rank < 2, "the first rank to answer is reported");
    assert!(
        error
            .0
            .message
            .contains("unknown path `NoSuchComponent` (known: Alloc, Digest, Echo"),
        "{}",
        error.0.message
    );
    assert!(
        exec.live_pids().is_empty(),
        "the partial group is torn down"
    );
    assert!(child_pids().is_empty());
}

#[test]
fn rank_exits_before_hello() {
    let _serial = serial();
    let logs = tempfile::tempdir().unwrap();
    let mut cfg = config(3, "Echo", serde_json::json!({}), logs.path());
    cfg.worker.program = "/bin/false".into();
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let err = start_err(&exec);
    let StartError::RankFailed(f) = &err else {
        panic!("{err:?}")
    };
    assert_eq!(f.cause, FailureCause::Exited(ExitStatus::Code(1)));
    assert!(
        chain(&err).contains("exited with code 1"),
        "{}",
        chain(&err)
    );
    assert!(child_pids().is_empty());
}

#[test]
fn one_rank_fails_to_build() {
    let _serial = serial();
    let logs = tempfile::tempdir().unwrap();
    let cfg = config(
        3,
        "Fail",
        serde_json::json!({"ranks": [1], "when": "build", "message": "no data"}),
        logs.path(),
    );
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let err = start_err(&exec);
    let StartError::Build { rank, error } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(*rank, 1);
    assert!(
        error.0.message.contains("no data (rank 1)"),
        "{}",
        error.0.message
    );
    assert!(child_pids().is_empty());
}

#[test]
fn a_build_panic_is_classified() {
    let _serial = serial();
    let logs = tempfile::tempdir().unwrap();
    let cfg = config(
        2,
        "Panic",
        serde_json::json!({"ranks": [0], "when": "build"}),
        logs.path(),
    );
    let exec = MultiProcessExecutor::new(cfg).unwrap();
    let err = start_err(&exec);
    let StartError::Build { error, .. } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(error.0.class, ErrorClass::Panic);
    assert!(
        error.0.message.contains("panic on purpose while building"),
        "{}",
        error.0.message
    );
}

#[test]
fn missing_worker_program_is_a_config_error() {
    let logs = tempfile::tempdir().unwrap();
    let mut cfg = config(2, "Echo", serde_json::json!({}), logs.path());
    cfg.worker.program = "no-such-worker-program".into();
    let err = MultiProcessExecutor::new(cfg).unwrap_err();
    assert_eq!(err.path, "worker.program");
    assert!(
        err.message
            .starts_with("`no-such-worker-program` not found"),
        "{err}"
    );
}
