"""Which program a rank group started from Python runs (rankexec._paths).

The executor looks a bare program name up next to the running executable, then on
PATH. For a Python host that executable is the interpreter's real file: for a venv's
`bin/python` it is the base interpreter's, whose `python` lacks the venv's packages.
`RankGroup` looks bare names up next to `sys.executable` first (and in the wheel's
`rankexec/_bin/` for `rankexec-worker` and `rankexec`: tests/test_wheel.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from conftest import COMPONENTS, pid_alive

from rankexec import _paths
from rankexec.host import RankGroup


def test_python_names_this_environments_interpreter(tmp_path):
    config = {
        "executor_id": "e",
        "num_of_processes": 2,
        "components": [{"id": "e", "path": f"{COMPONENTS / 'echo.py'}:Echo"}],
        "worker": {"program": "python", "args": ["-m", "rankexec.worker"]},
        "gpu": {"mode": "none"},
    }
    with RankGroup(config, workspace=str(tmp_path)) as group:
        group.start()
        pids = group.pids()
        programs = {os.readlink(f"/proc/{p}/exe") for p in pids}
        meta = group.execute("t", {"x": 1}).meta
    print(f"sys.executable {sys.executable}; ranks run {sorted(programs)}; rank 0: {meta}")
    assert meta["world_size"] == 2 and meta["x"] == 1
    assert programs == {os.path.realpath(sys.executable)}
    assert not any(pid_alive(p) for p in pids)


def test_resolve_worker_rewrites_bare_names_only():
    beside = str(Path(sys.executable).parent / "python")
    cfg = {"worker": {"program": "python", "args": ["-m", "rankexec.worker"]}, "x": 1}
    out = _paths.resolve_worker(cfg)
    assert out["worker"] == {"program": beside, "args": ["-m", "rankexec.worker"]}
    assert out["x"] == 1 and cfg["worker"]["program"] == "python"  # not modified
    for unchanged in (
        {"worker": {"program": "/bin/true"}},
        {"worker": {"program": "no-such-program-anywhere"}},
        {"worker": "not a mapping"},
    ):
        assert _paths.resolve_worker(unchanged) is unchanged
    # A checkout's package has no _bin/: the default worker is left to the executor.
    assert _paths.binary("rankexec-worker") is None
    assert _paths.resolve_worker({}) == {}
