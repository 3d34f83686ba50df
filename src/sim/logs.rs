//! Logs of a simulated job: the console, `WORKSPACE/log.txt` with everything, and
//! `WORKSPACE/site-N/log.txt` with each site's own lines (every event inside a span that
//! carries `site = ...`, which includes its executors' and ranks' output). Each rank's
//! raw stdout and stderr are also in `WORKSPACE/site-N/<executor>/rank-R/`.
//!
//! A rank's line relayed by its executor (target `rankexec::rank`) already carries the
//! rank's own timestamp and level: the files keep those and add none (a line the rank
//! printed without them gets the host's).

use std::collections::HashMap;
use std::fs::File;
use std::io::{LineWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use indicatif::MultiProgress;
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber, span};
use tracing_subscriber::filter::{EnvFilter, LevelFilter};
use tracing_subscriber::fmt::time::FormatTime;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{Layer, fmt};

use crate::logging::{Message, RANK_TARGET, RankLines, split_stamped};

struct Site(String);

struct SiteField(Option<String>);

impl Visit for SiteField {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "site" {
            self.0 = Some(value.to_owned());
        }
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "site" {
            self.0 = Some(format!("{value:?}").trim_matches('"').to_owned());
        }
    }
}

struct Text(String);

impl Visit for Text {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0.insert_str(0, &format!("{value:?}"));
        } else {
            self.0.push_str(&format!(" {}={value:?}", field.name()));
        }
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.0.insert_str(0, value);
        } else {
            self.0.push_str(&format!(" {}={value}", field.name()));
        }
    }
}

/// Writes each site's events to its own file, and ranks' lines to the job's file too.
struct SiteFiles {
    root: PathBuf,
    files: Mutex<HashMap<String, LineWriter<File>>>,
    all: Arc<Mutex<LineWriter<File>>>,
}

impl<S> Layer<S> for SiteFiles
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, ctx: Context<'_, S>) {
        let mut v = SiteField(None);
        attrs.record(&mut v);
        if let (Some(site), Some(span)) = (v.0, ctx.span(id)) {
            span.extensions_mut().insert(Site(site));
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let Some(site) = ctx.event_scope(event).and_then(|scope| {
            scope
                .from_root()
                .find_map(|s| s.extensions().get::<Site>().map(|x| x.0.clone()))
        }) else {
            return;
        };
        // Rank lines carry their own timestamp: the clock is read only for the others.
        let now = || {
            let mut ts = String::new();
            let _ = fmt::time::SystemTime.format_time(&mut fmt::format::Writer::new(&mut ts));
            ts
        };
        let meta = event.metadata();
        let line = if meta.target() == RANK_TARGET {
            let mut m = Message::default();
            event.record(&mut m);
            let (ts, level, rest) = split_stamped(&m.0)
                .map(|(t, l, r)| (t.to_owned(), l.to_owned(), r.to_owned()))
                .unwrap_or_else(|| (now(), meta.level().to_string(), m.0.clone()));
            let job_line = format!("{ts} {level:>5} {site}: {rest}\n");
            let _ = self
                .all
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .write_all(job_line.as_bytes());
            format!("{ts} {level:>5} {rest}\n")
        } else {
            let mut text = Text(String::new());
            event.record(&mut text);
            format!(
                "{} {:>5} {}: {}\n",
                now(),
                meta.level(),
                meta.target(),
                text.0
            )
        };
        let mut files = self.files.lock().unwrap_or_else(PoisonError::into_inner);
        if !files.contains_key(&site) {
            let dir = self.root.join(&site);
            if std::fs::create_dir_all(&dir).is_err() {
                return;
            }
            match File::options()
                .create(true)
                .append(true)
                .open(dir.join("log.txt"))
            {
                Ok(f) => {
                    files.insert(site.clone(), LineWriter::new(f));
                }
                Err(_) => return,
            }
        }
        if let Some(f) = files.get_mut(&site) {
            let _ = f.write_all(line.as_bytes());
        }
    }
}

/// Console output that does not tear the progress bars.
#[derive(Clone)]
struct Console(Option<MultiProgress>);

impl Write for Console {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match &self.0 {
            Some(mp) => mp
                .suspend(|| std::io::stderr().write_all(buf))
                .map(|()| buf.len()),
            None => std::io::stderr().write_all(buf).map(|()| buf.len()),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

/// Why the logs could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum LogSetupError {
    /// The job's log file could not be created.
    #[error("cannot create the log file {path}")]
    Create {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A global subscriber is already installed.
    #[error("a logger is already installed")]
    Installed(#[source] tracing_subscriber::util::TryInitError),
}

/// Installs the three destinations. `console` is the console's default level
/// (`RANKEXEC_LOG`/`RUST_LOG` override it).
pub fn install(
    workspace: &Path,
    console: LevelFilter,
    bars: Option<MultiProgress>,
) -> Result<(), LogSetupError> {
    let path = workspace.join("log.txt");
    let file = std::fs::create_dir_all(workspace)
        .and_then(|()| File::create(&path))
        .map_err(|source| LogSetupError::Create {
            path: path.display().to_string(),
            source,
        })?;
    let all = Arc::new(Mutex::new(LineWriter::new(file)));
    // Write errors are dropped, never reported with `eprintln!`: that panics (in whatever
    // thread was logging) when stderr is closed.
    let job_file = all.clone();
    let file_layer = fmt::layer()
        .with_ansi(false)
        .log_internal_errors(false)
        .with_writer(move || AllWriter(job_file.clone()))
        .with_filter(LevelFilter::INFO)
        // Ranks' lines are written by `SiteFiles`, with their own timestamps.
        .with_filter(tracing_subscriber::filter::filter_fn(|m| {
            m.target() != RANK_TARGET
        }));
    let console_filter = EnvFilter::try_from_env("RANKEXEC_LOG")
        .or_else(|_| EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| EnvFilter::default().add_directive(console.into()));
    let is_tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let console_layer = fmt::layer()
        .with_ansi(is_tty)
        .log_internal_errors(false)
        .event_format(RankLines(
            fmt::format().with_ansi(is_tty).with_target(false),
        ))
        .with_writer(move || Console(bars.clone()))
        .with_filter(console_filter);
    let sites = SiteFiles {
        root: workspace.to_owned(),
        files: Mutex::new(HashMap::new()),
        all,
    }
    .with_filter(LevelFilter::INFO);
    tracing_subscriber::registry()
        .with(file_layer)
        .with(sites)
        .with(console_layer)
        .try_init()
        .map_err(LogSetupError::Installed)
}

struct AllWriter(Arc<Mutex<LineWriter<File>>>);

impl Write for AllWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .flush()
    }
}
