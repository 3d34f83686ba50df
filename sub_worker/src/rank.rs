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
    Channel, Endpoint, FrameError, FrameLimits, Identity, Message, Secret, client_handshake,
    frame::read_frame,
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
    let conn = settings
        .endpoint
        .connect(settings.connect_timeout)
        .map_err(|source| StartupError::Connect {
            channel: channel.as_str(),
            endpoint: settings.endpoint.to_string(),
            source,
        })?;
    let who = Identity {
        channel,
        rank: settings.env.rank,
        world_size: settings.env.world_size,
        launch_id: settings.launch_id.clone(),
        pid: os::pid(),
        pgid: os::pgid(),
        host: os::hostname(),
    };
    client_handshake(&conn, &settings.secret, &who, settings.connect_timeout).map_err(
        |source| StartupError::Handshake {
            channel: channel.as_str(),
            source,
        },
    )?;
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
    tasks: Mutex<Tasks>,
    blob_policy_out: BlobPolicy,
}

/// The most aborts remembered for tasks whose Execute is still on its way.
const MAX_EARLY_ABORTS: usize = 64;

/// Which task runs, and aborts that arrived before their task started.
///
/// The handle thread can read an `Abort` while the exec thread is still reading that
/// task's `Execute` (a large input takes a while to arrive and map). Task ids only
/// grow, so an abort for an id above the last one started is for a task still on its
/// way: it is remembered and fires the task's signal as the task starts, instead of
/// being dropped.
#[derive(Default)]
struct Tasks {
    current: Option<(u64, Signal)>,
    /// The highest task id the exec thread has taken up.
    last_started: u64,
    /// Reasons of aborts for ids above `last_started`.
    early: std::collections::BTreeMap<u64, String>,
}

impl Tasks {
    /// Registers task `id` and returns its signal, already triggered if an abort for it
    /// came first (or the group is closing).
    fn start(&mut self, id: u64, closing: Option<&str>) -> Signal {
        let signal = Signal::new();
        self.last_started = self.last_started.max(id);
        if let Some(reason) = self.early.remove(&id) {
            info!(task_id = id, %reason, "abort arrived before the task started; starting it aborted");
            signal.trigger(reason);
        } else if let Some(reason) = closing {
            signal.trigger(reason.to_owned());
        }
        let last = self.last_started;
        self.early.retain(|k, _| *k > last);
        self.current = Some((id, signal.clone()));
        signal
    }

    /// Marks task `id` taken up without running it (its input could not be unpacked).
    fn skip(&mut self, id: u64) {
        self.last_started = self.last_started.max(id);
        let last = self.last_started;
        self.early.retain(|k, _| *k > last);
    }

    fn finish(&mut self) {
        self.current = None;
    }

    /// Fires the running task's signal, or remembers an abort for a task on its way.
    fn abort(&mut self, id: u64, reason: String) {
        match &self.current {
            Some((current, signal)) if *current == id => {
                info!(task_id = id, %reason, "abort requested");
                signal.trigger(reason);
            }
            _ if id > self.last_started => {
                debug!(task_id = id, "abort for a task not started yet; remembered");
                if self.early.len() >= MAX_EARLY_ABORTS {
                    self.early.pop_first();
                }
                self.early.insert(id, reason);
            }
            _ => debug!(task_id = id, "abort for a task that already ended"),
        }
    }

    /// Fires the running task's signal because the group closes.
    fn close(&mut self, reason: &str) {
        if let Some((_, signal)) = &self.current {
            signal.trigger(format!("closing: {reason}"));
        }
    }
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

    fn tasks(&self) -> std::sync::MutexGuard<'_, Tasks> {
        self.tasks.lock().unwrap_or_else(PoisonError::into_inner)
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
        tasks: Mutex::new(Tasks::default()),
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
                        rank.tasks().skip(x.task_id);
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
                // The handle thread closes under the same lock, so a Close that came
                // while this task was on its way is seen here.
                let signal = {
                    let mut tasks = rank.tasks();
                    let closing = rank.closing().then_some("closing");
                    tasks.start(x.task_id, closing)
                };
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
    rank.tasks().finish();
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
    let (msg, body, fds) = match outcome {
        Ok((out, body, fds)) => (
            Message::TaskResult {
                task_id,
                outcome: Ok(out),
            },
            body,
            fds,
        ),
        Err(e) => (
            Message::TaskResult {
                task_id,
                outcome: Err(e),
            },
            Vec::new(),
            Vec::new(),
        ),
    };
    let sent = envelope::frame(&msg, body, fds)
        .map_err(|e| chain(&e))
        .and_then(|f| {
            rank.exec
                .send_frame("TaskResult", &f)
                .map_err(|e| chain(&e))
        });
    if let Err(e) = sent {
        if rank.closing() {
            return;
        }
        warn!("cannot send the task result: {e}");
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
            Message::Abort { task_id, reason } => rank.tasks().abort(task_id, reason),
            Message::Close { reason } => {
                // The exec thread may be inside a task: stop it, then the exec channel's
                // own Close (or its end of file) ends the rank.
                let mut tasks = rank.tasks();
                rank.closing.store(true, Ordering::SeqCst);
                tasks.close(&reason);
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

#[cfg(test)]
mod tests {
    use super::Tasks;

    #[test]
    fn abort_before_the_task_starts_is_kept_and_fires_at_start() {
        let mut t = Tasks::default();
        t.abort(1, "early".into());
        let s = t.start(1, None);
        assert_eq!(s.reason().as_deref(), Some("early"));
        t.finish();
        // The next task starts clean.
        assert!(!t.start(2, None).is_triggered());
    }

    #[test]
    fn abort_of_a_running_task_fires_and_stale_ones_are_ignored() {
        let mut t = Tasks::default();
        let s = t.start(5, None);
        t.abort(4, "stale".into());
        assert!(!s.is_triggered());
        assert!(t.early.is_empty(), "an abort for an ended task is not kept");
        t.abort(5, "now".into());
        assert_eq!(s.reason().as_deref(), Some("now"));
    }

    #[test]
    fn early_aborts_are_bounded_and_pruned() {
        let mut t = Tasks::default();
        for id in 1..=200 {
            t.abort(id, format!("a{id}"));
        }
        assert_eq!(t.early.len(), super::MAX_EARLY_ABORTS);
        t.start(190, None);
        assert!(t.early.keys().all(|k| *k > 190));
        t.skip(200);
        assert!(t.early.is_empty());
    }

    #[test]
    fn a_task_that_starts_while_closing_starts_aborted() {
        let mut t = Tasks::default();
        assert!(t.start(1, Some("closing")).is_triggered());
    }
}
