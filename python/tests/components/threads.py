"""Components for the thread tests: which thread builds a component and runs its
events and tasks, whether thread-bound state set while building or in an event handler
holds in `execute`, aborts while a handler is slow, and outputs that cannot be sent.

Notes go to `OUT_DIR/<what>-<rank>.json` (`out_dir` arg)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np

import rankexec


def _on_main() -> bool:
    return threading.current_thread() is threading.main_thread()


def _note(out_dir: str, what: str, rank: int, data: dict) -> None:
    path = Path(out_dir) / f"{what}-{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.rename(path)


class ThreadState:
    """Sets thread-bound state in `__init__` (a `threading.local`, torch's grad mode,
    optionally a `SIGUSR1` handler) and in a `START_RUN` handler; `state` reports what
    `execute` sees; `usr1` signals itself; `fire` fires `mine` to the rank's components
    first."""

    def __init__(self, install_signal: bool = False) -> None:
        import torch

        self.local = threading.local()
        self.local.from_init = "init"
        self.built_on_main = _on_main()
        self.usr1 = 0
        if install_signal:
            signal.signal(signal.SIGUSR1, self._on_usr1)  # main thread only
        torch.set_grad_enabled(False)
        self.events: list[list] = []

    def _on_usr1(self, signum, frame) -> None:
        self.usr1 += 1

    def handle_event(self, event, ctx):
        self.events.append([event, _on_main()])
        if event == "_start_run":
            self.local.from_start_run = "start_run"

    def execute(self, task, input, ctx, abort):
        import torch

        if task == "usr1":
            os.kill(os.getpid(), signal.SIGUSR1)
            deadline = time.monotonic() + 30
            while self.usr1 == 0 and time.monotonic() < deadline:
                time.sleep(0.01)  # Python runs the handler on the main thread
        if task == "fire":
            ctx.fire_event("mine")
        return rankexec.Shareable(
            meta={
                "built_on_main": self.built_on_main,
                "execute_on_main": _on_main(),
                "from_init": getattr(self.local, "from_init", None),
                "from_start_run": getattr(self.local, "from_start_run", None),
                "grad_enabled": torch.is_grad_enabled(),
                "events": self.events,
                "usr1": self.usr1,
            }
        )


class SlowEvents:
    """`wait_abort`: notes `waiting`, waits for the abort, notes when it came;
    `handle_event("slow")` sleeps `hold` seconds and notes when it started and ended
    (`time.monotonic`, one clock for every thread); `seen` returns every event seen."""

    def __init__(self, out_dir: str, hold: float = 5.0) -> None:
        self.out_dir = out_dir
        self.hold = hold
        self.seen: list[str] = []

    def handle_event(self, event, ctx):
        self.seen.append(event)
        if event == "slow":
            start = time.monotonic()
            time.sleep(self.hold)
            end = time.monotonic()
            _note(self.out_dir, "slow", ctx.rank, {"start": start, "end": end, "main": _on_main()})

    def execute(self, task, input, ctx, abort):
        if task == "wait_abort":
            _note(self.out_dir, "waiting", ctx.rank, {"pid": os.getpid()})
            got = abort.wait(120)
            _note(self.out_dir, "abort", ctx.rank, {"seen_at": time.monotonic(), "got": got})
            raise rankexec.TaskAborted(abort.reason or "aborted")
        if task == "seen":
            return rankexec.Shareable(meta={"seen": self.seen})
        raise ValueError(f"unknown task {task!r}")


class Outputs:
    """Returns what it is told to: `dict`, `array`, `object_meta` (a Shareable with an
    unsendable meta value), anything else a good Shareable with the pid."""

    def execute(self, task, input, ctx, abort):
        if task == "dict":
            return {"loss": 1.0}
        if task == "array":
            return np.zeros(4, dtype=np.float32)
        if task == "object_meta":
            return rankexec.Shareable(meta={"obj": object()})
        return rankexec.Shareable(meta={"pid": os.getpid()})


class Waits:
    """`abort.wait` with odd timeouts: `inf` and `huge` wait for the abort; `nan` and
    `negative` must not wait. Notes what each saw."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def execute(self, task, input, ctx, abort):
        seen: dict = {"task": task}
        if task == "inf":
            seen["got"] = abort.wait(float("inf"))
        elif task == "huge":
            seen["got"] = abort.wait(1e300)
        elif task == "nan":
            try:
                abort.wait(float("nan"))
                seen["error"] = None
            except ValueError as e:
                seen["error"] = f"ValueError: {e}"
        elif task == "negative":
            seen["got"] = abort.wait(-5.0)
        seen["reason"] = abort.reason
        _note(self.out_dir, task, ctx.rank, seen)
        return rankexec.Shareable(meta={**seen, "pid": os.getpid()})


class CAtExit:
    """Registers a C `atexit` handler that writes `OUT_DIR/c-atexit-<pid>` (a rank that
    ends with `exit(3)` from a Rust thread runs it, concurrently with Python); `spin`
    notes the pid and keeps the main thread busy in Python until aborted."""

    def __init__(self, out_dir: str) -> None:
        import ctypes

        self.out_dir = out_dir
        marker = Path(out_dir) / f"c-atexit-{os.getpid()}"

        def ran(_arg) -> None:
            marker.write_text("the C atexit handler ran")

        # `atexit(3)` is `__cxa_atexit` underneath (glibc exports only the latter).
        self._ran = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(ran)  # lives as long as we do
        register = getattr(ctypes.CDLL(None), "__cxa_atexit")  # no name mangling
        if register(self._ran, None, None) != 0:
            raise OSError("cannot register the atexit handler")

    def execute(self, task, input, ctx, abort):
        _note(self.out_dir, "spinning", ctx.rank, {"pid": os.getpid()})
        deadline = time.monotonic() + 60
        n = 0
        while not abort.triggered and time.monotonic() < deadline:
            n += 1  # Python bytecode, not a wait
        return rankexec.Shareable(meta={"n": n})


class LongTask:
    """`work`: notes `busy`, works `secs` seconds (or until aborted) and returns the
    events handled so far; `handle_event` notes each event with the time it ran."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.events: list[list] = []

    def handle_event(self, event, ctx):
        self.events.append([event, time.monotonic()])

    def execute(self, task, input, ctx, abort):
        _note(self.out_dir, "busy", ctx.rank, {"pid": os.getpid()})
        abort.wait(float(input.meta.get("secs", 0)))
        return rankexec.Shareable(meta={"ended": time.monotonic(), "events": self.events})
