//! The exec thread: every task, one after another, on one long-lived thread, and its
//! result.

use rankexec_protocol::error_chain as chain;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use rankexec_protocol::wire::envelope::{self};
use rankexec_protocol::wire::message::{Props, RankError, TaskOutput, WireShareable};
use rankexec_protocol::wire::{FrameError, Message, frame::read_frame};
use rankexec_protocol::{ErrorClass, Executor, FlContext, Shareable};
use tracing::{debug, info, info_span, warn};

use super::*;

/// What one frame of the exec channel asked for.
pub(super) enum Step {
    /// Run this task, then answer it with [`finish_task`].
    Run(Job),
    /// The exec channel is done: `Close`, with this exit code.
    Done(u8),
    /// Nothing to run (a task whose input could not be unpacked was answered).
    Next,
}

pub(super) fn exec_loop(rank: &Rank, executor: &Arc<dyn Executor>) -> u8 {
    loop {
        match exec_step(rank) {
            Step::Run(job) => run_task(rank, executor, job),
            Step::Done(code) => return code,
            Step::Next => {}
        }
    }
}

/// Reads and takes up one frame of the exec channel (blocking until it arrives).
pub(super) fn exec_step(rank: &Rank) -> Step {
    let frame = match read_frame(&rank.exec.conn, &parent_limits()) {
        Ok(f) => f,
        Err(FrameError::Closed) if rank.closing() => return Step::Done(EXIT_OK),
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
                    return Step::Next;
                }
            };
            // The handle thread closes under the same lock, so a Close that came
            // while this task was on its way is seen here.
            let signal = {
                let mut tasks = rank.tasks();
                let closing = rank.closing().then_some("closing");
                tasks.start(x.task_id, closing)
            };
            // Tasks run one after another, on one long-lived thread; the handle thread
            // delivers aborts meanwhile.
            Step::Run(Job {
                task_id: x.task_id,
                task: x.task,
                props: x.props,
                input,
                want_output: x.want_output,
                signal,
            })
        }
        Message::Close { reason } => {
            info!(%reason, "close requested");
            rank.closing.store(true, Ordering::SeqCst);
            Step::Done(EXIT_OK)
        }
        other => protocol_violation("exec", &format!("unexpected {}", other.kind())),
    }
}

/// Inputs up to this size are held until the result is sent (see `run_task`).
pub(super) const HOLD_INPUT_MAX: u64 = 64 << 20;

pub(super) fn run_task(rank: &Rank, executor: &Arc<dyn Executor>, job: Job) {
    let span = info_span!("task", task = %job.task, task_id = job.task_id);
    let _enter = span.enter();
    let mut ctx = rank.rank_ctx(job.props);
    let started = std::time::Instant::now();
    // The input's (and output's) mappings are released only after the result is sent:
    // unmapping a large blob is not worth making the parent wait for. Not so for a
    // large model: its memory file is then the executor's to let go as soon as it is
    // done with it (a Client API script copies it and builds its result while the file
    // would still be held: one copy of the model more at the peak). The unmapping itself
    // is done on the protocol's `unmap` thread (`os::release`), not before the reply.
    let input_blobs: Vec<rankexec_protocol::Blob> = if job.input.blob_bytes() < HOLD_INPUT_MAX {
        job.input.blobs().values().cloned().collect()
    } else {
        Vec::new()
    };
    let res = catch_unwind(AssertUnwindSafe(|| {
        executor.execute(&job.task, job.input, &mut ctx, &job.signal)
    }));
    let res = match res {
        Ok(r) => r.map_err(|e| RankError {
            class: e.class(),
            message: e.chain_text(),
        }),
        Err(p) => Err(RankError {
            class: ErrorClass::Panic,
            message: panic_text(&p),
        }),
    };
    finish_task(rank, job.task_id, job.want_output, &ctx, res, started);
    drop(input_blobs);
}

/// Packs and sends a task's result, and marks the rank idle.
pub(super) fn finish_task(
    rank: &Rank,
    task_id: u64,
    want_output: bool,
    ctx: &FlContext,
    res: Result<Shareable, RankError>,
    started: std::time::Instant,
) {
    let (outcome, output) = match res {
        // Rank 0 always returns its output; the others only when the executor gathers.
        Ok(out) => (
            pack_output(rank, want_output || rank.env.rank == 0, ctx, &out),
            Some(out),
        ),
        Err(e) => (Err(e), None),
    };
    rank.tasks().finish();
    match &outcome {
        Ok(_) => debug!(
            elapsed_ms = started.elapsed().as_millis() as u64,
            "task done"
        ),
        Err(e) => warn!(class = %e.class, "task failed: {}", e.message),
    }
    send_result(rank, task_id, outcome);
    drop(output);
}

/// A packed task result: what `Link::send_task_result` sends.
pub(super) use crate::link::PackedOutput as Packed;

pub(super) fn pack_output(
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

pub(super) fn send_result(rank: &Rank, task_id: u64, outcome: Result<Packed, RankError>) {
    if let Err(e) = rank.exec.send_task_result(task_id, outcome) {
        if rank.closing() {
            return;
        }
        warn!("cannot send the task result: {}", chain(&e));
    }
}
