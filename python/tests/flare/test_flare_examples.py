"""The example FLARE jobs (examples/flare/) under the real `nvflare simulator`, with
Python ranks (`python -m rankexec.worker`)."""

from __future__ import annotations

import re
import shutil

import numpy as np
from conftest import (
    REPO,
    allow_rankexec,
    assert_no_errors,
    rank_pids,
    run_sim,
    server_model,
    site_log,
)

INITIAL = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=np.float32)


def test_numpy_fedavg_job_ends_with_the_model_its_ranks_imply(tmp_path):
    job = tmp_path / "numpy-fedavg"
    shutil.copytree(REPO / "examples" / "flare" / "numpy-fedavg", job)
    ws = tmp_path / "ws"
    allow_rankexec(ws)
    run_sim(job, ws)
    assert_no_errors(ws)
    # 3 rounds; every rank adds delta 1.0; FedAvg of equal client models is that model.
    model = server_model(ws)
    print("final model:", model.tolist())
    np.testing.assert_array_equal(model, INITIAL + 3.0)
    for site in ("site-1", "site-2"):
        m = re.search(r"rank group of 2 ready in ([\d.]+) ms", site_log(ws, site))
        assert m, site_log(ws, site)[-3000:]
        print(f"{site}: 2 Python ranks ready in {m.group(1)} ms")
    assert rank_pids(ws) == []
