//! The waiting room: connections the acceptor has challenged and whose peer has not
//! answered yet.
//!
//! A connection waits here with nothing but its descriptor: no thread, no slot a rank
//! needs. The acceptor polls every one of them together, and hands a connection to a
//! handshake thread once its peer has sent something. A connection that stays silent
//! past its pre-authentication deadline is closed.
//!
//! The room holds at most [`room_cap`] connections with the handshakes in progress
//! (a quarter of the process's descriptor limit): a flood larger than that must not
//! take the descriptors the group itself needs. At the bound, the oldest waiting
//! connection of the source holding the most is closed to make room ([`victim`]); a
//! rank that shares the flood's address is the youngest of that source (a real rank
//! answers its challenge within milliseconds), so it is the last to go. No connection
//! younger than [`MIN_AGE`] is closed for room: when all are, new connections stay in
//! the listen backlog until one ages or finishes, so a flood cannot churn a rank out.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::IpAddr;
use std::os::fd::{AsFd, BorrowedFd};
use std::time::{Duration, Instant};

use rankexec_protocol::wire::{Challenged, Conn};

/// The youngest a waiting connection may be and still be closed to make room.
pub(crate) const MIN_AGE: Duration = Duration::from_millis(500);

/// Where a connection comes from, for choosing which to close at the bound: a TCP
/// peer's address, or this host (every local-socket peer is of our own user).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Source {
    Local,
    Ip(IpAddr),
}

/// A challenged connection waiting for its peer's `Hello`.
pub(crate) struct Waiting {
    pub(crate) conn: Conn,
    pub(crate) challenged: Challenged,
    pub(crate) peer: String,
    pub(crate) peer_pid: Option<u32>,
    pub(crate) source: Source,
    pub(crate) since: Instant,
    pub(crate) deadline: Instant,
}

/// Most connections waiting or in a handshake at once: a quarter of this process's
/// descriptor limit (its soft `RLIMIT_NOFILE`), at least 64 and at most 16384.
pub(crate) fn room_cap() -> usize {
    let soft = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX);
    (soft / 4).clamp(64, 16384) as usize
}

/// The connections waiting, oldest first.
#[derive(Default)]
pub(crate) struct Room {
    entries: VecDeque<Waiting>,
}

/// What making room for one more connection came to.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum MakeRoom {
    /// There is room.
    Free,
    /// This waiting connection was closed for it (its peer's text).
    Closed(String),
    /// Every waiting connection is too young (or none waits and the bound is taken by
    /// handshakes): try again at this instant, or when a handshake ends.
    Full(Option<Instant>),
}

impl Room {
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(crate) fn push(&mut self, w: Waiting) {
        self.entries.push_back(w);
    }

    /// Every waiting connection's descriptor, in order.
    pub(crate) fn fds(&self) -> impl Iterator<Item = BorrowedFd<'_>> {
        self.entries.iter().map(|w| w.conn.as_fd())
    }

    /// Takes out the connections whose index in `ready` (in [`Room::fds`] order) is
    /// true.
    pub(crate) fn take_ready(&mut self, ready: &[bool]) -> Vec<Waiting> {
        let mut out = Vec::new();
        let mut keep = VecDeque::with_capacity(self.entries.len());
        for (i, w) in self.entries.drain(..).enumerate() {
            if ready.get(i).copied().unwrap_or(false) {
                out.push(w);
            } else {
                keep.push_back(w);
            }
        }
        self.entries = keep;
        out
    }

    /// Closes the connections whose deadline has passed; returns how many.
    pub(crate) fn expire(&mut self, now: Instant) -> usize {
        let before = self.entries.len();
        self.entries.retain(|w| w.deadline > now);
        before - self.entries.len()
    }

    /// The earliest deadline of a waiting connection.
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.entries.iter().map(|w| w.deadline).min()
    }

    /// Whether one more connection could be taken in (at once, or by closing a waiting
    /// one), when `in_handshake` more are being authenticated and at most `cap` may be
    /// open together; if not, when it could (`None`: when a handshake ends).
    pub(crate) fn room_for_one(
        &self,
        in_handshake: usize,
        cap: usize,
        now: Instant,
    ) -> Result<(), Option<Instant>> {
        if self.entries.len() + in_handshake < cap {
            return Ok(());
        }
        victim(self.entries.iter().map(|w| (w.source, w.since)), now).map(drop)
    }

    /// Makes room for one more connection when `in_handshake` more are being
    /// authenticated and at most `cap` may be open together.
    pub(crate) fn make_room(&mut self, in_handshake: usize, cap: usize, now: Instant) -> MakeRoom {
        if self.entries.len() + in_handshake < cap {
            return MakeRoom::Free;
        }
        match victim(self.entries.iter().map(|w| (w.source, w.since)), now) {
            Ok(i) => match self.entries.remove(i) {
                Some(w) => MakeRoom::Closed(w.peer),
                None => MakeRoom::Full(None),
            },
            Err(at) => MakeRoom::Full(at),
        }
    }
}

/// Which waiting connection to close for room, given each one's source and arrival
/// (oldest first): the oldest of the source that holds the most, if it is at least
/// [`MIN_AGE`] old. Otherwise, when one will be old enough (`None`: none waits).
pub(crate) fn victim(
    entries: impl Iterator<Item = (Source, Instant)> + Clone,
    now: Instant,
) -> Result<usize, Option<Instant>> {
    let mut counts: HashMap<Source, usize> = HashMap::new();
    for (s, _) in entries.clone() {
        *counts.entry(s).or_insert(0) += 1;
    }
    // The largest source with an entry old enough; ties go to the oldest entry.
    let mut best: Option<(usize, usize, Instant)> = None; // (count, index, since)
    let mut soonest: Option<Instant> = None;
    let mut seen: HashSet<Source> = HashSet::new();
    for (i, (s, since)) in entries.enumerate() {
        // Entries are oldest first: a source's first is its oldest.
        if !seen.insert(s) {
            continue;
        }
        if now.saturating_duration_since(since) < MIN_AGE {
            let at = since + MIN_AGE;
            soonest = Some(soonest.map_or(at, |t: Instant| t.min(at)));
            continue;
        }
        let n = counts.get(&s).copied().unwrap_or(0);
        if best.is_none_or(|(bn, _, bs)| n > bn || (n == bn && since < bs)) {
            best = Some((n, i, since));
        }
    }
    match best {
        Some((_, i, _)) => Ok(i),
        None => Err(soonest),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> Source {
        Source::Ip(s.parse().unwrap())
    }

    #[test]
    fn the_oldest_of_the_largest_source_goes() {
        let now = Instant::now() + Duration::from_secs(10);
        let t = |s: u64| now - Duration::from_secs(s);
        let flood = ip("10.0.0.1");
        let rank = ip("10.0.0.2");
        // Oldest first: a rank from elsewhere waits longest, the flood holds more.
        let entries = [(rank, t(9)), (flood, t(8)), (flood, t(7)), (flood, t(1))];
        assert_eq!(victim(entries.iter().copied(), now), Ok(1));
    }

    #[test]
    fn nothing_younger_than_min_age_is_closed() {
        let now = Instant::now() + Duration::from_secs(10);
        let young = now - MIN_AGE / 2;
        let entries = [(Source::Local, young), (Source::Local, young)];
        assert_eq!(
            victim(entries.iter().copied(), now),
            Err(Some(young + MIN_AGE))
        );
        assert_eq!(victim(std::iter::empty(), now), Err(None));
        // One old enough, of a smaller source, goes before the young ones.
        let old = now - MIN_AGE * 2;
        let entries = [(ip("10.0.0.9"), old), (Source::Local, young)];
        assert_eq!(victim(entries.iter().copied(), now), Ok(0));
    }

    #[test]
    fn room_is_free_below_the_bound() {
        let mut room = Room::default();
        let now = Instant::now();
        assert_eq!(room.make_room(0, 1, now), MakeRoom::Free);
        assert_eq!(room.make_room(1, 1, now), MakeRoom::Full(None));
    }
}
