"""``rankexec._ports.free_port``: the ports the tests give Flower, FLARE and torchrun
come from below the kernel's ephemeral range (where no outgoing connection takes them
between the pick and the server's bind), are free when given, and are never given
twice by one process."""

from __future__ import annotations

import socket

import pytest

import rankexec._ports as ports
from rankexec._ports import _ephemeral_start, free_port


def test_ports_are_below_the_ephemeral_range_free_and_distinct() -> None:
    start = _ephemeral_start()
    if start - 25000 <= 64:
        pytest.skip(f"the ephemeral range starts at {start}: free_port takes the kernel's pick")
    held = []
    try:
        picks = []
        for _ in range(200):
            port = free_port()
            assert 25000 <= port < start, (port, start)
            s = socket.socket()
            s.bind(("127.0.0.1", port))  # free when given: the server's bind works
            held.append(s)
            picks.append(port)
        assert len(set(picks)) == len(picks)
    finally:
        for s in held:
            s.close()


def test_a_port_someone_listens_on_is_not_given(monkeypatch) -> None:
    """The range narrowed to its last 80 ports, every one of them held by a listener (or
    by someone else): the pick avoids them all and falls back to the kernel's."""
    start = _ephemeral_start()
    monkeypatch.setattr(ports, "_LOW", start - 80)
    listeners = []
    try:
        for port in range(start - 80, start):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # bound by someone else: taken all the same
                s.close()
                continue
            s.listen()
            listeners.append(s)
        port = free_port()
        assert not start - 80 <= port < start, port
        assert port >= start  # the kernel's pick, from the ephemeral range
    finally:
        for s in listeners:
            s.close()


def test_ipv6_ports_are_given_too() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    port = free_port("::1")
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", port))
