//! Ctrl-C and SIGTERM for `rankexec` (libraries install no handler; binaries decide).
//!
//! The first signal aborts the job: every task in flight is aborted, `END_RUN` reaches
//! every rank and the groups are torn down with their grace periods. A second signal
//! kills every rank group of this process at once
//! ([`killswitch::kill_all`](rankexec_executor::killswitch::kill_all)); the command then
//! has [`CLEANUP`] to finish (its ranks are dead, so teardown is quick: run directories
//! are removed and `summary.json` is written) before the process exits with code 130
//! anyway. A third signal exits at once. The handler itself only counts and signals;
//! the work happens on the threads that own it, like nextest's signal escalation.
//!
//! Caveat: SIGINT is handled even when the parent shell ignored it (a script's
//! background job); SIGTERM always works.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use rankexec_protocol::Signal;

/// How long a command may take to clean up after the second signal.
pub const CLEANUP: Duration = Duration::from_secs(5);

/// The handler could not be installed.
#[derive(Debug, thiserror::Error)]
#[error("cannot install the Ctrl-C handler")]
pub struct SignalSetupError(#[from] ctrlc::Error);

/// What the handler saw, shared with the command it interrupts.
#[derive(Clone, Default)]
pub struct Interrupts {
    inner: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    count: AtomicU32,
    done: Mutex<bool>,
    cv: Condvar,
}

impl Interrupts {
    /// How many signals arrived.
    pub fn count(&self) -> u32 {
        self.inner.count.load(Ordering::SeqCst)
    }

    /// Whether a second signal killed every rank.
    pub fn killed(&self) -> bool {
        self.count() >= 2
    }

    /// The command has cleaned up: the process may exit now without being forced.
    pub fn done(&self) {
        *self
            .inner
            .done
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = true;
        self.inner.cv.notify_all();
    }

    /// Waits up to `within` for [`Interrupts::done`]; returns whether it came.
    fn wait_done(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        let mut done = self
            .inner
            .done
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        while !*done {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            done = self
                .inner
                .cv
                .wait_timeout(done, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        true
    }
}

/// Installs the handler; `abort` is triggered on the first signal.
///
/// The abort runs on a thread of its own (its callbacks wait for ranks to acknowledge),
/// so the handler is free for a second signal at once. Messages go to stderr and are
/// dropped if it is closed.
pub fn install(abort: Signal) -> Result<Interrupts, SignalSetupError> {
    let seen = Interrupts::default();
    let shared = seen.clone();
    ctrlc::set_handler(
        move || match shared.inner.count.fetch_add(1, Ordering::SeqCst) {
            0 => {
                say(
                    "\ninterrupted: aborting (press Ctrl-C or send SIGTERM again to kill every rank now)",
                );
                let abort = abort.clone();
                let spawned = std::thread::Builder::new()
                    .name("rx-interrupt".into())
                    .spawn(move || abort.trigger("interrupted (Ctrl-C or SIGTERM)"));
                if spawned.is_err() {
                    say("cannot start the abort; press Ctrl-C again to kill every rank");
                }
            }
            1 => {
                let n = rankexec_executor::killswitch::kill_all();
                say(&format!(
                    "\ninterrupted again: killed {n} rank groups; cleaning up (a third signal exits at once)"
                ));
                let watch = shared.clone();
                let spawned =
                    std::thread::Builder::new()
                        .name("rx-cleanup".into())
                        .spawn(move || {
                            if !watch.wait_done(CLEANUP) {
                                say("cleanup did not finish in time; exiting");
                                std::process::exit(130);
                            }
                        });
                if spawned.is_err() {
                    std::process::exit(130);
                }
            }
            _ => std::process::exit(130),
        },
    )?;
    Ok(seen)
}

/// One line to stderr; a closed stderr is not an error here.
fn say(text: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "{text}");
}
