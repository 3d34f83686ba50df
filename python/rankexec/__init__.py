"""rankexec: rank groups for federated learning, with rank code in Python.

Two ways to write a rank:

- **Component style**: a class with `execute(task, input, ctx, abort)` (and optionally
  `handle_event(event, ctx)`), named `"module:Class"` in the executor's `components`,
  run by `python -m rankexec.worker`.
- **Script style**: `rank = rankexec.init()`, then
  `while (task := rank.receive()) is not None: ... task.reply(...)`.

Your code (building components, event handlers, tasks) runs on the thread that calls
`receive()`, Python's main thread; the Rust runtime keeps the links, aborts and
heartbeats on its own threads, which never wait for the GIL. Blobs arrive as read-only buffers over shared memory
(`np.frombuffer(blob)` copies nothing) and can be produced in place
(`rankexec.SharedBuffer`). `rankexec.tensors` packs and unpacks state dicts.

`rankexec.__version__` is the version of the Rust crates it was built from (the
workspace's), the same that `rankexec --version` prints.
"""

from __future__ import annotations

from collections.abc import Callable

from rankexec import _rankexec
from rankexec._rankexec import (
    Abort,
    Blob,
    BufferSealed,
    Context,
    EventFailed,
    NotARank,
    PrivateBuffer,
    PropConflict,
    Rank,
    RankexecError,
    ReplyError,
    SharedBuffer,
    Task,
    TaskAborted,
    ValueBoundsError,
    __version__,
)
from rankexec._shareable import Shareable

__all__ = [
    "Abort",
    "Blob",
    "BufferSealed",
    "Context",
    "EventFailed",
    "NotARank",
    "PrivateBuffer",
    "PropConflict",
    "Rank",
    "RankexecError",
    "ReplyError",
    "Shareable",
    "SharedBuffer",
    "Task",
    "TaskAborted",
    "ValueBoundsError",
    "__version__",
    "init",
]


def init(on_event: Callable[[str, Context], None] | None = None) -> Rank:
    """Serves this process as a rank (script style) and returns it.

    The executor started this script as its rank program; every task it sends comes
    out of `rank.receive()`. `on_event(event, ctx)`, if given, is called for every
    event the host delivers, inside `rank.receive()` on the thread that calls it (an
    event that arrives while a task runs waits for the next `receive()`).

    Raises `NotARank` when the process was not started by an executor. Answers the
    worker command line (`--check-components ...`) and exits, when given one.
    """
    import json
    import sys

    # Job validation asks every worker program about its components; a script takes
    # every task whatever its component is named.
    if len(sys.argv) > 1 and sys.argv[1] == "--check-components":
        print(json.dumps({"ok": True, "errors": []}))
        sys.exit(0)
    if len(sys.argv) > 1 and sys.argv[1] == "--list-components":
        print("[]")
        sys.exit(0)
    from rankexec._torchrun import export

    export()  # torchrun's RANK, LOCAL_RANK, ... under mpirun and srun too
    return _rankexec.start("script", on_event)
