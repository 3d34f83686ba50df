"""`RankGroup.abort()` from another thread while `execute` is still preparing its
input (converting it and copying a large blob into shared memory) applies to that
task: it counts as in flight from the start. Before, such an abort found no task,
returned False and did nothing; the task then ran to the end."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import TARGET

from rankexec.host import Aborted, RankGroup

WORKER = str(TARGET / "release" / "rankexec-worker")


class Gate:
    """An integer metadata value whose conversion (`__index__`, called by `execute`
    while it prepares the input) waits until another thread has called `abort()`."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self.entered = threading.Event()
        self.aborted = threading.Event()
        self.abort_returned: bool | None = None

    def __index__(self) -> int:
        self.entered.set()
        assert self.aborted.wait(60), "the aborting thread did not run"
        return 7

    def abort_from_another_thread(self) -> threading.Thread:
        def run() -> None:
            if self.entered.wait(60):
                self.abort_returned = self.group.abort("stop while preparing")
            self.aborted.set()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t


def test_abort_while_the_input_is_prepared_aborts_that_task(tmp_path):
    cfg = {
        "executor_id": "ab",
        "num_of_processes": 2,
        "components": [{"id": "ab", "path": "Echo", "args": {}}],
        "worker": {"program": WORKER},
        "log_dir": str(tmp_path),
    }
    big = np.ones(64 << 20, dtype=np.uint8)
    with RankGroup(cfg, workspace=str(tmp_path)) as g:
        g.start()
        pids = g.pids()
        gate = Gate(g)
        t = gate.abort_from_another_thread()
        with pytest.raises(Aborted) as e:
            g.execute("t", {"n": gate}, {"w": big})
        t.join(60)
        assert gate.abort_returned is True
        assert e.value.reason == "stop while preparing"
        # Nothing left in flight; the group runs the next task on the same processes.
        assert g.abort() is False
        r = g.execute("t", {"n": 1}, {"w": big})
        assert r.meta["n"] == 1 and g.pids() == pids
