"""Finding, or starting, the node's host from a ``flwr-clientapp`` process.

Why: Flower 1.42 runs every message in a new ``flwr-clientapp`` process; the first one
that finds no host on its node starts ``python -m rankexec.flower.host`` (in its own
session, with the SuperNode's environment) and every later one connects to it. A file
lock (``start.lock`` in the node's folder) makes concurrent first messages start one.

A host the site runs as its own service user (``RANKEXEC_FLOWER_NODE_DIR``, see
``_peer``) is never started from here: the ClientApp connects to it, checking that it
runs as ``RANKEXEC_FLOWER_HOST_UID``, or fails naming the folder.

Caveats: the SuperNode is found among this process's ancestors by its program name
(``flower-supernode``), or, under ``--isolation process``, as the process that listens
on this ``flwr-clientapp``'s ``--runtime-api-address`` (``_supernode``); under the Simulation Engine the Ray actor's pid is watched
instead. What the host allows is its own reading of the site, never this process's.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rankexec.flower import _channel, _peer
from rankexec.flower._channel import ChannelError
from rankexec.flower._supernode import runtime_address, supernode_listening_on

# rankexec.flower.host's exit code when another host serves the node.
HOST_TAKEN_EXIT = 3

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


def _is_supernode(argv: list[str]) -> bool:
    return any(os.path.basename(a) == "flower-supernode" for a in argv[:2])


def _supernode() -> int | None:
    """The SuperNode this ClientApp process runs under (the host reads its settings):
    an ancestor, or, under ``--isolation process`` (a SuperExec the site runs beside
    the node, such as ``rankexec-flower-superexec``), the ``flower-supernode`` that
    listens on this process's ``--runtime-api-address``."""
    for pid, argv in _ancestors():
        if _is_supernode(argv):
            return pid
    found = runtime_address(sys.argv)
    return supernode_listening_on(found[1], found[0]) if found is not None else None


def connect_or_start(directory: Path, node_id: int) -> Any:
    """An authenticated socket to the node's host, started first if none listens.

    The host is given only where to serve and whom to watch; it reads the site's rules
    itself. A host that finds another live one (exit ``HOST_TAKEN_EXIT``) leaves, and
    this keeps connecting to that one until the start-up deadline. A host the site
    runs (``RANKEXEC_FLOWER_NODE_DIR``) is connected to, never started.
    """
    if _peer.is_service_dir():
        try:
            return _channel.connect(directory, host_uid=_peer.host_uid())
        except ChannelError as e:
            raise ChannelError(
                f"{e} (RANKEXEC_FLOWER_NODE_DIR: the site runs this node's host; a ClientApp"
                " does not start it)"
            ) from e
    with contextlib.suppress(ChannelError):
        return _channel.connect(directory)
    with open(directory / "start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with contextlib.suppress(ChannelError):
            return _channel.connect(directory)
        supernode = _supernode()
        if supernode is None and "ray" in sys.modules:
            # The Simulation Engine: this Ray actor serves messages for the whole run;
            # the host leaves with it.
            supernode = os.getpid()
        argv = [
            sys.executable,
            "-m",
            "rankexec.flower.host",
            "--dir",
            str(directory),
            "--node-id",
            str(node_id),
        ]
        if supernode is not None:
            argv += ["--supernode-pid", str(supernode)]
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
        last: ChannelError | None = None
        while True:
            if (directory / "host.sock").exists():
                try:
                    return _channel.connect(directory)
                except ChannelError as e:
                    last = e
            code = proc.poll()
            if code is not None and code != HOST_TAKEN_EXIT:
                raise ChannelError(
                    f"the rankexec host exited with code {code} (see {directory / 'host.log'})"
                )
            if time.monotonic() > deadline:
                if code is None:
                    proc.kill()
                    proc.wait(10)
                raise ChannelError(
                    f"no rankexec host listened within {_HOST_START_S}s"
                    f" (see {directory / 'host.log'}){f': {last}' if last else ''}"
                )
            time.sleep(0.05)


def request(directory: Path, req: dict[str, Any], node_id: int) -> Any:
    """Sends one request to the node's host (started if needed) and returns its answer.
    Its ``blobs`` are let go of once sent (``req["blobs"]`` is emptied): the memory files
    they map went to the host with the request, and this process need not keep the
    model's pages alive while the ranks run."""
    sock = connect_or_start(directory, node_id)
    with sock:
        _channel.send(sock, req)
        blobs = req.get("blobs")
        if isinstance(blobs, dict):
            blobs.clear()
        return _channel.recv(sock)


def host_status(node_id: int) -> dict[str, Any] | None:
    """The node's host: ``{"pid", "runs", "run_ids", "pids", "busy", "supernode_pid"}``
    (``runs``: run id to ``{"pids", "busy"}``; ``pids``, ``busy``: over every run), or
    None when none runs."""
    try:
        sock = _channel.connect(_peer.client_dir(node_id), timeout=5, host_uid=_peer.host_uid())
    except ChannelError:
        return None
    with sock:
        _channel.send(sock, {"op": "status"})
        out: dict[str, Any] = _channel.recv(sock)
        return out
