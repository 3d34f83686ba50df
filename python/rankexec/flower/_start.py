"""Finding, or starting, the node's host from a ``flwr-clientapp`` process.

Why: Flower 1.42 runs every message in a new ``flwr-clientapp`` process; the first one
that finds no host on its node starts ``python -m rankexec.flower.host`` (in its own
session, with the SuperNode's environment) and every later one connects to it. A file
lock (``start.lock`` in the node's folder) makes concurrent first messages start one.

Caveats: the SuperNode is found among this process's ancestors by its program name
(``flower-supernode``); under the Simulation Engine the Ray actor's pid is watched
instead. What the host allows is its own reading of the site, never this process's.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rankexec.flower import _channel
from rankexec.flower._channel import ChannelError

__all__ = ["connect_or_start", "host_status", "request"]

_HOST_START_S = 60.0


def _ancestors() -> Iterable[tuple[int, list[str]]]:
    pid = os.getppid()
    for _ in range(16):
        if pid <= 1:
            return
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return
        yield pid, [a.decode(errors="replace") for a in argv if a]
        ppid = [ln for ln in status.splitlines() if ln.startswith("PPid:")]
        pid = int(ppid[0].split()[1]) if ppid else 0


def _supernode() -> tuple[int | None, str | None]:
    """The SuperNode this ClientApp process runs under, and its insecure SuperLink."""
    for pid, argv in _ancestors():
        if any(os.path.basename(a) == "flower-supernode" for a in argv[:2]):
            link = None
            if "--insecure" in argv:
                for i, a in enumerate(argv):
                    if a == "--superlink" and i + 1 < len(argv):
                        link = argv[i + 1]
                    elif a.startswith("--superlink="):
                        link = a.split("=", 1)[1]
            return pid, link
    return None, None


def connect_or_start(directory: Path, node_id: int, site: Mapping[str, Any]) -> Any:
    """An authenticated socket to the node's host, started first if none listens."""
    with contextlib.suppress(ChannelError):
        return _channel.connect(directory)
    with open(directory / "start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with contextlib.suppress(ChannelError):
            return _channel.connect(directory)
        supernode, link = _supernode()
        if supernode is None and "ray" in sys.modules:
            # The Simulation Engine: this Ray actor serves messages for the whole run;
            # the host leaves with it.
            supernode = os.getpid()
        link = site.get("superlink") or link
        argv = [
            sys.executable,
            "-m",
            "rankexec.flower.host",
            "--dir",
            str(directory),
            "--node-id",
            str(node_id),
            "--lease",
            str(float(site.get("lease_s", 300.0))),
        ]
        if supernode is not None:
            argv += ["--supernode-pid", str(supernode)]
        if link:
            argv += ["--superlink", str(link)]
        with contextlib.suppress(FileNotFoundError):
            (directory / "host.sock").unlink()
        with open(directory / "host.log", "ab") as log:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        deadline = time.monotonic() + _HOST_START_S
        while True:
            if (directory / "host.sock").exists():
                with contextlib.suppress(ChannelError):
                    return _channel.connect(directory)
            code = proc.poll()
            if code is not None:
                raise ChannelError(
                    f"the rankexec host exited with code {code} (see {directory / 'host.log'})"
                )
            if time.monotonic() > deadline:
                proc.kill()
                raise ChannelError(f"the rankexec host did not listen within {_HOST_START_S}s")
            time.sleep(0.05)


def request(directory: Path, req: dict[str, Any], node_id: int, site: Any) -> Any:
    """Sends one request to the node's host (started if needed) and returns its answer."""
    sock = connect_or_start(directory, node_id, site)
    with sock:
        _channel.send(sock, req)
        return _channel.recv(sock)


def host_status(node_id: int) -> dict[str, Any] | None:
    """The node's host: ``{"pid", "run_id", "pids", "busy", "supernode_pid"}``, or None
    when none runs."""
    try:
        sock = _channel.connect(_channel.node_dir(node_id), timeout=5)
    except ChannelError:
        return None
    with sock:
        _channel.send(sock, {"op": "status"})
        out: dict[str, Any] = _channel.recv(sock)
        return out
