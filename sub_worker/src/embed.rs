//! The rank runtime for a rank written in another language (Python through PyO3).
//!
//! A foreign rank keeps its own main thread for its own code: it starts the runtime on
//! a background thread ([`start`]), which connects, authenticates, builds the
//! components (usually [`Bridge`]s) and then runs exactly as a Rust rank does, with
//! its handle, event and heartbeat threads. Every task a [`Bridge`] receives is handed
//! over a channel to the caller as a [`Task`], which answers through [`Task::reply`].
//! The links and heartbeats never wait for the caller (nor for Python's GIL).
//!
//! # Caveats
//!
//! - The runtime removes the rank's secret from the process environment when it starts
//!   (see [`run`](crate::run)). A foreign thread reading the C environment at that
//!   instant races with it; start the runtime before starting such threads.
//! - A task that is dropped without a reply fails with a clear error; one whose caller
//!   never answers is ended by the executor's task deadline, like any stuck rank.
//! - When the parent disappears, the runtime exits the whole process
//!   ([`EXIT_PARENT_GONE`](crate::EXIT_PARENT_GONE)), whatever the caller is doing.

use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, bounded, select, unbounded};
use rankexec_protocol::{
    ComponentError, EventType, Executor, FlComponent, FlContext, Registry, Shareable, Signal,
};

/// What a task's caller answers: the output and the context to send back, or an error.
pub type Answer = Result<(Shareable, FlContext), ComponentError>;

/// Where a task's answer goes. Dropping it without [`send`](Reply::send) fails the task.
#[derive(Debug)]
pub struct Reply(Sender<Answer>);

impl Reply {
    /// Sends the answer; `false` when the runtime no longer waits for it.
    pub fn send(self, answer: Answer) -> bool {
        self.0.send(answer).is_ok()
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

/// An event handler for a bridge (runs on the rank's handle thread).
pub type EventFn = dyn Fn(&EventType, &mut FlContext) -> Result<(), ComponentError> + Send + Sync;

/// An executor that hands every task to whoever reads the [`Tasks`] channel, and waits
/// for the answer. Build one per component in a [`Registry`] factory.
pub struct Bridge<T> {
    payload: T,
    tx: Sender<Task<T>>,
    events: Option<Arc<EventFn>>,
}

impl<T> Bridge<T> {
    /// A bridge sending tasks into `tx` with `payload`, and handling events with
    /// `events` (none: events are ignored).
    pub fn new(payload: T, tx: Sender<Task<T>>, events: Option<Arc<EventFn>>) -> Self {
        Bridge {
            payload,
            tx,
            events,
        }
    }
}

impl<T: Send + Sync + 'static> FlComponent for Bridge<T> {
    fn handle_event(&self, event: &EventType, ctx: &mut FlContext) -> Result<(), ComponentError> {
        match &self.events {
            Some(f) => f(event, ctx),
            None => Ok(()),
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
        let (tx, rx) = bounded(1);
        self.tx
            .send(Task {
                payload: self.payload.clone(),
                task: task.to_owned(),
                input,
                ctx: ctx.clone(),
                abort: abort.clone(),
                reply: Reply(tx),
            })
            .map_err(|_| ComponentError::failed("the rank's task loop has stopped"))?;
        match rx.recv() {
            Ok(Ok((out, back))) => {
                *ctx = back;
                Ok(out)
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(ComponentError::failed(
                "the task was dropped without a reply",
            )),
        }
    }
}

/// The caller's end: tasks to run, and the runtime's exit code when it stops.
pub struct Tasks<T> {
    rx: Receiver<Task<T>>,
    done: Receiver<u8>,
    code: Option<u8>,
}

/// What [`Tasks::next`] saw.
#[derive(Debug)]
pub enum Next<T> {
    /// A task to run.
    Task(Task<T>),
    /// The runtime stopped with this exit code ([`EXIT_OK`](crate::EXIT_OK) after the
    /// parent's `Close`).
    Stopped(u8),
    /// Nothing within the timeout.
    Idle,
}

impl<T> Tasks<T> {
    /// Waits up to `timeout` for the next task or for the runtime to stop.
    pub fn next(&mut self, timeout: Duration) -> Next<T> {
        if let Some(code) = self.code {
            return Next::Stopped(code);
        }
        select! {
            recv(self.rx) -> t => match t {
                Ok(t) => Next::Task(t),
                // Every bridge is gone: only the runtime's end can follow.
                Err(_) => match self.done.recv_timeout(timeout) {
                    Ok(code) => self.stopped(code),
                    Err(RecvTimeoutError::Timeout) => Next::Idle,
                    Err(RecvTimeoutError::Disconnected) => self.stopped(crate::EXIT_INTERNAL),
                },
            },
            recv(self.done) -> c => self.stopped(c.unwrap_or(crate::EXIT_INTERNAL)),
            default(timeout) => Next::Idle,
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

/// A channel for [`Bridge`]s: give the sender to every bridge, the receiver to [`start`].
pub fn channel<T>() -> (Sender<Task<T>>, Receiver<Task<T>>) {
    unbounded()
}

/// Starts the rank runtime with `registry` on a background thread (`rx-runtime`); tasks
/// sent by its bridges into the channel of `rx` come out of the returned [`Tasks`].
pub fn start<T: Send + 'static>(
    registry: Registry,
    rx: Receiver<Task<T>>,
) -> std::io::Result<Tasks<T>> {
    let (done_tx, done) = bounded(1);
    std::thread::Builder::new()
        .name("rx-runtime".into())
        .spawn(move || {
            let code = exit_code_of(crate::run(registry));
            let _ = done_tx.send(code);
        })?;
    Ok(Tasks {
        rx,
        done,
        code: None,
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
mod tests {
    use super::*;

    #[test]
    fn exit_codes_round_trip() {
        for c in [0u8, 1, 3, 5, 255] {
            assert_eq!(exit_code_of(std::process::ExitCode::from(c)), c);
        }
    }

    #[test]
    fn bridge_hands_the_task_over_and_returns_the_answer() {
        let (tx, rx) = channel::<u32>();
        let bridge = Bridge::new(7u32, tx, None);
        let caller = std::thread::spawn(move || {
            let t = rx.recv().unwrap();
            assert_eq!((t.payload, t.task.as_str()), (7, "train"));
            let mut ctx = t.ctx.clone();
            ctx.set_prop("seen", true, rankexec_protocol::PropFlags::PUBLIC)
                .unwrap();
            t.reply.send(Ok((t.input.with_meta("y", 2), ctx)));
        });
        let mut ctx = FlContext::new();
        let out = bridge
            .execute(
                "train",
                Shareable::new().with_meta("x", 1),
                &mut ctx,
                &Signal::new(),
            )
            .unwrap();
        caller.join().unwrap();
        assert_eq!(out.meta("y").and_then(|v| v.as_i64()), Some(2));
        assert!(ctx.get_prop("seen").is_some());
    }

    #[test]
    fn a_task_dropped_without_reply_fails_the_task() {
        let (tx, rx) = channel::<()>();
        let bridge = Bridge::new((), tx, None);
        let caller = std::thread::spawn(move || drop(rx.recv().unwrap()));
        let err = bridge
            .execute("t", Shareable::new(), &mut FlContext::new(), &Signal::new())
            .unwrap_err();
        caller.join().unwrap();
        assert_eq!(err.message(), "the task was dropped without a reply");
    }
}
