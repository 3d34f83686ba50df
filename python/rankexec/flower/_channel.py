"""The local channel between Flower's ClientApp processes and the per-node host.

Why: every Flower message runs in a new ``flwr-clientapp`` process, so the rank group
lives in a separate host process (``rankexec.flower.host``) that each ClientApp process
reaches over a Unix socket. The channel is authenticated the way rankexec's executor
authenticates its ranks:

- a private directory per node (``<base>/node-<id>``, mode 0700, owned by this uid;
  a directory with other owners or modes is refused, never reused);
- a per-launch secret: the host writes 32 random bytes (mode 0600) before it listens;
  a client answers the host's nonce with HMAC-SHA256(secret, nonce);
- a peer credential check (``SO_PEERCRED``) on both sides, before any frame: the host
  takes only its own uid unless it was told to allow others (``accept_auth``'s ``allow``,
  the host's ``--allow-uid``/``--allow-gid``, see ``_peer``) and refuses the rest with
  ``PeerRefused``; the ClientApp talks only to a host of the uid it was told
  (``connect``'s ``host_uid``: its own by default).

Frames (``send``, ``recv``, and the limits ``MAX_HEAD``, ``MAX_BUFFERS``,
``SHARE_FROM``) are in ``_frames`` and re-exported here: a frame carries plain data,
never code, and allocates only as its bytes arrive.

Caveats: Linux only (``SO_PEERCRED``); the base directory is ``$RANKEXEC_FLOWER_DIR``,
else ``$XDG_RUNTIME_DIR/rankexec-flower`` when ``$XDG_RUNTIME_DIR`` is set, else
``/tmp/rankexec-flower-<uid>``; a base that cannot be used is an error naming it, never
another folder. A host the site runs as its own service user serves a folder it shares
with its group instead (``_peer``: ``RANKEXEC_FLOWER_NODE_DIR`` on the ClientApp's side).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import socket
import stat
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from rankexec.flower._frames import (
    MAX_BUFFERS,
    MAX_FDS,
    MAX_HEAD,
    SHARE_FROM,
    ChannelError,
    FrameRefused,
    PeerRefused,
    recv,
    recv_exact,
    send,
    set_deadline,
)

__all__ = [
    "MAX_BUFFERS",
    "MAX_FDS",
    "MAX_HEAD",
    "SHARE_FROM",
    "ChannelError",
    "FrameRefused",
    "PeerRefused",
    "accept_auth",
    "base_dir",
    "connect",
    "node_dir",
    "peer_creds",
    "private_dir",
    "recv",
    "send",
    "socket_path",
    "write_secret",
]


def owned_dir(path: Path) -> os.stat_result:
    """Creates ``path`` with mode 0700 if missing and checks it is a directory of this
    uid (not a link); its ``lstat``. A folder that cannot be made or read, or is
    another's, is a ``ChannelError`` naming it."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.lstat()
    except OSError as e:
        raise ChannelError(f"the folder {path} cannot be used: {e}") from e
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise ChannelError(f"{path} is not a directory owned by uid {os.getuid()}")
    return st


def private_dir(path: Path) -> Path:
    """Creates ``path`` with mode 0700, or checks an existing one is ours and private.
    A folder that cannot be made or read is a ``ChannelError`` naming it."""
    st = owned_dir(path)
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise ChannelError(f"{path} is open to other users (mode {oct(st.st_mode)}); refusing")
    return path


def base_dir() -> Path:
    env = os.environ.get("RANKEXEC_FLOWER_DIR")
    if env:
        return private_dir(Path(env))
    run = os.environ.get("XDG_RUNTIME_DIR")
    if run:
        # Never another folder when this one is gone (logind removes it at the user's
        # last logout): a host started there would serve the node beside the first.
        if not os.path.isdir(run):
            raise ChannelError(
                f"$XDG_RUNTIME_DIR ({run}) is not a folder (logind removes it at the user's"
                " last logout); set RANKEXEC_FLOWER_DIR to a folder that lasts"
            )
        return private_dir(Path(run) / "rankexec-flower")
    return private_dir(Path(f"/tmp/rankexec-flower-{os.getuid()}"))


def node_dir(node_id: int) -> Path:
    return private_dir(base_dir() / f"node-{node_id}")


def write_secret(path: Path, mode: int = 0o600) -> bytes:
    """A new secret in ``path``, with exactly ``mode`` (whatever the umask: a host that
    shares its folder with a group makes it 0640)."""
    secret = secrets.token_bytes(32)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), mode)
        f.write(secret)
    os.replace(tmp, path)
    return secret


def peer_creds(sock: socket.socket) -> tuple[int, int, int]:
    """The connected peer's (pid, uid, gid), as the kernel recorded them when the
    connection was made (``SO_PEERCRED``: effective ids; the gid is the primary one)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", creds)
    return pid, uid, gid


def accept_auth(
    conn: socket.socket,
    secret: bytes,
    timeout: float = 10.0,
    allow: Callable[[int, int], bool] | None = None,
) -> None:
    """The host's side of the handshake, all of it within ``timeout`` seconds (a peer that
    answers slowly, a byte at a time, is held to the same deadline); raises
    ``ChannelError`` on any mismatch or when the deadline passes. First, before a byte
    is read or sent, the peer's credentials: ``allow(uid, gid)`` (default: the peer is
    this process's uid) or ``PeerRefused`` naming its pid, uid and gid."""
    deadline = time.monotonic() + timeout
    what = f"the handshake (deadline {timeout:g}s)"
    pid, uid, gid = peer_creds(conn)
    if not (allow(uid, gid) if allow is not None else uid == os.getuid()):
        raise PeerRefused(
            f"refused a connection from pid {pid}, uid {uid}, gid {gid}: not this host's uid"
            f" ({os.getuid()}) and not allowed (--allow-uid, --allow-gid)"
        )
    nonce = secrets.token_bytes(32)
    set_deadline(conn, deadline, what)
    conn.sendall(nonce)
    answer = bytes(recv_exact(conn, 32, deadline, what))
    if not hmac.compare_digest(answer, hmac.new(secret, nonce, hashlib.sha256).digest()):
        raise ChannelError("the peer does not know this launch's secret")
    set_deadline(conn, deadline, what)
    conn.sendall(b"OK")
    conn.settimeout(None)


#: A Unix socket's path holds 107 bytes (and a NUL).
_SUN_PATH_MAX = 107


@contextlib.contextmanager
def socket_path(directory: Path, name: str = "host.sock") -> Iterator[str]:
    """The path to bind or connect ``directory / name`` by: itself when it fits a Unix
    socket's address, else the same file through ``/proc/self/fd/N/`` of an ``O_PATH``
    descriptor of the folder, which Linux resolves (a node folder under a long
    ``RANKEXEC_FLOWER_DIR`` or ``$XDG_RUNTIME_DIR``, with Flower's 20-digit node ids)."""
    path = str(directory / name)
    if len(os.fsencode(path)) <= _SUN_PATH_MAX:
        yield path
        return
    fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{name}"
    finally:
        os.close(fd)


def connect(directory: Path, timeout: float = 10.0, host_uid: int | None = None) -> socket.socket:
    """Connects to the host in ``directory`` and authenticates. The host must run as
    ``host_uid`` (default: this process's uid), checked by its peer credentials before
    the secret is read."""
    want = os.getuid() if host_uid is None else host_uid
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        with socket_path(directory) as address:
            sock.connect(address)
        pid, uid, _gid = peer_creds(sock)
        if uid != want:
            raise PeerRefused(
                f"the host socket is served by pid {pid} of uid {uid}, not the host's uid"
                f" {want} (RANKEXEC_FLOWER_HOST_UID, default this process's uid)"
            )
        secret = (directory / "secret").read_bytes()
        try:
            nonce = bytes(recv_exact(sock, 32))
        except ChannelError as e:
            raise ChannelError(
                f"the host closed the channel before its handshake ({e}): a host refuses a"
                f" peer it does not allow (this process: uid {os.getuid()}, gid"
                f" {os.getegid()}; see the host's --allow-uid, --allow-gid and its log)"
            ) from e
        sock.sendall(hmac.new(secret, nonce, hashlib.sha256).digest())
        if bytes(recv_exact(sock, 2)) != b"OK":
            raise ChannelError("the host refused the handshake")
    except (OSError, ChannelError) as e:
        sock.close()
        kind = type(e) if isinstance(e, ChannelError) else ChannelError
        raise kind(f"cannot reach the rankexec host in {directory}: {e}") from e
    sock.settimeout(None)
    return sock
