//! The `rankexec` command line.

use std::process::ExitCode;

use clap::Parser;

mod cli;

fn main() -> ExitCode {
    // `rankexec worker` must not parse anything else or start threads before the rank
    // reads its environment.
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("worker") {
        return rankexec::sub_worker::main_with_args(cli::worker_registry(), args[2..].to_vec());
    }
    let cli = cli::Cli::parse();
    match cli.run() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
