"""Finding a node's ``flower-supernode`` by the port of its Runtime API.

Why: under ``--isolation process`` the SuperNode is not an ancestor of the
``flwr-clientapp`` processes (the site runs the SuperExec, ``rankexec-flower-superexec``
or Flower's own, beside it), yet the node's rankexec host must watch the SuperNode and
read its command line, and ``rankexec-flower-superexec`` must leave with it. Each knows
the Runtime API address it talks to; the SuperNode is the process that listens on it.

Caveats: Linux's ``/proc`` (``/proc/net/tcp``, ``tcp6``, each process's ``fd``); only
processes whose descriptors this user may read are seen (the SuperNode runs as the
same user, or this runs as root). A process is taken only if its command line is a
``flower-supernode``'s.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["listeners", "runtime_port", "supernode_listening_on"]


def _listening_inodes(port: int) -> set[int]:
    """The inodes of the TCP sockets listening on ``port`` (any address), from
    ``/proc/net/tcp`` and ``tcp6`` (state ``0A``)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(int(f[9]))
    return inodes


def listeners(port: int) -> list[int]:
    """The pids of the processes holding a TCP socket that listens on ``port``."""
    inodes = {f"socket:[{i}]" for i in _listening_inodes(port)}
    out: list[int] = []
    if not inodes:
        return out
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (d / "fd").iterdir()):
                out.append(int(d.name))
        except OSError:
            continue
    return out


def _is_supernode(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(Path(a.decode(errors="replace")).name == "flower-supernode" for a in argv[:2])


def supernode_listening_on(port: int) -> int | None:
    """The pid of the ``flower-supernode`` whose socket listens on ``port`` (its Runtime
    API), or ``None``: a process that holds the socket, checked by its command line."""
    return next((pid for pid in listeners(port) if _is_supernode(pid)), None)


def runtime_port(argv: list[str]) -> int | None:
    """The port of ``--runtime-api-address HOST:PORT`` in ``argv`` (a
    ``flwr-clientapp``'s), or ``None``."""
    for i, a in enumerate(argv):
        value = None
        if a == "--runtime-api-address" and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith("--runtime-api-address="):
            value = a.split("=", 1)[1]
        if value is not None:
            try:
                return int(value.rsplit(":", 1)[1])
            except (IndexError, ValueError):
                return None
    return None
