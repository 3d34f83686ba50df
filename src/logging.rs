//! Logging for the `rankexec` binary: a console subscriber, filtered by `RANKEXEC_LOG`
//! or `RUST_LOG` (default `info`). Rank output arrives as events with a `rank` field
//! (target `rankexec::rank`) and is printed with it.

use std::io::IsTerminal as _;

use tracing_subscriber::EnvFilter;

/// Installs the console subscriber once.
pub fn init(default: &str) {
    let filter = EnvFilter::try_from_env("RANKEXEC_LOG")
        .or_else(|_| EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        // A closed stderr (the parent that read it is gone) must not turn every log call
        // into a panic: tracing-subscriber reports write errors with `eprintln!`, which
        // panics when stderr itself is the broken writer.
        .log_internal_errors(false)
        .with_target(false)
        .try_init();
}
