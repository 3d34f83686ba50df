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
///
/// The abort runs on a thread of its own (its callbacks wait for ranks to acknowledge),
/// so the handler is free for a second signal at once. Messages go to stderr and are
/// dropped if it is closed.
pub fn install(abort: Signal) -> Result<(), SignalSetupError> {
    static COUNT: AtomicU32 = AtomicU32::new(0);
    ctrlc::set_handler(move || match COUNT.fetch_add(1, Ordering::SeqCst) {
        0 => {
            say("\ninterrupted: aborting the job (press Ctrl-C again to kill every rank now)");
            let abort = abort.clone();
            let spawned = std::thread::Builder::new()
                .name("rx-interrupt".into())
                .spawn(move || abort.trigger("interrupted (Ctrl-C or SIGTERM)"));
            if spawned.is_err() {
                say("cannot start the abort; press Ctrl-C again to kill every rank");
            }
        }
        _ => {
            let n = rankexec_executor::killswitch::kill_all();
            say(&format!("\ninterrupted again: killed {n} rank groups"));
            std::process::exit(130);
        }
    })?;
    Ok(())
}

/// One line to stderr; a closed stderr is not an error here.
fn say(text: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "{text}");
}
