//! Accepting rank connections: credentials, handshake, and registration.
//!
//! One thread waits on the listener, a waker, and every connection that has not
//! authenticated yet, with one `poll(2)`. It accepts every connection at once and sends
//! it its challenge, then keeps it in a waiting room ([`super::waiting`]) holding
//! nothing but its descriptor: no thread and no slot from a fixed pool, so silent
//! connections, however many and from whatever address (the ranks' own included),
//! never keep a rank waiting. A connection whose peer answers goes to a handshake
//! thread of its own (handshakes run concurrently); one that stays silent past its
//! pre-authentication deadline is closed ([`PRE_AUTH_TCP`] over TCP, where anyone on
//! the network can connect; the group's handshake deadline on a local socket, whose
//! peers `SO_PEERCRED` vouches for). The room and the handshakes together hold at most
//! a quarter of the descriptor limit ([`super::waiting::room_cap`]); past it, the oldest
//! waiting connection of the source holding the most makes room, never one younger
//! than [`super::waiting::MIN_AGE`] (a real rank answers in milliseconds). A rank whose
//! connection is closed before it authenticated retries with back-off until its
//! start-up deadline ([`rankexec_protocol::wire::dial()`]).
//!
//! Caveat: a peer that sends part of a `Hello` and stops holds a handshake thread until
//! its deadline; such peers count in the bound, so a flood of them delays start-up (new
//! connections wait in the listen backlog), never denies it. Once the group is ready
//! ([`AcceptPolicy::stop_accepting`]) the acceptor stops, closes whatever still waits,
//! and the listener closes. A connection is refused, with the reason logged and sent to
//! the peer, when:
//!
//! - its peer runs as another user (local sockets, `SO_PEERCRED`);
//! - it does not prove it holds the launch's secret, or speaks another protocol version;
//! - it names another launch, a rank outside the world, or another world size;
//! - its (rank, channel) slot is already taken (a duplicate);
//! - start-up is over (a late connection);
//! - with the built-in launcher, its pid is not the pid spawned for that rank.
//!
//! Refused connections never disturb the group: valid ranks keep connecting.
//!
//! # Whose pid
//!
//! A rank's pid and process group in its hello are claims, never used to signal
//! anything. On a local socket the kernel names the peer (`SO_PEERCRED`); for a rank we
//! did not spawn (external launchers) the handshake thread opens a pidfd for that pid
//! and reads its process group from the OS, and [`Connected::peer`] carries them as a
//! [`PeerProcess::Local`]. A TCP peer is [`PeerProcess::Remote`]: it may be on another
//! host, so nothing of ours ever signals it; it is torn down through `Close` and its
//! launcher.
//!
//! Caveat: `SO_PEERCRED` names the process that called `connect`. The pidfd is opened
//! once the handshake succeeds, so a peer that exits during its own handshake and whose
//! pid is reused within those milliseconds would name another process of the same user
//! (a peer of another user is refused before).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use rankexec_protocol::wire::message::{Hello, Identity};
use rankexec_protocol::wire::{
    Channel, Conn, FrameError, HandshakeError, Listener, Secret, effective_uid, server_challenge,
    server_finish,
};
use std::os::fd::AsFd;

pub(crate) use super::peer::PeerProcess;
use super::waiting::{MakeRoom, Room, Source, Waiting, room_cap};
use crate::os::{self, Waker};

/// How long a TCP peer has to prove it holds the secret once challenged (a real rank
/// answers in milliseconds; a silent connection is closed after this). Local peers
/// are vouched for by `SO_PEERCRED` (same user) and keep the group's handshake
/// deadline.
pub const PRE_AUTH_TCP: Duration = Duration::from_secs(3);

/// How long the acceptor waits after a failed `accept` before trying again.
const ACCEPT_BACKOFF: std::time::Duration = std::time::Duration::from_millis(100);

struct Slots {
    accepting: bool,
    seen: Vec<[bool; 3]>,
}

/// Who may connect.
pub(crate) struct AcceptPolicy {
    pub(crate) secret: Secret,
    pub(crate) launch_id: String,
    pub(crate) world: u32,
    /// With the built-in launcher, the pid spawned for each rank.
    pub(crate) expected_pids: Vec<Option<u32>>,
    pub(crate) handshake_timeout: Duration,
    slots: Mutex<Slots>,
    /// The acceptor to stop once start-up is over.
    acceptor: Mutex<Option<Acceptor>>,
}

impl AcceptPolicy {
    pub(crate) fn new(
        secret: Secret,
        launch_id: String,
        world: u32,
        expected_pids: Vec<Option<u32>>,
        handshake_timeout: Duration,
    ) -> Self {
        AcceptPolicy {
            secret,
            launch_id,
            world,
            expected_pids,
            handshake_timeout,
            slots: Mutex::new(Slots {
                accepting: true,
                seen: vec![[false; 3]; world as usize],
            }),
            acceptor: Mutex::new(None),
        }
    }

    /// Ends start-up: every later connection is refused, the acceptor stops and the
    /// listener closes.
    pub(crate) fn stop_accepting(&self) {
        self.slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .accepting = false;
        let acceptor = self
            .acceptor
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        drop(acceptor);
    }

    /// Records the pid spawned for `rank` (built-in launcher).
    pub(crate) fn expect_pid(&mut self, rank: u32, pid: u32) {
        if let Some(slot) = self.expected_pids.get_mut(rank as usize) {
            *slot = Some(pid);
        }
    }

    /// The process behind a connection of `rank`: a pidfd is opened only for a local
    /// rank we did not spawn (ours have theirs from the spawn on).
    fn peer(&self, rank: u32, peer_pid: Option<u32>) -> PeerProcess {
        match peer_pid {
            None => PeerProcess::Remote,
            Some(pid) => match self.expected_pids.get(rank as usize) {
                Some(Some(_)) => PeerProcess::Spawned { pid },
                _ => PeerProcess::open(pid),
            },
        }
    }

    fn admit(&self, h: &Identity, peer_pid: Option<u32>) -> Result<(), String> {
        if h.launch_id != self.launch_id {
            return Err(format!("launch `{}` is not this group's", h.launch_id));
        }
        if h.world_size != self.world {
            return Err(format!(
                "world size {} does not match {}",
                h.world_size, self.world
            ));
        }
        if h.rank >= self.world {
            return Err(format!(
                "rank {} is outside world size {}",
                h.rank, self.world
            ));
        }
        let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        if !slots.accepting {
            return Err("start-up is over; no new connections are accepted".to_owned());
        }
        if let (Some(Some(want)), Some(got)) = (self.expected_pids.get(h.rank as usize), peer_pid)
            && *want != got
        {
            return Err(format!(
                "rank {} must be pid {want}, the peer is pid {got}",
                h.rank
            ));
        }
        let slot = &mut slots.seen[h.rank as usize][h.channel.index()];
        if *slot {
            return Err(format!(
                "duplicate {} connection for rank {}",
                h.channel.as_str(),
                h.rank
            ));
        }
        *slot = true;
        Ok(())
    }
}

/// An authenticated, registered connection.
pub(crate) struct Connected {
    pub(crate) rank: u32,
    pub(crate) channel: Channel,
    pub(crate) conn: Conn,
    pub(crate) hello: Hello,
    /// The process at the other end, as the kernel (not the hello) says.
    pub(crate) peer: PeerProcess,
}

/// The acceptor thread; stops (and closes the listener) when dropped, or when its
/// policy stops accepting, whichever comes first.
pub(crate) struct Acceptor {
    waker: Arc<Waker>,
    stop: Arc<AtomicBool>,
}

impl Acceptor {
    fn handle(&self) -> Acceptor {
        Acceptor {
            waker: self.waker.clone(),
            stop: self.stop.clone(),
        }
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.waker.wake();
    }
}

impl Acceptor {
    /// Starts accepting on `listener`; each registered connection goes to `report`.
    pub(crate) fn start(
        listener: Listener,
        policy: Arc<AcceptPolicy>,
        report: Arc<dyn Fn(Connected) + Send + Sync>,
    ) -> std::io::Result<Acceptor> {
        let waker = Arc::new(Waker::new()?);
        let stop = Arc::new(AtomicBool::new(false));
        let acceptor = Acceptor { waker, stop };
        *policy
            .acceptor
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(acceptor.handle());
        let (w, s) = (acceptor.waker.clone(), acceptor.stop.clone());
        let span = tracing::Span::current();
        std::thread::Builder::new()
            .name("rx-accept".into())
            .spawn(move || span.in_scope(|| accept_loop(&listener, &policy, &report, &w, &s)))?;
        Ok(acceptor)
    }
}

fn accept_loop(
    listener: &Listener,
    policy: &Arc<AcceptPolicy>,
    report: &Arc<dyn Fn(Connected) + Send + Sync>,
    waker: &Arc<Waker>,
    stop: &AtomicBool,
) {
    let mut room = Room::default();
    let in_handshake = Arc::new(AtomicUsize::new(0));
    let cap = room_cap();
    let uid = effective_uid();
    let mut silent = 0usize;
    let mut back_off = false;
    loop {
        if back_off {
            // `accept` failed (out of descriptors, say) and left the connection queued:
            // polling the listener again at once would spin. Wait a little, waking at
            // once if asked to stop.
            back_off = false;
            if os::poll_readable(&[waker.fd()], Some(ACCEPT_BACKOFF)).is_ok_and(|r| r[0]) {
                waker.drain();
            }
        }
        if stop.load(Ordering::SeqCst) {
            return log_silent(silent, room.len());
        }
        let now = Instant::now();
        let expired = room.expire(now);
        if expired > 0 && silent == 0 {
            tracing::warn!(
                "closed a connection that did not authenticate in time (more are counted, \
                 not logged)"
            );
        }
        silent += expired;
        // The listener is polled only while a connection can be taken in; else new ones
        // wait in its backlog until a waiting one ages or a handshake ends (which wakes
        // this thread).
        let busy = in_handshake.load(Ordering::SeqCst);
        let room_at = room.room_for_one(busy, cap, now);
        let mut fds = vec![waker.fd()];
        if room_at.is_ok() {
            fds.push(listener.as_fd());
        }
        let first_waiting = fds.len();
        fds.extend(room.fds());
        let wake_at = [room.next_deadline(), room_at.err().flatten()]
            .into_iter()
            .flatten()
            .min();
        let timeout = wake_at.map(|t| t.saturating_duration_since(now));
        let ready = match os::poll_readable(&fds, timeout) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, "acceptor cannot poll");
                return;
            }
        };
        drop(fds);
        if stop.load(Ordering::SeqCst) {
            return log_silent(silent, room.len());
        }
        if ready[0] {
            waker.drain();
        }
        // Peers that answered (or hung up) get a handshake thread each.
        for w in room.take_ready(&ready[first_waiting..]) {
            handshake(w, policy, report, &in_handshake, waker);
        }
        if first_waiting == 2 && ready[1] {
            back_off = accept_all(listener, policy, &mut room, &in_handshake, cap, uid);
        }
    }
}

/// Accepts every pending connection there is room for, checks its credentials and
/// sends its challenge; returns whether `accept` failed (to back off).
fn accept_all(
    listener: &Listener,
    policy: &AcceptPolicy,
    room: &mut Room,
    in_handshake: &AtomicUsize,
    cap: usize,
    uid: u32,
) -> bool {
    loop {
        let now = Instant::now();
        match room.make_room(in_handshake.load(Ordering::SeqCst), cap, now) {
            MakeRoom::Free => {}
            MakeRoom::Closed(peer) => {
                tracing::debug!(%peer, "closed a waiting connection to make room ({cap} at most)");
            }
            // The rest wait in the backlog.
            MakeRoom::Full(_) => return false,
        }
        let conn = match listener.accept() {
            Ok(Some(c)) => c,
            Ok(None) => return false,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed; retrying in {ACCEPT_BACKOFF:?}");
                return true;
            }
        };
        let peer = conn.peer_text();
        let peer_pid = match conn.peer_creds() {
            Some(Ok((pid, peer_uid))) => {
                if peer_uid != uid {
                    tracing::warn!(%peer, "refused connection: peer runs as uid {peer_uid}, not {uid}");
                    continue;
                }
                Some(pid)
            }
            Some(Err(e)) => {
                tracing::warn!(%peer, error = %e, "refused connection: cannot read peer credentials");
                continue;
            }
            None => None,
        };
        let (source, pre_auth) = match conn.peer_ip() {
            // A TCP peer must prove itself quickly (see the module docs).
            Some(ip) => (Source::Ip(ip), policy.handshake_timeout.min(PRE_AUTH_TCP)),
            None => (Source::Local, policy.handshake_timeout),
        };
        // A fresh connection's buffer takes the challenge at once; a peer already gone
        // fails here.
        let challenged = match server_challenge(&conn, CHALLENGE_WRITE) {
            Ok(c) => c,
            Err(e) => {
                let text = rankexec_protocol::error_chain(&e);
                tracing::debug!(%peer, "closed a connection that could not be challenged: {text}");
                continue;
            }
        };
        room.push(Waiting {
            conn,
            challenged,
            peer,
            peer_pid,
            source,
            since: now,
            deadline: now + pre_auth,
        });
    }
}

/// How long the challenge may take to write (it never waits on a fresh connection).
const CHALLENGE_WRITE: Duration = Duration::from_millis(200);

/// Gives a handshake's place in the bound back when its thread ends (or cannot start),
/// and wakes the acceptor, which may have stopped taking connections at the bound.
struct InHandshake {
    count: Arc<AtomicUsize>,
    waker: Arc<Waker>,
}

impl Drop for InHandshake {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::SeqCst);
        self.waker.wake();
    }
}

/// Finishes a waiting connection's handshake on a thread of its own, now that its peer
/// has sent something, within what is left of its deadline.
fn handshake(
    w: Waiting,
    policy: &Arc<AcceptPolicy>,
    report: &Arc<dyn Fn(Connected) + Send + Sync>,
    in_handshake: &Arc<AtomicUsize>,
    waker: &Arc<Waker>,
) {
    in_handshake.fetch_add(1, Ordering::SeqCst);
    let place = InHandshake {
        count: in_handshake.clone(),
        waker: waker.clone(),
    };
    let (policy, report) = (policy.clone(), report.clone());
    let span = tracing::Span::current();
    let spawned = std::thread::Builder::new()
        .name("rx-handshake".into())
        .spawn(move || {
            span.in_scope(|| {
                let left = w
                    .deadline
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(1));
                let Waiting {
                    conn,
                    challenged,
                    peer,
                    peer_pid,
                    ..
                } = w;
                let hs = server_finish(&conn, &policy.secret, challenged, left, |h| {
                    policy.admit(h, peer_pid)
                });
                drop(place);
                match hs {
                    Ok(hello) => report(Connected {
                        rank: hello.who.rank,
                        channel: hello.who.channel,
                        peer: policy.peer(hello.who.rank, peer_pid),
                        conn,
                        hello,
                    }),
                    // A peer that hung up without a word (a flood's connection): no
                    // reason to give, and one line each would flood the log.
                    Err(HandshakeError::Frame(FrameError::Closed)) => {
                        tracing::debug!(%peer, "closed before it authenticated");
                    }
                    Err(e) => {
                        let text = rankexec_protocol::error_chain(&e);
                        tracing::warn!(%peer, "refused connection: {text}");
                    }
                }
            })
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start a handshake thread (the rank retries)");
    }
}

/// Says how many connections were closed for staying silent, once start-up is over.
fn log_silent(silent: usize, waiting: usize) {
    if silent + waiting > 0 {
        tracing::info!(
            "start-up over: {silent} connections closed for not authenticating in time, \
             {waiting} still waiting closed now"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(rank: u32, channel: Channel) -> Identity {
        Identity {
            channel,
            rank,
            world_size: 2,
            launch_id: "L".into(),
            pid: 10,
            pgid: 10,
            host: "h".into(),
        }
    }

    fn policy() -> AcceptPolicy {
        let secret = Secret::generate().unwrap();
        AcceptPolicy::new(
            secret,
            "L".into(),
            2,
            vec![Some(10), None],
            Duration::from_secs(1),
        )
    }

    #[test]
    fn admission_rules() {
        let p = policy();
        assert!(p.admit(&hello(0, Channel::Exec), Some(10)).is_ok());
        assert_eq!(
            p.admit(&hello(0, Channel::Exec), Some(10)).unwrap_err(),
            "duplicate exec connection for rank 0"
        );
        assert_eq!(
            p.admit(&hello(0, Channel::Handle), Some(11)).unwrap_err(),
            "rank 0 must be pid 10, the peer is pid 11"
        );
        assert_eq!(
            p.admit(&hello(2, Channel::Exec), Some(10)).unwrap_err(),
            "rank 2 is outside world size 2"
        );
        let mut other_launch = hello(1, Channel::Exec);
        other_launch.launch_id = "M".into();
        assert_eq!(
            p.admit(&other_launch, None).unwrap_err(),
            "launch `M` is not this group's"
        );
        let mut other_world = hello(1, Channel::Exec);
        other_world.world_size = 3;
        assert_eq!(
            p.admit(&other_world, None).unwrap_err(),
            "world size 3 does not match 2"
        );
        p.stop_accepting();
        assert_eq!(
            p.admit(&hello(1, Channel::Event), None).unwrap_err(),
            "start-up is over; no new connections are accepted"
        );
    }
}
