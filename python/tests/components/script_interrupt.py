"""A script-style rank that notes a Ctrl-C received while it waits in `receive()`."""

import os
import pathlib

import rankexec

rank = rankexec.init()
out = pathlib.Path(os.environ["OUT_DIR"])
while True:
    try:
        task = rank.receive()
    except KeyboardInterrupt:
        (out / f"interrupted-{rank.rank}").write_text("KeyboardInterrupt in receive()")
        raise SystemExit(0) from None
    if task is None:
        break
    task.reply(meta={"pid": os.getpid()})
