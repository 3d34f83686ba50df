//! `rankexec simulate JOB_DIR`: run a federated job locally.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use rankexec::protocol::Signal;
use rankexec::server::JobStatus;
use rankexec::sim::{self, SimOptions, Summary, progress::Progress};
use tracing_subscriber::filter::LevelFilter;

#[derive(Args)]
pub struct SimulateArgs {
    /// The job folder (meta.json, app/config/...).
    job: PathBuf,
    /// The workspace (default: ./workspace/<job name>).
    #[arg(short = 'w', long)]
    workspace: Option<PathBuf>,
    /// Number of clients (default: the job's min_clients, else 2).
    #[arg(short = 'n', long)]
    clients: Option<u32>,
    /// Rank groups alive at once (default: one per client).
    #[arg(long)]
    max_groups: Option<usize>,
    /// Log at info level on the console (default: warnings only, with progress bars).
    #[arg(short, long)]
    verbose: bool,
    /// No progress bars.
    #[arg(long)]
    no_progress: bool,
}

fn print_summary(s: &Summary) {
    println!();
    // The metrics the job reported, in the rounds kept.
    let keys: std::collections::BTreeSet<&String> = s
        .rounds
        .iter()
        .flat_map(|r| r.metrics.keys())
        .filter(|k| k.as_str() != "clients")
        .collect();
    let earlier = s.rounds_run as usize - s.rounds.len().min(s.rounds_run as usize);
    if earlier > 0 {
        println!(
            "(the last {} of {} rounds; every round is in {})",
            s.rounds.len(),
            s.rounds_run,
            s.metrics_file.display()
        );
    }
    if !s.rounds.is_empty() {
        let mut header = format!("{:>5}  {:>7}", "round", "clients");
        for k in &keys {
            header.push_str(&format!("  {k:>14}"));
        }
        header.push_str(&format!("  {:>8}", "seconds"));
        println!("{header}");
    }
    for r in &s.rounds {
        let mut line = format!(
            "{:>5}  {:>7}",
            r.round,
            r.metrics.get("clients").copied().unwrap_or(0.0)
        );
        for k in &keys {
            match r.metrics.get(*k) {
                Some(v) => line.push_str(&format!("  {v:>14.4}")),
                None => line.push_str(&format!("  {:>14}", "-")),
            }
        }
        line.push_str(&format!("  {:>8.2}", r.seconds));
        println!("{line}");
    }
    if let Some(f) = &s.final_metrics {
        let parts: Vec<String> = f.iter().map(|(k, v)| format!("{k} {v:.4}")).collect();
        println!("final model: {}", parts.join(", "));
    }
    if let Some(m) = &s.model {
        println!("model: {}", m.display());
    }
    let status = match s.status {
        JobStatus::Completed => "completed",
        JobStatus::Aborted => "aborted",
        JobStatus::Failed => "failed",
        JobStatus::Interrupted => "interrupted",
    };
    println!("status: {status} in {:.2} s", s.seconds);
    if let Some(r) = &s.reason {
        println!("reason: {r}");
    }
}

pub fn run(a: SimulateArgs) -> anyhow::Result<ExitCode> {
    let registry = super::worker_registry();
    let job = match rankexec::job::load(&a.job, &registry) {
        Ok(j) => j,
        Err(e) => {
            eprintln!("error: invalid job {}: {e}", a.job.display());
            return Ok(ExitCode::from(2));
        }
    };
    let workspace = a
        .workspace
        .clone()
        .unwrap_or_else(|| PathBuf::from("workspace").join(&job.meta.name));
    sim::prepare_workspace(&workspace)?;
    let progress = std::sync::Arc::new(Progress::new(!a.no_progress));
    let level = if a.verbose {
        LevelFilter::INFO
    } else {
        LevelFilter::WARN
    };
    sim::logs::install(&workspace, level, Some(progress.multi()))?;
    let abort = Signal::new();
    let interrupts = rankexec::signals::install(abort.clone())?;
    let opts = SimOptions {
        job: a.job.clone(),
        workspace: workspace.clone(),
        clients: a.clients,
        max_groups: a.max_groups,
    };
    println!(
        "simulating {} with {} clients in {}",
        job.meta.name,
        a.clients.or(job.meta.min_clients).unwrap_or(2),
        workspace.display()
    );
    for e in &job.executors {
        if let rankexec::job::ExecutorKind::MultiProcess(cfg) = &e.kind {
            println!(
                "  each client: `{}` runs {} on a group of {} ranks (tasks: {})",
                e.id,
                cfg.executor_id,
                cfg.num_of_processes,
                e.tasks.join(", ")
            );
        }
    }
    let summary = sim::simulate(&job, &registry, &opts, &progress, &abort, &interrupts)?;
    print_summary(&summary);
    // `metrics_file` is already absolute, in the workspace beside summary.json.
    println!(
        "summary: {}",
        summary
            .metrics_file
            .with_file_name("summary.json")
            .display()
    );
    interrupts.done();
    Ok(match summary.status {
        JobStatus::Completed => ExitCode::SUCCESS,
        JobStatus::Interrupted => ExitCode::from(130),
        _ => ExitCode::FAILURE,
    })
}
