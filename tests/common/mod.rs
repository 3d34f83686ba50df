//! Helpers shared by the integration tests: the real worker binary, configurations
//! with short deadlines, and what the OS says about processes and descriptors.

#![allow(dead_code)]

pub mod console;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rankexec::executor::{Dur, ExecutorConfig, MultiProcessExecutor};
use rankexec::protocol::{
    ComponentConfig, Engine, EventType, FireEventError, FlContext, PropFlags, Value, keys,
};

/// How long a process may take to disappear after it should have: a bound on a wait for
/// a condition, generous so a saturated machine (`scripts/load-test.sh`) does not fail
/// it; a passing test never waits this long.
pub const DIE_TIME: Duration = Duration::from_secs(30);

/// The `rankexec` binary.
pub fn rankexec_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_rankexec"))
}

/// The `rankexec-worker` binary (built by `cargo test --workspace` with its package).
pub fn worker_bin() -> PathBuf {
    let p = rankexec_bin().with_file_name("rankexec-worker");
    assert!(
        p.exists(),
        "{} is missing: run the tests with `cargo test --workspace` so the worker is built",
        p.display()
    );
    p
}

/// A configuration for `n` ranks of `path`, with short deadlines and logs in `logs`.
pub fn config(n: u32, path: &str, args: serde_json::Value, logs: &Path) -> ExecutorConfig {
    let mut c = ExecutorConfig::simple(n, path, args);
    c.worker.program = worker_bin().display().to_string();
    c.log_dir = Some(logs.to_owned());
    let d = &mut c.deadlines;
    // Generous: torch and Python ranks import for seconds on a saturated machine.
    d.startup = Dur(Duration::from_secs(120));
    d.task = Dur(Duration::from_secs(60));
    d.event = Dur(Duration::from_secs(20));
    d.heartbeat_interval = Dur(Duration::from_millis(200));
    d.heartbeat_timeout = Dur(Duration::from_secs(5));
    d.abort_grace = Dur(Duration::from_secs(2));
    d.shutdown_grace = Dur(Duration::from_secs(2));
    d.term_grace = Dur(Duration::from_secs(2));
    c.restart.backoff = Dur(Duration::from_millis(50));
    c
}

/// Adds a component to a configuration.
pub fn with_component(
    mut c: ExecutorConfig,
    id: &str,
    path: &str,
    args: serde_json::Value,
) -> ExecutorConfig {
    c.components.push(ComponentConfig::new(id, path, args));
    c
}

/// Whether a process exists and is not a zombie.
pub fn pid_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat
                .rfind(')')
                .and_then(|i| stat[i + 1..].split_whitespace().next())
                .unwrap_or("?");
            state != "Z" && state != "X"
        }
        Err(_) => false,
    }
}

/// Waits until every pid is gone; returns the survivors after `within`.
pub fn wait_gone(pids: &[u32], within: Duration) -> Result<Duration, Vec<u32>> {
    let start = Instant::now();
    loop {
        let alive: Vec<u32> = pids.iter().copied().filter(|p| pid_alive(*p)).collect();
        if alive.is_empty() {
            return Ok(start.elapsed());
        }
        if start.elapsed() > within {
            return Err(alive);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Asserts every pid is gone within [`DIE_TIME`].
#[track_caller]
pub fn assert_gone(pids: &[u32], what: &str) {
    if let Err(alive) = wait_gone(pids, DIE_TIME) {
        panic!("{what}: pids {alive:?} still alive after {DIE_TIME:?}");
    }
}

/// Open file descriptors of this process.
pub fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

static SERIAL: Mutex<()> = Mutex::new(());

/// Serializes tests of one binary that count this process's children.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Live (non-zombie) children of this process.
pub fn child_pids() -> Vec<u32> {
    let me = std::process::id().to_string();
    let mut out = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            let Ok(pid) = name.parse::<u32>() else {
                continue;
            };
            if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
                let Some(i) = stat.rfind(')') else { continue };
                let mut f = stat[i + 1..].split_whitespace();
                let state = f.next().unwrap_or("?");
                let ppid = f.next().unwrap_or("");
                if ppid == me && state != "Z" {
                    out.push(pid);
                }
            }
        }
    }
    out
}

/// The socket path in a `local:PATH` endpoint.
pub fn socket_path(endpoint: &str) -> PathBuf {
    PathBuf::from(endpoint.strip_prefix("local:").expect("local endpoint"))
}

/// A signal that fires `reason` after `delay`, as a controller's abort would; the thread
/// returns the instant it fired.
pub fn abort_after(
    delay: Duration,
    reason: &'static str,
) -> (rankexec::protocol::Signal, std::thread::JoinHandle<Instant>) {
    let abort = rankexec::protocol::Signal::new();
    let trigger = abort.clone();
    let fired = std::thread::spawn(move || {
        std::thread::sleep(delay);
        trigger.trigger(reason);
        Instant::now()
    });
    (abort, fired)
}

/// Starts the executor with a fresh context.
pub fn start(exec: &MultiProcessExecutor) -> FlContext {
    let mut ctx = FlContext::new();
    use rankexec::protocol::FlComponent;
    exec.handle_event(&EventType::START_RUN, &mut ctx)
        .expect("START_RUN");
    ctx
}

/// The whole error chain as text.
#[allow(unused_imports)]
pub use rankexec::protocol::error_chain as chain;

/// An event as the engine saw it: name, the rank it came from, its context values.
pub type Recorded = (String, Option<i64>, BTreeMap<String, Value>);

/// An engine that records every event fired into it and answers with a prop.
pub struct RecordingEngine {
    pub events: Mutex<Vec<Recorded>>,
    pub workspace: PathBuf,
}

impl RecordingEngine {
    pub fn new(workspace: &Path) -> Arc<Self> {
        Arc::new(RecordingEngine {
            events: Mutex::new(Vec::new()),
            workspace: workspace.to_owned(),
        })
    }
}

impl Engine for RecordingEngine {
    fn fire_event(&self, event: &EventType, ctx: &mut FlContext) -> Result<(), FireEventError> {
        let from = ctx.get_prop(keys::FROM_RANK_NUMBER).and_then(Value::as_i64);
        let props = ctx
            .props()
            .iter()
            .map(|(k, p)| (k.clone(), p.value.clone()))
            .collect();
        self.events
            .lock()
            .unwrap()
            .push((event.to_string(), from, props));
        let _ = ctx.set_prop("seen_by_host", true, PropFlags::PUBLIC);
        Ok(())
    }
    fn identity(&self) -> &str {
        "site-test"
    }
    fn job_id(&self) -> &str {
        "job-test"
    }
    fn workspace(&self) -> &Path {
        &self.workspace
    }
}

/// Collects every log line of this test binary (all threads).
pub struct LogCapture(Arc<Mutex<Vec<u8>>>);

impl LogCapture {
    pub fn install() -> LogCapture {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let w = buf.clone();
        let _ = tracing_subscriber::fmt()
            .with_env_filter("debug")
            .with_ansi(false)
            .with_writer(move || Writer(w.clone()))
            .try_init();
        LogCapture(buf)
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    /// Waits until the log contains `needle`.
    pub fn wait_for(&self, needle: &str, within: Duration) -> bool {
        let start = Instant::now();
        while start.elapsed() < within {
            if self.text().contains(needle) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }
}

struct Writer(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Writer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Waits for a child to exit; kills it (and fails) if it does not within `within`.
#[track_caller]
pub fn wait_exit(child: &mut std::process::Child, within: Duration) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        if start.elapsed() > within {
            let _ = child.kill();
            let _ = child.wait();
            panic!("pid {} did not exit within {within:?}", child.id());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Entries of a directory (empty when it does not exist).
pub fn entries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// A child process that is killed and reaped when dropped (a failing test leaves no
/// process behind; its process group goes with it when it leads one).
pub struct Reaper(pub std::process::Child);

impl Drop for Reaper {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Processes a test learned of without starting them (a host's ranks, a launcher's
/// workers), each held by a pidfd opened while the process that started it still
/// held it, and `SIGKILL`ed through that pidfd on drop: a test that fails (a panic
/// included) leaves none of them behind, and a reused pid is never signalled. Declare
/// it after the host's [`Reaper`], so the ranks go first.
pub struct Held(Vec<(u32, std::os::fd::OwnedFd)>);

impl Held {
    /// Holds every pid that is still alive (one already gone is skipped: nothing to
    /// kill later, and its number may already name another process).
    pub fn new(pids: &[u32]) -> Held {
        Held(
            pids.iter()
                .filter_map(|&pid| {
                    let raw = rustix::process::Pid::from_raw(i32::try_from(pid).ok()?)?;
                    let fd = rustix::process::pidfd_open(raw, rustix::process::PidfdFlags::empty())
                        .ok()?;
                    Some((pid, fd))
                })
                .collect(),
        )
    }

    /// The pids held.
    pub fn pids(&self) -> Vec<u32> {
        self.0.iter().map(|(p, _)| *p).collect()
    }
}

impl Drop for Held {
    /// Kills each, then waits (at most [`DIE_TIME`] in all) until each has exited, so
    /// whoever drops the ranks' parent next finds them gone (and it reaped them; a rank
    /// that outlived its parent would be left to init).
    fn drop(&mut self) {
        use rustix::event::{PollFd, PollFlags, poll};
        for (_, fd) in &self.0 {
            // Fails (ESRCH) once the process has exited: nothing left to do.
            let _ = rustix::process::pidfd_send_signal(fd, rustix::process::Signal::KILL);
        }
        let deadline = Instant::now() + DIE_TIME;
        for (_, fd) in &self.0 {
            // A pidfd becomes readable when its process exits.
            let left = deadline.saturating_duration_since(Instant::now());
            let Ok(left) = rustix::event::Timespec::try_from(left) else {
                return;
            };
            let _ = poll(&mut [PollFd::new(fd, PollFlags::IN)], Some(&left));
        }
    }
}

/// Busy processes that keep every core saturated; killed and reaped on drop.
pub struct Hogs(Vec<std::process::Child>);

impl Hogs {
    /// Two per core, plus one, each a shell spinning in a loop.
    pub fn start() -> Hogs {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let hogs = Hogs(
            (0..2 * cores + 1)
                .map(|_| {
                    std::process::Command::new("sh")
                        .args(["-c", "while :; do :; done"])
                        .stdin(std::process::Stdio::null())
                        .spawn()
                        .expect("a busy process starts")
                })
                .collect(),
        );
        // Busy for real before the kill: each has run on a CPU for a while.
        let deadline = Instant::now() + Duration::from_secs(20);
        for h in &hogs.0 {
            while cpu_ticks(h.id()) < 5 {
                assert!(
                    Instant::now() < deadline,
                    "busy process {} never ran",
                    h.id()
                );
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        hogs
    }

    /// How many there are.
    pub fn count(&self) -> usize {
        self.0.len()
    }
}

impl Drop for Hogs {
    fn drop(&mut self) {
        for h in &mut self.0 {
            let _ = h.kill();
            let _ = h.wait();
        }
    }
}

/// User plus system clock ticks `pid` has run for.
pub fn cpu_ticks(pid: u32) -> u64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0;
    };
    let Some(i) = stat.rfind(')') else { return 0 };
    let f: Vec<&str> = stat[i + 2..].split(' ').collect();
    // Fields 14 and 15 of stat(5), counted from the state (field 3).
    let tick = |n: usize| {
        f.get(n - 3)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    tick(14) + tick(15)
}
