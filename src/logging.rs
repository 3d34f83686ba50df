//! Logging for the `rankexec` binary: a console subscriber, filtered by `RANKEXEC_LOG`
//! or `RUST_LOG` (default: the level the command asks for). Rank output arrives as
//! events with a `rank` field (target `rankexec::rank`); a rank line that carries the
//! rank's own timestamp and level is printed as the rank wrote it ([`RankLines`]), so
//! it shows one of each, not two.

use std::fmt;
use std::io::IsTerminal as _;

use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// Target of the executor's events that relay a rank's output line.
pub const RANK_TARGET: &str = "rankexec::rank";

/// Splits a rank's log line into its timestamp, level and the rest, when it has them
/// (`2026-01-01T00:00:00.000000Z  INFO rank{rank=0}: ...`).
pub fn split_stamped(line: &str) -> Option<(&str, &str, &str)> {
    let (ts, rest) = line.split_once(' ')?;
    let b = ts.as_bytes();
    let looks_like_time = b.len() >= 20
        && b[4] == b'-'
        && b[10] == b'T'
        && ts.ends_with('Z')
        && b[..4].iter().all(u8::is_ascii_digit);
    if !looks_like_time {
        return None;
    }
    let (level, rest) = rest.trim_start().split_once(' ')?;
    matches!(level, "TRACE" | "DEBUG" | "INFO" | "WARN" | "ERROR").then_some((ts, level, rest))
}

/// The message of an event, without its other fields.
#[derive(Default)]
pub struct Message(pub String);

impl Visit for Message {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.0 = value.to_owned();
        }
    }
}

/// An event format that prints a rank's stamped line as the rank wrote it and every
/// other event with `F`.
pub struct RankLines<F>(pub F);

impl<S, N, F> FormatEvent<S, N> for RankLines<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        if event.metadata().target() == RANK_TARGET {
            let mut m = Message::default();
            event.record(&mut m);
            if split_stamped(&m.0).is_some() {
                return writeln!(writer, "{}", m.0);
            }
        }
        self.0.format_event(ctx, writer, event)
    }
}

/// Installs the console subscriber once.
pub fn init(default: &str) {
    let filter = EnvFilter::try_from_env("RANKEXEC_LOG")
        .or_else(|_| EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| EnvFilter::new(default));
    let ansi = std::io::stderr().is_terminal();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        // A closed stderr (the parent that read it is gone) must not turn every log call
        // into a panic: tracing-subscriber reports write errors with `eprintln!`, which
        // panics when stderr itself is the broken writer.
        .log_internal_errors(false)
        .event_format(RankLines(
            tracing_subscriber::fmt::format()
                .with_ansi(ansi)
                .with_target(false),
        ))
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::split_stamped;

    #[test]
    fn a_rank_line_keeps_its_own_stamp() {
        let line = "2026-11-23T16:42:38.201507Z  INFO rank{rank=0}: rank ready world_size=4";
        assert_eq!(
            split_stamped(line),
            Some((
                "2026-11-23T16:42:38.201507Z",
                "INFO",
                "rank{rank=0}: rank ready world_size=4"
            ))
        );
        assert_eq!(split_stamped("epoch 1: loss 0.3"), None);
        assert_eq!(split_stamped("2026-11-23T16:42:38Z NOTICE x"), None);
    }
}
