//! Subcommands of `rankexec`.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use rankexec::protocol::Registry;

mod bench;
mod gpus;
mod run;
mod simulate;

/// A multi-process executor for federated learning.
#[derive(Parser)]
#[command(name = "rankexec", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a federated job locally: server and clients in one process.
    Simulate(simulate::SimulateArgs),
    /// Launch a rank group and run tasks on it (no federation).
    Run(run::RunArgs),
    /// Measure start-up, round trips, fan-out, events, aborts and crash detection.
    Bench(bench::BenchArgs),
    /// Print this host's GPUs as NVML reports them (or why there are none).
    Gpus(gpus::GpusArgs),
    /// Run as a rank with the built-in components, and the example ones when built with
    /// them (the executor starts it).
    Worker {
        /// Worker arguments (`--list-components`, `--check-components`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

impl Cli {
    pub fn run(self) -> anyhow::Result<ExitCode> {
        match self.command {
            Command::Simulate(a) => simulate::run(a),
            Command::Run(a) => run::run(a),
            Command::Gpus(a) => gpus::run(a),
            Command::Bench(a) => bench::run(a),
            Command::Worker { args } => Ok(rankexec::sub_worker::main_with_args(
                worker_registry(),
                args,
            )),
        }
    }
}

/// What `rankexec worker` serves and `rankexec simulate` checks jobs against: the
/// built-in components, plus the example trainers when the binary is built with the
/// `examples` feature (the default in a checkout; the Python wheel's CLI is built
/// without it and links no example).
pub fn worker_registry() -> Registry {
    #[cfg(feature = "examples")]
    {
        rankexec_examples::worker_registry()
    }
    #[cfg(not(feature = "examples"))]
    {
        rankexec::sub_worker::builtins::registry()
    }
}
