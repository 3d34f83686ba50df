"""Crash detection and abort latency of a rank group, idle and saturated, in one run
(BENCHMARKS.md, "Crash detection and abort latency, idle and saturated").

Drives `rankexec.RankGroup` (the host FLARE's executors use) with Rust `Sleep` ranks
(`rankexec-worker`, a 60 s task that honours the abort). Per trial, for each load (idle;
`2 x cores + 1` busy shell loops started once the group is ready and reaped after the
trial), three figures:

- `crash_detect`: the last rank is SIGKILLed mid-task; time from the kill until
  `execute` raises the typed error (`RankFailed`, checked).
- `abort_task`: `RankGroup.abort()` from another thread; time until `execute` raises
  `Aborted` (raised once every rank has stopped its task); the same pids then run the
  next task (checked: the group is kept).
- `close_in_flight`: `close()` with a task in flight; time until it returns with every
  rank reaped (checked in `/proc`).

Trials alternate idle and saturated, so both loads see the same background (other
processes on the machine). Prints one JSON record per measurement and a median table.

    python benchmarks/crash_abort.py --worker target/release/rankexec-worker \\
        --ranks 2 8 --trials 7 [--json benchmarks/crash-abort.jsonl]

Caveats: Linux only (`/proc`); needs the `rankexec` package in the interpreter (the
venv). "Mid-task" means the host has sent the task and waited 50 ms; on a saturated
machine a rank may not yet have received it, which still ends the task the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rankexec.host import Aborted, RankexecError, RankFailed, RankGroup

REPO = Path(__file__).resolve().parent.parent
GIVE_UP = 60.0


class Unexpected(Exception):
    """A measurement that did not end as it should (the run stops)."""


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def hogs_start() -> list[subprocess.Popen[bytes]]:
    n = 2 * (os.cpu_count() or 1) + 1
    return [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(n)]


def hogs_stop(hogs: list[subprocess.Popen[bytes]]) -> None:
    for h in hogs:
        h.kill()
    for h in hogs:
        h.wait()


def config(worker: str, n: int, log_dir: str) -> dict[str, Any]:
    return {
        "executor_id": "bench",
        "num_of_processes": n,
        "components": [{"id": "bench", "path": "Sleep", "args": {"secs": 60}}],
        "worker": {"program": worker},
        "log_dir": log_dir,
        "gpu": {"mode": "none"},
        "deadlines": {"startup": "120s", "task": "300s"},
    }


class InFlight:
    """`execute` in a thread; records when it returned and what it raised."""

    def __init__(self, g: RankGroup) -> None:
        self.g = g
        self.ended = threading.Event()
        self.at = 0.0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + GIVE_UP
        while g.phase != "busy":
            if time.monotonic() > deadline or self.ended.is_set():
                raise Unexpected(f"the task never started (phase {g.phase})")
            time.sleep(0.001)
        time.sleep(0.05)  # let the ranks take the task

    def _run(self) -> None:
        try:
            self.g.execute("sleep")
        except RankexecError as e:  # recorded and checked by the caller
            self.error = e
        self.at = time.perf_counter()
        self.ended.set()

    def wait(self) -> float:
        if not self.ended.wait(GIVE_UP):
            raise Unexpected(f"the task did not end within {GIVE_UP} s")
        return self.at


def with_group(
    worker: str, n: int, busy: bool, tmp: str, measure: Any
) -> tuple[float, dict[str, Any]]:
    with RankGroup(config(worker, n, tmp), workspace=tmp) as g:
        g.start()
        hogs = hogs_start() if busy else []
        try:
            if busy:
                time.sleep(0.5)  # let the busy loops take the CPUs
            return measure(g)
        finally:
            hogs_stop(hogs)


def crash_detect(g: RankGroup) -> tuple[float, dict[str, Any]]:
    victim = g.pids()[-1]
    task = InFlight(g)
    t0 = time.perf_counter()
    os.kill(victim, signal.SIGKILL)
    t1 = task.wait()
    if not isinstance(task.error, RankFailed):
        raise Unexpected(f"expected RankFailed, got {task.error!r}")
    return t1 - t0, {"error": type(task.error).__name__}


def abort_task(g: RankGroup) -> tuple[float, dict[str, Any]]:
    pids = g.pids()
    task = InFlight(g)
    t0 = time.perf_counter()
    if not g.abort("bench"):
        raise Unexpected("abort found no task in flight")
    t1 = task.wait()
    if not isinstance(task.error, Aborted):
        raise Unexpected(f"expected Aborted, got {task.error!r}")
    # The group is kept: the same ranks take the next task (aborted at once again).
    kept = g.pids() == pids
    again = InFlight(g)
    g.abort("bench")
    again.wait()
    if not kept or g.pids() != pids:
        raise Unexpected("the group was not kept after the abort")
    return t1 - t0, {"error": type(task.error).__name__, "kept": kept}


def close_in_flight(g: RankGroup) -> tuple[float, dict[str, Any]]:
    pids = g.pids()
    task = InFlight(g)
    t0 = time.perf_counter()
    report = g.close()
    t1 = time.perf_counter()
    task.wait()
    left = [p for p in pids if alive(p)]
    if left:
        raise Unexpected(f"ranks survived close(): {left}")
    return t1 - t0, {
        "escalated": report.get("escalated"),
        "error": type(task.error).__name__,
    }


FIGURES = {
    "crash_detect": crash_detect,
    "abort_task": abort_task,
    "close_in_flight": close_in_flight,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", default=str(REPO / "target/release/rankexec-worker"))
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--json", type=Path, help="also append the records to this file")
    a = ap.parse_args()
    if not Path(a.worker).exists():
        print(f"{a.worker} is missing: cargo build --release --bins", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    out = a.json.open("a") if a.json else None
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    for n in a.ranks:
        for name, fn in FIGURES.items():
            for i in range(a.trials):
                for busy in (False, True):
                    with tempfile.TemporaryDirectory() as tmp:
                        secs, extra = with_group(a.worker, n, busy, tmp, fn)
                    rec = {
                        "figure": name,
                        "ranks": n,
                        "busy": 2 * (os.cpu_count() or 1) + 1 if busy else 0,
                        "trial": i,
                        "ms": round(secs * 1000, 3),
                        "at": started,
                        "load1": round(os.getloadavg()[0], 2),
                        **extra,
                    }
                    rows.append(rec)
                    line = json.dumps(rec)
                    print(line, flush=True)
                    if out:
                        out.write(line + "\n")
    if out:
        out.close()
    print("\n| figure | ranks | idle | saturated |\n|---|---|---|---|")
    for n in a.ranks:
        for name in FIGURES:
            cells = []
            for busy in (False, True):
                ms = [
                    r["ms"]
                    for r in rows
                    if r["figure"] == name
                    and r["ranks"] == n
                    and bool(r["busy"]) == busy
                ]
                cells.append(f"{statistics.median(ms):.1f} ms ({max(ms):.1f})")
            print(f"| {name} | {n} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
