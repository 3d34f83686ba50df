"""Process helpers for the Flower tests: the suite's own (python/tests/proc_checks.py),
and ``leave_nothing``, every Deployment fixture's teardown."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from proc_checks import pid_alive, pids_with_env, wait_until

__all__ = ["leave_nothing", "pid_alive", "pids_with_env", "wait_until"]


def leave_nothing(root: Path, tag: str, timeout: float = 60.0) -> list[int]:
    """After a Deployment's ``stop()``: waits up to ``timeout`` for every process that
    carries ``root`` in its environment to go (60 s: a Deployment's own processes took
    over 30 s to go under a loaded CI once), then names and SIGKILLs whatever is left,
    even when the wait failed. Returns the pids that were left."""
    left: list[int] = []
    try:
        wait_until(lambda: not pids_with_env(str(root)), timeout, "no process of the test left")
    finally:
        left = _kill_what_is_left(root, tag)
        # A parent killed in the same pass may have started a child after the scan (a
        # CI run once kept Ray's DashboardAgent and RuntimeEnvAgent, orphaned, past the
        # suite): scan again until nothing is left, 10 s at most.
        deadline = time.monotonic() + 10.0
        while left and time.monotonic() < deadline:
            time.sleep(0.5)
            more = _kill_what_is_left(root, tag)
            if not more:
                break
            left += more
    return left


def _kill_what_is_left(root: Path, tag: str) -> list[int]:
    """Names and SIGKILLs every process that carries ``root`` in its environment."""
    left = pids_with_env(str(root))
    for pid in left:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            print(f"[{tag}] left after stop: {pid} {cmd.decode(errors='replace')[:200]}")
        except OSError:
            pass
    for pid in left:  # never leave anything behind, even when the test fails
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # gone since the scan
    return left
