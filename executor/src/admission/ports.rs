//! The rendezvous port of a group (`MASTER_PORT`), reserved among the executors of
//! this network namespace for the group's life.
//!
//! `portpicker` finds a port that nobody has bound *now*. Rank 0 binds it only when
//! its code calls `init_process_group`, which can be minutes later (a Client API
//! script receives its first task first). Two groups started on one host within that
//! time (the sites of one FLARE simulator, jobs side by side, a test suite) could be
//! handed the same port, and the second rank 0 to bind it fails with `EADDRINUSE`.
//! So each group holds a Unix socket bound to the abstract name
//! `rankexec-master-port-<port>` while it lives, and a port whose name is bound
//! already is skipped. An abstract name is no file: it goes with the socket's last
//! descriptor, so a dropped lease, a crashed executor and a killed host all free their
//! ports and leave nothing behind. The socket is a stream socket that never listens:
//! nobody can connect to it or send it anything.
//!
//! Caveats:
//! - Abstract names, like ports, belong to a network namespace: executors in the same
//!   one coordinate, whoever runs them. Any other program is seen only by portpicker's
//!   bind test, and a port nobody reserved still goes to whoever binds it first.
//! - Any local user may bind such a name. One who binds many only makes the executor
//!   try other ports: after 32 taken names it picks a port as before, without a
//!   reservation, and [`PortLease::locked`] says so.
//! - The descriptor is close-on-exec, so ranks never hold it; a child *forked* by the
//!   host (not exec'd) does until it exits, and the port stays reserved that long.
//! - Nothing here waits: a name bound elsewhere means another port.

use std::os::fd::OwnedFd;

use rustix::io::Errno;
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};

/// Picks at most this many ports before settling for one without a reservation.
const TRIES: usize = 32;

/// Used when portpicker finds nothing (torch's default).
const FALLBACK: u16 = 29500;

/// The abstract socket name that reserves `port`.
fn name_of(port: u16) -> String {
    format!("rankexec-master-port-{port}")
}

/// A port picked for a group's rendezvous, and the bound socket that keeps other
/// executors from picking it while the lease lives. Dropping it frees the name.
#[derive(Debug)]
pub struct PortLease {
    port: u16,
    held: Option<OwnedFd>,
}

impl PortLease {
    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Whether other executors are kept off it (false: picked without a reservation).
    pub fn locked(&self) -> bool {
        self.held.is_some()
    }
}

/// A port for a group's rendezvous: free now (portpicker's bind test) and not reserved
/// by another executor. When no port can be reserved within 32 tries (or sockets
/// cannot be made), a port picked as before, unreserved.
pub fn reserve() -> PortLease {
    reserve_from(portpicker::pick_unused_port)
}

/// [`reserve`] with the candidates from `pick`.
fn reserve_from(mut pick: impl FnMut() -> Option<u16>) -> PortLease {
    for _ in 0..TRIES {
        let Some(port) = pick() else {
            break;
        };
        match take(port) {
            Ok(Some(held)) => {
                return PortLease {
                    port,
                    held: Some(held),
                };
            }
            Ok(None) => continue, // another executor holds it
            Err(e) => {
                tracing::debug!(error = %e, "MASTER_PORT not reserved: no socket");
                break;
            }
        }
    }
    unlocked()
}

fn unlocked() -> PortLease {
    PortLease {
        port: portpicker::pick_unused_port().unwrap_or(FALLBACK),
        held: None,
    }
}

/// A close-on-exec stream socket bound to `port`'s abstract name, or None when the
/// name is bound already.
fn take(port: u16) -> Result<Option<OwnedFd>, Errno> {
    let sock = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )?;
    let addr = SocketAddrUnix::new_abstract_name(name_of(port).as_bytes())?;
    match rustix::net::bind(&sock, &addr) {
        Ok(()) => Ok(Some(sock)),
        Err(Errno::ADDRINUSE) => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `port`'s name is bound: by binding it (and letting go at once).
    fn reserved(port: u16) -> bool {
        matches!(take(port), Ok(None))
    }

    #[test]
    fn a_reserved_port_is_never_handed_out_twice_while_held_and_freed_with_its_lease() {
        let leases: Vec<PortLease> = (0..64).map(|_| reserve()).collect();
        let mut ports: Vec<u16> = leases.iter().map(PortLease::port).collect();
        assert!(leases.iter().all(PortLease::locked));
        ports.sort_unstable();
        ports.dedup();
        assert_eq!(ports.len(), 64, "a port was handed out twice");
        // What the OS says: the names are bound while the leases live...
        assert!(ports.iter().all(|p| reserved(*p)));
        drop(leases);
        // ...and free (nothing to remove: an abstract name is no file) once they go.
        assert!(
            ports.iter().all(|p| !reserved(*p)),
            "a name outlived its lease"
        );
    }

    #[test]
    fn a_port_held_by_another_process_is_skipped() {
        // Another holder's names, bound by a child process (as another executor's).
        let (a, b, c) = (20001u16, 20002, 20003);
        let mut holder = std::process::Command::new("python3")
            .args([
                "-c",
                "import socket,sys\n\
                 s=[socket.socket(socket.AF_UNIX) for _ in sys.argv[1:]]\n\
                 [x.bind('\\0rankexec-master-port-'+p) for x,p in zip(s,sys.argv[1:])]\n\
                 print('bound',flush=True); sys.stdin.read()",
                &a.to_string(),
                &b.to_string(),
            ])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(holder.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        assert_eq!(line.trim(), "bound");
        let mut candidates = vec![a, b, c].into_iter();
        let lease = reserve_from(|| candidates.next());
        assert_eq!((lease.port(), lease.locked()), (c, true));
        // Once the holder is gone (killed: nothing of its own is run), its port can be
        // had again.
        holder.kill().unwrap();
        holder.wait().unwrap();
        let mut again = vec![a].into_iter();
        let lease2 = reserve_from(|| again.next());
        assert_eq!((lease2.port(), lease2.locked()), (a, true));
    }

    #[test]
    fn with_every_candidate_taken_a_port_is_still_picked_unreserved() {
        let held = reserve();
        let taken = held.port();
        let lease = reserve_from(|| Some(taken));
        assert!(!lease.locked());
        assert!(lease.port() > 0);
    }
}
