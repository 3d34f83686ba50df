"""The DDP example trains to the threshold through `rankexec simulate`, under the
builtin launcher and under torchrun (real torch, gloo on CPU, nccl on GPUs)."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
from conftest import BIN, REPO, env_with_python, pid_alive
from safetensors.numpy import load_file


@pytest.mark.parametrize("job", ["job", "job_torchrun"])
def test_ddp_digits_reaches_the_threshold(tmp_path, job):
    if not BIN.exists():
        pytest.fail(f"{BIN} is missing: run `cargo build --release` first")
    ws = tmp_path / "ws"
    out = subprocess.run(
        [str(BIN), "simulate", f"examples/python/ddp_digits/{job}", "-w", str(ws), "--no-progress"],
        cwd=REPO,
        env=env_with_python(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith(("round", "final"))]
    print(f"{job}:", *lines, sep="\n  ")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((ws / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["final_metrics"]["accuracy"] >= 0.95, summary["final_metrics"]
    assert summary["rounds"][-1]["metrics"]["world_size"] == 2.0, "two ranks per client"
    assert summary["leftover_pids"] == []
    assert not any(pid_alive(p) for p in summary["leftover_pids"])
    model = load_file(ws / "server" / "global_model.safetensors")
    assert {k: v.shape for k, v in model.items()} == {
        "0.weight": (128 * 64,),
        "0.bias": (128,),
        "2.weight": (10 * 128,),
        "2.bias": (10,),
    }
    assert all(np.isfinite(v).all() for v in model.values())
