"""Per-rank state shared between the rank component and the public helpers.

Why: Flower's handler signature has no abort argument, so the rank component keeps
the running task's rankexec ``Abort`` here for ``rankexec.flower.abort_requested()``.
"""

from __future__ import annotations

from typing import Any

current_abort: Any = None
