//! Start-up: the environment, `Init`, building the components, and `serve`, which
//! starts the service threads and runs the exec thread.

use rankexec_protocol::error_chain as chain;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rankexec_protocol::env::{self, RankEnv, vars};
use rankexec_protocol::wire::envelope::{self, BlobPolicy};
use rankexec_protocol::wire::message::{Init, Props, RankError};
use rankexec_protocol::wire::{Channel, Endpoint, FrameError, Message, Secret, frame::read_frame};
use rankexec_protocol::{
    Component, ComponentConfig, ErrorClass, Executor, FlContext, PropFlags, Registry, Signal, keys,
};
use tracing::{debug, error, info, warn};

use crate::engine::RankEngine;
use crate::{errorfile, os};

use super::*;

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

pub(super) struct Settings {
    pub(super) env: RankEnv,
    pub(super) endpoint: Endpoint,
    pub(super) secret: Secret,
    pub(super) launch_id: String,
    pub(super) connect_timeout: Duration,
    pub(super) log_dir: Option<PathBuf>,
}

pub(super) fn var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

pub(super) fn settings() -> Result<Settings, StartupError> {
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

pub(super) struct Built {
    pub(super) components: Vec<(String, Component)>,
    pub(super) executor: Arc<dyn Executor>,
}

pub(super) fn build(registry: &Registry, init: &Init) -> Result<Built, RankError> {
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

impl Rank {
    pub(super) fn rank_ctx(&self, props: Props) -> FlContext {
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

    pub(super) fn closing(&self) -> bool {
        self.closing.load(Ordering::SeqCst)
    }

    pub(super) fn tasks(&self) -> std::sync::MutexGuard<'_, Tasks> {
        self.tasks.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

pub(super) fn serve(
    settings: Settings,
    dir: Option<PathBuf>,
    registry: Registry,
    hook: Option<ExecHook>,
) -> Result<u8, StartupError> {
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
        tasks: Mutex::new(Tasks::default()),
        blob_policy_out: BlobPolicy {
            zero_copy_threshold: init.zero_copy_threshold,
            pass_fds: settings.endpoint_is_local(),
        },
    });
    // The service threads start before the rank says it is ready: glibc's
    // `pthread_create` blocks every signal in the calling thread until the new thread
    // exists, and the last thread started (handle) is the one that acknowledges the
    // parent's first event. Started after `InitAck`, a rank could be reported ready
    // (START_RUN acknowledged, pids printed) while its main thread still had every
    // signal blocked (`SigBlk` 0xfffffffffffbfeff in /proc, issue 32). Nothing is
    // lost in that window (a blocked signal stays pending), but "ready" now means the
    // rank's signal state is final. The parent takes heartbeats whenever they come,
    // and sends events only once every rank acknowledged `Init`.
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
    let (events_tx, events_rx) = crossbeam_channel::bounded(EVENT_QUEUE);
    spawn("rx-events", {
        let rank = rank.clone();
        let components = built.components.clone();
        move || events_loop(&rank, &events_rx, &components)
    });
    spawn("rx-handle", {
        let rank = rank.clone();
        move || handle_loop(&rank, events_tx)
    });
    // Logged before the ack, so the line is in the stderr pipe before the host can
    // send a task: a failure report's stderr tail then starts with it.
    info!(
        world_size = rank.env.world_size,
        components = built.components.len(),
        "rank ready"
    );
    rank.exec.send(&Message::InitAck { result: Ok(()) })?;
    let code = match hook {
        None => exec_loop(&rank, &built.executor),
        Some(hook) => {
            let (done, code) = crate::handoff::oneshot();
            let port = ExecPort::new(rank.clone(), init.executor_id.clone(), done);
            match hook(port) {
                // The caller serves the exec channel; its `Close` (or its end) ends this
                // wait, as the parent's `Close` ends the exec loop.
                Ok(()) => code.wait().unwrap_or(EXIT_INTERNAL),
                Err(port) => {
                    drop(port);
                    exec_loop(&rank, &built.executor)
                }
            }
        }
    };
    stop.trigger("closing");
    info!("rank closed");
    Ok(code)
}

impl Settings {
    pub(super) fn endpoint_is_local(&self) -> bool {
        matches!(self.endpoint, Endpoint::Local(_))
    }
}

/// Starts a service thread (handle, event relay, heartbeat). A rank cannot work without
/// them, so one that panics ends the process: the parent then sees the rank exit instead
/// of a rank that no longer answers or notices its parent's death.
pub(super) fn spawn(name: &str, f: impl FnOnce() + Send + 'static) {
    let span = tracing::Span::current();
    let thread = name.to_owned();
    if let Err(e) = std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            if catch_unwind(AssertUnwindSafe(|| span.in_scope(f))).is_err() {
                os::exit_after(EXIT_INTERNAL, move || {
                    error!(thread, "service thread panicked; exiting");
                });
            }
        })
    {
        let thread = name.to_owned();
        os::exit_after(EXIT_STARTUP, move || {
            error!(thread, error = %e, "cannot start thread");
        });
    }
}
