"""What the OS says about processes, for the Python suites (python/tests, and the
flower/ and flare/ packages under it): a plain module, not conftest.py, so a package
with a conftest.py of its own imports the same functions."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def pids_with_env(fragment: str) -> list[int]:
    """Live processes whose environment mentions `fragment` (every rank, and a launcher,
    has the group's log directory in `RANKEXEC_LOG_DIR`)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if fragment.encode() in (d / "environ").read_bytes() and pid_alive(int(d.name)):
                found.append(int(d.name))
        except OSError:
            continue
    return found


def wait_until(cond, timeout: float, what: str) -> None:
    """Waits for `cond()` with a deadline (short sleeps between checks of OS state)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


@contextmanager
def owned(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """Owns a child a test started (a host, a simulator, a launcher): on any exit of
    the `with` block, an exception included, a child still running is SIGKILLed (its
    whole process group when it leads one, as `start_new_session=True` makes it) and
    reaped. Its ranks then leave on their own (their connections close); the suite's
    leak check (scripts/leak-check.sh) names any that does not."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            try:
                # Our own unreaped child: its pid (and the group it leads) is still its.
                if os.getpgid(proc.pid) == proc.pid:
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    proc.kill()
            except ProcessLookupError:
                pass
            proc.wait(timeout=60)
