//! A rank's logs: formatted lines on stderr.
//!
//! The executor captures every rank's stdout and stderr, writes them to `rank-N/` files
//! in the job workspace and re-emits each line in its own log with the rank number, so a
//! rank only has to write to stderr. Lines are written synchronously: a rank killed by
//! `SIGKILL` loses nothing it had already logged.

use tracing_subscriber::EnvFilter;

/// Installs the stderr subscriber. `RANKEXEC_LOG`, then `RUST_LOG`, set the filter
/// (default `info`). Does nothing if a subscriber is already installed.
pub(crate) fn init() {
    let filter = EnvFilter::try_from_env("RANKEXEC_LOG")
        .or_else(|_| EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        // A closed stderr (the parent that read it is gone) must not turn every log call
        // into a panic: tracing-subscriber reports write errors with `eprintln!`, which
        // panics when stderr itself is the broken writer.
        .log_internal_errors(false)
        .with_target(false)
        .try_init();
}
