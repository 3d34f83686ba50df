"""A TCP port for a server started later by another process (a SuperLink, a SuperNode,
FLARE's ports, a torchrun rendezvous).

Why: the usual "bind port 0, read it, close" hands out a port from the kernel's
ephemeral range (``net.ipv4.ip_local_port_range``, 32768-60999 by default), the range
every outgoing connection takes its local port from. Between the pick and the server's
bind, any ``connect()`` on the machine may take that port, and the server then fails
with ``EADDRINUSE`` (a CI run lost a Flower SuperNode so: its port had become the
local end of some HTTP client's connection). This module picks at random below the
ephemeral range (as the ``portpicker`` crate does for the executor's rendezvous ports,
in 15000-25000; here 25000 up to the range's start, so the two never meet), checks
the port is free on the address, and never hands the same port out twice in one
process.

Caveats: a port is free when picked, not reserved: two processes may still pick the
same one (about one in several thousand for a pair of picks), or a program may bind it
before its server does. Where nothing below the ephemeral range is free, the kernel's
pick is returned.
"""

from __future__ import annotations

import random
import socket
import threading

__all__ = ["free_port"]

_LOW = 25000
_given: set[int] = set()
_lock = threading.Lock()
# Its own source: a program that seeds `random` (a trainer's set_seed) must not make
# two processes pick the same ports in the same order.
_random = random.SystemRandom()


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _family(addr: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in addr else socket.AF_INET


def _free(addr: str, port: int) -> bool:
    with socket.socket(_family(addr)) as s:
        try:
            s.bind((addr, port))
        except OSError:
            return False
    return True


def free_port(addr: str = "127.0.0.1") -> int:
    """A TCP port nothing is bound to on ``addr`` now, outside the ephemeral range,
    not given out before by this process."""
    high = _ephemeral_start()
    with _lock:
        if high - _LOW > 64:
            for _ in range(64):
                port = _random.randrange(_LOW, high)
                wildcard = "::" if _family(addr) == socket.AF_INET6 else "0.0.0.0"
                if port not in _given and _free(addr, port) and _free(wildcard, port):
                    _given.add(port)
                    return port
        with socket.socket(_family(addr)) as s:
            s.bind((addr, 0))
            port = int(s.getsockname()[1])
        _given.add(port)
        return port
