//! The loop: commands as they arrive, reports from the group's threads, and every
//! deadline, in one `select!` with a timer; nothing here blocks.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, after, never, select};
use rankexec_protocol::wire::message::Props;

use crate::admission::Admission;
use crate::config::ExecutorConfig;
use crate::error::{ExecuteError, FailureCause, StartError};
use crate::offload::Offload;

use super::startup::describe_missing;
use super::state::*;

impl Dispatcher {
    pub(crate) fn new(
        cfg: Arc<ExecutorConfig>,
        program: PathBuf,
        cmd_rx: Receiver<Command>,
        admission: Admission,
    ) -> std::io::Result<Self> {
        let (ev_tx, ev_rx) = crossbeam_channel::unbounded();
        let admit = Offload::start(format!("rx-admit-{}", cfg.executor_id))?;
        let work = Offload::start(format!("rx-work-{}", cfg.executor_id))?;
        Ok(Dispatcher {
            base_log_dir: cfg.log_dir.clone(),
            cfg,
            program,
            cmd_rx,
            ev_tx,
            ev_rx,
            engine: None,
            start_props: Props::new(),
            generation: 0,
            group: None,
            queue: VecDeque::new(),
            task: None,
            events: BTreeMap::new(),
            pending: None,
            admission: Arc::new(std::sync::Mutex::new(admission)),
            admit,
            admission_attempts: 0,
            work,
            consecutive_failures: 0,
            restarts: 0,
            last_failure: None,
            deferred: None,
            oom_startup_used: 0,
            oom_execute_used: 0,
            growth: 1.0,
            finalized: false,
            close_grace: None,
            next_task_id: 1,
            next_event_id: 1,
        })
    }

    /// Runs until the executor handle is dropped; then finalizes.
    pub(crate) fn run(mut self) {
        loop {
            let deadline = self.next_deadline();
            let timer = match deadline {
                Some(d) => after(d.saturating_duration_since(Instant::now())),
                None => never(),
            };
            select! {
                recv(self.cmd_rx) -> cmd => match cmd {
                    Ok(cmd) => self.on_command(cmd),
                    Err(_) => break,
                },
                recv(self.ev_rx) -> ev => {
                    if let Ok((generation, report)) = ev {
                        self.on_report(generation, report);
                    }
                },
                recv(timer) -> _ => {},
            }
            self.on_timers(Instant::now());
            self.drain_queue();
        }
        // The executor was dropped without finalize: tear down, bounded, and launch
        // nothing more.
        self.finalized = true;
        if self.group.is_some() {
            self.begin_stop("executor dropped", Vec::new());
            while self.group.is_some() {
                let deadline = self
                    .next_deadline()
                    .unwrap_or_else(|| Instant::now() + KILL_WAIT);
                if let Ok((generation, report)) = self.ev_rx.recv_deadline(deadline) {
                    self.on_report(generation, report);
                }
                self.on_timers(Instant::now());
            }
        }
    }

    pub(super) fn next_deadline(&self) -> Option<Instant> {
        let mut ds: Vec<Instant> = Vec::new();
        if let Some(p) = &self.pending {
            if !p.in_flight {
                ds.push(p.not_before);
            }
            ds.extend(p.admission_deadline);
        }
        if let Some(g) = &self.group {
            match &g.phase {
                Phase::Starting { deadline, .. } | Phase::Stopping { deadline, .. } => {
                    ds.push(*deadline)
                }
                Phase::Ready => {
                    let timeout = self.cfg.deadlines.heartbeat_timeout.0;
                    if let Some(oldest) =
                        g.last_seen.iter().map(|a| a.load(Ordering::Relaxed)).min()
                    {
                        ds.push(g.epoch + Duration::from_millis(oldest) + timeout);
                    }
                }
            }
            ds.extend(g.closed_pending.values().map(|c| c.deadline));
            ds.extend(g.exits_pending.first().map(|e| e.deadline));
        }
        if let Some(t) = &self.task {
            ds.push(t.deadline);
            match t.settle {
                // Every rank has answered a held task: no abort grace runs for it.
                Some(settle) => ds.push(settle),
                None => ds.extend(t.aborting.as_ref().map(|a| a.deadline)),
            }
        }
        ds.extend(self.events.values().map(|e| e.deadline));
        ds.into_iter().min()
    }

    pub(super) fn on_timers(&mut self, now: Instant) {
        self.check_pending_launch(now);
        let Some(g) = &mut self.group else { return };
        match &g.phase {
            Phase::Starting { deadline, .. } if now >= *deadline => {
                let missing = describe_missing(g);
                let err = StartError::Timeout {
                    timeout: self.cfg.deadlines.startup.0,
                    missing,
                };
                self.fail_start(err);
                return;
            }
            Phase::Stopping { deadline, .. } if now >= *deadline => {
                self.escalate();
                return;
            }
            Phase::Ready => {
                let timeout = self.cfg.deadlines.heartbeat_timeout.0;
                let now_ms = g.epoch.elapsed().as_millis() as u64;
                let silent = g
                    .last_seen
                    .iter()
                    .enumerate()
                    .map(|(r, a)| (r as u32, now_ms.saturating_sub(a.load(Ordering::Relaxed))))
                    .find(|(_, ms)| Duration::from_millis(*ms) > timeout);
                if let Some((rank, ms)) = silent {
                    g.unanswering.insert(rank);
                    let f =
                        self.failure(rank, FailureCause::Unresponsive(Duration::from_millis(ms)));
                    self.fail_group(f);
                    return;
                }
            }
            _ => {}
        }
        if g.exits_pending.first().is_some_and(|e| now >= e.deadline) {
            self.report_exits(now);
            return;
        }
        let expired = g
            .closed_pending
            .iter()
            .find(|(_, c)| now >= c.deadline)
            .map(|(r, c)| (*r, c.channel));
        if let Some((rank, ch)) = expired {
            let f = self.failure(rank, FailureCause::ConnectionClosed(ch));
            self.fail_group(f);
            return;
        }
        if let Some(t) = &self.task {
            if t.settle.is_some_and(|d| now >= d) {
                // No death came: the rank's error is the answer.
                self.complete_task();
                return;
            }
            // Every rank has answered a held task: no abort grace runs for it.
            if let Some(a) = &t.aborting
                && t.settle.is_none()
                && now >= a.deadline
            {
                self.force_abort();
                return;
            }
            if now >= t.deadline {
                self.task_timeout();
                return;
            }
        }
        let late = self
            .events
            .iter()
            .find(|(_, e)| now >= e.deadline)
            .map(|(id, _)| *id);
        if let Some(id) = late {
            self.event_timeout(id);
        }
    }

    pub(super) fn settled(&self) -> bool {
        self.pending.is_none()
            && match &self.group {
                None => true,
                Some(g) => matches!(g.phase, Phase::Ready),
            }
    }

    /// Takes a command as it arrives: `Status` and `Finalize` are answered at once and
    /// never wait behind anything; the rest join the queue.
    pub(super) fn on_command(&mut self, cmd: Command) {
        match cmd {
            Command::Status { reply } => drop(reply.send(self.status())),
            Command::Finalize { reply, grace } => self.finalize(reply, grace),
            Command::Execute(mut c) => {
                let tx = self.ev_tx.clone();
                c.wake = Some(
                    c.abort
                        .on_trigger(move || drop(tx.send((0, Report::WaitingAborted)))),
                );
                self.queue.push_back(Command::Execute(c));
            }
            other => self.queue.push_back(other),
        }
    }

    /// Answers every waiting task whose abort fired (queued, or waiting for a launch);
    /// a launch nobody waits for any more is dropped.
    pub(super) fn answer_aborted_waiting(&mut self) {
        let aborted = |c: &ExecuteCmd| c.abort.is_triggered();
        let mut answered = Vec::new();
        let queue = std::mem::take(&mut self.queue);
        for cmd in queue {
            match cmd {
                Command::Execute(c) if aborted(&c) => answered.push(c),
                other => self.queue.push_back(other),
            }
        }
        let mut take = |waiters: &mut Vec<Waiter>| {
            for w in std::mem::take(waiters) {
                match w {
                    Waiter::Execute(c) if aborted(&c) => answered.push(c),
                    other => waiters.push(other),
                }
            }
        };
        if let Some(p) = &mut self.pending {
            take(&mut p.waiters);
        }
        if let Some(g) = &mut self.group
            && let Phase::Starting { waiters, .. } = &mut g.phase
        {
            take(waiters);
        }
        if self.pending.as_ref().is_some_and(|p| p.waiters.is_empty()) {
            // A late admission answer is released (see `on_admitted`).
            self.pending = None;
        }
        for c in answered {
            let _ = c.reply.send(Err(ExecuteError::Aborted {
                task: c.task,
                reason: c.abort.reason().unwrap_or_default(),
                forced: false,
            }));
        }
    }

    /// Runs queued commands, in arrival order, as soon as each can run; one that must
    /// wait holds back only what has to follow it. Everything waits for a settled group
    /// (no launch or teardown in progress). An `Execute` waits for the running task and
    /// for any queued `Park`; a `Park` waits for the running task and events, never for
    /// a queued `Execute` (the group is parked between the two tasks, and the next one
    /// relaunches it); a `Start` and an `Event` wait for nothing else.
    pub(super) fn drain_queue(&mut self) {
        let mut i = 0;
        while i < self.queue.len() && self.settled() {
            let ready = match &self.queue[i] {
                Command::Start { .. } | Command::Event(_) => true,
                Command::Execute(_) => {
                    self.task.is_none()
                        && !self.queue.iter().any(|c| matches!(c, Command::Park { .. }))
                }
                Command::Park { .. } => self.task.is_none() && self.events.is_empty(),
                Command::Status { .. } | Command::Finalize { .. } => true,
            };
            if !ready {
                i += 1;
                continue;
            }
            let Some(cmd) = self.queue.remove(i) else {
                return;
            };
            match cmd {
                Command::Start {
                    props,
                    engine,
                    reply,
                } => self.cmd_start(props, engine, reply),
                Command::Execute(c) => self.cmd_execute(c),
                Command::Event(c) => self.cmd_event(c),
                Command::Park { reply } => {
                    if self.group.is_some() {
                        self.begin_stop("parked", vec![After::Parked(reply)]);
                    } else {
                        let _ = reply.send(());
                    }
                }
                Command::Status { reply } => drop(reply.send(self.status())),
                Command::Finalize { reply, grace } => self.finalize(reply, grace),
            }
        }
    }

    pub(super) fn status(&self) -> Status {
        let phase = match (&self.group, &self.pending) {
            (None, Some(_)) => "admitting",
            (None, None) => "idle",
            (Some(g), _) => match g.phase {
                Phase::Starting { .. } => "starting",
                Phase::Ready if self.task.is_some() => "busy",
                Phase::Ready => "ready",
                Phase::Stopping { .. } => "stopping",
            },
        };
        Status {
            phase,
            processes: self
                .group
                .as_ref()
                .map(|g| g.table.snapshot())
                .unwrap_or_default(),
            restarts: self.restarts,
            queued: self.queue.len(),
            log_dir: self.group.as_ref().map(|g| g.log_dir.clone()),
            endpoint: self.group.as_ref().map(|g| g.endpoint.clone()),
            finalized: self.finalized,
        }
    }

    pub(super) fn on_report(&mut self, generation: u64, report: Report) {
        let report = match report {
            Report::AbortTask { task_id, reason } => return self.abort_task(task_id, reason),
            Report::Admitted { attempt, outcome } => return self.on_admitted(attempt, outcome),
            Report::WaitingAborted => return self.answer_aborted_waiting(),
            other => other,
        };
        let current = self.group.as_ref().map(|g| g.generation);
        if current != Some(generation) {
            if let Report::Connected(c) = report {
                c.conn.shutdown();
            }
            return;
        }
        match report {
            Report::Connected(c) => self.on_connected(*c),
            Report::Exited(e) => self.on_exited(e),
            Report::Link { rank, ev } => self.on_link(rank, ev),
            Report::OutputClosed(src) => self.on_output_closed(src),
            Report::Packed { task_id, frames } => self.on_packed(task_id, frames),
            Report::AbortTask { .. } | Report::Admitted { .. } | Report::WaitingAborted => {}
        }
    }

    pub(super) fn stopping(&self) -> bool {
        matches!(
            self.group.as_ref().map(|g| &g.phase),
            Some(Phase::Stopping { .. })
        )
    }
}
