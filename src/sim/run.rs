//! `rankexec simulate`: the whole federation in one process.
//!
//! The server's controller and every client run here, each client hosting its
//! executors (and so its rank groups) exactly as a deployed client would. The job ends
//! with `END_RUN` on every client, whatever happened, and the simulator checks that no
//! rank process is left before it writes `WORKSPACE/summary.json`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use rankexec_protocol::Signal;
use serde::Serialize;
use tracing::{error, info};

use super::client::SimClient;
use super::progress::Progress;
use crate::host::{ClientError, ClientRuntime, GroupGate};
use crate::job::{Job, JobError};
use crate::server::{FedClient, JobStatus, ModelPersistor, RoundReport, ScatterAndGather};

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
    /// The workspace could not be written.
    #[error("workspace {path}")]
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
    /// Every round.
    pub rounds: Vec<RoundReport>,
    /// The final model's metrics.
    pub final_metrics: Option<std::collections::BTreeMap<String, f64>>,
    /// The final model's file.
    pub model: Option<PathBuf>,
    /// Rank processes still alive after END_RUN (always empty unless something is
    /// stuck in the kernel).
    pub leftover_pids: Vec<u32>,
    /// Wall time.
    pub seconds: f64,
}

/// Removes what an earlier run left in the workspace (only what a run writes).
pub fn prepare_workspace(ws: &Path) -> Result<(), SimError> {
    let err = |source| SimError::Workspace {
        path: ws.display().to_string(),
        source,
    };
    std::fs::create_dir_all(ws).map_err(err)?;
    for entry in std::fs::read_dir(ws).map_err(err)?.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        let ours = name == "server"
            || name.starts_with("site-")
            || name == "summary.json"
            || name == "log.txt";
        if ours {
            let p = entry.path();
            let r = if p.is_dir() {
                std::fs::remove_dir_all(&p)
            } else {
                std::fs::remove_file(&p)
            };
            r.map_err(err)?;
        }
    }
    Ok(())
}

/// Runs the job. `abort` is the job abort (Ctrl-C). Logging must be installed first.
pub fn simulate(
    job: &Job,
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
    let registry = crate::worker_registry();
    let gate = GroupGate::new(opts.max_groups.filter(|m| (*m as u32) < n));
    let wake = gate.clone();
    let _wake = abort.on_trigger(move || wake.wake_all());
    let mut clients: Vec<Arc<SimClient>> = Vec::new();
    for i in 0..n as usize {
        let rt = ClientRuntime::build(job, i, n as usize, &opts.workspace, &registry)?;
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
    let observer: Arc<dyn crate::server::Observer> = progress.clone();
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
        rounds: outcome.rounds,
        final_metrics: outcome.final_metrics,
        model: model.filter(|p| p.exists()),
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
