//! The process behind an accepted connection, as far as the OS can vouch for it (see
//! "Whose pid" in `session::accept`).

use std::os::fd::OwnedFd;

use crate::os;

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
    pub(crate) fn open(pid: u32) -> PeerProcess {
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
