//! Progress of a simulated job: a bar per round on the terminal (clients done, running
//! and queued), and one plain line per round on stdout.

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::server::{ClientState, Observer, RoundReport};

/// Draws progress.
pub struct Progress {
    mp: MultiProgress,
    bar: Mutex<Option<ProgressBar>>,
    states: Mutex<BTreeMap<String, ClientState>>,
    keys: Vec<String>,
}

impl Progress {
    /// Bars on stderr when it is a terminal and `bars` is set; hidden otherwise.
    /// `keys` are the metrics printed per round (others go to summary.json).
    pub fn new(bars: bool, keys: Vec<String>) -> Self {
        let target = if bars && std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        Progress {
            mp: MultiProgress::with_draw_target(target),
            bar: Mutex::new(None),
            states: Mutex::new(BTreeMap::new()),
            keys,
        }
    }

    /// The bars, for logs to print around them.
    pub fn multi(&self) -> MultiProgress {
        self.mp.clone()
    }

    fn refresh(&self) {
        let states = self.states.lock().unwrap_or_else(PoisonError::into_inner);
        let count = |s| states.values().filter(|v| **v == s).count();
        if let Some(b) = self
            .bar
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
        {
            b.set_position(count(ClientState::Done) as u64);
            b.set_message(format!(
                "{} running, {} queued",
                count(ClientState::Running),
                count(ClientState::Queued)
            ));
        }
    }

    /// Prints a line above the bars.
    pub fn println(&self, line: &str) {
        self.mp.suspend(|| println!("{line}"));
    }
}

impl Observer for Progress {
    fn phase_started(&self, phase: &str, round: u32, rounds: u32, clients: usize) {
        let bar = self.mp.add(ProgressBar::new(clients as u64));
        let style =
            ProgressStyle::with_template("{prefix:>14} [{bar:30}] {pos}/{len} clients  {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar());
        bar.set_style(style.progress_chars("=> "));
        bar.set_prefix(if phase == "round" {
            format!("round {round}/{rounds}")
        } else {
            phase.to_owned()
        });
        if let Some(old) = self
            .bar
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .replace(bar)
        {
            old.finish();
        }
        self.states
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        self.refresh();
    }

    fn client_state(&self, site: &str, state: ClientState) {
        self.states
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(site.to_owned(), state);
        self.refresh();
    }

    fn round_done(&self, r: &RoundReport) {
        let mut line = format!(
            "round {:>3}: {} clients",
            r.round,
            r.metrics.get("clients").copied().unwrap_or(0.0)
        );
        for k in &self.keys {
            if let Some(v) = r.metrics.get(k) {
                line.push_str(&format!("  {k} {v:.4}"));
            }
        }
        line.push_str(&format!("  ({:.2} s)", r.seconds));
        if let Some(b) = self
            .bar
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            b.finish_and_clear();
        }
        self.println(&line);
    }
}
