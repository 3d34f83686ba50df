"""The DDP example trains to the threshold through `rankexec simulate`, under the
builtin launcher and under torchrun (real torch, gloo on CPU, nccl on GPUs)."""

from __future__ import annotations

import json
import subprocess

import docrun
import numpy as np
import pytest
from conftest import BIN, REPO, env_with_python, pid_alive
from safetensors.numpy import load_file


@pytest.mark.parametrize("job", ["job", "job_torchrun"])
def test_ddp_digits_reaches_the_threshold(tmp_path, job):
    if not BIN.exists():
        pytest.fail(f"{BIN} is missing: run `cargo build --release` first")
    if job == "job":  # docs/rank-code.md's command and output, as shown (/tmp/ in tmp_path)
        (step,) = docrun.console("docs/rank-code.md", "ddp-digits", tmp=tmp_path)
        ws = tmp_path / "ws-ddp-digits"
        rc, out = docrun.run(step, tmp_path / "out.txt", 600, env=env_with_python())
        lines = [line for line in out.splitlines() if line.startswith(("round", "final"))]
        print(f"{job}:", *lines, sep="\n  ")
        assert (why := step.check(rc, out)) is None, f"{why}:\n{out[-3000:]}"
    else:
        ws = tmp_path / "ws"
        argv = [str(BIN), "simulate", f"examples/python/ddp_digits/{job}", "-w", str(ws)]
        res = subprocess.run(
            [*argv, "--no-progress"],
            cwd=REPO,
            env=env_with_python(),
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        lines = [line for line in res.stdout.splitlines() if line.startswith(("round", "final"))]
        print(f"{job}:", *lines, sep="\n  ")
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
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


def test_simulate_refuses_a_misspelt_argument_before_any_rank_starts(tmp_path):
    job = tmp_path / "job"
    src = REPO / "examples/python/ddp_digits/job"
    for rel in ("meta.json", "app/config/config_fed_server.json"):
        (job / rel).parent.mkdir(parents=True, exist_ok=True)
        (job / rel).write_text((src / rel).read_text())
    client = json.loads((src / "app/config/config_fed_client.json").read_text())
    client["executors"][0]["executor"]["args"]["components"][0]["args"] = {"epochz": 3}
    (job / "app/config/config_fed_client.json").write_text(json.dumps(client))
    out = subprocess.run(
        [str(BIN), "simulate", str(job), "-w", str(tmp_path / "ws"), "--no-progress"],
        cwd=REPO,
        env=env_with_python(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    text = out.stdout + out.stderr
    print("misspelt argument:", [line for line in text.splitlines() if "epochz" in line])
    assert out.returncode != 0
    assert "executors[0].executor.args.components[0]" in text, text[-2000:]
    assert "unexpected keyword argument 'epochz'" in text
    assert not list(tmp_path.rglob("rank-*")), "no rank started (no rank log directory)"
