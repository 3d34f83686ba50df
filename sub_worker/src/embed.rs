//! The rank runtime for a rank written in another language (Python through PyO3).
//!
//! A foreign rank keeps its own main thread for its own code: it starts the runtime on
//! a background thread ([`start`]), which connects, authenticates and then runs exactly
//! as a Rust rank does, with its handle, events, event and heartbeat threads. The
//! foreign code itself runs only on the caller's thread (the one calling
//! [`Tasks::next`]): the runtime sends it [`Request`]s over one channel and waits for
//! each answer:
//!
//! - [`Build`]: build a component ([`build_on_caller`], from a [`Registry`] factory);
//!   the answer becomes a [`Bridge`];
//! - [`Event`]: a [`Bridge`]'s component handles an event;
//! - [`Task`]: a [`Bridge`]'s component runs a task; answered through [`Task::reply`].
//!
//! Once the rank is ready, the caller also serves the exec channel itself
//! ([`ExecPort`]): [`Tasks::next`] waits for the next task on the exec socket and for
//! requests at once, and [`Reply::send`] packs and sends the result from the caller's
//! thread. A task thus costs no wake-up of another thread, as in a Rust rank (each
//! hand-over costs two, and on a machine with fewer cores than ranks they were most of
//! an empty task's round trip). An executor that is not a bridge made here gets its
//! tasks on the runtime's thread, through [`Bridge::execute`] if it is one.
//!
//! So state a library ties to a thread (a CUDA device, grad mode, signal handlers,
//! thread-locals, an event loop) set while building or in an event handler holds in
//! every task. The links, aborts and heartbeats never wait for the caller (nor for
//! Python's GIL).
//!
//! # Caveats
//!
//! - Start the runtime once per process, early: it reads the rank's secret when it
//!   starts (from the inherited pipe the executor passes, which it then closes), and a
//!   foreign runtime that closes or reuses inherited descriptors before that would cut
//!   the rank off.
//! - Requests are served one at a time, in order: an event that arrives while a task
//!   runs waits for the task to end (the task's abort signal does not wait: it fires
//!   from the handle thread). A caller that does not call [`Tasks::next`] holds every
//!   build and event up; the executor's start-up and event deadlines bound that.
//! - Events a task fires itself reach the rank's bridges on the thread waiting for
//!   that fire ([`fire_local`]), which must serve them: its own thread cannot serve
//!   the channel meanwhile.
//! - A task that is dropped without a reply fails with a clear error; one whose caller
//!   never answers is ended by the executor's task deadline, like any stuck rank.
//! - When the parent disappears, the runtime ends the whole process at once
//!   ([`EXIT_PARENT_GONE`](crate::EXIT_PARENT_GONE), with `_exit`: no `atexit` handler
//!   runs), whatever the caller is doing.
//! - A process forked from the rank is not the rank: its [`Tasks::next`] answers
//!   [`Next::Stopped`] at once, and a task's [`Reply`] does nothing there.

use std::any::Any;
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::handoff::{self, Bell};
use crate::rank::{ExecPort, Finish, PortStep};
use crossbeam_channel::{Receiver, Sender, TryRecvError, bounded, unbounded};
use rankexec_protocol::{
    Component, ComponentConfig, ComponentError, Engine, EventType, Executor, FireEventError,
    FlComponent, FlContext, Registry, Shareable, Signal,
};

/// What a task's caller answers: the output and the context to send back, or an error.
pub type Answer = Result<(Shareable, FlContext), ComponentError>;

/// Where a task's answer goes. Dropping it without [`send`](Reply::send) fails the task.
#[derive(Debug)]
pub struct Reply(ReplyTo);

#[derive(Debug)]
enum ReplyTo {
    /// To the runtime's thread, waiting in [`Bridge::execute`].
    Bridge(handoff::Slot<Answer>),
    /// Straight to the parent, from this thread (the caller serves the exec channel).
    Parent(Finish),
}

impl Reply {
    /// Sends the answer; `false` when the runtime no longer waits for it.
    pub fn send(self, answer: Answer) -> bool {
        match self.0 {
            ReplyTo::Bridge(slot) => slot.send(answer),
            ReplyTo::Parent(finish) => {
                finish.send(answer);
                true
            }
        }
    }
}

/// A task handed to the caller by a [`Bridge`].
#[derive(Debug)]
pub struct Task<T> {
    /// The bridge's payload (for example the foreign component object).
    pub payload: T,
    /// The task name.
    pub task: String,
    /// The input; its large blobs are read-only mappings of shared memory files.
    pub input: Shareable,
    /// The rank's context for this task (bound to the rank's engine).
    pub ctx: FlContext,
    /// The task's abort signal.
    pub abort: Signal,
    /// Where the answer goes.
    pub reply: Reply,
}

/// A component the caller built: its payload, and what the bridge serves.
#[derive(Debug)]
pub struct Built<T> {
    /// The payload every task and event of this component carries.
    pub payload: T,
    /// Whether it runs tasks (an executor) or only handles events.
    pub executor: bool,
    /// Whether its events go to the caller (otherwise they are acknowledged at once).
    pub handles_events: bool,
}

/// A request to build a component on the caller's thread.
#[derive(Debug)]
pub struct Build<T> {
    /// The component's id, path and arguments.
    pub config: ComponentConfig,
    /// Where the answer goes; dropped unanswered, the build fails.
    pub reply: Sender<Result<Built<T>, ComponentError>>,
}

/// An event for a bridge's component, handled on the caller's thread.
#[derive(Debug)]
pub struct Event<T> {
    /// The bridge's payload.
    pub payload: T,
    /// The event.
    pub event: EventType,
    /// The rank's context for this event.
    pub ctx: FlContext,
    /// Where the context the handler updated goes, or its error; dropped unanswered,
    /// the event fails.
    pub reply: Sender<Result<FlContext, ComponentError>>,
}

/// What the runtime asks of the caller.
#[derive(Debug)]
pub enum Request<T> {
    /// Build a component.
    Build(Build<T>),
    /// Handle an event.
    Event(Event<T>),
    /// Run a task.
    Task(Task<T>),
}

/// Where [`Request`]s for the caller go: a channel, and the bell that wakes the caller
/// ([`Tasks::next`]) without spinning. Make one with [`channel`].
pub struct Requests<T> {
    tx: Sender<Request<T>>,
    bell: Arc<Bell>,
    /// The payload of every component built, by id: the caller that serves the exec
    /// channel itself gives each task the executor's.
    payloads: Arc<Mutex<HashMap<String, T>>>,
}

impl<T> Clone for Requests<T> {
    fn clone(&self) -> Self {
        Requests {
            tx: self.tx.clone(),
            bell: self.bell.clone(),
            payloads: self.payloads.clone(),
        }
    }
}

impl<T> Requests<T> {
    /// A bridge for the component `id`, sending its requests here with `payload` (see
    /// [`Bridge::new`]). Its tasks carry `payload` also when the caller serves the exec
    /// channel itself.
    pub fn bridge(&self, id: &str, payload: T, handles_events: bool) -> Bridge<T>
    where
        T: Clone,
    {
        self.payloads
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id.to_owned(), payload.clone());
        Bridge::new(payload, self.clone(), handles_events)
    }

    /// Queues `request` and wakes the caller; `false` (the request dropped) when the
    /// caller is gone.
    pub fn send(&self, request: Request<T>) -> bool {
        if self.tx.send(request).is_err() {
            return false;
        }
        self.bell.ring();
        true
    }
}

/// The caller's end of [`channel`]; give it to [`start`].
pub struct Inbox<T> {
    rx: Receiver<Request<T>>,
    bell: Arc<Bell>,
    payloads: Arc<Mutex<HashMap<String, T>>>,
}

/// An executor (and event handler) that hands every task and event to whoever reads
/// the [`Tasks`] channel, and waits for the answer. [`build_on_caller`] makes them.
pub struct Bridge<T> {
    payload: T,
    tx: Requests<T>,
    handles_events: bool,
}

impl<T> Bridge<T> {
    /// A bridge sending its requests into `tx` with `payload`; events are acknowledged
    /// without asking the caller unless `handles_events`.
    pub fn new(payload: T, tx: Requests<T>, handles_events: bool) -> Self {
        Bridge {
            payload,
            tx,
            handles_events,
        }
    }
}

thread_local! {
    /// Where this thread's [`fire_local`] wants the bridges' events (a
    /// `Sender<Request<T>>`), instead of the caller's channel.
    static LOCAL: RefCell<Option<Box<dyn Any>>> = const { RefCell::new(None) };
}

/// Clears [`LOCAL`] when [`fire_local`] ends, even by a panic.
struct LocalGuard;

impl Drop for LocalGuard {
    fn drop(&mut self) {
        LOCAL.with(|l| l.borrow_mut().take());
    }
}

/// Fires `event` through `engine` from this thread, sending the events the rank's own
/// bridges must handle into `local` rather than the caller's channel. Use it for an
/// event fired by the caller (from a task or a handler): the caller waits for this fire
/// and cannot read its channel meanwhile, so it serves `local` while it waits.
pub fn fire_local<T: Send + 'static>(
    engine: &dyn Engine,
    event: &EventType,
    ctx: &mut FlContext,
    local: Sender<Request<T>>,
) -> Result<(), FireEventError> {
    LOCAL.with(|l| *l.borrow_mut() = Some(Box::new(local)));
    let _guard = LocalGuard;
    engine.fire_event(event, ctx)
}

impl<T: Clone + Send + Sync + 'static> FlComponent for Bridge<T> {
    fn handle_event(&self, event: &EventType, ctx: &mut FlContext) -> Result<(), ComponentError> {
        if !self.handles_events {
            return Ok(());
        }
        let (tx, rx) = bounded(1);
        let request = Request::Event(Event {
            payload: self.payload.clone(),
            event: event.clone(),
            ctx: ctx.clone(),
            reply: tx,
        });
        let local = LOCAL.with(|l| {
            l.borrow()
                .as_ref()
                .and_then(|b| b.downcast_ref::<Sender<Request<T>>>().cloned())
        });
        let sent = match local {
            Some(local) => local.send(request).is_ok(),
            None => self.tx.send(request),
        };
        if !sent {
            return Err(ComponentError::failed("the rank's task loop has stopped"));
        }
        // No deadline of its own: the caller answers once its running task (if any)
        // ends; the executor's event deadline bounds a caller that never does.
        match rx.recv() {
            Ok(Ok(back)) => {
                *ctx = back;
                Ok(())
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(ComponentError::failed(
                "the event was dropped without an answer",
            )),
        }
    }
}

impl<T: Clone + Send + Sync + 'static> Executor for Bridge<T> {
    fn execute(
        &self,
        task: &str,
        input: Shareable,
        ctx: &mut FlContext,
        abort: &Signal,
    ) -> Result<Shareable, ComponentError> {
        // Parks at once while the caller runs the task (no spinning: see `handoff`).
        let (tx, rx) = handoff::oneshot();
        let sent = self.tx.send(Request::Task(Task {
            payload: self.payload.clone(),
            task: task.to_owned(),
            input,
            ctx: ctx.clone(),
            abort: abort.clone(),
            reply: Reply(ReplyTo::Bridge(tx)),
        }));
        if !sent {
            return Err(ComponentError::failed("the rank's task loop has stopped"));
        }
        match rx.wait() {
            Some(Ok((out, back))) => {
                *ctx = back;
                Ok(out)
            }
            Some(Err(e)) => Err(e),
            None => Err(ComponentError::failed(
                "the task was dropped without a reply",
            )),
        }
    }
}

/// Asks the caller to build the component `config` (from a [`Registry`] factory, on
/// the runtime's thread) and waits for it: the caller's [`Tasks::next`] returns the
/// [`Build`]. The component is a [`Bridge`] to what the caller built.
pub fn build_on_caller<T: Clone + Send + Sync + 'static>(
    tx: &Requests<T>,
    config: &ComponentConfig,
) -> Result<Component, ComponentError> {
    let (reply, rx) = bounded(1);
    if !tx.send(Request::Build(Build {
        config: config.clone(),
        reply,
    })) {
        return Err(ComponentError::failed("the rank's task loop has stopped"));
    }
    // No deadline of its own: the executor's start-up deadline ends a rank whose caller
    // never serves its channel.
    let built = rx
        .recv()
        .map_err(|_| ComponentError::failed("the build was dropped without an answer"))??;
    let bridge = tx.bridge(&config.id, built.payload, built.handles_events);
    Ok(if built.executor {
        Component::Executor(std::sync::Arc::new(bridge))
    } else {
        Component::Handler(std::sync::Arc::new(bridge))
    })
}

/// The caller's end: requests to serve, and the runtime's exit code when it stops.
pub struct Tasks<T> {
    rx: Receiver<Request<T>>,
    /// Rung after every request, the exec port's arrival, and when the runtime stops.
    bell: Arc<Bell>,
    done: Receiver<u8>,
    code: Option<u8>,
    /// The exec channel and the executor's payload, once the rank is ready.
    ports: Receiver<(ExecPort, T)>,
    port: Option<(ExecPort, T)>,
    /// The rank's process: a process forked from it is not the rank.
    pid: u32,
}

/// What [`Tasks::next`] saw.
#[derive(Debug)]
pub enum Next<T> {
    /// A request to serve on this thread.
    Request(Request<T>),
    /// The runtime stopped with this exit code ([`EXIT_OK`](crate::EXIT_OK) after the
    /// parent's `Close`).
    Stopped(u8),
    /// Nothing within the timeout.
    Idle,
}

impl<T: Clone> Tasks<T> {
    /// Waits up to `timeout` for the next request or for the runtime to stop. Requests
    /// come first: the runtime stops only after its last request was answered. In a
    /// process forked from the rank (a task's `fork()` whose child carries on in the
    /// caller's loop) it answers [`EXIT_INTERNAL`](crate::EXIT_INTERNAL) at once: the
    /// child must not take the rank's requests or tasks.
    pub fn next(&mut self, timeout: Duration) -> Next<T> {
        let deadline = Instant::now() + timeout;
        if self.code.is_none() && self.pid != std::process::id() {
            self.code = Some(crate::EXIT_INTERNAL);
        }
        loop {
            if let Some(code) = self.code {
                return Next::Stopped(code);
            }
            // Every bridge gone (Disconnected): only the runtime's end can follow.
            if let Ok(t) = self.rx.try_recv() {
                return Next::Request(t);
            }
            if let Ok(port) = self.ports.try_recv() {
                self.port = Some(port);
            }
            match self.done.try_recv() {
                Ok(code) => return self.stopped(code),
                Err(TryRecvError::Disconnected) => return self.stopped(crate::EXIT_INTERNAL),
                Err(TryRecvError::Empty) => {}
            }
            // Senders ring after they queue, so a request queued since the look above
            // has rung already and these waits return at once.
            let Some((port, payload)) = self.port.as_mut().filter(|(p, _)| p.is_open()) else {
                if !self.bell.wait_until(deadline) {
                    return Next::Idle;
                }
                continue;
            };
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Next::Idle;
            }
            // An error (none is expected): the wait lasts its time, never a spin.
            let Ok([rang, exec]) = crate::os::wait_readable([self.bell.fd(), port.fd()], left)
            else {
                std::thread::sleep(left);
                return Next::Idle;
            };
            if rang {
                self.bell.take();
            }
            if exec {
                match port.step() {
                    PortStep::Task(t) => {
                        return Next::Request(Request::Task(Task {
                            payload: payload.clone(),
                            task: t.task,
                            input: t.input,
                            ctx: t.ctx,
                            abort: t.abort,
                            reply: Reply(ReplyTo::Parent(t.finish)),
                        }));
                    }
                    // The runtime stops next and rings.
                    PortStep::Closed | PortStep::Nothing => {}
                }
            }
        }
    }

    fn stopped(&mut self, code: u8) -> Next<T> {
        self.code = Some(code);
        Next::Stopped(code)
    }

    /// The exit code, once the runtime has stopped.
    pub fn exit_code(&self) -> Option<u8> {
        self.code
    }
}

/// A channel for [`Bridge`]s: give the sender to the registry's factories, the inbox
/// to [`start`].
pub fn channel<T>() -> std::io::Result<(Requests<T>, Inbox<T>)> {
    let (tx, rx) = unbounded();
    let bell = Arc::new(Bell::new()?);
    let payloads = Arc::new(Mutex::new(HashMap::new()));
    Ok((
        Requests {
            tx,
            bell: bell.clone(),
            payloads: payloads.clone(),
        },
        Inbox { rx, bell, payloads },
    ))
}

/// Starts the rank runtime with `registry` on a background thread (`rx-runtime`);
/// requests sent into the channel of `inbox` come out of the returned [`Tasks`]. Once
/// the rank is ready, the caller serves the exec channel itself (in [`Tasks::next`]),
/// when its executor was made by [`build_on_caller`] or [`Requests::bridge`]: each
/// task then reaches the caller, and its answer the parent, without a thread hop.
pub fn start<T: Clone + Send + 'static>(
    registry: Registry,
    inbox: Inbox<T>,
) -> std::io::Result<Tasks<T>> {
    let (done_tx, done) = bounded(1);
    let (ports_tx, ports) = bounded(1);
    let bell = inbox.bell.clone();
    let hook: crate::rank::ExecHook = Box::new({
        let bell = inbox.bell.clone();
        let payloads = inbox.payloads;
        move |port: ExecPort| {
            let payload = payloads
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(port.executor_id())
                .cloned();
            let Some(payload) = payload else {
                return Err(port);
            };
            ports_tx
                .send((port, payload))
                .map_err(|e| e.into_inner().0)?;
            bell.ring();
            Ok(())
        }
    });
    std::thread::Builder::new()
        .name("rx-runtime".into())
        .spawn(move || {
            let code = exit_code_of(crate::rank::run_with(registry, Some(hook)));
            let _ = done_tx.send(code);
            bell.ring();
        })?;
    Ok(Tasks {
        rx: inbox.rx,
        bell: inbox.bell,
        done,
        code: None,
        ports,
        port: None,
        pid: std::process::id(),
    })
}

/// Runs the worker command line ([`main_with_args`](crate::main_with_args)) and returns
/// its exit code as a number, for a foreign `main` to exit with.
pub fn cli(registry: Registry, args: Vec<String>) -> u8 {
    exit_code_of(crate::main_with_args(registry, args))
}

/// The number behind an [`ExitCode`](std::process::ExitCode) made from a `u8` (std
/// offers no getter).
fn exit_code_of(code: std::process::ExitCode) -> u8 {
    (0..=u8::MAX)
        .find(|&c| std::process::ExitCode::from(c) == code)
        .unwrap_or(crate::EXIT_INTERNAL)
}

#[cfg(test)]
#[path = "embed_tests.rs"]
mod tests;
