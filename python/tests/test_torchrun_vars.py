"""torchrun's variables and GPU numbering on Python ranks under every launcher.

A script written for torchrun reads ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and
``LOCAL_WORLD_SIZE`` and calls ``torch.cuda.set_device(LOCAL_RANK)``. Under mpirun
(which sets only ``OMPI_COMM_WORLD_*``) the rank runtime fills them in before the
script's own code runs, and ``CUDA_VISIBLE_DEVICES`` lists the group's GPUs so that
index ``LOCAL_RANK`` is the rank's own. The site declares 4 GPUs
(``RANKEXEC_GPU_INVENTORY``): no GPU is needed. The Rust side of the same contract,
with best fit out of index order and 1-8 ranks, is ``tests/gpu_numbering.rs``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap

import pytest
from conftest import wait_until

from rankexec.host import RankGroup

SCRIPT = """
    import json, os, sys
    import rankexec

    rank = rankexec.init()
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
            "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "OMPI_COMM_WORLD_RANK")
    path = os.path.join(sys.argv[1], f"env.{os.getpid()}")
    with open(path + ".tmp", "w") as f:
        json.dump({k: os.environ.get(k) for k in keys}, f)
    os.rename(path + ".tmp", path)
    while (task := rank.receive()) is not None:
        task.reply(meta={})
"""


def _launchers() -> list[tuple[str, dict]]:
    out: list[tuple[str, dict]] = [("builtin", {"builtin": None})]
    extra = ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    out.append(("mpirun", {"mpirun": {"extra_args": extra}}))
    return out


@pytest.mark.parametrize(("name", "launcher"), _launchers(), ids=lambda v: str(v)[:8])
def test_python_ranks_get_torchrun_s_variables_and_gpu_numbering(
    tmp_path, monkeypatch, name, launcher
):
    if name == "mpirun" and shutil.which("mpirun") is None:
        pytest.skip("no mpirun (Open MPI) in PATH")
    monkeypatch.setenv("RANKEXEC_GPU_INVENTORY", "4x16GiB")
    # This process's own GPU settings restrict the inventory (a test before this one in
    # the same process may have left a FLARE grant's): none here.
    for var in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "RANKEXEC_GPU_GRANT"):
        monkeypatch.delenv(var, raising=False)
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(SCRIPT))
    marks = tmp_path / "marks"
    marks.mkdir()
    world = 3
    cfg = {
        "executor_id": "t",
        "num_of_processes": world,
        "components": [{"id": "t", "path": "script", "args": {}}],
        "worker": {"program": sys.executable, "args": [str(script), str(marks)]},
        "launcher": launcher if launcher != {"builtin": None} else "builtin",
        "log_dir": str(tmp_path / "logs"),
        "deadlines": {"startup": "120s", "task": "60s"},
    }
    group = RankGroup(cfg, workspace=str(tmp_path / "run"))
    group.start()
    try:
        group.execute("t", {}, {})
        wait_until(lambda: len(list(marks.glob("env.*[0-9]"))) == world, 30, "every rank wrote")
    finally:
        group.close()
    envs = [json.loads(p.read_text()) for p in marks.glob("env.*[0-9]")]
    print(name, json.dumps(envs))
    assert sorted(int(e["RANK"]) for e in envs) == list(range(world))
    for e in envs:
        assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) == (str(world), str(world))
        if name == "mpirun":
            assert e["OMPI_COMM_WORLD_RANK"] == e["RANK"], "the launcher's own rank"
        visible = e["CUDA_VISIBLE_DEVICES"].split(",")
        # A declared inventory's GPU i is CUDA device i; best fit of equal GPUs is by index.
        assert visible == ["0", "1", "2"], e
        assert visible[int(e["LOCAL_RANK"])] == e["LOCAL_RANK"]
        assert e["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_the_launcher_s_own_torchrun_variables_are_kept(monkeypatch):
    from rankexec._torchrun import export

    # What Open MPI sets for rank 3 of 4, 1 of 2 on this host; the group's size.
    for k, v in {
        "RANKEXEC_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "LOCAL_RANK": "7",  # a launcher's own numbering wins
    }.items():
        monkeypatch.setenv(k, v)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANKEXEC_RANK", "RANKEXEC_RANK_SOURCE"):
        monkeypatch.delenv(k, raising=False)
    export()
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    assert [os.environ[k] for k in names] == ["3", "7", "4", "2"]
