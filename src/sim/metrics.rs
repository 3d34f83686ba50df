//! `WORKSPACE/metrics.jsonl`: every round's report, one JSON object per line, written
//! as the round ends (so memory does not grow with the number of rounds, and a reader
//! can follow a running job with `tail -f`). Each line is a
//! [`RoundReport`]: `round`, `clients` (each client's status, metrics and seconds),
//! `metrics` (the weighted means) and `seconds`.
//!
//! A write error is logged once and later rounds are not written; the job goes on.

use std::fs::File;
use std::io::{LineWriter, Write as _};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use tracing::error;

use crate::server::{ClientState, Observer, RoundReport};

/// The file's name in the workspace.
pub const FILE: &str = "metrics.jsonl";

/// Forwards progress to `inner` and appends every round to the metrics file.
pub struct MetricsLog {
    inner: Arc<dyn Observer>,
    path: PathBuf,
    file: Mutex<Option<LineWriter<File>>>,
}

impl MetricsLog {
    /// Creates (truncates) `WORKSPACE/metrics.jsonl`.
    pub fn create(workspace: &Path, inner: Arc<dyn Observer>) -> std::io::Result<MetricsLog> {
        let path = workspace.join(FILE);
        let file = File::create(&path)?;
        Ok(MetricsLog {
            inner,
            path,
            file: Mutex::new(Some(LineWriter::new(file))),
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Observer for MetricsLog {
    fn phase_started(&self, phase: &str, round: u32, rounds: u32, clients: usize) {
        self.inner.phase_started(phase, round, rounds, clients);
    }

    fn client_state(&self, site: &str, state: ClientState) {
        self.inner.client_state(site, state);
    }

    fn round_done(&self, report: &RoundReport) {
        self.inner.round_done(report);
        let mut file = self.file.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(f) = file.as_mut() {
            let written = serde_json::to_writer(&mut *f, report)
                .map_err(std::io::Error::other)
                .and_then(|()| f.write_all(b"\n"));
            if let Err(e) = written {
                error!(path = %self.path.display(), "cannot write the round's metrics: {e}");
                *file = None;
            }
        }
    }
}
