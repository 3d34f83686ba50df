//! Progress of a simulated job: a bar per round on the terminal (clients done, running
//! and queued), and a plain line per round on stdout with every metric the round
//! reported. Output is bounded by time, not by rounds: the first [`FIRST_LINES`] rounds,
//! the last one, failed ones, and then at most one line per [`LINE_EVERY`] are printed
//! (every round is in `metrics.jsonl`).

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::server::{ClientState, Observer, RoundReport};

/// Rounds printed in full at the start.
pub const FIRST_LINES: u32 = 5;
/// After those, at most one round line per this long.
pub const LINE_EVERY: Duration = Duration::from_secs(1);

/// Draws progress.
pub struct Progress {
    mp: MultiProgress,
    bar: Mutex<Option<ProgressBar>>,
    states: Mutex<BTreeMap<String, ClientState>>,
    /// The number of rounds, and when a round line was last printed.
    lines: Mutex<(u32, Option<Instant>)>,
}

impl Progress {
    /// Bars on stderr when it is a terminal and `bars` is set; hidden otherwise.
    pub fn new(bars: bool) -> Self {
        let target = if bars && std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        Progress {
            mp: MultiProgress::with_draw_target(target),
            bar: Mutex::new(None),
            states: Mutex::new(BTreeMap::new()),
            lines: Mutex::new((0, None)),
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
        self.lines.lock().unwrap_or_else(PoisonError::into_inner).0 = rounds;
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
            old.finish_and_clear();
            self.mp.remove(&old);
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
        if let Some(b) = self
            .bar
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            b.finish_and_clear();
            self.mp.remove(&b);
        }
        {
            let mut lines = self.lines.lock().unwrap_or_else(PoisonError::into_inner);
            let (rounds, last) = *lines;
            let show = r.round <= FIRST_LINES
                || r.round >= rounds
                || r.metrics.is_empty()
                || last.is_none_or(|t| t.elapsed() >= LINE_EVERY);
            if !show {
                return;
            }
            lines.1 = Some(Instant::now());
        }
        let mut line = format!(
            "round {:>3}: {} clients",
            r.round,
            r.metrics.get("clients").copied().unwrap_or(0.0)
        );
        for (k, v) in r.metrics.iter().filter(|(k, _)| k.as_str() != "clients") {
            line.push_str(&format!("  {k} {v:.4}"));
        }
        line.push_str(&format!("  ({:.2} s)", r.seconds));
        self.println(&line);
    }
}
