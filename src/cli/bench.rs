//! `rankexec bench`: measure this machine (see BENCHMARKS.md).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;

#[derive(Args)]
pub struct BenchArgs {
    /// One JSON object per line and figure.
    #[arg(long)]
    json: bool,
    /// Fewer repetitions and no 1 GiB payloads.
    #[arg(long)]
    quick: bool,
    /// The worker program (default: rankexec-worker next to this binary).
    #[arg(long)]
    worker: Option<PathBuf>,
    /// Only figures whose name starts with one of these (comma separated), e.g.
    /// `--only roundtrip,fanout`.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Run the experiments of a peer's harness instead and print its JSON records
    /// (`nvflare`: `shared/peers/nvflare`; render with its `summarize.py`).
    #[arg(long)]
    peer: Option<String>,
}

pub fn run(a: BenchArgs) -> anyhow::Result<ExitCode> {
    rankexec::logging::init("warn");
    rankexec::bench::run(&rankexec::bench::BenchOptions {
        json: a.json,
        quick: a.quick,
        worker: a.worker,
        only: a.only,
        peer: a.peer,
    })?;
    Ok(ExitCode::SUCCESS)
}
