//! Ctrl-C and SIGTERM for `rankexec` (libraries install no handler; binaries decide).
//!
//! The first signal aborts the job: every task in flight is aborted, `END_RUN` reaches
//! every rank and the groups are torn down with their grace periods. A second signal
//! kills every rank group of this process at once
//! ([`killswitch::kill_all`](rankexec_executor::killswitch::kill_all)) and exits with
//! code 130. The handler itself only counts and signals; the work happens on the
//! threads that own it, like nextest's signal escalation.

use std::sync::atomic::{AtomicU32, Ordering};

use rankexec_protocol::Signal;

/// The handler could not be installed.
#[derive(Debug, thiserror::Error)]
#[error("cannot install the Ctrl-C handler")]
pub struct SignalSetupError(#[from] ctrlc::Error);

/// Installs the handler; `abort` is triggered on the first signal.
pub fn install(abort: Signal) -> Result<(), SignalSetupError> {
    static COUNT: AtomicU32 = AtomicU32::new(0);
    ctrlc::set_handler(move || match COUNT.fetch_add(1, Ordering::SeqCst) {
        0 => {
            eprintln!(
                "\ninterrupted: aborting the job (press Ctrl-C again to kill every rank now)"
            );
            abort.trigger("interrupted (Ctrl-C or SIGTERM)");
        }
        _ => {
            let n = rankexec_executor::killswitch::kill_all();
            eprintln!("\ninterrupted again: killed {n} rank groups");
            std::process::exit(130);
        }
    })?;
    Ok(())
}
