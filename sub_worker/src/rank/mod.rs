//! The rank process: read the environment, connect and authenticate three channels,
//! build the components, then serve until the parent says `Close` or disappears.
//!
//! # Threads
//!
//! - **main**: reads the exec channel (`Execute`, `Close`) and runs every task itself,
//!   one after another, so libraries that tie state to a thread (MPI with
//!   `MPI_THREAD_FUNNELED`, CUDA contexts) see one thread, and a task costs no thread
//!   hop;
//! - **handle**: reads the handle channel: fires the running task's abort signal
//!   (`Abort`, `Close`) at once, and queues events for the events thread (at most
//!   [`EVENT_QUEUE`]; an event beyond that is refused with an `EventAck` saying the
//!   queue is full, which the host reports as this rank's failure to handle it);
//! - **events**: runs the components' event handlers, one event after another, and
//!   acknowledges each; a slow handler delays later events, never an abort;
//! - **event**: reads the parent's answers to relayed events;
//! - **heartbeat**: tells the parent every interval that the process is alive.
//!
//! # Caveats
//!
//! - If any channel closes without a `Close` first, the parent is gone (even a
//!   `SIGKILL`ed parent closes its sockets) and the rank exits at once with
//!   [`EXIT_PARENT_GONE`], even in the middle of a task. This is the one parent-death
//!   check that also works under external launchers.
//! - The service threads (handle, events, event, heartbeat) are what notice a dead
//!   parent while a task runs. They log to stderr, whose reader may be that dead
//!   parent, so logging ignores write errors; a service thread that panics ends the
//!   process with [`EXIT_INTERNAL`] rather than leave a rank nobody listens for.
//! - Those exits happen while other threads (a task, or a foreign runtime such as
//!   Python on its main thread) keep running, so they flush stdout and stderr and end
//!   the process at once (`_exit`): no `atexit` handler or library destructor runs
//!   concurrently with code still using what it tears down. Output the rank's own code
//!   buffered itself (Python's `sys.stdout`) is lost, as on `SIGKILL`.
//! - A task that ignores its abort signal keeps its thread busy; the parent escalates
//!   to signals after its grace period.
//! - `SIGTERM` keeps its default action (terminate at once). Put cleanup in an
//!   `END_RUN` handler: the parent delivers `END_RUN` before it closes the group.
//!
//! # Files
//!
//! - `startup`: environment, channels, `Init`, components, `serve`.
//! - `tasks`: which task runs, and aborts that arrive before their task.
//! - `exec`: the exec thread: tasks, one after another, and their results.
//! - `port`: the exec channel served by an embedding caller's thread instead.
//! - `service`: the handle, events, event and heartbeat threads, and the event queue.
//! - `panics`: panic locations for error reports.

use rankexec_protocol::error_chain as chain;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use rankexec_protocol::env::RankEnv;
use rankexec_protocol::wire::envelope::BlobPolicy;
use rankexec_protocol::wire::message::Props;
use rankexec_protocol::wire::{Channel, FrameLimits, Identity};
use rankexec_protocol::{Registry, Shareable, Signal};
use tracing::{error, info_span, warn};

use crate::engine::RankEngine;
use crate::link::Link;
use crate::{errorfile, os};

mod exec;
mod panics;
mod port;
mod service;
mod startup;
mod tasks;

use exec::exec_loop;
use panics::{install_panic_capture, panic_text};
pub use port::{ExecPort, Finish, PortStep, PortTask};
pub use service::EVENT_QUEUE;
use service::{event_loop, events_loop, handle_loop, heartbeat_loop};
use startup::{Settings, StartupError, serve, settings};
use tasks::Tasks;

/// Exit code: the parent closed the group cleanly.
pub const EXIT_OK: u8 = 0;
/// Exit code: the rank could not start (environment, connection, handshake, build).
pub const EXIT_STARTUP: u8 = 1;
/// Exit code: the command line was wrong.
pub const EXIT_USAGE: u8 = 2;
/// Exit code: the parent disappeared without closing the group.
pub const EXIT_PARENT_GONE: u8 = 3;
/// Exit code: the parent broke the protocol.
pub const EXIT_PROTOCOL: u8 = 4;
/// Exit code: one of the rank's own service threads panicked.
pub const EXIT_INTERNAL: u8 = 5;

/// Who this rank is and where it logs, available to components from construction on.
#[derive(Debug, Clone)]
pub struct RankInfo {
    /// The rank's place in its group.
    pub env: RankEnv,
    /// `LOG_DIR/rank-N`, if the executor gave a log directory.
    pub dir: Option<PathBuf>,
}

static RANK_INFO: std::sync::OnceLock<RankInfo> = std::sync::OnceLock::new();

/// This rank's identity, once the rank has read its environment (`None` outside a rank).
pub fn rank_info() -> Option<&'static RankInfo> {
    RANK_INFO.get()
}

/// Runs this process as a rank with the components of `registry`. Call it from `main`
/// before starting any thread; it returns the process exit code.
pub fn run(registry: Registry) -> std::process::ExitCode {
    run_with(registry, None)
}

/// Offers the exec channel to an embedding caller once the rank is ready: `Ok` when it
/// serves it (see [`ExecPort`]), the port back when it cannot (the rank then runs its
/// tasks through its executor, on the runtime's thread).
pub(crate) type ExecHook = Box<dyn FnOnce(ExecPort) -> Result<(), ExecPort> + Send>;

/// [`run`], offering the exec channel to `hook` (a foreign runtime's caller).
pub(crate) fn run_with(registry: Registry, hook: Option<ExecHook>) -> std::process::ExitCode {
    crate::logging::init();
    install_panic_capture();
    let settings = match settings() {
        Ok(s) => s,
        Err(e) => return startup_failure(&e),
    };
    let dir = settings
        .log_dir
        .as_ref()
        .map(|d| d.join(format!("rank-{}", settings.env.rank)));
    let _ = RANK_INFO.set(RankInfo {
        env: settings.env,
        dir: dir.clone(),
    });
    let span = info_span!("rank", rank = settings.env.rank);
    let _enter = span.enter();
    match serve(settings, dir, registry, hook) {
        Ok(code) => std::process::ExitCode::from(code),
        Err(e) => startup_failure(&e),
    }
}

fn startup_failure(e: &StartupError) -> std::process::ExitCode {
    let text = chain(e);
    error!("rank failed to start: {text}");
    errorfile::write("StartupError", &text, "");
    std::process::ExitCode::from(EXIT_STARTUP)
}

/// Exits the whole process because the parent is gone. The log line is written on the
/// way out, never waited for long (see [`os::exit_after`]).
fn parent_gone(channel: &str) -> ! {
    let channel = channel.to_owned();
    os::exit_after(EXIT_PARENT_GONE, move || {
        warn!("{channel} channel closed without Close: the parent is gone, exiting");
    })
}

fn protocol_violation(channel: &str, what: &str) -> ! {
    errorfile::write("ProtocolError", what, channel);
    let (channel, what) = (channel.to_owned(), what.to_owned());
    os::exit_after(EXIT_PROTOCOL, move || {
        error!("{channel} channel: protocol violation: {what}");
    })
}

/// Frames from the authenticated parent: generous, since it sends whole models.
fn parent_limits() -> FrameLimits {
    FrameLimits::for_max_frame(1 << 40)
}

fn connect(settings: &Settings, channel: Channel) -> Result<Link, StartupError> {
    let who = Identity {
        channel,
        rank: settings.env.rank,
        world_size: settings.env.world_size,
        launch_id: settings.launch_id.clone(),
        pid: os::pid(),
        pgid: os::pgid(),
        host: os::hostname(),
    };
    // Retries, with back-off, a parent too busy to take the connection yet.
    let conn = rankexec_protocol::wire::dial(
        &settings.endpoint,
        &settings.secret,
        &who,
        settings.connect_timeout,
    )
    .map_err(|e| match e {
        rankexec_protocol::wire::DialError::Connect { source, .. } => StartupError::Connect {
            channel: channel.as_str(),
            endpoint: settings.endpoint.to_string(),
            source,
        },
        rankexec_protocol::wire::DialError::Handshake { source, .. } => StartupError::Handshake {
            channel: channel.as_str(),
            source,
        },
    })?;
    Ok(Link::new(conn))
}

struct Job {
    task_id: u64,
    task: String,
    props: Props,
    input: Shareable,
    want_output: bool,
    signal: Signal,
}

struct Rank {
    env: RankEnv,
    exec: Arc<Link>,
    handle: Arc<Link>,
    event: Arc<Link>,
    engine: Arc<RankEngine>,
    closing: AtomicBool,
    tasks: Mutex<Tasks>,
    blob_policy_out: BlobPolicy,
}
