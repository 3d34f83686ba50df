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
import socket
from pathlib import Path

__all__ = ["flag", "listeners", "runtime_address", "runtime_port", "supernode_listening_on"]


def _proc_hex(packed: bytes) -> str:
    """An address as ``/proc/net/tcp{,6}`` writes it: each 32-bit word in host order."""
    return "".join(packed[i : i + 4][::-1].hex() for i in range(0, len(packed), 4)).upper()


def _hex_address(address: str) -> set[str]:
    """How ``/proc/net/tcp{,6}`` writes ``address``, its IPv4-mapped IPv6 form, and the
    wildcard addresses that also accept connections to it."""
    out = {_proc_hex(bytes(4)), _proc_hex(bytes(16))}
    try:
        out.add(_proc_hex(socket.inet_pton(socket.AF_INET, address)))
        out.add(_proc_hex(socket.inet_pton(socket.AF_INET6, "::ffff:" + address)))
    except OSError:
        out.add(_proc_hex(socket.inet_pton(socket.AF_INET6, address)))
    return out


def _listening_inodes(port: int, address: str | None = None) -> set[int]:
    """The inodes of the TCP sockets listening on ``port`` (on ``address`` or a wildcard
    where ``address`` is given), from ``/proc/net/tcp`` and ``tcp6`` (state ``0A``)."""
    wanted = _hex_address(address) if address is not None else None
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) <= 9 or f[3] != "0A":
                continue
            host, _, hexport = f[1].rpartition(":")
            if int(hexport, 16) == port and (wanted is None or host in wanted):
                inodes.add(int(f[9]))
    return inodes


def listeners(port: int, address: str | None = None) -> list[int]:
    """The pids of the processes holding a TCP socket that listens on ``port`` (on
    ``address``, or on any address, where ``address`` is given: an IPv4 or IPv6
    literal)."""
    inodes = {f"socket:[{i}]" for i in _listening_inodes(port, address)}
    out: list[int] = []
    if not inodes:
        return out
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fds = list((d / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:  # a descriptor may close under us: the next one is read all the same
                if os.readlink(fd) in inodes:
                    out.append(int(d.name))
                    break
            except OSError:
                continue
    return out


def _is_supernode(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(Path(a.decode(errors="replace")).name == "flower-supernode" for a in argv[:2])


def supernode_listening_on(port: int, address: str | None = None) -> int | None:
    """The pid of the ``flower-supernode`` whose socket listens on ``port`` (its Runtime
    API; on ``address`` or a wildcard where given), or ``None``: a process that holds
    the socket, checked by its command line."""
    return next((pid for pid in listeners(port, address) if _is_supernode(pid)), None)


def flag(argv: list[str], name: str) -> str | None:
    """The value of ``name VALUE`` or ``name=VALUE`` in a command line, or ``None``."""
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def runtime_address(argv: list[str]) -> tuple[str, int] | None:
    """The host and port of ``--runtime-api-address HOST:PORT`` (or Flower's older
    ``--appio-api-address``) in ``argv``, the host as an IP address literal (a name is
    resolved), or ``None`` where there is none or it does not parse."""
    value = flag(argv, "--runtime-api-address") or flag(argv, "--appio-api-address")
    if value is None:
        return None
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    try:
        number = int(port)
        literal = socket.getaddrinfo(host or "127.0.0.1", None, proto=socket.IPPROTO_TCP)[0][4][0]
    except (ValueError, OSError, IndexError):
        return None
    return str(literal), number


def runtime_port(argv: list[str]) -> int | None:
    """The port of ``runtime_address(argv)``, or ``None``."""
    found = runtime_address(argv)
    return found[1] if found else None
