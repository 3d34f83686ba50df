"""Components the tests run as ranks (component style)."""

from __future__ import annotations

import rankexec


class Echo:
    """Returns the input's meta plus who ran it and its args."""

    def __init__(self, tag: str = "none", **extra: object) -> None:
        self.tag = tag
        self.extra = extra
        self.events: list[str] = []

    def execute(self, task, input, ctx, abort):
        meta = dict(input.meta)
        meta.update(
            task=task,
            tag=self.tag,
            rank=ctx.rank,
            world_size=ctx.world_size,
            local_rank=ctx.local_rank,
            events=list(self.events),
        )
        meta.update(self.extra)
        return rankexec.Shareable(meta=meta)

    def handle_event(self, event, ctx):
        self.events.append(event)


class Sized:
    """Returns a blob of `n` bytes (input meta `n`) and its pid: results over the
    group's `max_frame` are refused by the rank itself."""

    def execute(self, task, input, ctx, abort):
        import os

        n = int(input.meta.get("n", 0))
        return rankexec.Shareable(
            meta={"rank": ctx.rank, "pid": os.getpid()}, blobs={"b": b"\x07" * n}
        )


class MasterPort:
    """Returns the rendezvous port its rank was given (`MASTER_PORT`)."""

    def execute(self, task, input, ctx, abort):
        import os

        return rankexec.Shareable(meta={"port": int(os.environ["MASTER_PORT"])})
