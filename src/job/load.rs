//! Loading a job folder: everything is validated before anything runs.
//!
//! Each error names the file, the JSON path and what was expected, e.g.
//! `app/config/config_fed_client.json: at executors[0].executor.args.num_of_processes:
//! invalid type: string "two", expected u32`. Checks:
//!
//! - JSON syntax, unknown keys, missing arguments and wrong types (serde, with the path);
//! - executor and workflow paths (`MultiProcessExecutor`, an in-process component,
//!   `ScatterAndGather`, `ModelPersistor`);
//! - every `MultiProcessExecutor` configuration ([`ExecutorConfig::validate`]), its
//!   worker program (found, relative to the job folder for relative paths), and its
//!   rank components: the worker binary is asked (`--check-components`) whether it knows
//!   each path and accepts its args, without building anything;
//! - GPU placement that can never work (more ranks than GPUs in `per_rank` mode);
//! - cross-references: the workflow's tasks are routed to an executor, its persistor exists.

use std::collections::BTreeSet;
use std::fmt;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use rankexec_executor::config::resolve_program;
use rankexec_executor::gpu::NvmlProbe;
use rankexec_executor::{ExecutorConfig, admission};
use rankexec_protocol::{ComponentConfig, Registry, error_chain};
use serde::de::DeserializeOwned;

use super::model::{ClientAppConfig, Meta, PersistorArgs, ScatterAndGatherArgs, ServerAppConfig};

/// A job that cannot be loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobError {
    /// The file, relative to the job folder.
    pub file: String,
    /// The JSON path (`$` for the whole file).
    pub path: String,
    /// What is wrong and what was expected.
    pub message: String,
}

impl fmt::Display for JobError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: at {}: {}", self.file, self.path, self.message)
    }
}

impl std::error::Error for JobError {}

impl JobError {
    fn new(file: &str, path: impl Into<String>, message: impl Into<String>) -> Self {
        JobError {
            file: file.to_owned(),
            path: path.into(),
            message: message.into(),
        }
    }
}

/// How a client runs an executor.
#[derive(Debug, Clone)]
pub enum ExecutorKind {
    /// In a group of rank processes.
    MultiProcess(Box<ExecutorConfig>),
    /// In the client process itself.
    InProcess(ComponentConfig),
}

/// A client executor with its tasks.
#[derive(Debug, Clone)]
pub struct LoadedExecutor {
    /// Its id.
    pub id: String,
    /// The tasks it runs.
    pub tasks: Vec<String>,
    /// How it runs.
    pub kind: ExecutorKind,
}

/// A validated job.
#[derive(Debug, Clone)]
pub struct Job {
    /// The folder.
    pub dir: PathBuf,
    /// `meta.json`.
    pub meta: Meta,
    /// The client executors.
    pub executors: Vec<LoadedExecutor>,
    /// Client components (in-process event handlers).
    pub client_components: Vec<ComponentConfig>,
    /// The controller's settings.
    pub workflow: ScatterAndGatherArgs,
    /// The model persistor, if configured.
    pub persistor: Option<PersistorArgs>,
}

const META: &str = "meta.json";
const CLIENT: &str = "app/config/config_fed_client.json";
const SERVER: &str = "app/config/config_fed_server.json";

fn read_json(dir: &Path, file: &str) -> Result<serde_json::Value, JobError> {
    let text = std::fs::read_to_string(dir.join(file))
        .map_err(|e| JobError::new(file, "$", format!("cannot read the file: {e}")))?;
    serde_json::from_str(&text).map_err(|e| {
        JobError::new(
            file,
            format!("line {} column {}", e.line(), e.column()),
            format!("invalid JSON: {e}"),
        )
    })
}

/// Deserializes `value` (found at `base` in `file`) into `T`, reporting the path of the
/// first field that does not fit.
fn typed<T: DeserializeOwned>(
    file: &str,
    base: &str,
    value: &serde_json::Value,
) -> Result<T, JobError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let inner = e.path().to_string();
        let path = match (base, inner.as_str()) {
            ("", "" | ".") => "$".to_owned(),
            (b, "" | ".") => b.to_owned(),
            ("", p) => p.to_owned(),
            (b, p) if p.starts_with('[') => format!("{b}{p}"),
            (b, p) => format!("{b}.{p}"),
        };
        let message = e.into_inner().to_string();
        // serde appends its own position for JSON text; values have none.
        JobError::new(file, path, message)
    })
}

/// The least time a worker program gets to answer `--check-components`.
const MIN_CHECK: Duration = Duration::from_secs(20);

fn args_or_empty(c: &ComponentConfig) -> serde_json::Value {
    if c.args.is_null() {
        serde_json::json!({})
    } else {
        c.args.clone()
    }
}

/// Asks the worker program whether it knows these components; `Ok(None)` when the
/// program does not support the question. It imports what a rank imports (torch, the
/// user's modules), so it may take as long as a rank's start-up: `within` is the
/// executor's start-up deadline, never less than [`MIN_CHECK`] (a fixed 20 s failed
/// valid jobs with the CPUs saturated).
fn check_with_worker(
    program: &Path,
    args: &[String],
    components: &[ComponentConfig],
    within: Duration,
) -> Result<Option<Vec<(String, String)>>, String> {
    let within = within.max(MIN_CHECK);
    let json = serde_json::to_string(components).map_err(|e| e.to_string())?;
    let mut child = Command::new(program)
        .args(args)
        .arg("--check-components")
        .arg(&json)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .env("RANKEXEC_LOG", "off")
        .spawn()
        .map_err(|e| format!("cannot run the worker program {}: {e}", program.display()))?;
    let mut stdout = child.stdout.take();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut out = String::new();
        if let Some(s) = stdout.as_mut() {
            let _ = s.read_to_string(&mut out);
        }
        let _ = tx.send(out);
    });
    let out = match rx.recv_timeout(within) {
        Ok(o) => o,
        Err(_) => {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!(
                "{} --check-components did not answer within {} s",
                program.display(),
                within.as_secs()
            ));
        }
    };
    let status = child.wait().map_err(|e| e.to_string())?;
    if status.code() == Some(2) {
        return Ok(None);
    }
    let report: serde_json::Value = match serde_json::from_str(&out) {
        Ok(v) => v,
        Err(_) => return Ok(None),
    };
    let errors = report["errors"]
        .as_array()
        .map(|errs| {
            errs.iter()
                .map(|e| {
                    (
                        e["id"].as_str().unwrap_or_default().to_owned(),
                        e["error"].as_str().unwrap_or_default().to_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    Ok(Some(errors))
}

/// Loads and validates a job folder. `in_process` knows the components a client may
/// run in its own process.
pub fn load(dir: &Path, in_process: &Registry) -> Result<Job, JobError> {
    let meta: Meta = typed(META, "", &read_json(dir, META)?)?;
    let client_json = read_json(dir, CLIENT)?;
    let client: ClientAppConfig = typed(CLIENT, "", &client_json)?;
    let server: ServerAppConfig = typed(SERVER, "", &read_json(dir, SERVER)?)?;

    if client.executors.is_empty() {
        return Err(JobError::new(
            CLIENT,
            "executors",
            "expected at least one executor",
        ));
    }
    let mut executors = Vec::new();
    let mut routed: BTreeSet<String> = BTreeSet::new();
    let mut ids: BTreeSet<String> = BTreeSet::new();
    for (i, entry) in client.executors.iter().enumerate() {
        let base = format!("executors[{i}]");
        if entry.tasks.is_empty() {
            return Err(JobError::new(
                CLIENT,
                format!("{base}.tasks"),
                "expected at least one task name",
            ));
        }
        for t in &entry.tasks {
            if !routed.insert(t.clone()) {
                return Err(JobError::new(
                    CLIENT,
                    format!("{base}.tasks"),
                    format!("task `{t}` is already routed to another executor"),
                ));
            }
        }
        let c = &entry.executor;
        if !ids.insert(c.id.clone()) {
            return Err(JobError::new(
                CLIENT,
                format!("{base}.executor.id"),
                format!("duplicate executor id `{}`", c.id),
            ));
        }
        let kind = if c.path == "MultiProcessExecutor" {
            let args_path = format!("{base}.executor.args");
            let mut cfg: ExecutorConfig = typed(CLIENT, &args_path, &args_or_empty(c))?;
            cfg.validate()
                .map_err(|e| JobError::new(CLIENT, format!("{args_path}.{}", e.path), e.message))?;
            // A relative program path is relative to the job folder.
            if cfg.worker.program.contains('/') && !Path::new(&cfg.worker.program).is_absolute() {
                cfg.worker.program = dir.join(&cfg.worker.program).display().to_string();
            }
            let program = resolve_program(&cfg.worker.program)
                .map_err(|m| JobError::new(CLIENT, format!("{args_path}.worker.program"), m))?;
            match check_with_worker(
                &program,
                &cfg.worker.args,
                &cfg.components,
                cfg.deadlines.startup.0,
            ) {
                Ok(Some(errors)) => {
                    if let Some((id, error)) = errors.first() {
                        let idx = cfg.components.iter().position(|c| &c.id == id).unwrap_or(0);
                        return Err(JobError::new(
                            CLIENT,
                            format!("{args_path}.components[{idx}]"),
                            error.clone(),
                        ));
                    }
                }
                Ok(None) => tracing::warn!(
                    program = %program.display(),
                    "the worker program cannot check components; they are checked when ranks start"
                ),
                Err(e) => {
                    return Err(JobError::new(
                        CLIENT,
                        format!("{args_path}.worker.program"),
                        e,
                    ));
                }
            }
            if let Err(e) = admission::check_placement(&cfg, &NvmlProbe) {
                let mut text = e.to_string();
                if let Some(src) = std::error::Error::source(&e) {
                    text = src.to_string();
                }
                return Err(JobError::new(
                    CLIENT,
                    format!("{args_path}.num_of_processes"),
                    text,
                ));
            }
            ExecutorKind::MultiProcess(Box::new(cfg))
        } else if in_process.contains(&c.path) {
            in_process
                .check(c)
                .map_err(|e| JobError::new(CLIENT, format!("{base}.executor"), error_chain(&e)))?;
            ExecutorKind::InProcess(c.clone())
        } else {
            return Err(JobError::new(
                CLIENT,
                format!("{base}.executor.path"),
                format!(
                    "unknown executor `{}` (expected MultiProcessExecutor or one of: {})",
                    c.path,
                    in_process
                        .paths()
                        .map(|(p, _)| p)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        };
        executors.push(LoadedExecutor {
            id: c.id.clone(),
            tasks: entry.tasks.clone(),
            kind,
        });
    }
    for (i, c) in client.components.iter().enumerate() {
        in_process
            .check(c)
            .map_err(|e| JobError::new(CLIENT, format!("components[{i}]"), error_chain(&e)))?;
    }

    let [wf] = server.workflows.as_slice() else {
        return Err(JobError::new(
            SERVER,
            "workflows",
            format!(
                "expected exactly one workflow, found {}",
                server.workflows.len()
            ),
        ));
    };
    if wf.path != "ScatterAndGather" {
        return Err(JobError::new(
            SERVER,
            "workflows[0].path",
            format!("unknown workflow `{}` (expected ScatterAndGather)", wf.path),
        ));
    }
    let workflow: ScatterAndGatherArgs = typed(SERVER, "workflows[0].args", &args_or_empty(wf))?;
    if workflow.num_rounds == 0 {
        return Err(JobError::new(
            SERVER,
            "workflows[0].args.num_rounds",
            "expected at least 1 round",
        ));
    }
    if workflow.min_clients == 0 {
        return Err(JobError::new(
            SERVER,
            "workflows[0].args.min_clients",
            "expected at least 1 client",
        ));
    }
    for (field, task) in [
        ("train_task", Some(&workflow.train_task)),
        ("validate_task", workflow.validate_task.as_ref()),
    ] {
        if let Some(t) = task
            && !routed.contains(t)
        {
            return Err(JobError::new(
                SERVER,
                format!("workflows[0].args.{field}"),
                format!(
                    "task `{t}` is not routed to any client executor (routed: {})",
                    routed.iter().cloned().collect::<Vec<_>>().join(", ")
                ),
            ));
        }
    }
    let mut persistor = None;
    for (i, c) in server.components.iter().enumerate() {
        if c.path != "ModelPersistor" {
            return Err(JobError::new(
                SERVER,
                format!("components[{i}].path"),
                format!(
                    "unknown server component `{}` (expected ModelPersistor)",
                    c.path
                ),
            ));
        }
        let args: PersistorArgs =
            typed(SERVER, &format!("components[{i}].args"), &args_or_empty(c))?;
        if workflow.persistor_id.as_deref() == Some(c.id.as_str()) {
            persistor = Some(args);
        }
    }
    if let Some(id) = &workflow.persistor_id
        && persistor.is_none()
    {
        return Err(JobError::new(
            SERVER,
            "workflows[0].args.persistor_id",
            format!("no server component has id `{id}`"),
        ));
    }
    Ok(Job {
        dir: dir.to_owned(),
        meta,
        executors,
        client_components: client.components,
        workflow,
        persistor,
    })
}
