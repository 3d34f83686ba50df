//! Job folders are validated before anything runs; each error names the file, the JSON
//! path and what was expected.

mod common;

use std::path::Path;

use rankexec::job::{JobError, load};

fn copy_job(src: &Path, dst: &Path) {
    for sub in ["", "app", "app/config"] {
        std::fs::create_dir_all(dst.join(sub)).unwrap();
    }
    for f in [
        "meta.json",
        "app/config/config_fed_client.json",
        "app/config/config_fed_server.json",
    ] {
        std::fs::copy(src.join(f), dst.join(f)).unwrap();
    }
}

/// Loads the fedavg example after `edit` changes one file's JSON.
fn load_edited(
    file: &str,
    edit: impl FnOnce(&mut serde_json::Value),
) -> Result<rankexec::job::Job, JobError> {
    let dir = tempfile::tempdir().unwrap();
    copy_job(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("examples/jobs/fedavg")
            .as_path(),
        dir.path(),
    );
    let path = dir.path().join(file);
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&path, v.to_string()).unwrap();
    load(dir.path(), &rankexec_examples::worker_registry())
}

const CLIENT: &str = "app/config/config_fed_client.json";
const SERVER: &str = "app/config/config_fed_server.json";

fn mpe_args(v: &mut serde_json::Value) -> &mut serde_json::Value {
    &mut v["executors"][0]["executor"]["args"]
}

#[test]
fn the_example_loads() {
    let job = load_edited(CLIENT, |_| {}).unwrap();
    assert_eq!(job.meta.name, "fedavg-digits");
    assert_eq!(job.workflow.num_rounds, 5);
}

/// A file, how to break it, and the start of the error that must result.
type Case = (
    &'static str,
    Box<dyn FnOnce(&mut serde_json::Value)>,
    &'static str,
);

#[test]
fn each_kind_of_error_names_file_path_and_expectation() {
    let cases: Vec<Case> = vec![
        (
            CLIENT,
            Box::new(|v| v["executors"][0]["executor"]["path"] = "NoSuchExecutor".into()),
            "app/config/config_fed_client.json: at executors[0].executor.path: unknown executor `NoSuchExecutor` (expected MultiProcessExecutor or one of: ",
        ),
        (
            CLIENT,
            Box::new(|v| mpe_args(v)["num_of_processes"] = "two".into()),
            "app/config/config_fed_client.json: at executors[0].executor.args.num_of_processes: invalid type: string \"two\", expected u32",
        ),
        (
            CLIENT,
            Box::new(|v| mpe_args(v)["num_of_procs"] = 2.into()),
            "app/config/config_fed_client.json: at executors[0].executor.args.num_of_procs: unknown field `num_of_procs`, expected one of `executor_id`, `num_of_processes`",
        ),
        (
            CLIENT,
            Box::new(|v| mpe_args(v)["num_of_processes"] = 5000.into()),
            "app/config/config_fed_client.json: at executors[0].executor.args.num_of_processes: must be between 1 and 1024, got 5000",
        ),
        (
            CLIENT,
            Box::new(|v| mpe_args(v)["components"][0]["path"] = "NoSuchComponent".into()),
            "app/config/config_fed_client.json: at executors[0].executor.args.components[0]: component `digits`: unknown path `NoSuchComponent`",
        ),
        (
            CLIENT,
            Box::new(|v| mpe_args(v)["components"][0]["args"]["epochs"] = "many".into()),
            "app/config/config_fed_client.json: at executors[0].executor.args.components[0]: component `digits` (`DigitsTrainer`): invalid args: invalid type: string \"many\", expected u32",
        ),
        (
            CLIENT,
            Box::new(|v| mpe_args(v)["components"][0]["args"]["lr"] = (-0.5).into()),
            "app/config/config_fed_client.json: at executors[0].executor.args.components[0]: component `digits` (`DigitsTrainer`): invalid args: lr must be a positive number, got -0.5",
        ),
        (
            CLIENT,
            Box::new(|v| mpe_args(v)["components"][0]["args"]["epochs"] = 0.into()),
            "app/config/config_fed_client.json: at executors[0].executor.args.components[0]: component `digits` (`DigitsTrainer`): invalid args: epochs must be at least 1, got 0",
        ),
        (
            CLIENT,
            Box::new(|v| mpe_args(v)["components"][0]["args"]["batch_size"] = 0.into()),
            "app/config/config_fed_client.json: at executors[0].executor.args.components[0]: component `digits` (`DigitsTrainer`): invalid args: batch_size must be at least 1, got 0",
        ),
        (
            CLIENT,
            Box::new(|v| mpe_args(v)["worker"]["program"] = "./missing-worker".into()),
            "app/config/config_fed_client.json: at executors[0].executor.args.worker.program: ",
        ),
        (
            SERVER,
            Box::new(|v| {
                v["workflows"][0]["args"]
                    .as_object_mut()
                    .unwrap()
                    .remove("num_rounds");
            }),
            "app/config/config_fed_server.json: at workflows[0].args: missing field `num_rounds`",
        ),
        (
            SERVER,
            Box::new(|v| v["workflows"][0]["args"]["train_task"] = "fit".into()),
            "app/config/config_fed_server.json: at workflows[0].args.train_task: task `fit` is not routed to any client executor (routed: train, validate)",
        ),
        (
            SERVER,
            Box::new(|v| v["workflows"][0]["args"]["persistor_id"] = "nope".into()),
            "app/config/config_fed_server.json: at workflows[0].args.persistor_id: no server component has id `nope`",
        ),
        (
            "meta.json",
            Box::new(|v| v["name"] = serde_json::Value::Null),
            "meta.json: at name: invalid type: null, expected a string",
        ),
    ];
    for (file, edit, want) in cases {
        let err = load_edited(file, edit).unwrap_err().to_string();
        eprintln!("{err}");
        assert!(err.starts_with(want), "\n got: {err}\nwant: {want}...");
    }
}

#[test]
fn broken_json_names_the_line() {
    let dir = tempfile::tempdir().unwrap();
    copy_job(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("examples/jobs/fedavg")
            .as_path(),
        dir.path(),
    );
    std::fs::write(dir.path().join(SERVER), "{\n  \"workflows\": [,]\n}").unwrap();
    let err = load(dir.path(), &rankexec_examples::worker_registry()).unwrap_err();
    assert_eq!(err.file, SERVER);
    assert_eq!(err.path, "line 2 column 17");
    assert!(
        err.message.starts_with("invalid JSON: expected value"),
        "{err}"
    );
}
