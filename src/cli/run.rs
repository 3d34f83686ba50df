//! `rankexec run`: launch a rank group and run tasks on it, without a federation.
//!
//! Useful to try a worker program and its components, and to watch the group's
//! lifecycle: `rankexec run -n 4 --component Echo --rounds 3`.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context as _;
use clap::Args;
use rankexec::executor::{ExecutorConfig, MultiProcessExecutor};
use rankexec::protocol::{
    EventType, FlComponent, FlContext, Shareable, Signal, Value, error_chain,
};

#[derive(Args)]
pub struct RunArgs {
    /// Number of ranks.
    #[arg(short = 'n', long, default_value_t = 2)]
    ranks: u32,
    /// The component each rank runs (a path the worker registers).
    #[arg(long, default_value = "Echo")]
    component: String,
    /// The component's args, as JSON.
    #[arg(long, default_value = "{}")]
    args: String,
    /// A whole executor configuration (JSON), instead of --ranks/--component/--args.
    #[arg(long, conflicts_with_all = ["component", "args"])]
    config: Option<PathBuf>,
    /// The worker program (default: rankexec-worker next to this binary).
    #[arg(long)]
    worker: Option<String>,
    /// The task name.
    #[arg(long, default_value = "task")]
    task: String,
    /// The task input's metadata, as a JSON object.
    #[arg(long, default_value = "{}")]
    meta: String,
    /// How many times to run the task.
    #[arg(long, default_value_t = 1)]
    rounds: u32,
    /// Where rank logs go.
    #[arg(long)]
    log_dir: Option<PathBuf>,
    /// Print `pids: P1 P2 ...` once the group is ready.
    #[arg(long)]
    print_pids: bool,
}

pub fn run(a: RunArgs) -> anyhow::Result<ExitCode> {
    rankexec::logging::init("info");
    let mut cfg: ExecutorConfig = match &a.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            serde_json::from_str(&text)
                .with_context(|| format!("invalid executor config {}", path.display()))?
        }
        None => {
            let args: serde_json::Value =
                serde_json::from_str(&a.args).context("--args must be JSON")?;
            let mut c = ExecutorConfig::simple(a.ranks, &a.component, args);
            c.num_of_processes = a.ranks;
            c
        }
    };
    if let Some(w) = &a.worker {
        cfg.worker.program = w.clone();
    }
    if a.log_dir.is_some() {
        cfg.log_dir = a.log_dir.clone();
    }
    let meta: serde_json::Value =
        serde_json::from_str(&a.meta).context("--meta must be a JSON object")?;
    let exec = MultiProcessExecutor::new(cfg)?;
    let mut ctx = FlContext::new();
    let t = Instant::now();
    exec.handle_event(&EventType::START_RUN, &mut ctx)?;
    println!("group ready in {:.1} ms", t.elapsed().as_secs_f64() * 1e3);
    if a.print_pids {
        let pids: Vec<String> = exec.live_pids().iter().map(u32::to_string).collect();
        println!("pids: {}", pids.join(" "));
        std::io::stdout().flush()?;
    }
    let mut code = ExitCode::SUCCESS;
    for round in 0..a.rounds {
        let mut input = Shareable::new().with_meta("round", round);
        if let Some(obj) = meta.as_object() {
            for (k, v) in obj {
                input.set_meta(k.clone(), Value::from_json(v));
            }
        }
        let t = Instant::now();
        match exec.run_task(&a.task, input, &mut ctx, &Signal::new()) {
            Ok(out) => {
                let meta: serde_json::Map<String, serde_json::Value> = out
                    .meta_map()
                    .iter()
                    .map(|(k, v)| (k.clone(), v.to_json()))
                    .collect();
                println!(
                    "round {round}: ok in {:.2} ms, rank 0 returned {}",
                    t.elapsed().as_secs_f64() * 1e3,
                    serde_json::Value::Object(meta)
                );
            }
            Err(e) => {
                let mut text = format!("round {round}: failed: {}", error_chain(&e));
                if let Some(f) = e.root_cause() {
                    text.push('\n');
                    text.push_str(&f.report());
                }
                println!("{text}");
                code = ExitCode::FAILURE;
            }
        }
    }
    let t = Instant::now();
    exec.handle_event(&EventType::END_RUN, &mut ctx)?;
    println!("group stopped in {:.1} ms", t.elapsed().as_secs_f64() * 1e3);
    Ok(code)
}
