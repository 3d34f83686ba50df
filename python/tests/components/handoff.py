"""Rank components for the task hand-over tests: one that reports how often each of
the rank's threads has been switched to, and one that forks and lets its child carry
on in the worker loop."""

from __future__ import annotations

import os
import time
from pathlib import Path

import rankexec


def thread_switches() -> dict[str, int]:
    """Voluntary context switches so far, by thread name (from /proc)."""
    out: dict[str, int] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            status = (task / "status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                out[name] = out.get(name, 0) + int(line.split()[1])
    return out


class Switches:
    def execute(self, task, input, ctx, abort):
        return rankexec.Shareable(meta={"switches": thread_switches(), "pid": os.getpid()})


class ForkCarriesOn:
    """Forks; the child returns from `execute` like the parent, so it carries on in the
    worker loop (replies, then asks for the next task). The parent waits (bounded) for
    the child to end and says how it ended."""

    def execute(self, task, input, ctx, abort):
        pid = os.fork()
        if pid == 0:
            return rankexec.Shareable(meta={"who": "child", "pid": os.getpid()})
        deadline = time.monotonic() + 60
        status = None
        while time.monotonic() < deadline:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = os.waitstatus_to_exitcode(st)
                break
            abort.wait(0.05)
        if status is None:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        return rankexec.Shareable(
            meta={"who": "parent", "pid": os.getpid(), "child_status": status}
        )
