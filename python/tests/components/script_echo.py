"""A script-style rank: the loop of a ported torchrun script."""

import os

import rankexec

events = []
rank = rankexec.init(on_event=lambda event, ctx: events.append(event))
steps = 0
while (task := rank.receive()) is not None:
    steps += 1
    if task.name == "fail":
        try:
            raise RuntimeError(f"script failed on rank {rank.rank}")
        except RuntimeError as e:
            task.fail(e)
        continue
    task.reply(
        meta={
            "task": task.name,
            "rank": rank.rank,
            "world_size": rank.world_size,
            "steps": steps,
            "x": task.meta.get("x"),
            "events": list(events),
            "pid": os.getpid(),
        }
    )
