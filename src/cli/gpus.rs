//! `rankexec gpus`: the GPU inventory.

use std::process::ExitCode;

use clap::Args;
use rankexec::executor::gpu::{GpuProbe, Inventory, NvmlProbe};

#[derive(Args)]
pub struct GpusArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Ignore this process's CUDA_VISIBLE_DEVICES.
    #[arg(long)]
    all: bool,
}

pub fn run(a: GpusArgs) -> anyhow::Result<ExitCode> {
    let inv = if a.all {
        NvmlProbe.all()
    } else {
        NvmlProbe.inventory()
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&inv)?);
    } else {
        print!("{inv}");
        if matches!(inv, Inventory::NoGpus { .. }) {
            println!("\nranks will run on CPUs (set gpu.require_gpu to refuse instead)");
        }
    }
    Ok(ExitCode::SUCCESS)
}
