"""The example FLARE jobs (examples/flare/) under the real `nvflare simulator`, with
Python ranks (`python -m rankexec.worker`)."""

from __future__ import annotations

import re

import docrun
import numpy as np

from .flare_helpers import (
    REPO,
    SIM_CAP_S,
    assert_no_errors,
    rank_pids,
    server_model,
    site_log,
)

INITIAL = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=np.float32)


def test_numpy_fedavg_job_ends_with_the_model_its_ranks_imply(tmp_path):
    # docs/flare-jobs.md's first commands, as shown there (/tmp/ in tmp_path): a job
    # with custom code runs on a workspace where `allow-list` was never run.
    sim, show = docrun.console("docs/flare-jobs.md", "numpy-fedavg", tmp=tmp_path)
    rc, out = docrun.run(sim, tmp_path / "sim.out", SIM_CAP_S)
    assert (why := sim.check(rc, out)) is None, f"{why}:\n{out[-4000:]}"
    ws = tmp_path / "ws-numpy"
    assert_no_errors(ws)
    rc, out = docrun.run(show, tmp_path / "show.out", 60)
    assert (why := show.check(rc, out)) is None, f"{why}:\n{out}"
    # 3 rounds; every rank adds delta 1.0; FedAvg of equal client models is that model.
    model = server_model(ws)
    print("final model:", model.tolist())
    np.testing.assert_array_equal(model, INITIAL + 3.0)
    for site in ("site-1", "site-2"):
        m = re.search(r"rank group of 2 ready in ([\d.]+) ms", site_log(ws, site))
        assert m, site_log(ws, site)[-3000:]
        print(f"{site}: 2 Python ranks ready in {m.group(1)} ms")
    assert rank_pids(ws) == []


def test_ddp_digits_job_reaches_its_accuracy(tmp_path):
    import importlib.util

    import torch

    (sim,) = docrun.console("docs/flare-jobs.md", "ddp-digits", tmp=tmp_path)
    rc, out = docrun.run(sim, tmp_path / "sim.out", 400)
    assert (why := sim.check(rc, out)) is None, f"{why}:\n{out[-4000:]}"
    ws = tmp_path / "ws-ddp"
    assert_no_errors(ws)
    model_file = ws / "server" / "simulate_job" / "app_server" / "FL_global_model.pt"
    saved = torch.load(model_file, weights_only=False)
    state = saved.get("model", saved)
    spec = importlib.util.spec_from_file_location(
        "ddp_trainer_under_test", REPO / "examples" / "python" / "ddp_digits" / "trainer.py"
    )
    trainer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trainer)
    _, (x_test, y_test) = trainer._split(2026, 0.2)  # the trainer's own held-out split
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    model.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()})
    with torch.no_grad():
        acc = (model(torch.from_numpy(x_test)).argmax(1).numpy() == y_test).mean()
    print(f"DDP job: server model accuracy {acc:.4f} on {len(y_test)} held-out digits")
    assert acc >= 0.95
    log = site_log(ws, "site-1") + site_log(ws, "site-2")
    assert "rank group of 2 ready" in log
    assert rank_pids(ws) == []


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def test_torch_digits_job_from_flares_job_api_trains_with_tensors_and_leaves_nothing(tmp_path):
    """The realistic PyTorch example (examples/flare/torch-digits): exported by FLARE's
    own Job API, FLARE's PyTorch exchange format (torch tensors both ways), a DataLoader
    with persistent workers in every rank, setup in `__init__`, a `state_dict()` back."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import torch

    from .flare_helpers import descendants

    # docs/flare-jobs.md's commands, as shown there (/tmp/ in tmp_path).
    make, simulate = docrun.console("docs/flare-jobs.md", "torch-digits", tmp=tmp_path)
    rc, out = docrun.run(make, tmp_path / "make.out", 120)
    assert (why := make.check(rc, out)) is None, f"{why}:\n{out}"
    job = tmp_path / "jobs" / "torch-digits"
    client = json.loads((job / "app_site-1" / "config" / "config_fed_client.json").read_text())
    executor = client["executors"][0]["executor"]
    print("exported executor:", json.dumps(executor))
    assert executor["path"] == "rankexec.flare.MultiProcessExecutor"
    assert executor["args"]["num_of_processes"] == 2, "the Job API exported every arg"
    assert executor["args"]["server_expected_format"] == "pytorch"
    assert not list(job.rglob("rankexec")), "no copy of the installed package in custom/"

    ws = tmp_path / "ws-torch"
    log = (tmp_path / "sim.out").open("w")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    sim = subprocess.Popen(
        simulate.argv,
        cwd=simulate.cwd,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    seen: dict[int, int | None] = {}  # our processes while it ran -> their parent
    deadline = time.monotonic() + 500
    while sim.poll() is None and time.monotonic() < deadline:
        for pid in rank_pids(ws):
            seen.setdefault(pid, _ppid(pid))
        time.sleep(0.1)
    if sim.poll() is None:
        for pid in [*descendants(sim.pid), sim.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    log.close()
    out = (tmp_path / "sim.out").read_text(errors="replace")
    assert (why := simulate.check(sim.wait(60), out)) is None, f"{why}:\n{out[-4000:]}"
    assert_no_errors(ws)

    saved = torch.load(
        ws / "server" / "simulate_job" / "app_server" / "FL_global_model.pt", weights_only=False
    )
    state = saved.get("model", saved)
    assert all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 for v in state.values())
    sys.path.insert(0, str(REPO / "examples" / "python" / "torch_digits"))
    try:
        import trainer
    finally:
        sys.path.pop(0)
    net = trainer.Net(128)
    net.load_state_dict(state)
    _, (x_test, y_test) = trainer._digits(2026, 0.2)
    with torch.no_grad():
        acc = (net(torch.from_numpy(x_test)).argmax(1).numpy() == y_test).mean()
    print(f"torch-digits job: server model accuracy {acc:.4f} on {len(y_test)} held-out digits")
    assert acc >= 0.95
    log = site_log(ws, "site-1") + site_log(ws, "site-2")
    assert log.count("rank group of 2 ready") == 2, log[-3000:]
    workers = {p for p, parent in seen.items() if parent in seen}
    print(f"processes seen: {len(seen)} ranks and DataLoader workers, workers: {len(workers)}")
    assert len(workers) >= 4, f"the ranks' DataLoader workers were seen: {seen}"
    assert rank_pids(ws) == []
