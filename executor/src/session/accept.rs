//! Accepting rank connections: credentials, handshake, and registration.
//!
//! One thread waits on the listener (and a waker) with `poll(2)`. Each accepted
//! connection is authenticated on its own short-lived thread, so a peer that connects
//! and says nothing holds up nobody. At most [`max_pending`] handshakes run at once
//! (three per rank plus [`MAX_PENDING`] to spare: the limit grows with the group), each
//! has a deadline, and a slot is given back however its thread ends (a guard, even if
//! the thread cannot start). A connection over the limit is closed at once; ranks
//! retry with back-off ([`rankexec_protocol::wire::dial`]), so idle connections can
//! delay start-up by at most one handshake deadline, never deny it.
//!
//! TCP is reachable by anyone on the network, so two more rules hold there: a peer
//! must authenticate within [`PRE_AUTH_TCP`] (a real rank answers the challenge in
//! milliseconds; one that connects and says nothing gives its slot back quickly), and
//! one source address may hold at most half of the slots ([`max_pending_per_source`]),
//! so a host flooding the port with silent connections cannot keep ranks on other
//! hosts out. Caveat: ranks that share the flooding address (same host, or behind the
//! same NAT) compete with it for that half; the short deadline bounds how long each
//! silent connection holds a slot, not how often it comes back. Once the group is
//! ready ([`AcceptPolicy::stop_accepting`]) the acceptor stops and the listener
//! closes. A connection is refused, with the reason logged and sent to the
//! peer, when:
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

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rankexec_protocol::wire::message::{Hello, Identity};
use rankexec_protocol::wire::{Channel, Conn, Listener, Secret, effective_uid, server_handshake};
use std::os::fd::{AsFd, OwnedFd};

use crate::os::{self, Waker};

/// Handshakes in progress allowed beyond three per rank.
pub const MAX_PENDING: usize = 64;

/// Most handshakes in progress at once for a group of `world` ranks.
pub fn max_pending(world: u32) -> usize {
    3 * world as usize + MAX_PENDING
}

/// How long a TCP peer has to prove it holds the secret (the whole handshake is one
/// round trip, so this bounds it). Local peers are vouched for by `SO_PEERCRED` (same
/// user) before their handshake and keep the group's handshake deadline.
pub const PRE_AUTH_TCP: Duration = Duration::from_secs(3);

/// Most handshakes in progress at once from one TCP source address: half the group's
/// slots, so one flooding host always leaves room for ranks elsewhere.
pub fn max_pending_per_source(world: u32) -> usize {
    max_pending(world) / 2
}

/// Handshakes in progress per TCP source address.
type PerSource = Arc<Mutex<HashMap<IpAddr, usize>>>;

/// Gives a handshake slot back when dropped (and its source's share, for TCP).
struct Slot {
    total: Arc<AtomicUsize>,
    source: Option<(PerSource, IpAddr)>,
}

impl Slot {
    /// Takes a slot, unless `limit` slots are taken, or `per_source` from `ip`.
    fn take(
        total: &Arc<AtomicUsize>,
        limit: usize,
        sources: &PerSource,
        ip: Option<IpAddr>,
        per_source: usize,
    ) -> Result<Slot, String> {
        if total.fetch_add(1, Ordering::SeqCst) >= limit {
            total.fetch_sub(1, Ordering::SeqCst);
            return Err(format!("{limit} handshakes already in progress"));
        }
        let mut slot = Slot {
            total: total.clone(),
            source: None,
        };
        if let Some(ip) = ip {
            let mut map = sources.lock().unwrap_or_else(PoisonError::into_inner);
            let n = map.entry(ip).or_insert(0);
            if *n >= per_source {
                return Err(format!(
                    "{per_source} handshakes already in progress from {ip} (the most one source may hold)"
                ));
            }
            *n += 1;
            slot.source = Some((sources.clone(), ip));
        }
        Ok(slot)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.total.fetch_sub(1, Ordering::SeqCst);
        if let Some((sources, ip)) = self.source.take() {
            let mut map = sources.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(n) = map.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    map.remove(&ip);
                }
            }
        }
    }
}

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

/// The process behind a connection, as far as the OS can vouch for it.
#[derive(Debug)]
pub(crate) enum PeerProcess {
    /// A rank we spawned (its pid matched the spawned one): already tracked.
    Spawned { pid: u32 },
    /// A process on this host named by `SO_PEERCRED`, held by a pidfd, with its process
    /// group read from the OS.
    Local { pid: u32, pgid: u32, pidfd: OwnedFd },
    /// A local peer whose pidfd could not be opened (it has exited): nothing to signal.
    Gone { pid: u32 },
    /// A TCP peer, perhaps on another host: never signalled.
    Remote,
}

impl PeerProcess {
    /// The verified local pid, if there is one.
    pub(crate) fn pid(&self) -> Option<u32> {
        match self {
            PeerProcess::Spawned { pid }
            | PeerProcess::Local { pid, .. }
            | PeerProcess::Gone { pid } => Some(*pid),
            PeerProcess::Remote => None,
        }
    }

    /// Opens a pidfd for a local peer named by `SO_PEERCRED`.
    fn open(pid: u32) -> PeerProcess {
        let opened = os::pidfd_open(pid).and_then(|fd| {
            let pgid = os::pgid_of(pid)?;
            // The group read above is this process's only if it still lives.
            if os::exited(&fd)? {
                return Err(std::io::Error::from(std::io::ErrorKind::NotFound));
            }
            Ok((fd, pgid))
        });
        match opened {
            Ok((pidfd, pgid)) => PeerProcess::Local { pid, pgid, pidfd },
            Err(e) => {
                tracing::debug!(pid, error = %e, "cannot hold the peer's process");
                PeerProcess::Gone { pid }
            }
        }
    }
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
    waker: &Waker,
    stop: &AtomicBool,
) {
    let pending = Arc::new(AtomicUsize::new(0));
    let sources: PerSource = Arc::default();
    let limit = max_pending(policy.world);
    let per_source = max_pending_per_source(policy.world);
    let uid = effective_uid();
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
            if stop.load(Ordering::SeqCst) {
                return;
            }
        }
        let ready = match os::poll_readable(&[waker.fd(), listener.as_fd()], None) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, "acceptor cannot poll");
                return;
            }
        };
        if stop.load(Ordering::SeqCst) {
            return;
        }
        if ready[0] {
            waker.drain();
        }
        if !ready[1] {
            continue;
        }
        loop {
            let conn = match listener.accept() {
                Ok(Some(c)) => c,
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed; retrying in {ACCEPT_BACKOFF:?}");
                    back_off = true;
                    break;
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
            let ip = conn.peer_ip();
            let slot = match Slot::take(&pending, limit, &sources, ip, per_source) {
                Ok(s) => s,
                Err(why) => {
                    tracing::warn!(%peer, "refused connection: {why} (the rank retries)");
                    continue;
                }
            };
            // A TCP peer must prove itself quickly (see the module docs).
            let timeout = match ip {
                Some(_) => policy.handshake_timeout.min(PRE_AUTH_TCP),
                None => policy.handshake_timeout,
            };
            let (policy, report) = (policy.clone(), report.clone());
            let span = tracing::Span::current();
            let spawned = std::thread::Builder::new()
                .name("rx-handshake".into())
                .spawn(move || {
                    span.in_scope(|| {
                        let hs = server_handshake(&conn, &policy.secret, timeout, |h| {
                            policy.admit(h, peer_pid)
                        });
                        drop(slot);
                        match hs {
                            Ok(hello) => report(Connected {
                                rank: hello.who.rank,
                                channel: hello.who.channel,
                                peer: policy.peer(hello.who.rank, peer_pid),
                                conn,
                                hello,
                            }),
                            Err(e) => {
                                let text = rankexec_protocol::error_chain(&e);
                                tracing::warn!(%peer, "refused connection: {text}");
                            }
                        }
                    })
                });
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "cannot start a handshake thread");
            }
        }
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
    fn one_source_holds_at_most_its_share_of_slots() {
        let total = Arc::new(AtomicUsize::new(0));
        let sources = PerSource::default();
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let held: Vec<Slot> = (0..2)
            .map(|_| Slot::take(&total, 4, &sources, Some(a), 2).unwrap())
            .collect();
        let err = Slot::take(&total, 4, &sources, Some(a), 2).err().unwrap();
        assert_eq!(
            err,
            "2 handshakes already in progress from 10.0.0.1 (the most one source may hold)"
        );
        // Another source still gets in, up to the total.
        let c = Slot::take(&total, 4, &sources, Some(b), 2).unwrap();
        let d = Slot::take(&total, 4, &sources, None, 2).unwrap();
        assert_eq!(
            Slot::take(&total, 4, &sources, Some(b), 2).err().unwrap(),
            "4 handshakes already in progress"
        );
        drop((held, c, d));
        assert_eq!(total.load(Ordering::SeqCst), 0);
        assert!(sources.lock().unwrap().is_empty(), "shares are given back");
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
