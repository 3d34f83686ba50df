"""Process helpers for the Flower tests: the suite's own (python/tests/proc_checks.py),
``leave_nothing`` (every Deployment fixture's teardown), ``served_app`` (an app module
of a test's own, served by a real host and ranks) and ``mapping_of``."""

from __future__ import annotations

import importlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from proc_checks import pid_alive, pids_with_env, wait_until

__all__ = [
    "leave_nothing",
    "mapping_of",
    "pid_alive",
    "pids_with_env",
    "served_app",
    "wait_until",
]


def served_app(tmp_path: Path, monkeypatch: Any, package: str, source: str) -> Iterator[Any]:
    """A fixture's body: ``source`` as ``<package>.client_app`` in ``tmp_path/app``, its
    ``app`` yielded (the node's host and ranks run under ``tmp_path/rx``); afterwards the
    module is forgotten and the host, which outlives its group by its idle lease, is
    stopped by SIGTERM (each pid verified by the test's folder in its environment)
    until none is left."""
    pkg = tmp_path / "app" / package
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "client_app.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path / "app"))
    monkeypatch.setenv("RANKEXEC_FLOWER_DIR", str(tmp_path / "rx"))
    monkeypatch.setenv("RANKEXEC_LOG", "warn")
    yield importlib.import_module(f"{package}.client_app").app
    sys.modules.pop(f"{package}.client_app", None)
    sys.modules.pop(package, None)
    mine = str(tmp_path / "rx")
    for pid in pids_with_env(mine):
        os.kill(pid, signal.SIGTERM)
    wait_until(lambda: not pids_with_env(mine), 30, "this test's host to exit")


def mapping_of(address: int) -> tuple[str, int]:
    """The path and inode of this process's mapping that holds ``address``."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                return (parts[5].strip() if len(parts) > 5 else ""), int(parts[4])
    return "", 0


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
