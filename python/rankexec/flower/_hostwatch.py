"""The Flower node host's watches: what ends a run's group or the host itself without a
request asking for it.

Why a module of its own: the host's lifetime is decided here, on two daemon threads
that ``Host.serve`` starts:

- the sentinel (``sentinel``) waits, with no timeout, on the SuperNode's pidfd (its
  death shuts the host down at once, its groups killed), on the lock socket (a second
  host asking who holds the node: accepted and closed, it read this pid), and on the
  host's wake pipe (written by ``shutdown``);
- the watch (``watch``) wakes every quarter second: the node's folder and files
  (``NodeFiles.lost``), each run's status at the SuperLink (every couple of seconds per
  run: a finished run's group closes, a task in flight of it is aborted first) and its
  idle lease, the host's own lease (not for a ``--service`` host), and the SuperNode's
  pid through ``/proc`` where no pidfd could be had.

Caveats: ``/proc`` is polled, so without a pidfd the SuperNode's death is seen within a
quarter second, not at once. A run whose task is in flight is not ended under it: its
task is aborted and its serving thread closes the group when the abort lands.
"""

from __future__ import annotations

import contextlib
import os
import select
import time
from typing import TYPE_CHECKING

from rankexec.flower._hostlog import log

if TYPE_CHECKING:
    from rankexec.flower._runs import Run
    from rankexec.flower.host import Host

__all__ = ["open_pidfd", "pid_alive", "sentinel", "watch"]


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False


def open_pidfd(pid: int) -> int | None:
    """A pidfd of ``pid`` (readable once it exits), or None where none can be had (an
    old kernel, the process already gone): then the watch reads ``/proc`` instead."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def watch(host: Host) -> None:
    """Every quarter second: the node's folder and files (``NodeFiles.lost``), each
    run's status and lease, the host's own lease; the SuperNode's pid too where no pidfd
    could be had (the sentinel watches it otherwise)."""
    next_status: dict[int, float] = {}
    while not host.stopping.wait(0.25):
        if (
            host.pidfd is None
            and host.supernode_pid is not None
            and not pid_alive(host.supernode_pid)
        ):
            host.shutdown(f"the SuperNode (pid {host.supernode_pid}) is gone", node_gone=True)
            return
        lost = host.node.lost()
        if lost is not None:
            host.shutdown(lost)
            return
        now = time.monotonic()
        with host.lock:
            runs = list(host.runs.values())
            idle = now - host.last_active
        for run in runs:
            # Every run the host knows, with or without a live group (one whose task
            # was aborted, or whose rank failed): a finished run is forgotten at once.
            if now >= next_status.get(run.run_id, 0.0):
                next_status[run.run_id] = now + 2.0
                if _run_finished(host, run.run_id):
                    _run_ended(host, run, f"run {run.run_id} is finished (flwr stop or its end)")
                    continue
            if now - run.last_active > host.lease_s and run.lock.acquire(blocking=False):
                try:
                    if not run.ended and time.monotonic() - run.last_active > host.lease_s:
                        host.end_run(run, "the idle lease ran out")
                finally:
                    run.lock.release()
        if not runs and idle > host.lease_s and not host.service:
            host.shutdown("idle, no run, the lease ran out")
            return


def _run_finished(host: Host, run_id: int) -> bool:
    """Whether the SuperLink says the run is over (``flwr stop`` or its end)."""
    return host.runcheck is not None and host.runcheck.finished(run_id) is True


def _run_ended(host: Host, run: Run, why: str) -> None:
    if run.lock.acquire(blocking=False):
        try:
            if not run.ended:
                host.end_run(run, why)
        finally:
            run.lock.release()
        return
    # A task of the run is in flight: abort it; its serving thread closes the group
    # when the abort lands, and the next check ends the run.
    log(f"aborting run {run.run_id}'s task in flight: {why}")
    run.abort(why)


def sentinel(host: Host) -> None:
    """Wakes for the SuperNode's death (its pidfd turns readable), for a host that
    asks who holds the node (a connection to the lock socket: accepted and closed,
    it read this pid from it), or for this host's stop (``shutdown`` writes the wake
    pipe). The wait has no timeout: one of these ends it, nothing else is waited for."""
    poller = select.poll()
    poller.register(host.wake_r, select.POLLIN)
    if host.pidfd is not None:
        poller.register(host.pidfd, select.POLLIN)
    lock = host.node.lock_sock
    if lock is not None:
        poller.register(lock.fileno(), select.POLLIN)
    while not host.stopping.is_set():
        for fd, _events in poller.poll():
            if fd == host.pidfd:
                why = f"the SuperNode (pid {host.supernode_pid}) is gone"
                host.shutdown(why, node_gone=True)
                return
            if lock is not None and fd == lock.fileno():
                with contextlib.suppress(OSError):
                    lock.accept()[0].close()
