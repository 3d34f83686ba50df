"""rankexec.flower under Flower's Simulation Engine (Ray), when ``flwr[simulation]`` is
installed (it is not in requirements-test.txt, to keep CI's install and time down: the
test skips without Ray).

A SuperLink started with ``--simulation`` (two virtual SuperNodes, offline) runs
``examples/flower/ddp-digits`` for two rounds: Ray's actors call the ClientApp, each
virtual node gets its own host and two DDP ranks, the same pids in both rounds, and
``close_groups`` closes them. Afterwards no host or rank is left (the hosts watch the
actor that started them), and every process of the test is stopped by pid.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

pytest.importorskip("flwr")
pytest.importorskip("ray")
pytest.importorskip("torch")
pytest.importorskip("sklearn")

from rankexec.flower.deployment import Deployment

from .helpers import pid_alive, pids_with_env, wait_until

APP = Path(__file__).resolve().parents[3] / "examples" / "flower" / "ddp-digits"


def test_ddp_digits_under_the_simulation_engine(tmp_path) -> None:
    d = Deployment(
        tmp_path,
        [],
        env={"RANKEXEC_FLOWER_DIR": str(tmp_path / "rx"), "RANKEXEC_LOG": "warn"},
        simulation_nodes=2,
    )
    try:
        d.start()
        out = tmp_path / "result.json"
        run = d.submit(APP, {"result-file": str(out), "num-server-rounds": 2})
        status = d.wait_run(run, 600)
        assert status == "finished:completed", d.last_failure[-4000:]
        res = json.loads(out.read_text())
        per_round = [sorted(tuple(r["pids"]) for r in reps) for reps in res["replies"]]
        print(f"\n[flower-sim] accuracy {res['accuracy']:.4f}, rank pids per round {per_round}")
        assert res["accuracy"] >= 0.9
        assert len(per_round[0]) == 2 and per_round[0] == per_round[1]
        assert all(res["closed"].values()) and len(res["closed"]) == 2
        ranks = [p for pair in per_round[0] for p in pair]
        wait_until(lambda: not any(pid_alive(p) for p in ranks), 30, "ranks gone")
    finally:
        d.stop()
        try:
            wait_until(lambda: not pids_with_env(str(tmp_path)), 60, "no process left")
        finally:
            for pid in pids_with_env(str(tmp_path)):
                os.kill(pid, signal.SIGKILL)
