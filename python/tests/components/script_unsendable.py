"""A script-style rank whose replies may hold values that cannot be sent: a list that
contains itself (task `cycle`) or dicts nested 65 deep (task `deep`). The failed reply
fails the task (ReplyError here); the rank goes on to the next task."""

import os

import rankexec


def nested(levels: int) -> dict:
    d: object = 1
    for _ in range(levels):
        d = {"a": d}
    return d  # type: ignore[return-value]


rank = rankexec.init()
while (task := rank.receive()) is not None:
    meta: dict = {"pid": os.getpid(), "task": task.name}
    if task.name == "cycle":
        loop: list = [1]
        loop.append(loop)
        meta["x"] = loop
    elif task.name == "deep":
        meta["d"] = nested(65)
    elif task.name == "deep_prop":
        try:
            task.ctx.set_prop("p", nested(65))
        except rankexec.ValueBoundsError as e:
            task.fail(e)
            continue
    try:
        task.reply(meta=meta)
    except rankexec.ReplyError:
        pass
