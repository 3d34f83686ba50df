//! Connections and endpoints: local sockets for ranks on this host, TCP for ranks on
//! other hosts.
//!
//! The parent always listens and ranks always connect, so no port is ever chosen by
//! one process and bound by another (the race FLARE's `get_open_ports` has). A local
//! listener is a socket file in a private (0700) run directory, created with
//! `interprocess` and removed when the listener is dropped. A TCP listener binds port 0
//! by default and keeps its socket for its whole life.
//!
//! Every TCP socket (both ends) has keepalive and `TCP_USER_TIMEOUT` set, so a peer
//! whose host vanished (link down, power off) is an error on the connection within
//! about 10 s, not after the kernel's 15-minute retransmission limit: a rank then
//! exits as "parent gone", and the parent's writes to it fail instead of hanging.
//!
//! [`Conn`] hides the difference for the framing code. Only local connections can pass
//! file descriptors (the zero-copy path) and report the peer's credentials.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, OnceLock};

use super::secure::{Channel, Keys};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::{Duration, Instant};

use interprocess::local_socket::traits::Listener as _;
use interprocess::local_socket::{
    ConnectOptions, GenericFilePath, ListenerNonblockingMode, ListenerOptions, ToFsName,
};
use interprocess::os::unix::local_socket::ListenerOptionsExt as _;

use crate::os;

/// Where ranks connect: `local:/path/to/socket` or `tcp:host:port`.
///
/// ```
/// use rankexec_protocol::wire::Endpoint;
/// let e: Endpoint = "tcp:127.0.0.1:4000".parse().unwrap();
/// assert_eq!(e.to_string(), "tcp:127.0.0.1:4000");
/// assert!("udp:x".parse::<Endpoint>().is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// A socket file on this host.
    Local(PathBuf),
    /// A TCP address, `host:port`.
    Tcp(String),
}

/// An endpoint string that does not parse.
#[derive(Debug, Clone, thiserror::Error)]
#[error("invalid endpoint `{0}`: expected `local:PATH` or `tcp:HOST:PORT`")]
pub struct EndpointParseError(String);

impl FromStr for Endpoint {
    type Err = EndpointParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(path) = s.strip_prefix("local:") {
            if path.is_empty() {
                return Err(EndpointParseError(s.to_owned()));
            }
            Ok(Endpoint::Local(PathBuf::from(path)))
        } else if let Some(addr) = s.strip_prefix("tcp:") {
            match addr.rsplit_once(':') {
                Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
                    Ok(Endpoint::Tcp(addr.to_owned()))
                }
                _ => Err(EndpointParseError(s.to_owned())),
            }
        } else {
            Err(EndpointParseError(s.to_owned()))
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Local(p) => write!(f, "local:{}", p.display()),
            Endpoint::Tcp(a) => write!(f, "tcp:{a}"),
        }
    }
}

impl Endpoint {
    /// Connects, waiting at most `timeout`.
    pub fn connect(&self, timeout: Duration) -> io::Result<Conn> {
        match self {
            Endpoint::Local(path) => {
                let name = path.as_path().to_fs_name::<GenericFilePath>()?;
                let stream = ConnectOptions::new()
                    .name(name)
                    .wait_mode(interprocess::ConnectWaitMode::Timeout(timeout))
                    .connect_sync()?;
                Ok(Conn::Local(local_stream(stream)))
            }
            Endpoint::Tcp(addr) => {
                let deadline = Instant::now() + timeout;
                let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
                for sa in addr.to_socket_addrs()? {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(io::Error::new(io::ErrorKind::TimedOut, "connect timed out"));
                    }
                    match TcpStream::connect_timeout(&sa, left) {
                        Ok(s) => {
                            s.set_nodelay(true)?;
                            os::tcp_liveness(&s)?;
                            return Ok(Conn::Tcp(TcpConn::new(s)));
                        }
                        Err(e) => last = e,
                    }
                }
                Err(last)
            }
        }
    }
}

/// Unwraps interprocess's stream into the standard library's socket, which has every
/// operation the framing code needs (timeouts, shutdown, fd passing).
fn local_stream(s: interprocess::local_socket::Stream) -> UnixStream {
    match s {
        interprocess::local_socket::Stream::UdSocket(s) => UnixStream::from(OwnedFd::from(s)),
    }
}

/// One connection to a peer.
#[derive(Debug)]
pub enum Conn {
    /// A local (Unix domain) socket.
    Local(UnixStream),
    /// A TCP socket; encrypted and authenticated record by record once its handshake
    /// is done (see `wire::secure`).
    Tcp(TcpConn),
}

/// A TCP connection and its record layer (shared by every handle of it).
#[derive(Debug)]
pub struct TcpConn {
    stream: TcpStream,
    channel: Arc<OnceLock<Channel>>,
}

impl TcpConn {
    fn new(stream: TcpStream) -> TcpConn {
        TcpConn {
            stream,
            channel: Arc::new(OnceLock::new()),
        }
    }
}

impl Read for &Conn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Conn::Local(s) => (&mut &*s).read(buf),
            Conn::Tcp(t) => match t.channel.get() {
                Some(c) => c.read(&t.stream, buf),
                None => (&mut &t.stream).read(buf),
            },
        }
    }
}

impl Write for &Conn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Conn::Local(s) => (&mut &*s).write(buf),
            Conn::Tcp(t) => match t.channel.get() {
                Some(c) => c.write(&t.stream, buf),
                None => (&mut &t.stream).write(buf),
            },
        }
    }
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Conn::Local(s) => (&mut &*s).write_vectored(bufs),
            Conn::Tcp(t) => match t.channel.get() {
                // One record per call, from the first non-empty slice.
                Some(c) => match bufs.iter().find(|b| !b.is_empty()) {
                    Some(b) => c.write(&t.stream, b),
                    None => Ok(0),
                },
                None => (&mut &t.stream).write_vectored(bufs),
            },
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl AsFd for Conn {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Conn::Local(s) => s.as_fd(),
            Conn::Tcp(t) => t.stream.as_fd(),
        }
    }
}

impl Conn {
    /// A connected pair of local sockets (for tests and in-process use).
    pub fn pair() -> io::Result<(Conn, Conn)> {
        let (a, b) = UnixStream::pair()?;
        Ok((Conn::Local(a), Conn::Local(b)))
    }

    /// Sets the read timeout (`None`: block).
    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Conn::Local(s) => s.set_read_timeout(t),
            Conn::Tcp(c) => c.stream.set_read_timeout(t),
        }
    }

    /// Sets the write timeout (`None`: block).
    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Conn::Local(s) => s.set_write_timeout(t),
            Conn::Tcp(c) => c.stream.set_write_timeout(t),
        }
    }

    /// Shuts both directions down, waking any thread blocked on it. Errors are ignored:
    /// the peer may already be gone.
    pub fn shutdown(&self) {
        let _ = match self {
            Conn::Local(s) => s.shutdown(Shutdown::Both),
            Conn::Tcp(t) => t.stream.shutdown(Shutdown::Both),
        };
    }

    /// Another handle to the same connection.
    pub fn try_clone(&self) -> io::Result<Conn> {
        Ok(match self {
            Conn::Local(s) => Conn::Local(s.try_clone()?),
            Conn::Tcp(t) => Conn::Tcp(TcpConn {
                stream: t.stream.try_clone()?,
                channel: t.channel.clone(),
            }),
        })
    }

    /// Turns the record layer on (TCP; after a successful handshake). Local sockets
    /// need none: only processes of our user can reach them.
    pub(crate) fn secure(&self, keys: &Keys) {
        if let Conn::Tcp(t) = self {
            let _ = t.channel.set(Channel::new(keys));
        }
    }

    /// Whether file descriptors can be passed on this connection.
    pub fn passes_fds(&self) -> bool {
        matches!(self, Conn::Local(_))
    }

    /// The peer's process id and user id (local connections only).
    pub fn peer_creds(&self) -> Option<io::Result<(u32, u32)>> {
        match self {
            Conn::Local(s) => Some(os::peer_creds(s)),
            Conn::Tcp(_) => None,
        }
    }

    /// The peer's address (TCP only): the source a listener counts handshakes by.
    pub fn peer_ip(&self) -> Option<std::net::IpAddr> {
        match self {
            Conn::Local(_) => None,
            Conn::Tcp(t) => t.stream.peer_addr().ok().map(|a| a.ip()),
        }
    }

    /// A description of the peer for logs.
    pub fn peer_text(&self) -> String {
        match self {
            Conn::Local(s) => match os::peer_creds(s) {
                Ok((pid, uid)) => format!("local peer pid {pid} uid {uid}"),
                Err(_) => "local peer".to_owned(),
            },
            Conn::Tcp(t) => t
                .stream
                .peer_addr()
                .map_or_else(|_| "tcp peer".to_owned(), |a| format!("tcp peer {a}")),
        }
    }
}

/// The effective uid of this process, for comparing with a peer's.
pub fn effective_uid() -> u32 {
    os::effective_uid()
}

/// A listening socket whose `accept` never blocks (poll its descriptor for readiness).
pub enum Listener {
    /// A socket file (removed when the listener is dropped).
    Local {
        /// The listener.
        listener: interprocess::local_socket::Listener,
        /// Its path.
        path: PathBuf,
    },
    /// A TCP socket.
    Tcp(TcpListener),
}

impl fmt::Debug for Listener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Listener({})", self.endpoint())
    }
}

impl Listener {
    /// Listens on a socket file, readable and writable by this user only.
    pub fn bind_local(path: &Path) -> io::Result<Listener> {
        let name = path.to_fs_name::<GenericFilePath>()?;
        let listener = ListenerOptions::new()
            .name(name)
            .mode(0o600)
            .nonblocking(ListenerNonblockingMode::Accept)
            .reclaim_name(true)
            .create_sync()?;
        Ok(Listener::Local {
            listener,
            path: path.to_owned(),
        })
    }

    /// Listens on a TCP address such as `127.0.0.1:0`.
    pub fn bind_tcp(addr: &str) -> io::Result<Listener> {
        let l = TcpListener::bind(addr)?;
        l.set_nonblocking(true)?;
        Ok(Listener::Tcp(l))
    }

    /// Where ranks connect to reach this listener.
    pub fn endpoint(&self) -> Endpoint {
        match self {
            Listener::Local { path, .. } => Endpoint::Local(path.clone()),
            Listener::Tcp(l) => match l.local_addr() {
                Ok(a) => Endpoint::Tcp(a.to_string()),
                Err(_) => Endpoint::Tcp("0.0.0.0:0".to_owned()),
            },
        }
    }

    /// Accepts one pending connection; `Ok(None)` when none is pending.
    pub fn accept(&self) -> io::Result<Option<Conn>> {
        let res = match self {
            Listener::Local { listener, .. } => {
                listener.accept().map(|s| Conn::Local(local_stream(s)))
            }
            Listener::Tcp(l) => l.accept().and_then(|(s, _)| {
                s.set_nonblocking(false)?;
                s.set_nodelay(true)?;
                os::tcp_liveness(&s)?;
                Ok(Conn::Tcp(TcpConn::new(s)))
            }),
        };
        match res {
            Ok(c) => Ok(Some(c)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }
}

impl AsFd for Listener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Listener::Local { listener, .. } => match listener {
                interprocess::local_socket::Listener::UdSocket(l) => l.as_fd(),
            },
            Listener::Tcp(l) => l.as_fd(),
        }
    }
}
