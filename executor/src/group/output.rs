//! Rank output: every rank's stdout and stderr, captured through pipes.
//!
//! One thread polls every pipe. Each line goes to `LOG_DIR/rank-N/stdout.log` or
//! `stderr.log` and into the host's log as a `tracing` event with the rank number
//! (target `rankexec::rank`), like torchrun's `--tee` with a `[rankN]:` prefix. The
//! last [`TAIL_LINES`] lines of each rank's stderr are kept in memory for error
//! reports. Output of an external launcher goes to `LOG_DIR/launcher/`.
//!
//! Each stream's file is bounded while the group lives (`max_rank_log`, the cap):
//! before a line would take `stdout.log` past half of the cap, it becomes
//! `stdout.log.1` (replacing the older one) and a new `stdout.log` starts, so the last
//! half to all of the cap stays on disk, never more (the log folder may be memory, as
//! a Flower node's is). A relaunched group appends to its ranks' files, counting what
//! is already there. Caveat: when the rename fails the file is emptied instead, and
//! when no new file can be opened the stream goes on to the host's log only.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::os::{self, Waker};

/// Lines of stderr kept per rank for error reports.
pub const TAIL_LINES: usize = 20;
const MAX_LINE: usize = 16 << 10;

/// Whose output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Source {
    Rank(u32),
    Launcher,
}

/// Which stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    fn name(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
    }
}

#[derive(Default)]
struct Tail {
    lines: VecDeque<String>,
    open: u8,
}

/// Called when a source's last pipe closes.
type OnClosed = Box<dyn Fn(Source) + Send + Sync>;

/// The last stderr lines of each source.
#[derive(Default)]
pub(crate) struct Tails {
    state: Mutex<HashMap<Source, Tail>>,
    cv: Condvar,
    on_closed: Mutex<Option<OnClosed>>,
}

impl Tails {
    /// The last lines of `src`'s stderr, waiting up to `wait` for its pipes to close so
    /// that a dying rank's final words are included.
    pub(crate) fn tail(&self, src: Source, wait: Duration) -> Vec<String> {
        let deadline = Instant::now() + wait;
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            let open = st.get(&src).map_or(0, |t| t.open);
            let now = Instant::now();
            if open == 0 || now >= deadline {
                return st
                    .get(&src)
                    .map(|t| t.lines.iter().cloned().collect())
                    .unwrap_or_default();
            }
            st = self
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    fn opened(&self, src: Source) {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(src)
            .or_default()
            .open += 1;
    }

    /// Whether some pipe of `src` is still open (a dead rank's stderr stays open while
    /// a child it left, such as a DataLoader worker, holds it).
    pub(crate) fn is_open(&self, src: Source) -> bool {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&src)
            .is_some_and(|t| t.open > 0)
    }

    /// Calls `f` (on the pump thread, which must not block) whenever a source's last
    /// pipe closes, so a waiter can learn it without blocking on [`Tails::tail`].
    pub(crate) fn notify_closed(&self, f: impl Fn(Source) + Send + Sync + 'static) {
        *self
            .on_closed
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Box::new(f));
    }

    fn closed(&self, src: Source) {
        let now_closed = self
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_mut(&src)
            .is_some_and(|t| {
                t.open = t.open.saturating_sub(1);
                t.open == 0
            });
        self.cv.notify_all();
        if now_closed
            && let Some(f) = &*self
                .on_closed
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
        {
            f(src);
        }
    }

    fn push(&self, src: Source, line: &str) {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let t = st.entry(src).or_default();
        if t.lines.len() == TAIL_LINES {
            t.lines.pop_front();
        }
        t.lines.push_back(line.to_owned());
    }
}

/// A stream's file, kept under its cap (see the module docs).
struct LogFile {
    path: PathBuf,
    file: Option<File>,
    /// Bytes in `path` (what was there when it was opened, plus what was written).
    len: u64,
    /// Half of the cap: the most bytes of each of `NAME.log` and `NAME.log.1`.
    half: u64,
}

impl LogFile {
    fn open(path: PathBuf, cap: u64) -> std::io::Result<LogFile> {
        let file = File::options().create(true).append(true).open(&path)?;
        let len = file.metadata()?.len();
        Ok(LogFile {
            path,
            file: Some(file),
            len,
            half: (cap / 2).max(2),
        })
    }

    /// Appends `text` and a newline, rotating first if they would pass half the cap;
    /// a line longer than that is cut.
    fn write_line(&mut self, text: &[u8]) {
        if self.file.is_none() {
            return;
        }
        let keep = usize::try_from(self.half - 1).unwrap_or(usize::MAX);
        let text = &text[..text.len().min(keep)];
        let n = text.len() as u64 + 1;
        if self.len > 0 && self.len + n > self.half {
            self.rotate();
        }
        let Some(f) = self.file.as_mut() else {
            return;
        };
        match f.write_all(text).and_then(|()| f.write_all(b"\n")) {
            Ok(()) => self.len += n,
            // A full disk: count what did land.
            Err(_) => self.len = f.metadata().map_or(self.len + n, |m| m.len()),
        }
    }

    /// `NAME.log` becomes `NAME.log.1` and a new `NAME.log` starts.
    fn rotate(&mut self) {
        let mut old = self.path.clone().into_os_string();
        old.push(".1");
        let moved = std::fs::rename(&self.path, &old)
            .and_then(|()| File::options().create(true).append(true).open(&self.path));
        match moved {
            Ok(f) => {
                self.file = Some(f);
                self.len = 0;
            }
            Err(e) => {
                // Bounded all the same: this file starts over (or, if it is gone and no
                // new one opens, the stream goes to the host's log only).
                let emptied = self.file.as_ref().map(|f| f.set_len(0));
                tracing::warn!(
                    path = %self.path.display(),
                    error = %e,
                    "cannot rotate a rank log; emptying it instead"
                );
                match emptied {
                    Some(Ok(())) => self.len = 0,
                    _ => self.file = None,
                }
            }
        }
    }
}

struct Pipe {
    src: Source,
    stream: Stream,
    reader: File,
    log: LogFile,
    partial: Vec<u8>,
}

/// Handle to the pump thread. Dropping it makes the thread read what is already
/// buffered and stop.
pub(crate) struct OutputPump {
    waker: Arc<Waker>,
    stop: Arc<AtomicBool>,
    tails: Arc<Tails>,
}

impl OutputPump {
    /// Starts pumping `pipes` into files under `dir`, each kept to its last `cap` bytes
    /// (see the module docs), tagging log lines with `label`.
    pub(crate) fn start(
        pipes: Vec<(Source, Stream, OwnedFd)>,
        dir: &Path,
        label: String,
        cap: u64,
    ) -> std::io::Result<OutputPump> {
        let tails = Arc::new(Tails::default());
        let mut open = Vec::with_capacity(pipes.len());
        for (src, stream, fd) in pipes {
            let sub = match src {
                Source::Rank(r) => dir.join(format!("rank-{r}")),
                Source::Launcher => dir.join("launcher"),
            };
            std::fs::create_dir_all(&sub)?;
            let log = LogFile::open(sub.join(format!("{}.log", stream.name())), cap)?;
            tails.opened(src);
            open.push(Pipe {
                src,
                stream,
                reader: File::from(fd),
                log,
                partial: Vec::new(),
            });
        }
        let waker = Arc::new(Waker::new()?);
        let stop = Arc::new(AtomicBool::new(false));
        let (w, s, t) = (waker.clone(), stop.clone(), tails.clone());
        let span = tracing::Span::current();
        std::thread::Builder::new()
            .name("rx-output".into())
            .spawn(move || span.in_scope(|| pump(open, &w, &s, &t, &label)))?;
        Ok(OutputPump { waker, stop, tails })
    }

    /// The stderr tails.
    pub(crate) fn tails(&self) -> Arc<Tails> {
        self.tails.clone()
    }
}

impl Drop for OutputPump {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.waker.wake();
    }
}

fn emit(p: &mut Pipe, line: &[u8], tails: &Tails, label: &str) {
    let text = String::from_utf8_lossy(line);
    let text = text.trim_end_matches('\r');
    p.log.write_line(text.as_bytes());
    match p.src {
        Source::Rank(rank) if p.stream == Stream::Stderr => {
            tracing::info!(target: "rankexec::rank", rank, "{text}");
        }
        Source::Rank(rank) => {
            tracing::info!(target: "rankexec::rank", rank, stream = "stdout", "{text}");
        }
        Source::Launcher => {
            tracing::info!(target: "rankexec::launcher", launcher = label, stream = p.stream.name(), "{text}");
        }
    }
    if p.stream == Stream::Stderr {
        tails.push(p.src, text);
    }
}

/// Reads what is available; returns false at end of file.
fn read_some(p: &mut Pipe, tails: &Tails, label: &str) -> bool {
    let mut buf = [0u8; 64 << 10];
    let n = match p.reader.read(&mut buf) {
        Ok(n) => n,
        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => return true,
        Err(_) => 0,
    };
    if n == 0 {
        if !p.partial.is_empty() {
            let line = std::mem::take(&mut p.partial);
            emit(p, &line, tails, label);
        }
        return false;
    }
    p.partial.extend_from_slice(&buf[..n]);
    while let Some(pos) = p.partial.iter().position(|b| *b == b'\n') {
        let line: Vec<u8> = p.partial.drain(..=pos).collect();
        emit(p, &line[..line.len() - 1], tails, label);
    }
    if p.partial.len() > MAX_LINE {
        let line = std::mem::take(&mut p.partial);
        emit(p, &line, tails, label);
    }
    true
}

fn pump(mut pipes: Vec<Pipe>, waker: &Waker, stop: &AtomicBool, tails: &Tails, label: &str) {
    while !pipes.is_empty() {
        let stopping = stop.load(Ordering::SeqCst);
        let ready = {
            let mut fds: Vec<BorrowedFd<'_>> = vec![waker.fd()];
            fds.extend(pipes.iter().map(|p| p.reader.as_fd()));
            let timeout = if stopping { Some(Duration::ZERO) } else { None };
            match os::poll_readable(&fds, timeout) {
                Ok(r) => r,
                Err(_) => break,
            }
        };
        if ready[0] {
            waker.drain();
        }
        let mut done = Vec::new();
        for (i, p) in pipes.iter_mut().enumerate() {
            if ready[i + 1] && !read_some(p, tails, label) {
                done.push(i);
            }
        }
        for i in done.into_iter().rev() {
            let p = pipes.remove(i);
            tails.closed(p.src);
        }
        if stopping && !ready.iter().skip(1).any(|r| *r) {
            break;
        }
    }
    for p in pipes {
        tails.closed(p.src);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_file_keeps_its_last_lines_within_its_cap_across_reopens() {
        let dir = std::env::temp_dir().join(format!("rankexec-logfile-{}", os::own_pid()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("stdout.log");
        let cap = 1000;
        let size = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len());
        // A relaunched group's pump opens the same file and counts what is there.
        for generation in 0..3 {
            let mut log = LogFile::open(path.clone(), cap).unwrap();
            for i in 0..100 {
                log.write_line(format!("generation {generation} line {i:03}").as_bytes());
                let old = dir.join("stdout.log.1");
                assert!(size(&path) <= cap / 2 && size(&old) <= cap / 2);
            }
        }
        let text = std::fs::read_to_string(dir.join("stdout.log.1")).unwrap()
            + &std::fs::read_to_string(&path).unwrap();
        assert!(text.ends_with("generation 2 line 099\n"), "{text}");
        assert!(text.len() >= 500 - 22, "{}", text.len());
        // A line longer than half the cap is cut, and the bound holds.
        let mut log = LogFile::open(path.clone(), cap).unwrap();
        log.write_line(&[b'x'; 4000]);
        assert_eq!(size(&path), 500);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn closing_the_last_pipe_notifies_once() {
        let tails = Tails::default();
        let (tx, rx) = crossbeam_channel::unbounded();
        tails.notify_closed(move |s| {
            let _ = tx.send(s);
        });
        let src = Source::Rank(3);
        tails.opened(src);
        tails.opened(src);
        tails.push(src, "last words");
        assert!(tails.is_open(src));
        tails.closed(src);
        assert!(rx.try_recv().is_err(), "stdout closed, stderr still open");
        tails.closed(src);
        assert_eq!(rx.try_recv().ok(), Some(src));
        assert!(!tails.is_open(src));
        assert_eq!(
            tails.tail(src, Duration::ZERO),
            vec!["last words".to_owned()]
        );
    }
}
