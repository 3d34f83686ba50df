"""A rank component whose own event handler makes the event thread die: it raises
pyo3's PanicException (obtained from a real Rust panic: `Abort.wait(inf)`), which the
Rust side resumes as a panic on the thread that delivers the event. `Context.fire_event`
must then fail, not wait forever on the closed channel."""

from __future__ import annotations

import resource
import time

import rankexec


def cpu_seconds() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


class EventThreadDies:
    def __init__(self) -> None:
        self.panic_cls: type[BaseException] | None = None

    def handle_event(self, event, ctx):
        if event == "die" and self.panic_cls is not None:
            raise self.panic_cls("the event thread dies here")

    def execute(self, task, input, ctx, abort):
        try:
            abort.wait(float("inf"))
        except BaseException as e:  # noqa: BLE001 - pyo3's PanicException
            self.panic_cls = type(e)
        assert self.panic_cls is not None and self.panic_cls.__name__ == "PanicException"
        cpu0, t0 = cpu_seconds(), time.monotonic()
        try:
            ctx.fire_event("die")
            error = None
        except rankexec.EventFailed as e:
            error = str(e)
        return rankexec.Shareable(
            meta={
                "error": error,
                "cpu_s": cpu_seconds() - cpu0,
                "wall_s": time.monotonic() - t0,
            }
        )
