//! A rank's three connections: one reader thread and one writer thread each.
//!
//! Readers decode frames and report to the dispatcher; they never block on it. Events a
//! rank relays go to one relay thread per rank, which fires them on the parent's engine
//! in order and writes each reply: a slow host handler stalls neither task results nor
//! other ranks, nor the heartbeats that share the event channel (a handler slower than
//! `heartbeat_timeout` is not mistaken for a silent rank), and a panicking one becomes
//! the rank's error. The engine is held weakly (the host's engine owns the executor).
//!
//! Frames to the exec and handle channels go out straight from the dispatcher with a
//! non-blocking write when the rank's writer thread is idle (no thread hop for the
//! small frames of a fan-out: blobs travel as memory files). Whatever cannot go out at
//! once (a large inline frame, a rank whose buffer is full because it stopped reading)
//! is finished by that channel's writer thread, in order, so a stuck rank blocks only
//! its own writers; teardown shuts its sockets down. Each channel has its own writer:
//! an `Abort` or `Close` on the handle channel never waits behind a half-written
//! `Execute` on the exec channel.

use rankexec_protocol::error_chain as chain;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender, unbounded};
use rankexec_protocol::wire::envelope;
use rankexec_protocol::wire::frame::read_frame;
use rankexec_protocol::wire::message::{Props, RankError};
use rankexec_protocol::wire::{Channel, Conn, FrameError, FrameLimits, Message, OutFrame};
use rankexec_protocol::{Engine, FlContext, PropFlags, Shareable, keys};

use crate::dispatcher::Reporter;

/// What a rank's connections report.
#[derive(Debug)]
pub(crate) enum LinkEvent {
    InitAck(Result<(), RankError>),
    TaskResult {
        task_id: u64,
        outcome: Result<(Props, Shareable), RankError>,
    },
    EventAck {
        event_id: u64,
        result: Result<Props, RankError>,
    },
    Closed(Channel),
    Protocol {
        channel: Channel,
        what: String,
    },
}

/// Shared by a rank's threads.
#[derive(Clone)]
pub(crate) struct LinkContext {
    pub(crate) rank: u32,
    pub(crate) reporter: Reporter,
    /// Held weakly: the host's engine usually owns this executor, and a strong reference
    /// here would keep both alive forever.
    pub(crate) engine: Option<Weak<dyn Engine>>,
    /// Whether this rank's events are fired on the engine (see `relay_events_from`).
    pub(crate) relay: bool,
    pub(crate) last_seen: Arc<AtomicU64>,
    pub(crate) epoch: Instant,
    pub(crate) limits: FrameLimits,
}

impl LinkContext {
    fn touch(&self) {
        self.last_seen
            .store(self.epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    fn report(&self, ev: LinkEvent) {
        self.reporter.link(self.rank, ev);
    }
}

/// A frame for a writer thread, with the bytes already sent.
type Outgoing = (Arc<OutFrame>, u64);

/// One channel's writer thread and what it has not written yet.
struct Writer {
    tx: Sender<Outgoing>,
    /// Frames handed to the writer and not yet written.
    queued: Arc<AtomicUsize>,
}

/// The parent's end of one rank.
pub(crate) struct RankLink {
    conns: [Option<Arc<Conn>>; 3],
    /// Started on a channel's first frame that cannot go out at once (most never need
    /// one: the dispatcher writes small frames itself).
    writers: [OnceLock<Writer>; 3],
    ctx: Option<LinkContext>,
    /// The rank's pid, from its hello.
    pub(crate) pid: u32,
    /// The rank's process group, from its hello.
    pub(crate) pgid: u32,
}

impl RankLink {
    pub(crate) fn new() -> Self {
        RankLink {
            conns: [None, None, None],
            writers: Default::default(),
            ctx: None,
            pid: 0,
            pgid: 0,
        }
    }

    /// Whether all three channels are connected.
    pub(crate) fn complete(&self) -> bool {
        self.conns.iter().all(Option::is_some)
    }

    /// Whether `channel` is connected.
    pub(crate) fn has(&self, channel: Channel) -> bool {
        self.conns[channel.index()].is_some()
    }

    /// How many channels are connected.
    pub(crate) fn connected(&self) -> usize {
        self.conns.iter().filter(|c| c.is_some()).count()
    }

    /// Adds a connection and starts its reader.
    pub(crate) fn attach(
        &mut self,
        channel: Channel,
        conn: Conn,
        ctx: &LinkContext,
    ) -> std::io::Result<()> {
        let conn = Arc::new(conn);
        let (read_side, c) = (conn.clone(), ctx.clone());
        let span = tracing::info_span!("rank", rank = ctx.rank, channel = channel.as_str());
        std::thread::Builder::new()
            .name(format!("rx-read-{}-{}", ctx.rank, channel.as_str()))
            .spawn(move || span.in_scope(|| read_loop(&read_side, channel, &c)))?;
        self.conns[channel.index()] = Some(conn);
        self.ctx = Some(ctx.clone());
        Ok(())
    }

    /// Sends a frame: at once when the channel's writer is idle and the socket takes
    /// it, else through that writer. False if the channel is not connected. Only the
    /// dispatcher calls this, so an idle writer (nothing queued) cannot become busy
    /// meanwhile.
    pub(crate) fn send(&self, channel: Channel, frame: Arc<OutFrame>) -> bool {
        let Some(conn) = &self.conns[channel.index()] else {
            return false;
        };
        let slot = &self.writers[channel.index()];
        let mut written = 0;
        if slot
            .get()
            .is_none_or(|w| w.queued.load(Ordering::Acquire) == 0)
        {
            // Errors (a gone rank) are left to the writer, which reports them.
            if let Ok(n) = frame.try_write_now(conn) {
                if n == frame.wire_len() {
                    return true;
                }
                written = n;
            }
        }
        let w = match slot.get() {
            Some(w) => w,
            None => match self.start_writer(channel, conn) {
                Ok(w) => slot.get_or_init(|| w),
                Err(e) => {
                    if let Some(ctx) = &self.ctx {
                        ctx.report(LinkEvent::Protocol {
                            channel,
                            what: format!("cannot start a writer thread: {e}"),
                        });
                    }
                    return false;
                }
            },
        };
        w.queued.fetch_add(1, Ordering::AcqRel);
        w.tx.send((frame, written)).is_ok()
    }

    fn start_writer(&self, channel: Channel, conn: &Arc<Conn>) -> std::io::Result<Writer> {
        let Some(ctx) = self.ctx.clone() else {
            return Err(std::io::Error::other("the rank is not connected"));
        };
        let (tx, rx) = unbounded();
        let queued = Arc::new(AtomicUsize::new(0));
        let (q, conn) = (queued.clone(), conn.clone());
        let span = tracing::info_span!("rank", rank = ctx.rank, channel = channel.as_str());
        std::thread::Builder::new()
            .name(format!("rx-write-{}-{}", ctx.rank, channel.as_str()))
            .spawn(move || span.in_scope(|| write_loop(&rx, &conn, channel, &q, &ctx)))?;
        Ok(Writer { tx, queued })
    }

    /// Whether the exec channel can pass descriptors.
    pub(crate) fn passes_fds(&self) -> bool {
        self.conns[Channel::Exec.index()]
            .as_ref()
            .is_some_and(|c| c.passes_fds())
    }

    /// Shuts every connection down, waking its reader and writer.
    pub(crate) fn shutdown(&mut self) {
        for c in self.conns.iter().flatten() {
            c.shutdown();
        }
        self.writers = Default::default();
    }
}

fn write_loop(
    rx: &Receiver<Outgoing>,
    conn: &Conn,
    channel: Channel,
    queued: &AtomicUsize,
    ctx: &LinkContext,
) {
    for (frame, written) in rx {
        let result = frame.write_rest(conn, written);
        queued.fetch_sub(1, Ordering::AcqRel);
        if let Err(e) = result {
            match e {
                FrameError::Io(_) | FrameError::Closed | FrameError::TimedOut => {
                    ctx.report(LinkEvent::Closed(channel))
                }
                other => ctx.report(LinkEvent::Protocol {
                    channel,
                    what: format!("cannot send: {}", chain(&other)),
                }),
            }
            return;
        }
    }
}

/// A relayed event waiting for the host's handlers.
type RelayRequest = (u64, rankexec_protocol::EventType, Props);

fn read_loop(conn: &Arc<Conn>, channel: Channel, ctx: &LinkContext) {
    // Relayed events run on their own thread, so a slow host handler never stops this
    // reader from seeing the heartbeats that share the channel.
    let mut relayer: Option<Sender<RelayRequest>> = None;
    loop {
        let frame = match read_frame(conn, &ctx.limits) {
            Ok(f) => f,
            Err(FrameError::Closed) => return ctx.report(LinkEvent::Closed(channel)),
            Err(FrameError::Io(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                return ctx.report(LinkEvent::Closed(channel));
            }
            Err(e) => {
                return ctx.report(LinkEvent::Protocol {
                    channel,
                    what: chain(&e),
                });
            }
        };
        ctx.touch();
        let msg = match envelope::decode(&frame) {
            Ok(m) => m,
            Err(e) => {
                return ctx.report(LinkEvent::Protocol {
                    channel,
                    what: chain(&e),
                });
            }
        };
        if !msg.valid_from_rank(channel) {
            return ctx.report(LinkEvent::Protocol {
                channel,
                what: format!("{} is not allowed on this channel", msg.kind()),
            });
        }
        let kind = msg.kind();
        let plain = |frame: &rankexec_protocol::wire::InFrame| envelope::expect_plain(kind, frame);
        let event = match msg {
            Message::TaskResult { task_id, outcome } => match outcome {
                Ok(out) => match envelope::unpack(out.output, &frame.body, frame.fds) {
                    Ok(s) => LinkEvent::TaskResult {
                        task_id,
                        outcome: Ok((out.props, s)),
                    },
                    Err(e) => {
                        return ctx.report(LinkEvent::Protocol {
                            channel,
                            what: chain(&e),
                        });
                    }
                },
                Err(e) => match plain(&frame) {
                    Ok(()) => LinkEvent::TaskResult {
                        task_id,
                        outcome: Err(e),
                    },
                    Err(e) => {
                        return ctx.report(LinkEvent::Protocol {
                            channel,
                            what: chain(&e),
                        });
                    }
                },
            },
            other => {
                if let Err(e) = plain(&frame) {
                    return ctx.report(LinkEvent::Protocol {
                        channel,
                        what: chain(&e),
                    });
                }
                match other {
                    Message::InitAck { result } => LinkEvent::InitAck(result),
                    Message::EventAck { event_id, result } => {
                        LinkEvent::EventAck { event_id, result }
                    }
                    Message::Heartbeat { .. } => continue,
                    Message::FireEvent {
                        request_id,
                        event,
                        props,
                    } => {
                        if relayer.is_none() {
                            match start_relayer(conn, ctx) {
                                Ok(tx) => relayer = Some(tx),
                                Err(e) => {
                                    return ctx.report(LinkEvent::Protocol {
                                        channel,
                                        what: format!("cannot start the event relay: {e}"),
                                    });
                                }
                            }
                        }
                        if let Some(tx) = &relayer {
                            let _ = tx.send((request_id, event, props));
                        }
                        continue;
                    }
                    _ => continue,
                }
            }
        };
        ctx.report(event);
    }
}

/// Starts the thread that fires a rank's relayed events on the host's engine, in order,
/// and writes each reply. It ends when the reader drops its sender.
fn start_relayer(conn: &Arc<Conn>, ctx: &LinkContext) -> std::io::Result<Sender<RelayRequest>> {
    let (tx, rx) = unbounded::<RelayRequest>();
    let (conn, ctx) = (conn.clone(), ctx.clone());
    let span = tracing::info_span!("rank", rank = ctx.rank, channel = "event");
    std::thread::Builder::new()
        .name(format!("rx-relay-{}", ctx.rank))
        .spawn(move || {
            span.in_scope(|| {
                for (request_id, event, props) in rx {
                    // A panicking host handler is the rank's error, not this thread's end.
                    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        relay(&ctx, &event, props)
                    }))
                    .unwrap_or_else(|p| {
                        Err(format!(
                            "a host handler of `{event}` panicked: {}",
                            rankexec_protocol::panic_message(p.as_ref())
                        ))
                    });
                    let reply = Message::EventReply { request_id, result };
                    let sent = envelope::plain(&reply)
                        .map_err(|e| chain(&e))
                        .and_then(|f| f.write_to(&conn).map_err(|e| chain(&e)));
                    if let Err(e) = sent {
                        tracing::debug!("cannot answer a relayed event: {e}");
                    }
                }
            })
        })?;
    Ok(tx)
}

/// Fires a rank's event on the parent's engine, in a fresh context tagged with the rank,
/// and returns the context the handlers left (minus the tags).
fn relay(
    ctx: &LinkContext,
    event: &rankexec_protocol::EventType,
    props: Props,
) -> Result<Props, String> {
    if !ctx.relay {
        return Ok(props);
    }
    let Some(engine) = ctx.engine.as_ref().and_then(Weak::upgrade) else {
        return Err("the executor has no engine to fire events into (none was given at START_RUN, or the host dropped it)".to_owned());
    };
    let mut fl = FlContext::with_engine(engine.clone());
    let _ = fl.merge_from(props);
    for key in [keys::FROM_RANK_NUMBER, keys::EVENT_ORIGIN_SITE] {
        fl.remove_prop(key);
    }
    let _ = fl.set_prop(keys::FROM_RANK_NUMBER, ctx.rank, PropFlags::PRIVATE);
    let _ = fl.set_prop(keys::EVENT_ORIGIN_SITE, "rank", PropFlags::PRIVATE);
    engine.fire_event(event, &mut fl).map_err(|e| chain(&e))?;
    let mut out = fl.props().clone();
    out.remove(keys::FROM_RANK_NUMBER);
    out.remove(keys::EVENT_ORIGIN_SITE);
    Ok(out)
}
