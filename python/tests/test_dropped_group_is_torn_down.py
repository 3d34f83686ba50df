"""A `RankGroup` dropped without `close()` is torn down when the garbage collector
frees it, also when its `on_event` callback refers back to its owner (the FLARE
adapter builds exactly that cycle). Before, the native group hid the callback from
the collector: the cycle was never collected and the ranks lived until the host
process exited."""

from __future__ import annotations

import gc
import os

from conftest import TARGET, pid_alive, wait_until

from rankexec.host import RankGroup

WORKER = str(TARGET / "release" / "rankexec-worker")


class Owner:
    """Holds a group whose event callback is one of its own methods (a cycle)."""

    def __init__(self, cfg: dict, workspace: str) -> None:
        self.events: list[str] = []
        self.group = RankGroup(cfg, on_event=self.on_event, workspace=workspace)

    def on_event(self, event, rank, props):
        self.events.append(event)


def test_a_group_in_a_reference_cycle_is_torn_down_by_the_collector(tmp_path):
    cfg = {
        "executor_id": "gc",
        "num_of_processes": 2,
        "components": [{"id": "gc", "path": "Echo", "args": {}}],
        "worker": {"program": WORKER},
        "log_dir": str(tmp_path),
    }
    owner = Owner(cfg, str(tmp_path))
    owner.group.start()
    pids = owner.group.pids()
    assert len(pids) == 2 and all(pid_alive(p) for p in pids)
    assert owner.group.execute("t", {"x": 1}).meta["x"] == 1
    del owner
    gc.collect()
    wait_until(
        lambda: not any(pid_alive(p) or os.path.exists(f"/proc/{p}") for p in pids),
        60,
        f"ranks {pids} to be gone after the group was collected",
    )
