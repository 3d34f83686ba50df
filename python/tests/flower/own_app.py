"""The app of test_rank0_owns.py (copied into a package of the test's own): a handler
that updates the model it receives in place and replies with it, which with
``arrays_to="rank0"`` is rank 0's own memory files, taken and sent without a copy. The
``how`` record asks it to wait while the test looks at the node's memory files
(``hold``) and to add arrays that are not the message's (``extra``).
"""

import json
import os
import select

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict

from rankexec.flower import ClientApp, ndarrays, shared_array_record

# Rank 0 alone receives the arrays, as its own writable copy.
app = ClientApp(
    num_of_processes=2, arrays_to="rank0", deadlines={"startup": "120s", "task": "120s"}
)


@app.train()
def train(msg: Message, context) -> Message:
    how = msg.content["how"]
    record = msg.content["arrays"]
    if int(os.environ["RANK"]) != 0:
        _tell(how, "rank1", {"rank": 1, "n": len(record)})  # empty: not this rank's
        return Message(RecordDict(), reply_to=msg)
    arrays = ndarrays(record, writable=True)  # views of rank 0's own files
    info = {
        "n": len(arrays),
        "writable": all(a.flags.writeable for a in arrays),
        "inodes": sorted({_inode(a.ctypes.data) for a in arrays}),
    }
    _hold(how, info)
    for a in arrays:
        a += 1  # in place: the files themselves
    out = dict(zip(record.keys(), arrays, strict=True))
    if how["extra"]:
        out["extra"] = np.arange(1000, dtype=np.float32)  # not the message's: copied
        out["flat0"] = arrays[0].reshape(-1)[:10]  # a part of one: copied
    # The same arrays back: their files, sealed, no copy.
    reply = shared_array_record(out)
    return Message(RecordDict({"arrays": reply, "info": ConfigRecord(info)}), reply_to=msg)


def _inode(address: int) -> int:
    """The inode of the mapping that holds ``address``."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                return int(parts[4])
    return 0


def _tell(how, name: str, info: dict) -> None:
    if how["hold"]:
        with open(os.path.join(how["hold"], name + ".tmp"), "w") as f:
            json.dump(info, f)
        os.rename(os.path.join(how["hold"], name + ".tmp"), os.path.join(how["hold"], name))


def _hold(how, info: dict) -> None:
    """Tells the test the arrays are taken, then waits (60 s at most) until it has
    looked: it opens the FIFO ``go`` for writing."""
    if not how["hold"]:
        return
    fd = os.open(os.path.join(how["hold"], "go"), os.O_RDONLY | os.O_NONBLOCK)
    try:
        _tell(how, "ready", info)  # after the FIFO is open: the test's open finds it
        select.select([fd], [], [], 60)
    finally:
        os.close(fd)
