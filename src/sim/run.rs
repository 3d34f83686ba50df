//! `rankexec simulate`: the whole federation in one process.
//!
//! The server's controller and every client run here, each client hosting its
//! executors (and so its rank groups) exactly as a deployed client would. The job ends
//! with `END_RUN` on every client, whatever happened, and the simulator checks that no
//! rank process is left before it writes `WORKSPACE/summary.json`. Every round's report
//! is streamed to `WORKSPACE/metrics.jsonl`; the summary keeps the last rounds.
//! Paths in the summary are absolute.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use rankexec_protocol::{Registry, Signal};
use serde::Serialize;
use tracing::{error, info};

use super::client::SimClient;
use super::metrics::MetricsLog;
use super::progress::Progress;
use crate::host::{ClientError, ClientRuntime, GroupGate};
use crate::job::{Job, JobError};
use crate::server::{FedClient, JobStatus, ModelPersistor, RoundReport, ScatterAndGather};

/// `p` made absolute against the current directory (as it is when this runs).
fn absolute(p: &Path) -> PathBuf {
    std::path::absolute(p).unwrap_or_else(|_| p.to_owned())
}

/// What to simulate.
#[derive(Debug, Clone)]
pub struct SimOptions {
    /// The job folder.
    pub job: PathBuf,
    /// Where everything is written.
    pub workspace: PathBuf,
    /// How many clients (default: the job's `min_clients`, else 2).
    pub clients: Option<u32>,
    /// How many rank groups may be alive at once (default: no limit).
    pub max_groups: Option<usize>,
}

/// Why a simulation could not run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The job is invalid.
    #[error("invalid job")]
    Job(#[from] JobError),
    /// Too few clients for the workflow.
    #[error("the simulation runs {clients} clients but the workflow needs min_clients {min}")]
    TooFewClients {
        /// Clients simulated.
        clients: u32,
        /// Clients needed.
        min: u32,
    },
    /// A client could not be built.
    #[error("cannot build the clients")]
    Client(#[from] ClientError),
    /// The workspace, or a part of its path, exists but is not a directory.
    #[error("the workspace {path} cannot be a directory: {blocker} is not a directory")]
    NotADirectory {
        /// The workspace.
        path: String,
        /// The part of its path that exists and is not a directory.
        blocker: String,
    },
    /// The workspace directory could not be created.
    #[error("cannot create the workspace directory {path} in {parent}")]
    CreateWorkspace {
        /// The path.
        path: String,
        /// Its deepest existing ancestor, where the creation failed.
        parent: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A file or directory in the workspace could not be written or removed.
    #[error("cannot write {path}")]
    Workspace {
        /// The path.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// `WORKSPACE/summary.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// The job's name.
    pub job: String,
    /// How it ended.
    pub status: JobStatus,
    /// Why, when not completed.
    pub reason: Option<String>,
    /// The simulated sites.
    pub clients: Vec<String>,
    /// How many rounds ran.
    pub rounds_run: u32,
    /// The last rounds (at most [`KEEP_ROUNDS`](crate::server::scatter_gather::KEEP_ROUNDS)).
    pub rounds: Vec<RoundReport>,
    /// Every round, one JSON object per line (absolute path).
    pub metrics_file: PathBuf,
    /// The final model's metrics.
    pub final_metrics: Option<std::collections::BTreeMap<String, f64>>,
    /// The final model's file (absolute path).
    pub model: Option<PathBuf>,
    /// Rank processes still alive after END_RUN (always empty unless something is
    /// stuck in the kernel).
    pub leftover_pids: Vec<u32>,
    /// Wall time.
    pub seconds: f64,
}

/// Creates the workspace, or removes what an earlier run left in it (only what a run
/// writes), and checks that it can be written. Each error names the path at fault.
pub fn prepare_workspace(ws: &Path) -> Result<(), SimError> {
    let err = |p: &Path| {
        let path = p.display().to_string();
        move |source| SimError::Workspace { path, source }
    };
    // The deepest part of the path that exists says what is wrong with it.
    let existing = ws
        .ancestors()
        .find(|a| a.as_os_str().is_empty() || a.exists());
    if let Some(e) = existing.filter(|e| !e.as_os_str().is_empty() && !e.is_dir()) {
        return Err(SimError::NotADirectory {
            path: ws.display().to_string(),
            blocker: e.display().to_string(),
        });
    }
    std::fs::create_dir_all(ws).map_err(|source| SimError::CreateWorkspace {
        path: ws.display().to_string(),
        parent: existing
            .filter(|e| !e.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .display()
            .to_string(),
        source,
    })?;
    for entry in std::fs::read_dir(ws).map_err(err(ws))?.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        let ours = name == "server"
            || name.starts_with("site-")
            || name == "summary.json"
            || name == super::metrics::FILE
            || name == "log.txt";
        if ours {
            let p = entry.path();
            let r = if p.is_dir() {
                std::fs::remove_dir_all(&p)
            } else {
                std::fs::remove_file(&p)
            };
            r.map_err(err(&p))?;
        }
    }
    // A read-only workspace is refused here, naming a file it could not create.
    let probe = ws.join("summary.json");
    std::fs::write(&probe, b"{}\n").map_err(err(&probe))?;
    std::fs::remove_file(&probe).map_err(err(&probe))
}

/// Runs the job. `registry` holds the components the clients may host in process;
/// `abort` is the job abort (Ctrl-C). Logging must be installed first.
pub fn simulate(
    job: &Job,
    registry: &Registry,
    opts: &SimOptions,
    progress: &Arc<Progress>,
    abort: &Signal,
    interrupts: &crate::signals::Interrupts,
) -> Result<Summary, SimError> {
    let started = Instant::now();
    let n = opts.clients.or(job.meta.min_clients).unwrap_or(2);
    if n < job.workflow.min_clients {
        return Err(SimError::TooFewClients {
            clients: n,
            min: job.workflow.min_clients,
        });
    }
    let gate = GroupGate::new(opts.max_groups.filter(|m| (*m as u32) < n));
    let wake = gate.clone();
    let _wake = abort.on_trigger(move || wake.wake_all());
    let mut clients: Vec<Arc<SimClient>> = Vec::new();
    for i in 0..n as usize {
        let rt = ClientRuntime::build(job, i, n as usize, &opts.workspace, registry)?;
        clients.push(Arc::new(SimClient::new(rt, gate.clone())));
    }
    let names: Vec<String> = clients.iter().map(|c| c.name().to_owned()).collect();
    info!(job = %job.meta.name, clients = n, max_groups = ?opts.max_groups, "simulation started");
    let persistor = job
        .persistor
        .as_ref()
        .map(|p| ModelPersistor::new(opts.workspace.join("server").join(&p.file)));
    let model = persistor.as_ref().map(|p| p.path().to_owned());
    let controller = ScatterAndGather::new(job.workflow.clone(), persistor, &job.meta.name);
    let fed: Vec<Arc<dyn FedClient>> = clients
        .iter()
        .map(|c| c.clone() as Arc<dyn FedClient>)
        .collect();
    let metrics = MetricsLog::create(&opts.workspace, progress.clone()).map_err(|source| {
        SimError::Workspace {
            path: opts
                .workspace
                .join(super::metrics::FILE)
                .display()
                .to_string(),
            source,
        }
    })?;
    let metrics_file = absolute(metrics.path());
    let observer: Arc<dyn crate::server::Observer> = Arc::new(metrics);
    let outcome = controller.run(&fed, abort, &observer);

    // END_RUN everywhere, in parallel: every rank group is torn down.
    std::thread::scope(|s| {
        for c in &clients {
            s.spawn(move || {
                if let Err(e) = c.runtime().end() {
                    error!(site = c.name(), "END_RUN: {e}");
                }
            });
        }
    });
    let leftover_pids: Vec<u32> = clients
        .iter()
        .flat_map(|c| c.runtime().live_pids())
        .collect();
    if !leftover_pids.is_empty() {
        error!(?leftover_pids, "rank processes survived END_RUN");
    }
    let status = if interrupts.killed() {
        JobStatus::Interrupted
    } else {
        outcome.status
    };
    let summary = Summary {
        job: job.meta.name.clone(),
        status,
        reason: outcome.reason,
        clients: names,
        rounds_run: outcome.rounds_run,
        rounds: outcome.rounds,
        metrics_file,
        final_metrics: outcome.final_metrics,
        model: model.filter(|p| p.exists()).map(|p| absolute(&p)),
        leftover_pids,
        seconds: started.elapsed().as_secs_f64(),
    };
    let path = opts.workspace.join("summary.json");
    let text = serde_json::to_string_pretty(&summary).map_err(|e| SimError::Workspace {
        path: path.display().to_string(),
        source: std::io::Error::other(e),
    })?;
    std::fs::write(&path, text).map_err(|source| SimError::Workspace {
        path: path.display().to_string(),
        source,
    })?;
    Ok(summary)
}
