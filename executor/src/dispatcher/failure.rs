//! Failure reports: what a rank failure says (pid, cause, stderr tail, `error.json`),
//! exits waiting for their stderr, closed connections, and failing what is in flight.

use rankexec_protocol::error_chain as chain;
use std::time::{Duration, Instant};

use rankexec_protocol::wire::Channel;
use tracing::{debug, info, warn};

use crate::error::{EventError, ExecuteError, FailureCause, RankFailure, StartError};
use crate::group::output::Source;
use crate::group::process::Role;
use crate::group::watch::Exited;
use crate::session::link::LinkEvent;

use super::state::*;

impl Dispatcher {
    pub(super) fn failure(&self, rank: u32, cause: FailureCause) -> RankFailure {
        let g = self.group.as_ref();
        let pid = g.and_then(|g| {
            let link = &g.links[rank as usize];
            if link.pid != 0 {
                return Some(link.pid);
            }
            g.table
                .snapshot()
                .into_iter()
                .find(|p| matches!(p.role, Role::Rank(r) | Role::ExternalRank(r) if r == rank))
                .map(|p| p.pid)
        });
        // Never waits: an exit is reported once its stderr closed or `TAIL_WAIT` passed
        // (see `Group::exits_pending`); a live rank's stderr stays open.
        let stderr_tail = g
            .map(|g| g.tails.tail(Source::Rank(rank), Duration::ZERO))
            .unwrap_or_default();
        let error_file =
            g.and_then(|g| error_json_message(&g.log_dir.join(format!("rank-{rank}/error.json"))));
        RankFailure {
            rank,
            pid,
            cause,
            stderr_tail,
            error_file,
            after: g.map(|g| g.epoch.elapsed()).unwrap_or_default(),
        }
    }

    pub(super) fn on_exited(&mut self, e: Exited) {
        debug!(pid = e.pid, role = ?e.role, status = %e.status, "process exited");
        if self.stopping() {
            self.maybe_finish_stop();
            return;
        }
        let Some(g) = &self.group else { return };
        match e.role {
            Role::Rank(rank) | Role::ExternalRank(rank) => {
                // A SIGKILL while the OOM-kill counter of the rank's memory cgroup (read
                // when it started) rose is the OOM killer's.
                let oom_killed = e.status.signal() == Some(9)
                    && g.oom_baselines
                        .get(&e.pid)
                        .is_some_and(|then| then.reread().is_some_and(|now| now > then.kills));
                let cause = if oom_killed {
                    FailureCause::OomKilled
                } else {
                    FailureCause::Exited(e.status)
                };
                if let Some(g) = &mut self.group {
                    g.closed_pending.remove(&rank);
                    g.exits_pending.push(PendingExit {
                        source: Source::Rank(rank),
                        cause: Some(cause),
                        status: e.status,
                        deadline: Instant::now() + TAIL_WAIT,
                    });
                }
                self.report_exits(Instant::now());
            }
            Role::Launcher => {
                if let Phase::Starting { .. } = g.phase {
                    if let Some(g) = &mut self.group {
                        g.exits_pending.push(PendingExit {
                            source: Source::Launcher,
                            cause: None,
                            status: e.status,
                            deadline: Instant::now() + TAIL_WAIT,
                        });
                    }
                    self.report_exits(Instant::now());
                } else {
                    // The ranks go with their launcher; give their connections a moment
                    // to close so the failure names a rank.
                    let deadline = Instant::now() + CLOSED_GRACE;
                    if let Some(g) = &mut self.group {
                        g.closed_pending.entry(0).or_insert(ClosedPending {
                            channel: Channel::Exec,
                            deadline,
                        });
                    }
                    warn!("the launcher exited with {}", e.status);
                }
            }
        }
    }

    pub(super) fn on_output_closed(&mut self, _src: Source) {
        self.report_exits(Instant::now());
    }

    /// Reports the earliest pending exit once its stderr has closed or its deadline
    /// passed (the failure that stops the group is the first exit, not the first with
    /// a closed stderr).
    pub(super) fn report_exits(&mut self, now: Instant) {
        if self.stopping() {
            return;
        }
        let Some(g) = &mut self.group else { return };
        let Some(first) = g.exits_pending.first() else {
            return;
        };
        if g.tails.is_open(first.source) && now < first.deadline {
            return;
        }
        let first = g.exits_pending.remove(0);
        match (first.source, first.cause) {
            (Source::Rank(rank), Some(cause)) => {
                let f = self.failure(rank, cause);
                self.fail_group(f);
            }
            _ => {
                let tail = g.tails.tail(Source::Launcher, Duration::ZERO);
                self.fail_start(StartError::LauncherExited {
                    status: first.status,
                    tail,
                });
            }
        }
    }

    pub(super) fn on_link(&mut self, rank: u32, ev: LinkEvent) {
        if self.stopping() {
            return;
        }
        match ev {
            LinkEvent::Closed(channel) => {
                let Some(g) = &mut self.group else { return };
                if g.external {
                    let f = self.failure(rank, FailureCause::ConnectionClosed(channel));
                    self.fail_group(f);
                } else {
                    // Our own child: wait briefly for its exit status, which says more.
                    g.closed_pending.entry(rank).or_insert(ClosedPending {
                        channel,
                        deadline: Instant::now() + CLOSED_GRACE,
                    });
                }
            }
            LinkEvent::Protocol { channel, what } => {
                let f = self.failure(rank, FailureCause::Protocol { channel, what });
                self.fail_group(f);
            }
            LinkEvent::InitAck(result) => self.on_init_ack(rank, result),
            LinkEvent::TaskResult { task_id, outcome } => {
                self.on_task_result(rank, task_id, outcome)
            }
            LinkEvent::EventAck { event_id, result } => self.on_event_ack(rank, event_id, result),
        }
    }

    pub(super) fn note_failure(&mut self) {
        self.consecutive_failures += 1;
    }

    /// Errors for everything in flight, to deliver after teardown; with `retry`, the
    /// task in flight is run again instead when `f` allows it (see `retry`).
    pub(super) fn fail_inflight(&mut self, f: &RankFailure, retry: bool) -> Vec<After> {
        let mut after: Vec<After> = Vec::new();
        if let Some(t) = self.task.take() {
            let err = ExecuteError::RankFailed {
                failure: Box::new(f.clone()),
                others: Vec::new(),
            };
            if retry {
                after.push(self.retry_or_fail(t, f, err));
            } else {
                self.last_failure = Some(err.clone());
                after.push(After::FailTask(t.cmd.reply, err));
            }
        }
        for (_, op) in std::mem::take(&mut self.events) {
            let err = EventError::RankFailed {
                event: op.cmd.event.to_string(),
                failure: Box::new(f.clone()),
            };
            after.push(After::FailEvent(op.cmd.reply, err));
        }
        after
    }

    /// A rank failed: record it, fail what is in flight, and stop the group.
    pub(super) fn fail_group(&mut self, f: RankFailure) {
        if self.stopping() {
            return;
        }
        let starting = matches!(
            self.group.as_ref().map(|g| &g.phase),
            Some(Phase::Starting { .. })
        );
        let busy = self.task.is_some() || !self.events.is_empty();
        // A caller waiting on the start, a task or an event gets this failure and
        // reports it; a warning is for a failure nobody waits for (an idle group).
        if starting || busy {
            info!("{}", f.report());
        } else {
            warn!("{}", f.report());
        }
        if starting {
            self.fail_start(StartError::RankFailed(Box::new(f)));
            return;
        }
        if let Some(g) = &mut self.group {
            g.failures.push(f.clone());
        }
        self.note_failure();
        let after = self.fail_inflight(&f, true);
        if !busy {
            let err = ExecuteError::RankFailed {
                failure: Box::new(f),
                others: Vec::new(),
            };
            self.last_failure = Some(err.clone());
            self.deferred = Some(err);
        }
        self.begin_stop("a rank failed", after);
    }

    pub(super) fn fail_start(&mut self, err: StartError) {
        let Some(g) = &mut self.group else { return };
        let waiters = match &mut g.phase {
            Phase::Starting { waiters, .. } => std::mem::take(waiters),
            _ => Vec::new(),
        };
        if waiters.is_empty() {
            warn!("rank group start-up failed: {}", chain(&err));
        } else {
            info!("rank group start-up failed: {}", chain(&err));
        }
        self.note_failure();
        self.last_failure = Some(ExecuteError::Start(err.clone()));
        self.begin_stop("start-up failed", vec![After::FailWaiters(waiters, err)]);
    }
}

pub(super) fn error_json_message(path: &std::path::Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let m = v.get("message")?;
    match m {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => {
            o.get("message").and_then(|x| x.as_str()).map(str::to_owned)
        }
        _ => None,
    }
}
