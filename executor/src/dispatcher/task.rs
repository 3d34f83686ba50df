//! Tasks: packing (on the work thread), fan-out, aborts, results, the gather reduce
//! (on the work thread), the abort grace and the task deadline.

use std::sync::Arc;
use std::time::Instant;

use rankexec_protocol::wire::envelope::{self, BlobPolicy};
use rankexec_protocol::wire::message::{Execute, Props, RankError};
use rankexec_protocol::wire::{Channel, Message};
use rankexec_protocol::{ErrorClass, Shareable};
use tracing::{debug, info, info_span, warn};

use crate::config::ResultPolicy;
use crate::error::{ExecuteError, FailureCause, RankFailure};
use crate::result::reduce;

use super::state::*;

/// Inputs with fewer blob bytes than this are packed on the dispatcher thread.
const INLINE_PACK_BYTES: u64 = 64 << 10;

/// The bytes packing `input` copies: every blob's for links without descriptors
/// (`inline_links`), else only the blobs not already in a sealed memory file.
pub(super) fn bytes_to_copy(input: &Shareable, inline_links: bool) -> u64 {
    input
        .blobs()
        .values()
        .filter(|b| inline_links || !b.is_shared())
        .map(|b| b.len() as u64)
        .sum()
}

impl Dispatcher {
    pub(super) fn cmd_execute(&mut self, mut c: ExecuteCmd) {
        if self.finalized {
            let _ = c.reply.send(Err(ExecuteError::Finalized));
            return;
        }
        if let Some(err) = self.deferred.take()
            && let Some(err) = self.absorb_idle_death(&mut c, err)
        {
            let _ = c.reply.send(Err(err));
            return;
        }
        if c.abort.is_triggered() {
            let _ = c.reply.send(Err(ExecuteError::Aborted {
                task: c.task.clone(),
                reason: c.abort.reason().unwrap_or_default(),
                forced: false,
            }));
            return;
        }
        if self.group.is_none() {
            let after_failure = self.consecutive_failures > 0;
            self.request_launch(Waiter::Execute(c), after_failure);
            return;
        }
        self.start_task(c);
    }

    pub(super) fn start_task(&mut self, mut c: ExecuteCmd) {
        let Some(g) = &self.group else { return };
        let id = self.next_task_id;
        self.next_task_id += 1;
        let span = info_span!("task", task = %c.task, task_id = id);
        let world = self.cfg.num_of_processes;
        // One frame per carrier kind, encoded once (off this thread: it copies large
        // blobs into memory files) and written to every rank when it comes back.
        let mut needed = [false; 2];
        for link in &g.links {
            needed[usize::from(!link.passes_fds())] = true;
        }
        let spec = PackSpec {
            task_id: id,
            task: c.task.clone(),
            props: c.props.clone(),
            input: c.input.clone(),
            want_output: self.cfg.result.gathers(&c.task),
            needed,
            zero_copy_threshold: self.cfg.zero_copy_threshold.bytes(),
        };
        let generation = g.generation;
        // Inputs with little to copy are packed here: a hop to the work thread would
        // cost more than the packing. A blob already in a sealed memory file is passed
        // as its descriptor to ranks that take descriptors (nothing to copy); a link
        // without descriptors (TCP) carries every blob's bytes in the frame.
        let inline = bytes_to_copy(&c.input, needed[1]) < INLINE_PACK_BYTES;
        let packed_here = if inline {
            Some(spec.pack())
        } else {
            let tx = self.ev_tx.clone();
            self.work.run(move || {
                let frames = spec.pack();
                let _ = tx.send((
                    generation,
                    Report::Packed {
                        task_id: spec.task_id,
                        frames,
                    },
                ));
            });
            None
        };
        let tx = self.ev_tx.clone();
        let sub = c.abort.on_trigger({
            let abort = c.abort.clone();
            move || {
                let reason = abort.reason().unwrap_or_else(|| "aborted".to_owned());
                let _ = tx.send((
                    generation,
                    Report::AbortTask {
                        task_id: id,
                        reason,
                    },
                ));
            }
        });
        span.in_scope(|| debug!(ranks = world, "task packing"));
        // A retried task keeps the deadline of its first run.
        let deadline = *c
            .deadline
            .get_or_insert_with(|| Instant::now() + self.cfg.deadlines.task.0);
        self.task = Some(TaskOp {
            id,
            deadline,
            // A rank that does not get the task (`rank0_only`) has answered already.
            results: (0..world as usize)
                .map(|r| {
                    (!self.cfg.result.delivers_to(r)).then(|| Ok((Props::new(), Shareable::new())))
                })
                .collect(),
            aborting: None,
            _sub: sub,
            span,
            cmd: c,
            sent: None,
            settle: None,
        });
        if let Some(frames) = packed_here {
            self.on_packed(id, frames);
        }
    }

    /// The task's frames are packed: send them, unless the task ended meanwhile.
    pub(super) fn on_packed(&mut self, task_id: u64, frames: Result<Frames, ExecuteError>) {
        let current = self
            .task
            .as_ref()
            .is_some_and(|t| t.id == task_id && t.sent.is_none());
        let (Some(g), true) = (&self.group, current) else {
            // Memory files are freed off this thread too.
            drop(frames.map(crate::reclaim::Deferred::new));
            return;
        };
        let frames = match frames {
            Ok(f) => f,
            Err(e) => {
                if let Some(t) = self.task.take() {
                    let _ = t.cmd.reply.send(Err(e));
                }
                return;
            }
        };
        for (rank, link) in g.links.iter().enumerate() {
            if !self.cfg.result.delivers_to(rank) {
                continue;
            }
            if let Some(f) = &frames[usize::from(!link.passes_fds())] {
                link.send(Channel::Exec, f.clone());
            }
        }
        let retries = self.cfg.restart.retry_task > 0;
        if let Some(t) = &mut self.task {
            t.span.in_scope(|| debug!("task sent"));
            if retries {
                t.sent = Some(crate::reclaim::Deferred::new(frames));
            } else {
                // Nothing will send this input again: its memory files go with the
                // frames (the writers hold them until written), so a large model's
                // pages live only as long as the ranks map them, and a rank that copies
                // its input and lets go of it frees them before it builds its result.
                let input = std::mem::take(&mut t.cmd.input);
                drop(crate::reclaim::Deferred::new((input, frames)));
                t.sent = Some(crate::reclaim::Deferred::new([None, None]));
            }
        }
    }

    pub(super) fn send_abort(&self, task_id: u64, reason: &str) {
        let Some(g) = &self.group else { return };
        let Some(t) = &self.task else { return };
        let frame = match envelope::plain(&Message::Abort {
            task_id,
            reason: reason.to_owned(),
        }) {
            Ok(f) => Arc::new(f),
            Err(_) => return,
        };
        for (rank, link) in g.links.iter().enumerate() {
            if t.results[rank].is_none() {
                link.send(Channel::Handle, frame.clone());
            }
        }
    }

    pub(super) fn abort_task(&mut self, task_id: u64, reason: String) {
        let Some(t) = &mut self.task else { return };
        if t.id != task_id {
            return;
        }
        if t.sent.is_none() {
            // No rank has seen the task: it ends here.
            if let Some(t) = self.task.take() {
                t.span
                    .in_scope(|| info!(%reason, "task aborted before it was sent"));
                let _ = t.cmd.reply.send(Err(ExecuteError::Aborted {
                    task: t.cmd.task,
                    reason,
                    forced: false,
                }));
            }
            return;
        }
        match &mut t.aborting {
            Some(a) => {
                a.by_user = true;
                return;
            }
            None => {
                t.aborting = Some(Aborting {
                    reason: reason.clone(),
                    deadline: Instant::now() + self.cfg.deadlines.abort_grace.0,
                    by_user: true,
                });
            }
        }
        t.span.in_scope(|| info!(%reason, "aborting the task"));
        self.send_abort(task_id, &reason);
    }

    pub(super) fn on_task_result(
        &mut self,
        rank: u32,
        task_id: u64,
        outcome: Result<(Props, Shareable), RankError>,
    ) {
        let Some(t) = &mut self.task else { return };
        if t.id != task_id || t.results[rank as usize].is_some() {
            return;
        }
        let first_error = outcome.is_err() && t.aborting.is_none();
        if let Err(e) = &outcome {
            // The error goes back to the caller, who reports it: a warning here would
            // print a rank's traceback twice on every console.
            if e.class == ErrorClass::Aborted && t.aborting.is_some() {
                t.span
                    .in_scope(|| info!(rank, "rank stopped: {}", e.message));
            } else {
                t.span
                    .in_scope(|| info!(rank, class = %e.class, "rank reported: {}", e.message));
            }
        }
        t.results[rank as usize] = Some(outcome);
        if first_error {
            // Other ranks may be stuck waiting for the failed one in a collective: tell
            // them to stop, and kill them if they do not.
            t.aborting = Some(Aborting {
                reason: format!("rank {rank} failed"),
                deadline: Instant::now() + self.cfg.deadlines.abort_grace.0,
                by_user: false,
            });
            self.send_abort(task_id, &format!("rank {rank} failed"));
        }
        if self
            .task
            .as_ref()
            .is_some_and(|t| t.results.iter().all(Option::is_some))
        {
            self.complete_task();
        }
    }

    pub(super) fn complete_task(&mut self) {
        if self.hold_for_death() {
            return;
        }
        let Some(t) = self.task.take() else { return };
        let _enter = t.span.enter();
        let mut errors: Vec<(u32, RankError)> = Vec::new();
        let mut outputs: Vec<(Props, Shareable)> = Vec::new();
        for (rank, r) in t.results.into_iter().enumerate() {
            match r {
                Some(Ok(o)) => outputs.push(o),
                Some(Err(e)) => errors.push((rank as u32, e)),
                None => {}
            }
        }
        let by_user = t.aborting.as_ref().is_some_and(|a| a.by_user);
        if by_user {
            let reason = t.aborting.map(|a| a.reason).unwrap_or_default();
            info!("task aborted; every rank returned");
            let _ = t.cmd.reply.send(Err(ExecuteError::Aborted {
                task: t.cmd.task,
                reason,
                forced: false,
            }));
            return;
        }
        if !errors.is_empty() {
            // The root cause is the first error that is not an abort we caused.
            let root = errors
                .iter()
                .position(|(_, e)| e.class != ErrorClass::Aborted)
                .unwrap_or(0);
            let (rank, e) = errors.remove(root);
            let oom = e.class == ErrorClass::OutOfMemory;
            if oom && self.oom_execute_used < self.cfg.resources.oom_retries.execute {
                self.oom_execute_used += 1;
                self.growth *= self.cfg.resources.oom_growth;
                warn!(
                    rank,
                    retry = self.oom_execute_used,
                    "rank ran out of memory; relaunching the group with larger estimates and retrying the task"
                );
                let cmd = t.cmd;
                self.begin_stop(
                    "out of memory; retrying the task",
                    vec![After::RetryTask(cmd)],
                );
                return;
            }
            // Built only when reported: each reads the rank's error file.
            let failure = self.failure(rank, FailureCause::Reported(e));
            let others: Vec<RankFailure> = errors
                .into_iter()
                .filter(|(_, e)| e.class != ErrorClass::Aborted)
                .map(|(r, e)| self.failure(r, FailureCause::Reported(e)))
                .collect();
            let _ = t.cmd.reply.send(Err(ExecuteError::RankFailed {
                failure: Box::new(failure),
                others,
            }));
            return;
        }
        // Every rank succeeded: the group is healthy (a gather error below is the
        // caller's, not the group's).
        self.consecutive_failures = 0;
        self.restarts = 0;
        self.oom_execute_used = 0;
        self.last_failure = None;
        debug!("task done");
        match &self.cfg.result {
            ResultPolicy::Gather {
                weight_key,
                average,
                ..
            } if self.cfg.result.gathers(&t.cmd.task) => {
                // Averaging models is CPU work proportional to their size: off this thread.
                let (weight_key, average, reply) =
                    (weight_key.clone(), average.clone(), t.cmd.reply);
                self.work.run(move || {
                    let _ = reply
                        .send(reduce(outputs, &weight_key, &average).map_err(ExecuteError::Gather));
                });
            }
            _ => {
                let (props, out) = outputs.swap_remove(0);
                let _ = t.cmd.reply.send(Ok((out, props)));
            }
        }
    }

    pub(super) fn force_abort(&mut self) {
        let Some(t) = self.task.take() else { return };
        let pending = missing_ranks(&t.results);
        let (reason, by_user) = match &t.aborting {
            Some(a) => (a.reason.clone(), a.by_user),
            None => (String::new(), false),
        };
        t.span.in_scope(|| {
            warn!(
                ?pending,
                "ranks did not stop within the abort grace; killing the group"
            )
        });
        let cmd = t.cmd;
        if by_user {
            let err = ExecuteError::Aborted {
                task: cmd.task.clone(),
                reason,
                forced: true,
            };
            self.begin_teardown(
                "abort grace expired",
                Teardown::Kill,
                vec![After::FailTask(cmd.reply, err)],
            );
        } else {
            // A rank failed and the others did not stop: the failure is the answer.
            let (rank, e) = t
                .results
                .into_iter()
                .enumerate()
                .find_map(|(r, x)| x.and_then(|x| x.err()).map(|e| (r as u32, e)))
                .unwrap_or((
                    0,
                    RankError {
                        class: ErrorClass::Exception,
                        message: reason,
                    },
                ));
            let failure = self.failure(rank, FailureCause::Reported(e));
            self.note_failure();
            let err = ExecuteError::RankFailed {
                failure: Box::new(failure),
                others: Vec::new(),
            };
            self.last_failure = Some(err.clone());
            self.begin_teardown(
                "ranks did not stop after a rank failed",
                Teardown::Kill,
                vec![After::FailTask(cmd.reply, err)],
            );
        }
    }

    pub(super) fn task_timeout(&mut self) {
        let Some(t) = self.task.take() else { return };
        let pending = missing_ranks(&t.results);
        let err = ExecuteError::Timeout {
            task: t.cmd.task.clone(),
            timeout: self.cfg.deadlines.task.0,
            pending,
        };
        t.span.in_scope(|| warn!("{err}"));
        self.note_failure();
        self.last_failure = Some(err.clone());
        let reply = t.cmd.reply;
        self.begin_stop("task deadline", vec![After::FailTask(reply, err)]);
    }
}

/// The ranks (slot indices) that have not answered yet.
pub(super) fn missing_ranks<T>(answers: &[Option<T>]) -> Vec<u32> {
    (0u32..)
        .zip(answers)
        .filter(|(_, a)| a.is_none())
        .map(|(rank, _)| rank)
        .collect()
}

impl PackSpec {
    pub(super) fn pack(&self) -> Result<Frames, ExecuteError> {
        // A value the ranks would refuse to decode fails the task here, naming its path;
        // sent, it would break every rank's connection and cost the group.
        envelope::check_props(&self.props).map_err(|e| ExecuteError::Input(Arc::new(e.into())))?;
        let mut frames: Frames = [None, None];
        for (slot, frame) in frames.iter_mut().enumerate() {
            if !self.needed[slot] {
                continue;
            }
            let policy = if slot == 0 {
                BlobPolicy {
                    zero_copy_threshold: self.zero_copy_threshold,
                    pass_fds: true,
                }
            } else {
                BlobPolicy::INLINE
            };
            let (mut body, mut fds) = (Vec::new(), Vec::new());
            let input = envelope::pack(&self.input, policy, &mut body, &mut fds)
                .map_err(|e| ExecuteError::Input(Arc::new(e)))?;
            let msg = Message::Execute(Box::new(Execute {
                task_id: self.task_id,
                task: self.task.clone(),
                props: self.props.clone(),
                input,
                want_output: self.want_output,
            }));
            let f = envelope::frame(&msg, body, fds).map_err(|e| {
                ExecuteError::Input(Arc::new(rankexec_protocol::wire::PackError::Codec(e)))
            })?;
            *frame = Some(Arc::new(f));
        }
        Ok(frames)
    }
}
