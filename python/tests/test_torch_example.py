"""The realistic PyTorch example (examples/python/torch_digits) under `rankexec
simulate`: setup and `init_process_group` in `__init__`, a DataLoader with two
persistent workers forked from every rank, a `state_dict()` returned, five rounds. It
reaches the digits accuracy, and no rank and no DataLoader worker is left."""

from __future__ import annotations

import json
import os
import subprocess
import time

import docrun
from conftest import env_with_python, pid_alive, pids_with_env
from proc_checks import owned


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def test_torch_digits_with_dataloader_workers_trains_and_leaves_nothing(tmp_path):
    # docs/rank-code.md's command and output, as shown there (/tmp/ in tmp_path).
    (step,) = docrun.console("docs/rank-code.md", "torch-digits", tmp=tmp_path)
    ws = tmp_path / "ws-torch-digits"
    proc = subprocess.Popen(
        step.argv,
        cwd=step.cwd,
        env=env_with_python(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # While it runs, note every process of this job (ranks and their DataLoader workers:
    # they inherit the rank's environment, which names the job's log directory).
    seen: dict[int, int | None] = {}  # pid -> parent pid, read while it ran
    deadline = time.monotonic() + 600
    with owned(proc):
        while proc.poll() is None and time.monotonic() < deadline:
            for pid in pids_with_env(str(ws)):
                seen.setdefault(pid, _ppid(pid))
            time.sleep(0.1)
        if proc.poll() is None:
            proc.kill()
        out, _ = proc.communicate(timeout=60)
    lines = [line for line in out.splitlines() if line.startswith(("round", "final"))]
    print("torch_digits:", *lines, sep="\n  ")
    assert (why := step.check(proc.returncode, out)) is None, f"{why}:\n{out[-3000:]}"
    summary = json.loads((ws / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["final_metrics"]["accuracy"] >= 0.95, summary["final_metrics"]
    last = summary["rounds"][-1]["metrics"]
    assert last["world_size"] == 2.0 and last["loader_workers"] == 2.0, last
    # DataLoader workers are children of ranks (their parent has the same environment).
    workers = {p for p, parent in seen.items() if parent in seen}
    print(f"processes seen: {len(seen)}, of which DataLoader workers: {len(workers)}")
    assert len(workers) >= 2, f"the ranks' DataLoader workers were seen ({sorted(seen)})"
    alive = [p for p in seen if pid_alive(p) and os.path.exists(f"/proc/{p}")]
    assert alive == [], f"left running after the job: {alive}"
    assert summary["leftover_pids"] == []
