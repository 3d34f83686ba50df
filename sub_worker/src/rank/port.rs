//! The exec channel served by an embedding caller's own thread (a Python rank's main
//! thread), so a task reaches the code that runs it, and its result the parent, without
//! a hop between threads.
//!
//! A Rust rank reads its exec channel and runs each task on one thread. A foreign rank
//! must run its tasks on the caller's thread; handing each task over from an exec
//! thread and its answer back costs two wake-ups per task, which on a machine with
//! fewer cores than ranks is most of an empty task's round trip. With an
//! [`ExecPort`], the caller waits for the exec channel itself (with its other work:
//! [`fd`](ExecPort::fd) can be polled beside other descriptors), reads each frame
//! ([`step`](ExecPort::step)), and answers each task through its [`Finish`], which
//! packs and sends the result from the answering thread.
//!
//! # Caveats
//!
//! - Every read of a frame blocks until the whole frame is in, so call `step` only once
//!   `fd` is readable. A frame's bytes are all consumed by its read (on TCP, a record
//!   never spans two frames), so a readable descriptor is the only sign of a new one.
//! - The handle, events, event and heartbeat threads run as in a Rust rank: aborts,
//!   events and liveness never wait for the caller.
//! - In a process forked from the rank (a `DataLoader` worker), the port and every
//!   [`Finish`] do nothing: the child must not read or answer the parent's tasks.
//! - A frame's read is not interrupted by signals: over TCP, where a large input
//!   streams through the frame, the caller checks for Ctrl-C once the input is in.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::Instant;

use rankexec_protocol::wire::message::RankError;
use rankexec_protocol::{Blob, ComponentError, FlContext, Shareable, Signal};

use super::exec::{Step, exec_step, finish_task};
use super::{EXIT_INTERNAL, Rank};
use crate::handoff::Slot;

/// The exec channel, handed to the caller that serves it. Dropped before the parent's
/// `Close`, the rank ends with [`EXIT_INTERNAL`].
pub struct ExecPort {
    rank: Arc<Rank>,
    executor_id: String,
    pid: u32,
    /// Where the exit code goes once the exec channel is done (the runtime waits).
    done: Option<Slot<u8>>,
}

/// What [`ExecPort::step`] read.
#[derive(Debug)]
pub enum PortStep {
    /// A task to run on this thread; answer it through its [`Finish`].
    Task(PortTask),
    /// The exec channel is done (the parent's `Close`); the runtime stops next.
    Closed,
    /// Nothing for the caller (a frame the runtime answered itself).
    Nothing,
}

/// A task read from the exec channel.
#[derive(Debug)]
pub struct PortTask {
    /// The task name.
    pub task: String,
    /// The input; its large blobs are read-only mappings of shared memory files.
    pub input: Shareable,
    /// The rank's context for this task (bound to the rank's engine).
    pub ctx: FlContext,
    /// The task's abort signal (fired from the handle thread).
    pub abort: Signal,
    /// Where the answer goes.
    pub finish: Finish,
}

/// Answers one task: packs its output and sends the result to the parent. Dropped
/// without [`send`](Finish::send), the task fails with a clear error.
pub struct Finish {
    rank: Arc<Rank>,
    task_id: u64,
    want_output: bool,
    started: Instant,
    pid: u32,
    /// Kept mapped until the result is sent (unmapping is not worth the wait).
    input_blobs: Vec<Blob>,
    sent: bool,
}

impl std::fmt::Debug for Finish {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Finish")
            .field("task_id", &self.task_id)
            .finish()
    }
}

impl ExecPort {
    pub(super) fn new(rank: Arc<Rank>, executor_id: String, done: Slot<u8>) -> Self {
        ExecPort {
            rank,
            executor_id,
            pid: std::process::id(),
            done: Some(done),
        }
    }

    /// The component that runs the tasks.
    pub fn executor_id(&self) -> &str {
        &self.executor_id
    }

    /// The exec channel's descriptor: readable when a frame is on its way.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.rank.exec.conn.as_fd()
    }

    /// Whether the port still serves: not after `Close`, nor in a forked child.
    pub fn is_open(&self) -> bool {
        self.done.is_some() && self.pid == std::process::id()
    }

    /// Reads and takes up the next frame, blocking until it is in: call it once
    /// [`fd`](Self::fd) is readable. Like a Rust rank's exec thread, it ends the
    /// process when the parent is gone or breaks the protocol.
    pub fn step(&mut self) -> PortStep {
        if !self.is_open() {
            return PortStep::Closed;
        }
        match exec_step(&self.rank) {
            Step::Run(job) => {
                // Held until the result is sent, as a Rust rank's are, but for a large
                // model (see `exec::run_task`).
                let input_blobs = if job.input.blob_bytes() < super::exec::HOLD_INPUT_MAX {
                    job.input.blobs().values().cloned().collect()
                } else {
                    Vec::new()
                };
                PortStep::Task(PortTask {
                    ctx: self.rank.rank_ctx(job.props),
                    task: job.task,
                    input: job.input,
                    abort: job.signal,
                    finish: Finish {
                        rank: self.rank.clone(),
                        task_id: job.task_id,
                        want_output: job.want_output,
                        started: Instant::now(),
                        pid: self.pid,
                        input_blobs,
                        sent: false,
                    },
                })
            }
            Step::Done(code) => {
                if let Some(done) = self.done.take() {
                    done.send(code);
                }
                PortStep::Closed
            }
            Step::Next => PortStep::Nothing,
        }
    }
}

impl Drop for ExecPort {
    fn drop(&mut self) {
        if let Some(done) = self.done.take() {
            done.send(EXIT_INTERNAL);
        }
    }
}

impl Finish {
    /// Sends the task's result: the output and the context the task updated, or its
    /// error. Does nothing in a process forked from the rank.
    pub fn send(mut self, answer: Result<(Shareable, FlContext), ComponentError>) {
        self.answer(answer.map_err(|e| RankError {
            class: e.class(),
            message: e.chain_text(),
        }));
    }

    fn answer(&mut self, res: Result<(Shareable, FlContext), RankError>) {
        if std::mem::replace(&mut self.sent, true) || self.pid != std::process::id() {
            return;
        }
        let span = tracing::info_span!("task", task_id = self.task_id);
        let _enter = span.enter();
        let (res, ctx) = match res {
            Ok((out, ctx)) => (Ok(out), ctx),
            Err(e) => (Err(e), FlContext::new()),
        };
        finish_task(
            &self.rank,
            self.task_id,
            self.want_output,
            &ctx,
            res,
            self.started,
        );
        drop(std::mem::take(&mut self.input_blobs));
    }
}

impl Drop for Finish {
    fn drop(&mut self) {
        self.answer(Err(RankError {
            class: rankexec_protocol::ErrorClass::Exception,
            message: "the task was dropped without a reply".to_owned(),
        }));
    }
}
