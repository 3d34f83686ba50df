"""Values without bounds: a list that contains itself, or lists and dicts nested deeper
than the receiver decodes (64), are refused where they are converted, with a typed
error naming the path, and the group keeps its processes.

Before, a self-referential value overflowed the stack (SIGSEGV of the host or the
rank) and a value nested 65 deep reached every rank, which each broke the protocol:
the group was torn down.
"""

from __future__ import annotations

import os

import pytest
from conftest import COMPONENTS, PYBIN, TARGET, executor_config

import rankexec
from rankexec.host import RankFailed, RankGroup, ValueBoundsError

WORKER = str(TARGET / "release" / "rankexec-worker")


def nested(levels: int) -> object:
    d: object = 1
    for _ in range(levels):
        d = {"a": d}
    return d


def cycle() -> list:
    loop: list = [1]
    loop.append(loop)
    return loop


def test_host_refuses_unsendable_values_and_the_group_survives(tmp_path):
    cfg = {
        "executor_id": "v",
        "num_of_processes": 2,
        "components": [{"id": "v", "path": "Echo", "args": {}}],
        "worker": {"program": WORKER},
        "log_dir": str(tmp_path),
    }
    with RankGroup(cfg, workspace=str(tmp_path)) as g:
        g.start()
        pids = g.pids()
        with pytest.raises(ValueBoundsError) as e:
            g.execute("t", {"x": cycle()})
        assert str(e.value) == "meta.x[1]: refers to itself"
        with pytest.raises(ValueBoundsError) as e:
            g.execute("t", {"deep": nested(65)})
        assert str(e.value) == "meta.deep" + ".a" * 64 + ": nested deeper than 64"
        selfref: dict = {}
        selfref["me"] = selfref
        with pytest.raises(ValueBoundsError, match=r"^meta\.d\.me: refers to itself$"):
            g.execute("t", {"d": selfref})
        with pytest.raises(ValueBoundsError, match=r"^props\.p\[1\]: refers to itself$"):
            g.execute("t", {}, props={"p": cycle()})
        with pytest.raises(ValueBoundsError, match=r"^props\.p(\.a)+: nested deeper than 64$"):
            g.fire_event("ev", {"p": nested(65)})
        assert issubclass(ValueBoundsError, rankexec.RankexecError)
        # The limit itself travels; the same processes run it.
        r = g.execute("t", {"ok": nested(64), "shared": [[1], [1]]})
        assert r.meta["ok"] == nested(64)
        assert g.pids() == pids


def test_rank_reply_with_unsendable_values_fails_the_task_and_the_rank_lives(tmp_path):
    cfg = executor_config(
        "script", 2, log_dir=tmp_path, program=[str(COMPONENTS / "script_unsendable.py")]
    )
    old_path = os.environ.get("PATH", "")
    os.environ["PATH"] = PYBIN + os.pathsep + old_path
    try:
        with RankGroup(cfg, workspace=str(tmp_path)) as g:
            g.start()
            pids = g.pids()
            with pytest.raises(RankFailed) as e:
                g.execute("cycle")
            assert e.value.error_class == "exception", e.value.report
            assert "meta.x[1]: refers to itself" in e.value.remote_message
            with pytest.raises(RankFailed) as e:
                g.execute("deep")
            assert "meta.d" + ".a" * 64 + ": nested deeper than 64" in e.value.remote_message
            with pytest.raises(RankFailed) as e:
                g.execute("deep_prop")
            assert "p" + ".a" * 64 + ": nested deeper than 64" in e.value.remote_message
            r = g.execute("ok")
            assert r.meta["task"] == "ok" and r.meta["pid"] in pids
            assert g.pids() == pids
    finally:
        os.environ["PATH"] = old_path
