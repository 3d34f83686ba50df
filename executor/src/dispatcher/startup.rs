//! Start-up: ranks connect and authenticate, get `Init`, and acknowledge it; the
//! waiting commands then run.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use rankexec_protocol::ErrorClass;
use rankexec_protocol::wire::envelope;
use rankexec_protocol::wire::message::{Init, RankError, WireComponent};
use rankexec_protocol::wire::{Channel, FrameLimits, Message};
use tracing::{debug, info, warn};

use crate::config::EventRanks;
use crate::error::{RemoteError, StartError};
use crate::session::accept::Connected;
use crate::session::link::{LinkContext, RankLink};

use super::state::*;

impl Dispatcher {
    pub(super) fn on_connected(&mut self, c: Connected) {
        let Some(g) = &mut self.group else { return };
        if !matches!(g.phase, Phase::Starting { .. }) {
            c.conn.shutdown();
            return;
        }
        let rank = c.rank;
        let ctx = LinkContext {
            rank,
            reporter: Reporter {
                generation: g.generation,
                tx: self.ev_tx.clone(),
            },
            engine: self.engine.clone(),
            relay: self.cfg.relay_events_from == EventRanks::All || rank == 0,
            last_seen: g.last_seen[rank as usize].clone(),
            epoch: g.epoch,
            limits: FrameLimits::for_max_frame(self.cfg.max_frame.bytes()),
        };
        let link = &mut g.links[rank as usize];
        // The kernel's word for a local peer; a remote rank's claim is only reported.
        link.pid = c.peer.pid().unwrap_or(c.hello.who.pid);
        link.pgid = c.hello.who.pgid;
        if let Err(e) = link.attach(c.channel, c.conn, &ctx) {
            self.fail_start(StartError::Threads {
                rank,
                source: Arc::new(e),
            });
            return;
        }
        if g.external && !g.table.has_rank(rank) {
            // Not our child: held by the pidfd its connection's kernel-given pid opened.
            if let Some((index, fd)) = g.table.add_peer(rank, c.peer) {
                g.watcher.watch(index, fd);
            }
        }
        debug!(rank, channel = c.channel.as_str(), pid = c.hello.who.pid, host = %c.hello.who.host, "rank connected");
        self.maybe_send_init();
    }

    pub(super) fn maybe_send_init(&mut self) {
        let Some(g) = &mut self.group else { return };
        let Phase::Starting { init_sent, .. } = &mut g.phase else {
            return;
        };
        if *init_sent || !g.links.iter().all(RankLink::complete) {
            return;
        }
        *init_sent = true;
        let d = &self.cfg.deadlines;
        let init = Init {
            executor_id: self.cfg.executor_id.clone(),
            components: self
                .cfg
                .components
                .iter()
                .map(|c| WireComponent {
                    id: c.id.clone(),
                    path: c.path.clone(),
                    args_json: c.args.to_string(),
                })
                .collect(),
            props: self.start_props.clone(),
            heartbeat_interval_ms: d.heartbeat_interval.0.as_millis() as u64,
            event_timeout_ms: d.event.0.as_millis() as u64,
            zero_copy_threshold: self.cfg.zero_copy_threshold.bytes(),
            max_frame_bytes: self.cfg.max_frame.bytes(),
        };
        let frame = match envelope::plain(&Message::Init(Box::new(init))) {
            Ok(f) => Arc::new(f),
            Err(e) => {
                self.fail_start(StartError::Encode(Arc::new(e)));
                return;
            }
        };
        for link in &g.links {
            link.send(Channel::Exec, frame.clone());
        }
        debug!("all ranks connected; Init sent");
    }

    pub(super) fn on_init_ack(&mut self, rank: u32, result: Result<(), RankError>) {
        let Some(g) = &mut self.group else { return };
        let Phase::Starting { acks, .. } = &mut g.phase else {
            return;
        };
        if let Err(error) = result {
            let oom = error.class == ErrorClass::OutOfMemory;
            let err = StartError::Build {
                rank,
                error: RemoteError(error),
            };
            if oom && self.oom_startup_used < self.cfg.resources.oom_retries.startup {
                self.oom_startup_used += 1;
                self.growth *= self.cfg.resources.oom_growth;
                warn!(
                    rank,
                    retry = self.oom_startup_used,
                    "rank ran out of memory while building; relaunching with larger estimates"
                );
                self.retry_start();
                return;
            }
            self.fail_start(err);
            return;
        }
        acks[rank as usize] = true;
        if !acks.iter().all(|a| *a) {
            return;
        }
        let Phase::Starting { waiters, .. } = std::mem::replace(&mut g.phase, Phase::Ready) else {
            return;
        };
        if let Some(p) = &g.policy {
            p.stop_accepting();
        }
        let now = g.epoch.elapsed().as_millis() as u64;
        for a in &g.last_seen {
            a.store(now, Ordering::Relaxed);
        }
        info!(
            ranks = self.cfg.num_of_processes,
            startup_ms = g.epoch.elapsed().as_millis() as u64,
            "rank group ready"
        );
        // Waiting commands run now, in the order they arrived.
        for w in waiters.into_iter().rev() {
            match w {
                Waiter::Start(r) => drop(r.send(Ok(()))),
                Waiter::Execute(c) => self.queue.push_front(Command::Execute(c)),
            }
        }
    }

    /// Tears the starting group down and launches again, keeping the waiters.
    pub(super) fn retry_start(&mut self) {
        let Some(g) = &mut self.group else { return };
        let waiters = match &mut g.phase {
            Phase::Starting { waiters, .. } => std::mem::take(waiters),
            _ => Vec::new(),
        };
        self.begin_stop(
            "out of memory at start-up; retrying",
            vec![After::Relaunch(waiters)],
        );
    }
}

pub(super) fn describe_missing(g: &Group) -> String {
    let mut parts = Vec::new();
    let unconnected: Vec<String> = g
        .links
        .iter()
        .enumerate()
        .filter(|(_, l)| !l.complete())
        .map(|(r, l)| format!("{r} ({}/3 channels)", l.connected()))
        .collect();
    if !unconnected.is_empty() {
        parts.push(format!("ranks not connected: {}", unconnected.join(", ")));
    }
    if let Phase::Starting {
        acks,
        init_sent: true,
        ..
    } = &g.phase
    {
        let waiting: Vec<String> = acks
            .iter()
            .enumerate()
            .filter(|(_, a)| !**a)
            .map(|(r, _)| r.to_string())
            .collect();
        if !waiting.is_empty() {
            parts.push(format!(
                "ranks still building components: {}",
                waiting.join(", ")
            ));
        }
    }
    if parts.is_empty() {
        "no rank reported".to_owned()
    } else {
        parts.join("; ")
    }
}
