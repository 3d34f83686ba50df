//! Teardown: `Close`, the shutdown grace, `SIGTERM`, the term grace, `SIGKILL`, with
//! stages no live process can act on skipped; finalize.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use rankexec_protocol::wire::envelope;
use rankexec_protocol::wire::{Channel, Message};
use tracing::{info, warn};

use crate::error::{EventError, ExecuteError, FinalizeReport, StartError};
use crate::group::process::Role;
use crate::os::{self, TermSignal};

use super::state::*;

impl Dispatcher {
    pub(super) fn begin_stop(&mut self, reason: &str, after: Vec<After>) {
        self.begin_teardown(reason, Teardown::Graceful, after);
    }

    pub(super) fn begin_teardown(&mut self, reason: &str, how: Teardown, after: Vec<After>) {
        let Some(g) = &mut self.group else {
            let report = FinalizeReport::default();
            for a in after {
                self.apply(a, &report);
            }
            return;
        };
        if let Phase::Stopping {
            after: existing, ..
        } = &mut g.phase
        {
            existing.extend(after);
            return;
        }
        info!(%reason, ?how, "stopping the rank group");
        if let Some(p) = &g.policy {
            p.stop_accepting();
        }
        let now = Instant::now();
        if how == Teardown::Kill {
            let sent = g.table.signal_all(TermSignal::Kill);
            info!(targets = ?sent, "sent SIGKILL");
            for l in &mut g.links {
                l.shutdown();
            }
            g.phase = Phase::Stopping {
                stage: TermStage::Killing,
                deadline: now + KILL_WAIT,
                started: now,
                escalated: Some(TermSignal::Kill),
                after,
            };
            g.closed_pending.clear();
            self.maybe_finish_stop();
            return;
        }
        if let Ok(f) = envelope::plain(&Message::Close {
            reason: reason.to_owned(),
        }) {
            let f = Arc::new(f);
            for link in &g.links {
                link.send(Channel::Exec, f.clone());
                link.send(Channel::Handle, f.clone());
            }
        }
        g.phase = Phase::Stopping {
            stage: TermStage::Closing,
            deadline: now
                + self
                    .close_grace
                    .unwrap_or(self.cfg.deadlines.shutdown_grace.0),
            started: now,
            escalated: None,
            after,
        };
        g.closed_pending.clear();
        g.exits_pending.clear();
        self.maybe_finish_stop();
    }

    pub(super) fn escalate(&mut self) {
        self.escalate_once();
        self.maybe_finish_stop();
    }

    /// Moves teardown to its next stage (`SIGTERM`, then `SIGKILL`, then giving up).
    pub(super) fn escalate_once(&mut self) {
        let Some(g) = &mut self.group else { return };
        let Phase::Stopping {
            stage,
            deadline,
            escalated,
            ..
        } = &mut g.phase
        else {
            return;
        };
        let now = Instant::now();
        match stage {
            TermStage::Closing => {
                let sent = g.table.signal_all(TermSignal::Term);
                info!(targets = ?sent, "ranks did not exit after Close; sent SIGTERM");
                *stage = TermStage::Terminating;
                *escalated = Some(TermSignal::Term);
                *deadline = now + self.cfg.deadlines.term_grace.0;
            }
            TermStage::Terminating => {
                let sent = g.table.signal_all(TermSignal::Kill);
                warn!(targets = ?sent, "ranks did not exit after SIGTERM; sent SIGKILL");
                // A rank stuck writing to us must not keep its threads alive either.
                for l in &mut g.links {
                    l.shutdown();
                }
                *stage = TermStage::Killing;
                *escalated = Some(TermSignal::Kill);
                *deadline = now + KILL_WAIT;
            }
            TermStage::Killing => {
                let stuck = g.table.live_pids();
                warn!(
                    ?stuck,
                    "processes survived SIGKILL (stuck in the kernel?); giving up on them"
                );
                self.finish_stop(stuck);
            }
        }
    }

    /// Finishes teardown once every process is gone, and skips a stage that no live
    /// process can act on: the `Close` grace when no live rank can answer a `Close`
    /// (never connected, silent, stopped, gone), the `SIGTERM` grace when every live
    /// process is stopped (only `SIGKILL` acts on a stopped process).
    pub(super) fn maybe_finish_stop(&mut self) {
        loop {
            let Some(g) = &self.group else { return };
            let Phase::Stopping { stage, .. } = &g.phase else {
                return;
            };
            if g.table.all_exited() {
                self.finish_stop(Vec::new());
                return;
            }
            let skip = match stage {
                TermStage::Closing => !any_live_answers_close(g),
                TermStage::Terminating => all_live_stopped(g),
                TermStage::Killing => false,
            };
            if !skip {
                return;
            }
            info!(stage = ?stage, "no live process can act on this stage; skipping its grace");
            self.escalate_once();
        }
    }

    pub(super) fn finish_stop(&mut self, unkillable: Vec<u32>) {
        let Some(mut g) = self.group.take() else {
            return;
        };
        for l in &mut g.links {
            l.shutdown();
        }
        // What dead ranks left in their groups goes before their leaders are reaped.
        let released = g.table.release();
        if !released.is_empty() {
            info!(targets = ?released, "sent SIGKILL to what dead ranks left behind");
        }
        let (started, escalated, after) = match std::mem::replace(&mut g.phase, Phase::Ready) {
            Phase::Stopping {
                started,
                escalated,
                after,
                ..
            } => (started, escalated, after),
            _ => (Instant::now(), None, Vec::new()),
        };
        let report = FinalizeReport {
            elapsed: started.elapsed(),
            escalated,
            unkillable,
        };
        info!(
            elapsed_ms = report.elapsed.as_millis() as u64,
            escalated = ?report.escalated.map(TermSignal::name),
            "rank group stopped"
        );
        // Threads, listener, output pump, run directory go now; the admission
        // reservation on the admission thread (after any update queued there).
        drop(g);
        for a in after {
            self.apply(a, &report);
        }
    }

    /// Does what waited for the teardown.
    fn apply(&mut self, after: After, report: &FinalizeReport) {
        match after {
            After::FailTask(reply, err) => drop(reply.send(Err(err))),
            After::FailEvent(reply, err) => drop(reply.send(Err(err))),
            After::Parked(reply) => drop(reply.send(())),
            After::Finalized(reply) => drop(reply.send(report.clone())),
            After::FailWaiters(waiters, err) => {
                for w in waiters {
                    w.fail(&err);
                }
            }
            After::RetryTask(cmd) => self.queue.push_front(Command::Execute(cmd)),
            After::Relaunch(waiters) => {
                self.pending = Some(PendingLaunch {
                    not_before: Instant::now(),
                    admission_deadline: None,
                    in_flight: false,
                    attempt: 0,
                    waiters,
                });
            }
        }
    }

    pub(super) fn finalize(&mut self, reply: Sender<FinalizeReport>, grace: Option<Duration>) {
        if self.finalized && self.group.is_none() {
            let _ = reply.send(FinalizeReport::default());
            return;
        }
        self.finalized = true;
        let mut after: Vec<After> = Vec::new();
        if let Some(t) = self.task.take() {
            let err = ExecuteError::Aborted {
                task: t.cmd.task.clone(),
                reason: "the job is ending".to_owned(),
                forced: false,
            };
            let r = t.cmd.reply;
            after.push(After::FailTask(r, err));
        }
        for (_, op) in std::mem::take(&mut self.events) {
            after.push(After::FailEvent(op.cmd.reply, EventError::Finalized));
        }
        if let Some(p) = self.pending.take() {
            for w in p.waiters {
                w.fail(&StartError::Aborted);
            }
        }
        if let Some(g) = &mut self.group
            && let Phase::Starting { waiters, .. } = &mut g.phase
        {
            for w in std::mem::take(waiters) {
                w.fail(&StartError::Aborted);
            }
        }
        // Queued work will not run.
        for cmd in std::mem::take(&mut self.queue) {
            match cmd {
                Command::Execute(c) => drop(c.reply.send(Err(ExecuteError::Finalized))),
                Command::Event(c) => drop(c.reply.send(Err(EventError::Finalized))),
                Command::Start { reply, .. } => drop(reply.send(Err(StartError::Finalized))),
                Command::Park { reply } => drop(reply.send(())),
                Command::Finalize { reply, .. } => drop(reply.send(FinalizeReport::default())),
                Command::Status { reply } => drop(reply.send(self.status())),
            }
        }
        self.deferred = None;
        after.push(After::Finalized(reply));
        // The grace applies to the teardown started here (its deadline is set now), not
        // to a later group's (a task after finalize launches a new one).
        self.close_grace = grace;
        self.begin_stop("finalize", after);
        self.close_grace = None;
    }
}

/// Whether some live process may still act on a `Close`: a launcher (it exits with its
/// ranks), or a rank with a channel to receive it that is neither silent nor stopped.
/// Only our own children are looked up in `/proc`: a pid a rank reports is not trusted.
pub(super) fn any_live_answers_close(g: &Group) -> bool {
    g.table
        .snapshot()
        .iter()
        .filter(|p| p.status.is_none())
        .any(|p| match p.role {
            Role::Launcher => true,
            Role::Rank(r) | Role::ExternalRank(r) => {
                let link = &g.links[r as usize];
                let reachable = link.has(Channel::Exec) || link.has(Channel::Handle);
                reachable
                    && !g.unanswering.contains(&r)
                    && !(matches!(p.role, Role::Rank(_)) && os::is_stopped(p.pid))
            }
        })
}

/// Whether every live process is one of our children and stopped.
pub(super) fn all_live_stopped(g: &Group) -> bool {
    g.table
        .snapshot()
        .iter()
        .filter(|p| p.status.is_none())
        .all(|p| matches!(p.role, Role::Rank(_)) && os::is_stopped(p.pid))
}
