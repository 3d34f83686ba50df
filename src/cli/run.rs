//! `rankexec run`: launch a rank group and run tasks on it, without a federation.
//!
//! Useful to try a worker program and its components, and to watch the group's
//! lifecycle: `rankexec run -n 4 --component Echo --rounds 3`.
//!
//! - The rank program defaults to this binary's own `worker` subcommand (the built-ins
//!   and the example components, always of this version); `--worker` names another, and
//!   a `--config` file's `worker` is used as written (`rankexec-worker` falls back to
//!   this binary when it is not built).
//! - Rank logs go to `--log-dir`, else to a private temporary directory (0700, under
//!   `$TMPDIR`) that is removed at exit unless a round failed; the path is printed.
//! - Ctrl-C or SIGTERM: the first aborts the task and stops the group (exit 130), a
//!   second kills every rank at once (see [`rankexec::signals`]).
//! - The console shows warnings only; `-v` adds info lines, `-vv` debug lines.

use std::io::Write as _;
use std::os::unix::fs::PermissionsExt as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context as _;
use clap::Args;
use rankexec::executor::config::resolve_program;
use rankexec::executor::{ExecutorConfig, FailureCause, MultiProcessExecutor};
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
    /// The worker program (default: this binary's own `worker` subcommand, or the
    /// config file's `worker`).
    #[arg(long)]
    worker: Option<String>,
    /// An argument for the worker program (repeat for more).
    #[arg(long = "worker-arg", allow_hyphen_values = true)]
    worker_args: Vec<String>,
    /// The task name.
    #[arg(long, default_value = "task")]
    task: String,
    /// The task input's metadata, as a JSON object.
    #[arg(long, default_value = "{}")]
    meta: String,
    /// How many times to run the task.
    #[arg(long, default_value_t = 1)]
    rounds: u32,
    /// Where rank logs go (kept). Default: a private temporary directory, removed at
    /// exit unless a round failed.
    #[arg(long)]
    log_dir: Option<PathBuf>,
    /// Print `pids: P1 P2 ...` once the group is ready.
    #[arg(long)]
    print_pids: bool,
    /// More console output: `-v` info, `-vv` debug (default: warnings only).
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
}

/// The rank program: `--worker` when given; without `--config`, this binary in rank
/// mode; with one, the config's program, or this binary when that is the default
/// `rankexec-worker` and it is not built.
fn choose_worker(cfg: &mut ExecutorConfig, a: &RunArgs) -> anyhow::Result<()> {
    if let Some(w) = &a.worker {
        cfg.worker.program = w.clone();
        cfg.worker.args = a.worker_args.clone();
        return Ok(());
    }
    if !a.worker_args.is_empty() {
        cfg.worker.args = a.worker_args.clone();
    }
    // Without a config, ranks run this very binary (`rankexec worker`): it is always
    // built and always of this version. A `rankexec-worker` left next to it by an
    // earlier build may speak an older start-up contract.
    let own = a.config.is_none();
    if own
        || (cfg.worker.program == "rankexec-worker"
            && resolve_program(&cfg.worker.program).is_err())
    {
        let me = std::env::current_exe().context("cannot find this program's path")?;
        tracing::info!(program = %me.display(), "ranks run `rankexec worker`");
        cfg.worker.program = me.display().to_string();
        cfg.worker.args = vec!["worker".to_owned()];
    }
    Ok(())
}

pub fn run(a: RunArgs) -> anyhow::Result<ExitCode> {
    rankexec::logging::init(match a.verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    });
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
    choose_worker(&mut cfg, &a)?;
    let meta: serde_json::Value =
        serde_json::from_str(&a.meta).context("--meta must be a JSON object")?;
    // A private temporary directory unless the user chose one (or the config did).
    let mut temp_logs = None;
    if a.log_dir.is_some() {
        cfg.log_dir = a.log_dir.clone();
    } else if cfg.log_dir.is_none() {
        let dir = tempfile::Builder::new()
            .prefix("rankexec-run-")
            .permissions(std::fs::Permissions::from_mode(0o700))
            .tempdir()
            .context("cannot create a temporary directory for rank logs")?;
        cfg.log_dir = Some(dir.path().to_owned());
        temp_logs = Some(dir);
    }
    if let Some(dir) = &cfg.log_dir {
        let note = if temp_logs.is_some() {
            " (removed at exit unless a round fails)"
        } else {
            ""
        };
        println!("rank logs: {}{note}", dir.display());
    }
    let abort = Signal::new();
    let interrupts = rankexec::signals::install(abort.clone())?;
    let exec = MultiProcessExecutor::new(cfg)?;
    let mut ctx = FlContext::new();
    let t = Instant::now();
    let started = exec.handle_event(&EventType::START_RUN, &mut ctx);
    let mut code = ExitCode::SUCCESS;
    let mut failed = false;
    match started {
        Ok(()) => {
            println!("group ready in {:.1} ms", t.elapsed().as_secs_f64() * 1e3);
            if a.print_pids {
                let pids: Vec<String> = exec.live_pids().iter().map(u32::to_string).collect();
                println!("pids: {}", pids.join(" "));
            }
            std::io::stdout().flush()?;
            failed = run_rounds(&exec, &a, &meta, &mut ctx, &abort);
        }
        Err(e) if !abort.is_triggered() => {
            println!("start-up failed: {}", error_chain(&e));
            failed = true;
        }
        Err(_) => {}
    }
    if failed {
        code = ExitCode::FAILURE;
    }
    let t = Instant::now();
    if let Err(e) = exec.handle_event(&EventType::END_RUN, &mut ctx) {
        println!("stopping the group failed: {}", error_chain(&e));
        code = ExitCode::FAILURE;
    } else {
        println!("group stopped in {:.1} ms", t.elapsed().as_secs_f64() * 1e3);
    }
    // The group's run directory goes with the executor.
    drop(exec);
    match temp_logs {
        Some(dir) if failed => {
            println!("rank logs kept in {}", dir.keep().display());
        }
        Some(dir) => {
            let _ = dir.close();
        }
        None => {}
    }
    if abort.is_triggered() {
        println!("interrupted");
        code = ExitCode::from(130);
    }
    interrupts.done();
    Ok(code)
}

/// Runs every round; returns whether one failed (an interruption is not a failure).
fn run_rounds(
    exec: &MultiProcessExecutor,
    a: &RunArgs,
    meta: &serde_json::Value,
    ctx: &mut FlContext,
    abort: &Signal,
) -> bool {
    let mut failed = false;
    for round in 0..a.rounds {
        if abort.is_triggered() {
            break;
        }
        let mut input = Shareable::new().with_meta("round", round);
        if let Some(obj) = meta.as_object() {
            for (k, v) in obj {
                input.set_meta(k.clone(), Value::from_json(v));
            }
        }
        let t = Instant::now();
        match exec.run_task(&a.task, input, ctx, abort) {
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
            Err(_) if abort.is_triggered() => {
                println!("round {round}: interrupted");
            }
            Err(e) => {
                let mut text = format!("round {round}: failed: {}", error_chain(&e));
                // The line above names the rank and its error; a crash adds its stderr
                // tail. An error the rank reported is its own account (its log line of
                // it, in the tail, would say it again).
                if let Some(f) = e.root_cause()
                    && !matches!(f.cause, FailureCause::Reported(_))
                {
                    text.push_str(&f.stderr_report());
                }
                println!("{text}");
                failed = true;
            }
        }
        let _ = std::io::stdout().flush();
    }
    failed
}
