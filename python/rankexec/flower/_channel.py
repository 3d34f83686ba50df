"""The local channel between Flower's ClientApp processes and the per-node host.

Why: every Flower message runs in a new ``flwr-clientapp`` process, so the rank group
lives in a separate host process (``rankexec.flower.host``) that each ClientApp process
reaches over a Unix socket. The channel is authenticated the way rankexec's executor
authenticates its ranks:

- a private directory per node (``<base>/node-<id>``, mode 0700, owned by this uid;
  a directory with other owners or modes is refused, never reused);
- a per-launch secret: the host writes 32 random bytes (mode 0600) before it listens;
  a client answers the host's nonce with HMAC-SHA256(secret, nonce);
- a peer uid check (``SO_PEERCRED``) on both sides: only this uid talks to the host.

Frames: an 8-byte length, then a pickle (protocol 5) whose out-of-band buffers (the
arrays' bytes) follow as raw frames, so large payloads are never re-pickled. Pickle is
only read after authentication.

Caveats: Linux only (``SO_PEERCRED``); the base directory is ``$RANKEXEC_FLOWER_DIR``,
else ``$XDG_RUNTIME_DIR/rankexec-flower``, else ``/tmp/rankexec-flower-<uid>``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import secrets
import socket
import stat
import struct
from pathlib import Path
from typing import Any

__all__ = [
    "ChannelError",
    "accept_auth",
    "base_dir",
    "connect",
    "node_dir",
    "private_dir",
    "recv",
    "send",
    "write_secret",
]


class ChannelError(ConnectionError):
    """The host cannot be reached, refused us, or broke the protocol."""


def private_dir(path: Path) -> Path:
    """Creates ``path`` with mode 0700, or checks an existing one is ours and private."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise ChannelError(f"{path} is not a directory owned by uid {os.getuid()}")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise ChannelError(f"{path} is open to other users (mode {oct(st.st_mode)}); refusing")
    return path


def base_dir() -> Path:
    env = os.environ.get("RANKEXEC_FLOWER_DIR")
    if env:
        return private_dir(Path(env))
    run = os.environ.get("XDG_RUNTIME_DIR")
    if run and os.path.isdir(run):
        return private_dir(Path(run) / "rankexec-flower")
    return private_dir(Path(f"/tmp/rankexec-flower-{os.getuid()}"))


def node_dir(node_id: int) -> Path:
    return private_dir(base_dir() / f"node-{node_id}")


def write_secret(path: Path) -> bytes:
    secret = secrets.token_bytes(32)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
    os.replace(tmp, path)
    return secret


def _peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ChannelError("the peer closed the channel")
        got += k
    return buf


def send(sock: socket.socket, obj: Any) -> None:
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    sizes = struct.pack(f"<{len(raws)}Q", *[r.nbytes for r in raws])
    sock.sendall(struct.pack("<QQ", len(head), len(raws)) + sizes + head)
    for r in raws:
        sock.sendall(r)


def recv(sock: socket.socket) -> Any:
    n_head, n_bufs = struct.unpack("<QQ", _recv_exact(sock, 16))
    if n_head > 1 << 32 or n_bufs > 1 << 20:
        raise ChannelError("malformed frame")
    sizes = struct.unpack(f"<{n_bufs}Q", _recv_exact(sock, 8 * n_bufs)) if n_bufs else ()
    head = _recv_exact(sock, n_head)
    bufs = [_recv_exact(sock, s) for s in sizes]
    return pickle.loads(head, buffers=bufs)


def accept_auth(conn: socket.socket, secret: bytes, timeout: float = 10.0) -> None:
    """The host's side of the handshake; raises ``ChannelError`` on any mismatch."""
    conn.settimeout(timeout)
    if _peer_uid(conn) != os.getuid():
        raise ChannelError("a process of another user connected")
    nonce = secrets.token_bytes(32)
    conn.sendall(nonce)
    answer = bytes(_recv_exact(conn, 32))
    if not hmac.compare_digest(answer, hmac.new(secret, nonce, hashlib.sha256).digest()):
        raise ChannelError("the peer does not know this launch's secret")
    conn.sendall(b"OK")
    conn.settimeout(None)


def connect(directory: Path, timeout: float = 10.0) -> socket.socket:
    """Connects to the host in ``directory`` and authenticates."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(directory / "host.sock"))
        if _peer_uid(sock) != os.getuid():
            raise ChannelError("the host socket belongs to another user")
        secret = (directory / "secret").read_bytes()
        nonce = bytes(_recv_exact(sock, 32))
        sock.sendall(hmac.new(secret, nonce, hashlib.sha256).digest())
        if bytes(_recv_exact(sock, 2)) != b"OK":
            raise ChannelError("the host refused the handshake")
    except (OSError, ChannelError) as e:
        sock.close()
        raise ChannelError(f"cannot reach the rankexec host in {directory}: {e}") from e
    sock.settimeout(None)
    return sock
