"""A Python rank written as a script: a ported torchrun loop keeps its shape."""

import rankexec

rank = rankexec.init()
print(f"rank {rank.rank} of {rank.world_size} ready", flush=True)
while (task := rank.receive()) is not None:
    if task.abort.triggered:
        task.fail(rankexec.TaskAborted("aborted before it started"))
        continue
    task.reply(meta={"task": task.name, "rank": rank.rank, "round": task.meta.get("round")})
