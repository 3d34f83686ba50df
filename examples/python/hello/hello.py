"""A Python rank component: `python -m rankexec.worker` builds `Hello(greeting=...)` in
every rank and runs each task on it."""

import numpy as np
import rankexec


class Hello:
    def __init__(self, greeting: str = "hello") -> None:
        self.greeting = greeting

    def execute(self, task, input, ctx, abort):
        if task == "fail" and ctx.rank == 1:
            raise ValueError(f"rank {ctx.rank} cannot do that")
        # Blobs arrive as read-only buffers over shared memory: no copy.
        total = sum(int(np.frombuffer(b, dtype=np.uint8).sum()) for b in input.blobs.values())
        return rankexec.Shareable(
            meta={
                "greeting": f"{self.greeting} from rank {ctx.rank} of {ctx.world_size}",
                "round": input.meta.get("round"),
                "blob_sum": total,
            }
        )

    def handle_event(self, event, ctx):
        print(f"rank {ctx.rank} got event {event}", flush=True)
