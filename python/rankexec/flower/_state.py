"""Per-rank state shared between the rank component and the public helpers.

Why: Flower's handler signature has no abort argument, so the rank component keeps
the running task's rankexec ``Abort`` here for ``abort_requested()``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["abort_requested", "current_abort"]

current_abort: Any = None


def abort_requested() -> bool:
    """On a rank, inside a handler: whether rankexec aborted the message (``flwr stop``,
    the SuperNode's end). Check it between steps of a long handler to stop at once;
    a rank that never checks is killed after ``deadlines.abort_grace``."""
    abort = current_abort
    return bool(abort) if abort is not None else False
