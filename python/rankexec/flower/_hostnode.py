"""The Flower node host's hold on its node: the lock that makes it the node's only host,
and the files it makes in the node's folder (``host.sock``, ``secret``, ``host.pid``).

Why a module of its own: "one host per node, whatever happens to the folder" is its own
concern, apart from serving requests. ``NodeFiles`` takes the node (``take``) for the
process's life, or raises ``HostTaken``: first a lock socket (``lock_name``: a Linux
abstract Unix socket named from the uid and the folder's path: no file, so removing the
folder does not free it, and it goes with the process), then ``host.lock`` (an exclusive
``flock``, with the pid in it: hosts in other network namespaces, while the folder
lives). A second host reads the holder's pid from the lock socket (``SO_PEERCRED``). It
records the inode of each file the host makes, removes only those (``unlink_ours``), and
says when the folder, ``host.lock``, the socket or the secret is no longer what the
host made or opened (``lost``): such a host serves nobody and shuts down.

Caveats: abstract socket names have no owner, so another user's process can take the
name first: the host then refuses to start, naming that pid and uid. ``lost`` is a
check, not a notification: the host's watch calls it every quarter second. Rank logs of
a run whose site keeps none go to ``scratch_logs``, a folder on disk, falling back to
the node's folder (logged once) when that cannot be made.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import socket
from pathlib import Path

from rankexec.flower import _channel
from rankexec.flower._hostlog import log

__all__ = ["MADE", "HostTaken", "NodeFiles", "lock_holder", "lock_name"]

#: The files a host makes in the node's folder and removes when it stops.
MADE = ("host.sock", "secret", "host.pid")


class HostTaken(RuntimeError):
    """Another live host holds the node (its lock socket, or its ``host.lock``)."""


def lock_name(directory: Path) -> bytes:
    """The node's lock: a Linux abstract Unix socket name (no file, so nothing can
    remove it under the host; it goes with the host's process). From this uid and the
    node folder's path (hashed): the hosts of one folder exclude each other whatever
    happens to the folder, while separate base folders (separate deployments, test
    suites) stay apart."""
    path = os.fsencode(os.path.abspath(directory))
    digest = hashlib.sha256(path).hexdigest()[:24]
    return f"\0rankexec-flower-{os.getuid()}-{directory.name[:40]}-{digest}".encode()


def lock_holder(name: bytes) -> str:
    """Who holds the lock socket ``name``: its listener's pid (``SO_PEERCRED``), with
    its uid when that is not ours; ``unknown`` when it does not answer in time."""
    import struct

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2.0)
        try:
            sock.connect(name)
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        except OSError:
            return "unknown"
    pid, uid, _gid = struct.unpack("3i", creds)
    return str(pid) if uid == os.getuid() else f"{pid}, of uid {uid}, not this user"


class NodeFiles:
    """One host's node folder: its lock, and the files it made there."""

    def __init__(self, directory: Path, node_id: int) -> None:
        self.dir = directory
        self.node_id = node_id
        self.made: dict[str, int] = {}  # file name -> inode of what this host created
        self.lock_fd: int | None = None
        self.lock_sock: socket.socket | None = None  # the node's abstract lock
        self.dir_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the folder
        self._scratch_warned = False

    def take(self) -> None:
        """Holds the node for this process's life, or raises ``HostTaken``: first its
        lock socket (``lock_name``: an abstract Unix socket, which no removal of the
        folder frees; a second host reads the holder's pid from it), then ``host.lock``
        (an exclusive ``flock``, with the pid in it: hosts in other network namespaces,
        while the folder lives)."""
        name = lock_name(self.dir)
        lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            lock.bind(name)
        except OSError as e:
            lock.close()
            if e.errno != errno.EADDRINUSE:
                raise
            raise HostTaken(
                f"another rankexec host (pid {lock_holder(name)}) serves node"
                f" {self.node_id} from {self.dir} (it holds the lock socket"
                f" @{name[1:].decode()}); this one does not start"
            ) from None
        lock.listen(8)
        lock.setblocking(False)
        self.lock_sock = lock
        path = self.dir / "host.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            self.release()
            raise HostTaken(
                f"another rankexec host (pid {other}) serves node {self.node_id} from"
                f" {self.dir} (it holds {path}); this one does not start"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self.lock_fd = fd
        # The lock is ours, so a socket or secret left here is a dead host's.
        for made in MADE:
            with contextlib.suppress(FileNotFoundError):
                (self.dir / made).unlink()

    def release(self) -> None:
        """Lets the node go (the process's exit does it too)."""
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None
        if self.lock_sock is not None:
            self.lock_sock.close()
            self.lock_sock = None

    def note_dir(self) -> None:
        """Records the folder's identity, which ``lost`` compares with from then on."""
        st = self.dir.lstat()
        self.dir_id = (st.st_dev, st.st_ino)

    def note_made(self, name: str) -> None:
        self.made[name] = (self.dir / name).lstat().st_ino

    def unlink_ours(self, name: str) -> None:
        ino = self.made.pop(name, None)
        path = self.dir / name
        with contextlib.suppress(OSError):
            if ino is not None and path.lstat().st_ino == ino:
                path.unlink()

    def scratch_logs(self) -> Path:
        """Where a run's rank logs go when the site keeps none: the node's folder when
        the operator chose it (``RANKEXEC_FLOWER_DIR``), else a private folder on disk
        (``$XDG_STATE_HOME/rankexec-flower/node-<id>``, else ``~/.local/state/...``),
        not the default node folder, which is memory (tmpfs under ``$XDG_RUNTIME_DIR``)
        beside the user's admission ledger; the run's logs are removed with its group
        all the same. A home that cannot be written falls back to the node's folder,
        logged once."""
        if os.environ.get("RANKEXEC_FLOWER_DIR"):
            return self.dir  # the operator chose the node's folder: the logs go there too
        state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
        folder = Path(state) / "rankexec-flower" / f"node-{self.node_id}"
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            return _channel.private_dir(folder)
        except (OSError, _channel.ChannelError) as e:
            if not self._scratch_warned:
                self._scratch_warned = True
                log(f"rank logs stay in the node's folder {self.dir}: {e}")
            return self.dir

    def lost(self) -> str | None:
        """Why the node's folder, ``host.lock``, socket or secret is no longer what this
        host made or opened (removed, or replaced), or None while they all are: a host
        whose folder is gone serves nobody (its socket cannot be reached) and leaves."""
        if self.dir_id is None:
            return None
        try:
            st = self.dir.lstat()
        except OSError:
            return f"its folder {self.dir} was removed"
        if (st.st_dev, st.st_ino) != self.dir_id:
            return f"its folder {self.dir} was replaced"
        made = dict(self.made)
        if self.lock_fd is not None:
            with contextlib.suppress(OSError):
                made["host.lock"] = os.fstat(self.lock_fd).st_ino
        for name in ("host.lock", "host.sock", "secret"):
            if name not in made:
                continue
            try:
                ino = (self.dir / name).lstat().st_ino
            except OSError:
                return f"its folder {self.dir} lost its {name} (removed)"
            if ino != made[name]:
                return f"its folder {self.dir} holds another {name} (replaced)"
        return None
