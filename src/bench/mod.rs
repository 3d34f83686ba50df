//! `rankexec bench`: the figures BENCHMARKS.md reports, measured on this machine.
//!
//! - [`cases`]: each measurement (start-up, empty round trip, fan-out against one
//!   memcpy, event relay, abort, crash detection, parent memory).
//! - [`report`]: figures, the table, JSON lines.
//! - [`peer`]: the NVFlare peer harness's experiments, as that harness's own records.
//! - [`tcp`]: the encrypted TCP transport beside local sockets, a memcpy and a plain
//!   (unencrypted) TCP copy of the same bytes (`--only tcp`).
//!
//! Timings are medians; ratios are computed from figures measured in the same run.
//! Nothing here is asserted: the targets live in BENCHMARKS.md, not in tests.

pub mod cases;
pub mod peer;
pub mod report;
pub mod tcp;

use std::path::PathBuf;
use std::time::Instant;

use report::{Figure, print};

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// JSON lines instead of a table.
    pub json: bool,
    /// Fewer repetitions and no 1 GiB payloads.
    pub quick: bool,
    /// The worker program (default: `rankexec-worker` next to this binary, else this
    /// binary's `worker` mode).
    pub worker: Option<PathBuf>,
    /// Only these figures (empty: all).
    pub only: Vec<String>,
    /// Run a peer harness's experiments instead (`nvflare`), printing its records.
    pub peer: Option<String>,
}

/// Runs every measurement and prints each figure as soon as it is known.
pub fn run(opts: &BenchOptions) -> anyhow::Result<Vec<Figure>> {
    let exe = std::env::current_exe()?;
    let sibling = exe.with_file_name("rankexec-worker");
    let (program, args): (PathBuf, Vec<String>) = match &opts.worker {
        Some(w) => (w.clone(), Vec::new()),
        None if sibling.exists() => (sibling, Vec::new()),
        None => (exe.clone(), vec!["worker".to_owned()]),
    };
    let logs = tempfile::tempdir()?;
    let program_text = program.display().to_string();
    let setup = cases::Setup {
        program: &program_text,
        args: &args,
        logs: logs.path(),
        tcp: false,
    };
    if let Some(peer) = &opts.peer {
        if peer != "nvflare" {
            anyhow::bail!("unknown peer `{peer}` (expected nvflare)");
        }
        peer::run(&setup, opts.quick)?;
        return Ok(Vec::new());
    }
    if !opts.json {
        println!(
            "worker: {} {}\n{:<18} {:>5} {:>9} {:>14} {:<9}",
            program_text,
            args.join(" "),
            "figure",
            "ranks",
            "payload",
            "median",
            "unit"
        );
    }
    let started = Instant::now();
    let (reps, big) = if opts.quick { (3, false) } else { (7, true) };
    let mut all = Vec::new();
    let mut emit = |f: Figure| {
        print(&f, opts.json);
        all.push(f);
    };
    let want =
        |name: &str| opts.only.is_empty() || opts.only.iter().any(|o| name.starts_with(o.as_str()));
    if want("startup") {
        for n in [1, 2, 4, 8] {
            emit(cases::startup(&setup, n, reps)?);
        }
    }
    if want("roundtrip") {
        let rounds = if opts.quick { 100 } else { 1000 };
        for n in [1, 2, 4, 8] {
            emit(cases::roundtrip(&setup, n, rounds)?);
        }
    }
    let mut sizes = vec![1usize << 20, 64 << 20, 256 << 20];
    if big {
        sizes.push(1 << 30);
    }
    if !(want("fanout") || want("memcpy")) {
        sizes.clear();
    }
    for size in sizes {
        let data = cases::payload(size);
        let fan_reps = 5;
        let copy = cases::memcpy(&data, fan_reps);
        let yardstick = copy.value;
        emit(copy);
        for n in [2, 4, 8] {
            for shared in [false, true] {
                let f = cases::fanout(&setup, n, &data, shared, fan_reps)?;
                let ratio = f.value / yardstick;
                emit(f.with("ratio_to_memcpy", ratio));
            }
        }
    }
    if want("event_relay") {
        for n in [1, 4, 8] {
            emit(cases::event_relay(&setup, n, 2000, 3)?);
        }
    }
    if want("abort") {
        for n in [2, 8] {
            emit(cases::abort(&setup, n, false, reps)?);
            emit(cases::abort(&setup, n, true, reps)?);
        }
    }
    if want("crash") {
        for n in [2, 8] {
            emit(cases::crash_detect(&setup, n, reps)?);
        }
    }
    if want("tcp") {
        tcp::run(&setup, reps, big, &mut emit)?;
    }
    if want("parent_peak_rss") {
        emit(cases::parent_peak_rss(
            &setup,
            8,
            if big { 1 << 30 } else { 256 << 20 },
        )?);
    }
    if !opts.json {
        println!("done in {:.1} s", started.elapsed().as_secs_f64());
    }
    Ok(all)
}
