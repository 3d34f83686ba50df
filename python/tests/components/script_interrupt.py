"""A script-style rank that notes a Ctrl-C received while it waits in `receive()`."""

import os
import pathlib

import rankexec

rank = rankexec.init()
out = pathlib.Path(os.environ["OUT_DIR"])
answered = 0
while True:
    try:
        # The test signals once this file says how many tasks were answered and the
        # main thread sleeps: inside receive() (a signal between the two is caught here
        # too, never in reply()).
        (out / f"waiting-{rank.rank}").write_text(str(answered))
        task = rank.receive()
    except KeyboardInterrupt:
        (out / f"interrupted-{rank.rank}").write_text("KeyboardInterrupt in receive()")
        raise SystemExit(0) from None
    if task is None:
        break
    task.reply(meta={"pid": os.getpid()})
    answered += 1
