"""FLARE's own plain Client API DDP example as rank groups, run as its user runs it.

``examples/flare/multi-gpu-pt`` is NVFlare's ``examples/advanced/multi-gpu/pt``
(``import nvflare.client as flare``, ``dist.init_process_group``, rank 0 broadcasting
``flare.is_running()`` with ``broadcast_object_list``, ``DDP(device_ids=[local_rank])``,
DataLoader workers forked by the script) with ``use_rank_groups(recipe,
num_of_processes=2)`` in ``job.py`` in place of its per-site torchrun commands, gloo and
the CPU where there is no GPU, and CIFAR-10 from a local folder. ``python job.py``
under FLARE's simulator, 2 sites x 2 ranks, 2 rounds: both rounds complete on both
sites, rank 0 alone talks to FLARE, every rank trains, the group ends on its own.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import docrun
import pytest

from .flare_helpers import REPO, SIM_CAP_S, assert_no_errors, rank_pids, site_log

pytest.importorskip("torchvision")

EXAMPLE = REPO / "examples" / "flare" / "multi-gpu-pt"
PREPARE = REPO / "examples" / "flare" / "lightning-ddp" / "prepare_data.py"


def test_flare_s_pt_ddp_example_completes_its_rounds_as_rank_groups(tmp_path):
    app = tmp_path / "multi-gpu-pt"
    shutil.copytree(EXAMPLE, app, ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    # docs/flare-jobs.md's commands, as shown there, in this copy, with /tmp/ in tmp_path
    # (the data and the simulator's workspace too: their defaults are under /tmp/nvflare).
    env["CIFAR10_ROOT"] = str(tmp_path / "nvflare" / "data")
    env["NVFLARE_SIMULATOR_WORKSPACE_ROOT"] = str(tmp_path / "nvflare" / "simulation")
    data, job = docrun.console(
        "docs/flare-jobs.md",
        "multi-gpu-pt",
        tmp=tmp_path,
        paths={"../lightning-ddp/prepare_data.py": PREPARE},
        cwd=app,
    )
    rc, out = docrun.run(data, tmp_path / "p", 60, env=env)
    assert (why := data.check(rc, out)) is None, f"{why}:\n{out}"
    rc, output = docrun.run(job, tmp_path / "job.out", 2 * SIM_CAP_S, env=env)
    assert (why := job.check(rc, output)) is None, f"{why}:\n{output[-4000:]}"
    ws = tmp_path / "nvflare" / "simulation" / "pt_ddp"
    assert_no_errors(ws)
    assert "Traceback" not in output, output[-4000:]
    server = (ws / "server" / "log.txt").read_text()
    assert "Round 0 started" in server and "Round 1 started" in server
    for site in ("site-1", "site-2"):
        log = site_log(ws, site)
        assert log.count("rank group of 2 ready") == 1, log[-3000:]
        assert "rank group stopped cooperatively" in log
        ranks = ws / site / "simulate_job" / "rankexec"
        outs = [(ranks / f"rank-{r}" / "stdout.log").read_text() for r in (0, 1)]
        for r, out in enumerate(outs):
            assert f"DDP global_rank={r}, local_rank={r} initialized on" in out, out[-2000:]
            assert out.count(f"Rank {r}: Finished Training") == 2, out[-2000:]
        assert re.findall(r"\[Round=(\d+), Site=([\w-]+)\]", outs[0]) == [("0", site), ("1", site)]
        accs = [float(a) for a in re.findall(r"Accuracy: ([\d.]+)%", outs[0])]
        print(f"{site}: accuracy of the received model by round {accs}")
        # One evaluation of the received model per round. Whether it improves is not
        # asserted: FLARE's script shuffles without a seed and trains 2 epochs on a few
        # hundred images, so a round may score lower (seen: 16.25 % then 7.5 %).
        assert len(accs) == 2, outs[0][-2000:]
        for r in (0, 1):
            err = (ranks / f"rank-{r}" / "stderr.log").read_text()
            assert "Traceback" not in err, err[-3000:]
    assert rank_pids(ws) == []
