//! The rank process: read the environment, connect and authenticate three channels,
//! build the components, then serve until the parent says `Close` or disappears.
//!
//! # Threads
//!
//! - **main**: reads the exec channel (`Execute`, `Close`) and runs every task itself,
//!   one after another, so libraries that tie state to a thread (MPI with
//!   `MPI_THREAD_FUNNELED`, CUDA contexts) see one thread, and a task costs no thread
//!   hop;
//! - **handle**: reads the handle channel, runs event handlers, and fires the running
//!   task's abort signal (`Abort`, `Close`);
//! - **event**: reads the parent's answers to relayed events;
//! - **heartbeat**: tells the parent every interval that the process is alive.
//!
//! # Caveats
//!
//! - If any channel closes without a `Close` first, the parent is gone (even a
//!   `SIGKILL`ed parent closes its sockets) and the rank exits at once with
//!   [`EXIT_PARENT_GONE`], even in the middle of a task. This is the one parent-death
//!   check that also works under external launchers.
//! - The service threads (handle, event, heartbeat) are what notice a dead parent while
//!   a task runs. They log to stderr, whose reader may be that dead parent, so logging
//!   ignores write errors; a service thread that panics ends the process with
//!   [`EXIT_INTERNAL`] rather than leave a rank nobody listens for.
//! - A task that ignores its abort signal keeps its thread busy; the parent escalates
//!   to signals after its grace period.
//! - `SIGTERM` keeps its default action (terminate at once). Put cleanup in an
//!   `END_RUN` handler: the parent delivers `END_RUN` before it closes the group.

use rankexec_protocol::error_chain as chain;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rankexec_protocol::env::{self, RankEnv, vars};
use rankexec_protocol::wire::envelope::{self, BlobPolicy};
use rankexec_protocol::wire::message::{Init, Props, RankError, TaskOutput, WireShareable};
use rankexec_protocol::wire::{
    Channel, Endpoint, FrameError, FrameLimits, Identity, Message, Secret, frame::read_frame,
};
use rankexec_protocol::{
    Component, ComponentConfig, ErrorClass, Executor, FlContext, PropFlags, Registry, Shareable,
    Signal, keys,
};
use tracing::{debug, error, info, info_span, warn};

use crate::engine::RankEngine;
use crate::link::Link;
use crate::{errorfile, os};

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

/// Why the rank could not start.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StartupError {
    #[error("cannot determine this rank")]
    RankEnv(#[from] env::RankEnvError),
    #[error("{0} is not set")]
    Missing(&'static str),
    #[error("invalid {0}")]
    Invalid(
        &'static str,
        #[source] Box<dyn std::error::Error + Send + Sync>,
    ),
    #[error("parent process {0} is already gone")]
    ParentGone(u32),
    #[error("cannot connect the {channel} channel to {endpoint}")]
    Connect {
        channel: &'static str,
        endpoint: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{channel} channel handshake failed")]
    Handshake {
        channel: &'static str,
        #[source]
        source: rankexec_protocol::wire::HandshakeError,
    },
    #[error("did not receive Init")]
    NoInit(#[source] FrameError),
    #[error("expected Init, got {0}")]
    NotInit(String),
    #[error("cannot decode Init")]
    BadInit(#[source] rankexec_protocol::wire::codec::CodecError),
    #[error("cannot answer Init")]
    Send(#[from] crate::link::SendError),
}

struct Settings {
    env: RankEnv,
    endpoint: Endpoint,
    secret: Secret,
    launch_id: String,
    connect_timeout: Duration,
    log_dir: Option<PathBuf>,
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

fn settings() -> Result<Settings, StartupError> {
    if let Some(ppid) = var(vars::PARENT_PID).filter(|v| !v.is_empty()) {
        let ppid: u32 = ppid
            .parse()
            .map_err(|e| StartupError::Invalid(vars::PARENT_PID, Box::new(e)))?;
        match os::die_with_parent(ppid) {
            Ok(true) => {}
            Ok(false) => return Err(StartupError::ParentGone(ppid)),
            Err(e) => warn!(error = %e, "cannot set the parent-death signal"),
        }
    }
    let env = env::discover(&var)?;
    let endpoint: Endpoint = var(vars::ENDPOINT)
        .ok_or(StartupError::Missing(vars::ENDPOINT))?
        .parse()
        .map_err(|e| StartupError::Invalid(vars::ENDPOINT, Box::new(e)))?;
    // From an inherited pipe (closed once read) for ranks the executor spawned; the
    // environment is never edited (unsound with threads).
    let secret =
        env::take_secret(&var).map_err(|e| StartupError::Invalid("secret", Box::new(e)))?;
    let launch_id = var(vars::LAUNCH_ID).ok_or(StartupError::Missing(vars::LAUNCH_ID))?;
    let connect_timeout = match var(vars::CONNECT_TIMEOUT_MS) {
        Some(ms) => Duration::from_millis(
            ms.parse()
                .map_err(|e| StartupError::Invalid(vars::CONNECT_TIMEOUT_MS, Box::new(e)))?,
        ),
        None => Duration::from_secs(30),
    };
    Ok(Settings {
        env,
        endpoint,
        secret,
        launch_id,
        connect_timeout,
        log_dir: var(vars::LOG_DIR).map(PathBuf::from),
    })
}

/// Runs this process as a rank with the components of `registry`. Call it from `main`
/// before starting any thread; it returns the process exit code.
pub fn run(registry: Registry) -> std::process::ExitCode {
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
    match serve(settings, dir, registry) {
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

/// Exits the whole process because the parent is gone.
fn parent_gone(channel: &str) -> ! {
    warn!("{channel} channel closed without Close: the parent is gone, exiting");
    std::process::exit(EXIT_PARENT_GONE.into());
}

fn protocol_violation(channel: &str, what: &str) -> ! {
    error!("{channel} channel: protocol violation: {what}");
    errorfile::write("ProtocolError", what, channel);
    std::process::exit(EXIT_PROTOCOL.into());
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

struct Built {
    components: Vec<(String, Component)>,
    executor: Arc<dyn Executor>,
}

fn build(registry: &Registry, init: &Init) -> Result<Built, RankError> {
    let mut components = Vec::with_capacity(init.components.len());
    for wc in &init.components {
        let args: serde_json::Value =
            serde_json::from_str(&wc.args_json).map_err(|e| RankError {
                class: ErrorClass::Protocol,
                message: format!("component `{}`: args are not JSON: {e}", wc.id),
            })?;
        let cfg = ComponentConfig::new(&wc.id, &wc.path, args);
        let built =
            catch_unwind(AssertUnwindSafe(|| registry.build(&cfg))).map_err(|p| RankError {
                class: ErrorClass::Panic,
                message: format!(
                    "component `{}` panicked while building: {}",
                    wc.id,
                    panic_text(&p)
                ),
            })?;
        let component = built.map_err(|e| RankError {
            class: match &e {
                rankexec_protocol::BuildError::Constructor { source, .. } => source.class(),
                _ => ErrorClass::Exception,
            },
            message: chain(&e),
        })?;
        components.push((wc.id.clone(), component));
    }
    let executor = components
        .iter()
        .find(|(id, _)| *id == init.executor_id)
        .ok_or_else(|| RankError {
            class: ErrorClass::Exception,
            message: format!("executor_id `{}` names no component", init.executor_id),
        })?
        .1
        .executor()
        .cloned()
        .ok_or_else(|| RankError {
            class: ErrorClass::Exception,
            message: format!("component `{}` is not an executor", init.executor_id),
        })?;
    Ok(Built {
        components,
        executor,
    })
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
    current: Mutex<Option<(u64, Signal)>>,
    blob_policy_out: BlobPolicy,
}

impl Rank {
    fn rank_ctx(&self, props: Props) -> FlContext {
        let mut ctx = FlContext::from_props(props);
        ctx.set_engine(self.engine.clone());
        for (k, v) in [
            (keys::RANK_NUMBER, self.env.rank),
            (keys::NUM_OF_PROCESSES, self.env.world_size),
        ] {
            ctx.remove_prop(k);
            let _ = ctx.set_prop(k, v, PropFlags::PRIVATE_STICKY);
        }
        ctx
    }

    fn closing(&self) -> bool {
        self.closing.load(Ordering::SeqCst)
    }
}

fn serve(settings: Settings, dir: Option<PathBuf>, registry: Registry) -> Result<u8, StartupError> {
    let exec = Arc::new(connect(&settings, Channel::Exec)?);
    let handle = Arc::new(connect(&settings, Channel::Handle)?);
    let event = Arc::new(connect(&settings, Channel::Event)?);
    debug!("three channels authenticated");

    let frame = read_frame(&exec.conn, &parent_limits()).map_err(StartupError::NoInit)?;
    let init = match envelope::decode(&frame).map_err(StartupError::BadInit)? {
        Message::Init(init) => init,
        other => return Err(StartupError::NotInit(other.kind().to_owned())),
    };
    let prop_text = |k: &str| {
        init.props
            .get(k)
            .and_then(|p| p.value.as_str().map(str::to_owned))
            .unwrap_or_default()
    };
    for link in [&exec, &handle, &event] {
        link.set_max_frame(init.max_frame_bytes);
    }
    let engine = Arc::new(RankEngine::new(
        prop_text(keys::IDENTITY_NAME),
        prop_text(keys::JOB_ID),
        dir.unwrap_or_else(|| PathBuf::from(".")),
        Duration::from_millis(init.event_timeout_ms),
        event.clone(),
    ));
    let built = match build(&registry, &init) {
        Ok(b) => b,
        Err(e) => {
            error!("component build failed: {}", e.message);
            exec.send(&Message::InitAck {
                result: Err(e.clone()),
            })?;
            errorfile::write("BuildError", &e.message, "");
            // Wait for the parent to close the group; it owns the teardown.
            let _ = read_frame(&exec.conn, &parent_limits());
            return Ok(EXIT_STARTUP);
        }
    };
    engine.set_components(built.components.clone());
    let rank = Arc::new(Rank {
        env: settings.env,
        exec,
        handle,
        event,
        engine,
        closing: AtomicBool::new(false),
        current: Mutex::new(None),
        blob_policy_out: BlobPolicy {
            zero_copy_threshold: init.zero_copy_threshold,
            pass_fds: settings.endpoint_is_local(),
        },
    });
    rank.exec.send(&Message::InitAck { result: Ok(()) })?;
    info!(
        world_size = rank.env.world_size,
        components = built.components.len(),
        "rank ready"
    );

    let stop = Signal::new();
    spawn("rx-event", {
        let rank = rank.clone();
        move || event_loop(&rank)
    });
    spawn("rx-heartbeat", {
        let rank = rank.clone();
        let stop = stop.clone();
        let every = Duration::from_millis(init.heartbeat_interval_ms.max(10));
        move || heartbeat_loop(&rank, &stop, every)
    });
    spawn("rx-handle", {
        let rank = rank.clone();
        let components = built.components.clone();
        move || handle_loop(&rank, &components)
    });
    let code = exec_loop(&rank, &built.executor);
    stop.trigger("closing");
    info!("rank closed");
    Ok(code)
}

impl Settings {
    fn endpoint_is_local(&self) -> bool {
        matches!(self.endpoint, Endpoint::Local(_))
    }
}

/// Starts a service thread (handle, event relay, heartbeat). A rank cannot work without
/// them, so one that panics ends the process: the parent then sees the rank exit instead
/// of a rank that no longer answers or notices its parent's death.
fn spawn(name: &str, f: impl FnOnce() + Send + 'static) {
    let span = tracing::Span::current();
    let thread = name.to_owned();
    if let Err(e) = std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            if catch_unwind(AssertUnwindSafe(|| span.in_scope(f))).is_err() {
                error!(thread, "service thread panicked; exiting");
                std::process::exit(EXIT_INTERNAL.into());
            }
        })
    {
        error!(thread = name, error = %e, "cannot start thread");
        std::process::exit(EXIT_STARTUP.into());
    }
}

fn exec_loop(rank: &Rank, executor: &Arc<dyn Executor>) -> u8 {
    loop {
        let frame = match read_frame(&rank.exec.conn, &parent_limits()) {
            Ok(f) => f,
            Err(FrameError::Closed) if rank.closing() => return EXIT_OK,
            Err(FrameError::Closed) => parent_gone("exec"),
            Err(e) => protocol_violation("exec", &chain(&e)),
        };
        let msg = match envelope::decode(&frame) {
            Ok(m) => m,
            Err(e) => protocol_violation("exec", &chain(&e)),
        };
        match msg {
            Message::Execute(x) => {
                let x = *x;
                let input = match envelope::unpack(x.input, &frame.body, frame.fds) {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = rank.exec.send(&Message::TaskResult {
                            task_id: x.task_id,
                            outcome: Err(RankError {
                                class: ErrorClass::Protocol,
                                message: format!("cannot unpack task input: {}", chain(&e)),
                            }),
                        });
                        continue;
                    }
                };
                let signal = Signal::new();
                *rank.current.lock().unwrap_or_else(PoisonError::into_inner) =
                    Some((x.task_id, signal.clone()));
                // Tasks run here, one after another, on this one long-lived thread; the
                // handle thread delivers aborts meanwhile.
                run_task(
                    rank,
                    executor,
                    Job {
                        task_id: x.task_id,
                        task: x.task,
                        props: x.props,
                        input,
                        want_output: x.want_output,
                        signal,
                    },
                );
            }
            Message::Close { reason } => {
                info!(%reason, "close requested");
                rank.closing.store(true, Ordering::SeqCst);
                return EXIT_OK;
            }
            other => protocol_violation("exec", &format!("unexpected {}", other.kind())),
        }
    }
}

fn run_task(rank: &Rank, executor: &Arc<dyn Executor>, job: Job) {
    let span = info_span!("task", task = %job.task, task_id = job.task_id);
    let _enter = span.enter();
    let mut ctx = rank.rank_ctx(job.props);
    let started = std::time::Instant::now();
    // The input's (and output's) mappings are released only after the result is sent:
    // unmapping a large blob is not worth making the parent wait for.
    let input_blobs: Vec<rankexec_protocol::Blob> = job.input.blobs().values().cloned().collect();
    let res = catch_unwind(AssertUnwindSafe(|| {
        executor.execute(&job.task, job.input, &mut ctx, &job.signal)
    }));
    let (outcome, output) = match res {
        // Rank 0 always returns its output; the others only when the executor gathers.
        Ok(Ok(out)) => (
            pack_output(rank, job.want_output || rank.env.rank == 0, &ctx, &out),
            Some(out),
        ),
        Ok(Err(e)) => (
            Err(RankError {
                class: e.class(),
                message: e.chain_text(),
            }),
            None,
        ),
        Err(p) => (
            Err(RankError {
                class: ErrorClass::Panic,
                message: panic_text(&p),
            }),
            None,
        ),
    };
    *rank.current.lock().unwrap_or_else(PoisonError::into_inner) = None;
    match &outcome {
        Ok(_) => debug!(
            elapsed_ms = started.elapsed().as_millis() as u64,
            "task done"
        ),
        Err(e) => warn!(class = %e.class, "task failed: {}", e.message),
    }
    send_result(rank, job.task_id, outcome);
    drop((input_blobs, output));
}

type Packed = (
    TaskOutput,
    Vec<bytes::Bytes>,
    Vec<Arc<std::os::fd::OwnedFd>>,
);

fn pack_output(
    rank: &Rank,
    want: bool,
    ctx: &FlContext,
    out: &Shareable,
) -> Result<Packed, RankError> {
    if !want {
        return Ok((
            TaskOutput {
                props: Props::new(),
                output: WireShareable::default(),
            },
            Vec::new(),
            Vec::new(),
        ));
    }
    let (mut body, mut fds) = (Vec::new(), Vec::new());
    let output =
        envelope::pack(out, rank.blob_policy_out, &mut body, &mut fds).map_err(|e| RankError {
            class: ErrorClass::Exception,
            message: format!("cannot send the task output: {}", chain(&e)),
        })?;
    Ok((
        TaskOutput {
            props: ctx.props().clone(),
            output,
        },
        body,
        fds,
    ))
}

fn send_result(rank: &Rank, task_id: u64, outcome: Result<Packed, RankError>) {
    if let Err(e) = rank.exec.send_task_result(task_id, outcome) {
        if rank.closing() {
            return;
        }
        warn!("cannot send the task result: {}", chain(&e));
    }
}

fn handle_loop(rank: &Rank, components: &[(String, Component)]) {
    loop {
        let frame = match read_frame(&rank.handle.conn, &parent_limits()) {
            Ok(f) => f,
            Err(FrameError::Closed) if rank.closing() => return,
            Err(FrameError::Closed) => parent_gone("handle"),
            Err(e) => protocol_violation("handle", &chain(&e)),
        };
        let msg = match envelope::decode(&frame) {
            Ok(m) => m,
            Err(e) => protocol_violation("handle", &chain(&e)),
        };
        match msg {
            Message::HandleEvent {
                event_id,
                event,
                props,
            } => {
                let span = info_span!("event", event = %event);
                let _enter = span.enter();
                let mut ctx = rank.rank_ctx(props);
                let mut result = Ok(());
                for (id, c) in components {
                    let r = catch_unwind(AssertUnwindSafe(|| {
                        c.handler().handle_event(&event, &mut ctx)
                    }));
                    let err = match r {
                        Ok(Ok(())) => continue,
                        Ok(Err(e)) => RankError {
                            class: e.class(),
                            message: format!("component `{id}`: {}", e.chain_text()),
                        },
                        Err(p) => RankError {
                            class: ErrorClass::Panic,
                            message: format!("component `{id}`: {}", panic_text(&p)),
                        },
                    };
                    result = Err(err);
                    break;
                }
                let reply = Message::EventAck {
                    event_id,
                    result: result.map(|()| ctx.props().clone()),
                };
                if rank.handle.send(&reply).is_err() && !rank.closing() {
                    parent_gone("handle");
                }
            }
            Message::Abort { task_id, reason } => {
                let current = rank.current.lock().unwrap_or_else(PoisonError::into_inner);
                match current.as_ref() {
                    Some((id, signal)) if *id == task_id => {
                        info!(task_id, %reason, "abort requested");
                        signal.trigger(reason);
                    }
                    _ => debug!(task_id, "abort for a task that is not running"),
                }
            }
            Message::Close { reason } => {
                // The exec thread may be inside a task: stop it, then the exec channel's
                // own Close (or its end of file) ends the rank.
                rank.closing.store(true, Ordering::SeqCst);
                if let Some((_, signal)) = rank
                    .current
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .as_ref()
                {
                    signal.trigger(format!("closing: {reason}"));
                }
                return;
            }
            other => protocol_violation("handle", &format!("unexpected {}", other.kind())),
        }
    }
}

fn event_loop(rank: &Rank) {
    loop {
        let frame = match read_frame(&rank.event.conn, &parent_limits()) {
            Ok(f) => f,
            Err(FrameError::Closed) if rank.closing() => {
                rank.engine.fail_all();
                return;
            }
            Err(FrameError::Closed) => parent_gone("event"),
            Err(e) => protocol_violation("event", &chain(&e)),
        };
        match envelope::decode(&frame) {
            Ok(Message::EventReply { request_id, result }) => {
                if !rank.engine.complete(request_id, result) {
                    debug!(request_id, "late event reply ignored");
                }
            }
            Ok(other) => protocol_violation("event", &format!("unexpected {}", other.kind())),
            Err(e) => protocol_violation("event", &chain(&e)),
        }
    }
}

fn heartbeat_loop(rank: &Rank, stop: &Signal, every: Duration) {
    let mut seq = 0u64;
    while !stop.wait_timeout(every) {
        seq += 1;
        if rank.event.send(&Message::Heartbeat { seq }).is_err() {
            if rank.closing() {
                return;
            }
            parent_gone("event");
        }
    }
}

static LAST_PANIC: Mutex<Option<String>> = Mutex::new(None);

/// Records where the last panic happened, so the error sent to the parent names it.
fn install_panic_capture() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let location = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        *LAST_PANIC.lock().unwrap_or_else(PoisonError::into_inner) = Some(location);
        default(info);
    }));
}

fn panic_text(payload: &Box<dyn std::any::Any + Send>) -> String {
    let msg = rankexec_protocol::panic_message(payload.as_ref());
    let location = LAST_PANIC
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take()
        .unwrap_or_default();
    format!("panicked{location}: {msg}")
}
