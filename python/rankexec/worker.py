"""`python -m rankexec.worker`: a rank program that runs Python components.

Name a component in the executor's `components` as
`{"id": "t", "path": "my_module:Trainer", "args": {"lr": 0.1}}` (or
`"path": "trainer.py:Trainer"`), with `"worker": {"program": "python", "args":
["-m", "rankexec.worker"]}`. The class is built with `args` as keyword arguments and
must have `execute(task, input, ctx, abort)`, returning a `rankexec.Shareable` (or
None); `handle_event(event, ctx)` is optional. The class is built, and its
`handle_event` and `execute` run, on the process's main thread.

With arguments it answers the worker command line: `--check-components JSON`,
`--list-components`, `--version`, `--help`.
"""

from __future__ import annotations

import sys
from typing import Any

from rankexec import _rankexec
from rankexec._rankexec import ReplyError
from rankexec._torchrun import export

__all__ = ["main", "serve"]


def serve(rank: _rankexec.Rank) -> int:
    """Runs every task on its component until the host closes the group.

    Everything runs on this (the main) thread: `receive()` builds the components and
    runs their `handle_event` between tasks. An output that cannot be sent (not a
    `Shareable`, an unsendable meta value) fails that task only, with the reason.
    """
    while (task := rank.receive()) is not None:
        _serve_one(task)
        # The task (its input's memory files) and its result go now, not when the next
        # task arrives: between rounds a rank holds no model it was sent or sent back.
        del task
    return rank.exit_code or 0


def _serve_one(task: Any) -> None:
    component: Any = task.component  # always set in component style
    try:
        out = component.execute(task.name, task.input, task.ctx, task.abort)
    except BaseException as e:
        if e.__traceback__ is not None:
            e.__traceback__ = e.__traceback__.tb_next  # start at the user's frame
        task.fail(e)
        if not isinstance(e, Exception):
            raise  # KeyboardInterrupt, SystemExit: the rank stops
        return
    try:
        task.reply(out)
    except ReplyError:
        # `reply` already failed the task with why; the rank serves the next one.
        return


def main(argv: list[str] | None = None) -> int:
    """``python -m rankexec.worker``: with arguments, the worker command line
    (``--list-components``, ``--check-components JSON|-``, ``--version``, ``--help``);
    without, serves this process as a component-style rank until the host closes the
    group, and returns its exit code."""
    args = sys.argv[1:] if argv is None else argv
    if args:
        return _rankexec.worker_cli(args)
    export()  # torchrun's RANK, LOCAL_RANK, ... under mpirun and srun too
    return serve(_rankexec.start("components"))


if __name__ == "__main__":
    sys.exit(main())
