"""The Flower node host under pressure (issue 39, items 2 and 4): a real host process
(``python -m rankexec.flower.host``), no ranks.

- out of descriptors, ``accept`` fails with ``EMFILE``: the host says so once, backs
  off, and serves again when descriptors are free, keeping its socket, secret and pid
  file; at start it raises its soft descriptor limit to the hard one;
- a connection that never authenticates is closed at the handshake deadline, one that
  authenticates and sends nothing at the request deadline; connections past the cap in
  their handshake at once are closed at once;
- a frame that declares more than it sends costs the host what arrived, not what was
  declared; one that declares more than the channel's limits is refused, naming them.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import docrun
import pytest
from proc_checks import owned

from rankexec.flower import _channel, host_status

from .helpers import pid_alive, wait_until

_FILES = ("host.sock", "secret", "host.pid")
# Starts the host with a soft descriptor limit of argv[1] (exec keeps it).
_LOW_NOFILE = (
    "import os, resource, sys\n"
    "_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
    "resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), hard))\n"
    "os.execv(sys.executable, [sys.executable, '-m', 'rankexec.flower.host', *sys.argv[2:]])\n"
)


@pytest.fixture(autouse=True)
def _base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANKEXEC_FLOWER_DIR", str(tmp_path / "rx"))


def _start(node: int, tmp_path: Path, *extra: str, soft: int | None = None):
    """The host for ``node`` (its log is ``tmp_path/host-<node>.log``), listening."""
    args = ["--node-id", str(node), "--lease", "120", *extra]
    if soft is None:
        argv = [sys.executable, "-m", "rankexec.flower.host", *args]
    else:
        argv = [sys.executable, "-c", _LOW_NOFILE, str(soft), *args]
    with open(tmp_path / f"host-{node}.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc


def _log(tmp_path: Path, node: int) -> str:
    return (tmp_path / f"host-{node}.log").read_text(errors="replace")


def _listening(proc, node: int, tmp_path: Path) -> Path:
    wait_until(lambda: host_status(node) is not None or proc.poll() is not None, 60, "the host up")
    assert proc.poll() is None, _log(tmp_path, node)
    return _channel.node_dir(node)


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError(f"no VmRSS for pid {pid}")


def _soft_nofile(pid: int) -> int:
    return resource.prlimit(pid, resource.RLIMIT_NOFILE)[0]


def _readable(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def _raw(directory: Path) -> socket.socket:
    """A connection to the host that has not answered its nonce (yet)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    with _channel.socket_path(directory) as address:
        sock.connect(address)
    return sock


def _recv_all(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes, or fewer where the peer closed (the socket's timeout bounds it)."""
    out = b""
    while len(out) < n:
        try:
            got = sock.recv(n - len(out))
        except ConnectionResetError:
            break
        if not got:
            break
        out += got
    return out


def _answer(sock: socket.socket, directory: Path, nonce: bytes) -> None:
    """The client's side of the handshake, as ``_channel.connect`` does it."""
    secret = (directory / "secret").read_bytes()
    sock.sendall(hmac.new(secret, nonce, hashlib.sha256).digest())
    assert _recv_all(sock, 2) == b"OK"


def _stop(proc, directory: Path) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    assert not set(_FILES) & {p.name for p in directory.iterdir()}


# ---- descriptors (item 4) --------------------------------------------------------------


def test_the_host_raises_its_soft_descriptor_limit(tmp_path: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if want <= 256:
        pytest.skip(f"the hard descriptor limit ({hard}) leaves nothing to raise")
    node = 7401
    with owned(_start(node, tmp_path, soft=256)) as proc:
        directory = _listening(proc, node, tmp_path)
        log = _log(tmp_path, node)
        print(f"\n[flower-host] {[ln for ln in log.splitlines() if 'descriptor' in ln]}")
        assert _soft_nofile(proc.pid) == want, log
        assert f"descriptor limit raised from 256 to {want}" in log, log
        _stop(proc, directory)


def test_accept_out_of_descriptors_backs_off_and_serves_again(tmp_path: Path) -> None:
    """The host's soft descriptor limit is lowered from outside to just above what it
    uses; connections fill it until ``accept`` fails with EMFILE. The host logs it once,
    keeps its files and serves the queued connection once the others close."""
    node = 7402
    with owned(_start(node, tmp_path)) as proc:
        directory = _listening(proc, node, tmp_path)
        pid = proc.pid
        _, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (_fds(pid) + 4, hard))
        held: list[socket.socket] = []
        probe = None
        try:
            for _ in range(32):
                sock = _raw(directory)
                # The host accepts it (its nonce arrives), or its accept fails (logged).
                wait_until(
                    lambda s=sock: _readable(s) or "accept failed" in _log(tmp_path, node),
                    30,
                    "the host to accept the connection or to fail to",
                )
                nonce = _recv_all(sock, 32) if _readable(sock) else b""
                if len(nonce) < 32:  # queued, or dropped with the listening socket
                    probe = sock
                    break
                _answer(sock, directory, nonce)
                held.append(sock)
            assert probe is not None, f"accept never failed with {len(held)} connections open"
            log = _log(tmp_path, node)
            print(f"\n[flower-host] {len(held)} connections filled the host's descriptors")
            assert "accept failed" in log, f"the host said nothing of its failed accept:\n{log}"
            assert "Too many open files" in log and "EMFILE" in log, log
            assert pid_alive(pid), "the host died of one failed accept"
            assert not _readable(probe), "the queued connection was dropped"
            for name in _FILES:
                assert (directory / name).exists(), f"{name} went while the host lives"
        finally:
            for sock in held:
                sock.close()
        # Descriptors are free again: the queued connection is served.
        wait_until(lambda: _readable(probe), 30, "the queued connection accepted")
        with probe:
            _answer(probe, directory, _recv_all(probe, 32))
            _channel.send(probe, {"op": "status"})
            assert _channel.recv(probe)["pid"] == pid
        st = host_status(node)
        assert st is not None and st["pid"] == pid
        log = _log(tmp_path, node)
        print("\n".join("  " + ln for ln in log.splitlines() if "accept" in ln))
        assert log.count("accept failed") == 1, "one log line per episode"
        assert "accepting again after" in log, log
        _stop(proc, directory)


# ---- handshakes (item 4) ---------------------------------------------------------------


def test_a_silent_connection_is_closed_at_the_handshake_deadline(tmp_path: Path) -> None:
    node = 7403
    args = ("--handshake-deadline", "0.5", "--request-deadline", "0.5")
    with owned(_start(node, tmp_path, *args)) as proc:
        directory = _listening(proc, node, tmp_path)
        # Never answers its nonce (the deadline starts after the connect).
        start = time.monotonic()
        with _raw(directory) as sock:
            assert len(_recv_all(sock, 32)) == 32
            assert _recv_all(sock, 1) == b"", "the host closes it"
            took = time.monotonic() - start
        print(f"\n[flower-host] a silent connection closed after {took:.2f}s")
        assert 0.5 <= took < 10, took
        # Authenticates, then never sends its request (the deadline starts after the OK).
        with _raw(directory) as sock:
            nonce = _recv_all(sock, 32)
            start = time.monotonic()
            _answer(sock, directory, nonce)
            assert _recv_all(sock, 1) == b""
            took = time.monotonic() - start
        print(f"[flower-host] a connection without a request closed after {took:.2f}s")
        assert 0.5 <= took < 10, took
        log = _log(tmp_path, node)
        assert "the handshake (deadline 0.5s) did not arrive within its deadline" in log, log
        assert "a frame did not arrive within its deadline" in log, log
        assert host_status(node) is not None
        _stop(proc, directory)


def test_connections_past_the_handshake_cap_are_closed_at_once(tmp_path: Path) -> None:
    node = 7404
    args = ("--max-unauthenticated", "2", "--handshake-deadline", "60")
    with owned(_start(node, tmp_path, *args)) as proc:
        directory = _listening(proc, node, tmp_path)
        waiting = [_raw(directory) for _ in range(2)]
        nonces = [_recv_all(s, 32) for s in waiting]
        assert all(len(n) == 32 for n in nonces)
        with _raw(directory) as extra:
            assert _recv_all(extra, 32) == b"", "closed without a nonce"
        log = _log(tmp_path, node)
        print(f"\n[flower-host] {log.splitlines()[-1]}")
        assert "2 connections are in their handshake at once (--max-unauthenticated)" in log
        # One handshake ends: a slot is free again.
        with waiting[0] as sock:
            _answer(sock, directory, nonces[0])
            _channel.send(sock, {"op": "status"})
            assert _channel.recv(sock)["pid"] == proc.pid
        assert host_status(node) is not None
        assert "taking connections again (1 closed" in _log(tmp_path, node)
        waiting[1].close()
        _stop(proc, directory)


# ---- frames (item 2) -------------------------------------------------------------------


def _declare(sock: socket.socket, head: int, bufs: list[tuple[int, int, int]]) -> None:
    sock.sendall(
        struct.pack("<QQQ", head, len(bufs), 0) + b"".join(struct.pack("<QqQ", *b) for b in bufs)
    )


def _growth_until_answered(sock: socket.socket, pid: int, before: int) -> int:
    """Waits for the host's answer on ``sock`` (or for its memory to pass 64 MiB more
    than ``before``) and returns how much its resident memory grew."""
    wait_until(lambda: _readable(sock) or _rss(pid) - before > 64 << 20, 30, "the host's answer")
    return _rss(pid) - before


def test_a_frame_costs_what_arrives_and_past_the_limits_is_refused(tmp_path: Path) -> None:
    node = 7405
    mib = 1 << 20
    with owned(_start(node, tmp_path)) as proc:
        directory = _listening(proc, node, tmp_path)
        pid = proc.pid
        # A pickle of 256 MiB declared, nothing of it sent.
        with _channel.connect(directory) as sock:
            before = _rss(pid)
            _declare(sock, 256 * mib, [])
            grew = _growth_until_answered(sock, pid, before)
            print(f"\n[flower-frames] 256 MiB pickle declared: the host grew {grew / mib:.1f} MiB")
            assert grew < 4 * mib, f"the host committed {grew / mib:.0f} MiB for unsent bytes"
            out = _channel.recv(sock)
            print(f"[flower-frames] answer: {out['error']}")
            assert "the limit is 16777216 bytes (16 MiB" in out["error"], out
            assert "MAX_HEAD" in out["error"], out
            shown = docrun.log_lines("docs/flower-site.md", "frame-refused")
            assert not docrun.missing_lines(shown, out["error"]), (shown, out["error"])
        # A raw buffer of 256 MiB declared: large buffers travel as memory files.
        with _channel.connect(directory) as sock:
            before = _rss(pid)
            _declare(sock, 16, [(256 * mib, -1, 0)])
            grew = _growth_until_answered(sock, pid, before)
            assert grew < 4 * mib, f"the host committed {grew / mib:.0f} MiB for unsent bytes"
            out = _channel.recv(sock)
            print(f"[flower-frames] answer: {out['error']}")
            assert "raw buffers are under 65536 bytes (64 KiB" in out["error"], out
            assert "memory files" in out["error"], out
        # Under the limit: 15 MiB declared, 2 MiB sent. ``sendall`` returns once the host
        # has read all but a socket buffer of it, so its reading has begun.
        with _channel.connect(directory) as sock:
            before = _rss(pid)
            _declare(sock, 15 * mib, [])
            sock.sendall(b"\0" * (2 * mib))
            grew = _rss(pid) - before
            print(
                f"[flower-frames] 15 MiB declared, 2 MiB sent: the host grew {grew / mib:.1f} MiB"
            )
            assert grew < 6 * mib, f"the host committed {grew / mib:.0f} MiB for 2 MiB sent"
        assert pid_alive(pid) and host_status(node)["pid"] == pid
        log = _log(tmp_path, node)
        assert log.count("a request was refused") == 2, log
        _stop(proc, directory)


def test_a_frame_larger_than_a_chunk_arrives_whole() -> None:
    """A pickle of more than one growth chunk (3 MiB and a byte, in band) and raw
    buffers below ``SHARE_FROM`` arrive exactly as sent."""
    blob = os.urandom((3 << 20) + 1)
    small = [os.urandom(n) for n in (1, 4096, _channel.SHARE_FROM - 1)]
    a, b = socket.socketpair()
    with a, b:
        obj = {"blob": blob, "small": [pickle.PickleBuffer(s) for s in small]}
        sender = threading.Thread(target=_channel.send, args=(a, obj))
        sender.start()
        out = _channel.recv(b, time.monotonic() + 30)
        sender.join(30)
    assert out["blob"] == blob
    assert [bytes(x) for x in out["small"]] == small
