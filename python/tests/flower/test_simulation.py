"""rankexec.flower under Flower's Simulation Engine (Ray, ``flwr[simulation]``, in
requirements-test.txt), offline.

A SuperLink started with ``--simulation`` and four virtual SuperNodes runs
``examples/flower/ddp-digits`` (two DDP ranks per virtual node) on this 2-core machine,
where Ray runs two actors (one CPU each) that carry the four nodes' messages in turn:

1. two rounds without ``close_groups``: each virtual node has its own host and its
   own two ranks, the same pids in both rounds; the run's end (the simulation process
   exits, Ray's actors with it, and each host watches the actor that started it)
   leaves no host and no rank;
2. a slow run: a SIGKILLed Ray worker (the actor that started a busy node's host)
   takes the hosts it started and their ranks with it;
3. ``flwr stop`` of a slow run (the same one if it survived its actor) leaves no host
   and no rank.

What each case saw is printed (``-s``). Every process of the test is stopped by pid
afterwards (Ray's included: they carry the test's folder in their environment).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")
pytest.importorskip("ray")
pytest.importorskip("torch")
pytest.importorskip("sklearn")

from rankexec.flower import host_status
from rankexec.flower.deployment import Deployment

from .helpers import leave_nothing, pid_alive, wait_until

APP = Path(__file__).resolve().parents[3] / "examples" / "flower" / "ddp-digits"
NODES = 4
# The target is 15 s from the run's end or `flwr stop` to every rank gone
# (measured and printed); the bound leaves room for a loaded 2-core machine.
GONE_BOUND_S = 30.0


@pytest.fixture
def sim(tmp_path: Path):
    d = Deployment(
        tmp_path,
        [],
        env={
            "RANKEXEC_FLOWER_DIR": str(tmp_path / "rx"),
            "RANKEXEC_LOG": "warn",
            # Ray's own OOM killer picks actors once the machine passes 95% of its memory,
            # whoever uses it (a shared CI machine): this test SIGKILLs its worker itself.
            "RAY_memory_monitor_refresh_ms": "0",
        },
        simulation_nodes=NODES,
        simulation_cpus=1,  # two actors on 2 cores: any actor may carry any node's message
    )
    try:
        d.start()
        yield d
    finally:
        d.stop()
        leave_nothing(tmp_path, "flower-sim")


def _hosts(d: Deployment) -> dict[int, dict]:
    """Node id to its host's status, for every node folder with a live host."""
    old = os.environ.get("RANKEXEC_FLOWER_DIR")
    os.environ["RANKEXEC_FLOWER_DIR"] = str(d.root / "rx")
    try:
        out = {}
        for p in (d.root / "rx").glob("node-*"):
            node = int(p.name.split("-", 1)[1])
            st = host_status(node)
            if st is not None:
                out[node] = st
        return out
    finally:
        if old is None:
            del os.environ["RANKEXEC_FLOWER_DIR"]
        else:
            os.environ["RANKEXEC_FLOWER_DIR"] = old


def _host_pids(d: Deployment) -> list[int]:
    pids = []
    for p in (d.root / "rx").glob("node-*/host.pid"):
        try:
            pids.append(int(p.read_text()))
        except (OSError, ValueError):
            continue
    return pids


def test_virtual_nodes_keep_their_ranks_and_leave_nothing(sim: Deployment) -> None:
    # 1. The run's end, without close_groups: Ray's actors go, the hosts and ranks too.
    out = sim.root / "result.json"
    t0 = time.monotonic()
    run = sim.submit(APP, {"result-file": str(out), "num-server-rounds": 2, "close-groups": "no"})
    status = sim.wait_run(run, 600)
    assert status == "finished:completed", sim.last_failure[-4000:]
    t_end = time.monotonic()
    res = json.loads(out.read_text())
    assert res["errors"] == [[], []], res["errors"]
    per_round = [sorted(tuple(r["pids"]) for r in reps) for reps in res["replies"]]
    print(
        f"\n[flower-sim] run {run}: {status} in {t_end - t0:.1f}s, accuracy"
        f" {res['accuracy']:.4f}, rank pids per round {per_round}"
    )
    assert res["accuracy"] >= 0.9
    assert len(per_round) == 2 and len(per_round[0]) == NODES
    assert all(len(pair) == 2 for pair in per_round[0]), "two ranks per virtual node"
    # Every virtual node kept its ranks, except where a rank's death from outside (the
    # kernel's OOM killer on a crowded machine) made restart.retry_task relaunch them.
    retried = sum(
        p.read_text().count("the task ran again after") for p in sim.root.glob("rx/node-*/host.log")
    )
    changed = set(per_round[0]) - set(per_round[1])
    if retried:
        print(f"[flower-sim] {retried} message(s) retried after a rank's death: {changed}")
    assert len(changed) <= retried, "every virtual node kept its ranks"
    ranks = sorted({p for pair in per_round[0] + per_round[1] for p in pair})
    assert len(set(per_round[0])) == NODES
    hosts = _host_pids(sim)
    wait_until(lambda: not any(pid_alive(p) for p in ranks + hosts), GONE_BOUND_S, "ranks gone")
    print(
        f"[flower-sim] run's end: {len(ranks)} ranks and {len(hosts)} hosts gone"
        f" {time.monotonic() - t_end:.1f}s after the run was seen finished"
    )

    # 2. A slow run: a SIGKILLed Ray worker takes the hosts it started and their ranks.
    run = sim.submit(APP, {"num-server-rounds": 2, "slow-s": 300.0, "close-groups": "no"})
    st = _wait_busy(sim, run)
    actor = st["supernode_pid"]
    victims = [h for h in _hosts(sim).values() if h["supernode_pid"] == actor]
    gone = [p for h in victims for p in h["pids"] + [h["pid"]]]
    t = time.monotonic()
    os.kill(actor, signal.SIGKILL)
    wait_until(lambda: not any(pid_alive(p) for p in gone), GONE_BOUND_S, "the actor's hosts")
    print(
        f"[flower-sim] Ray worker {actor} SIGKILLed: {len(victims)} host(s) and their ranks"
        f" {gone} gone in {time.monotonic() - t:.1f}s"
    )

    # 3. flwr stop of a slow run (this one, if it still runs after its actor's death).
    if sim.status(run).startswith("finished"):
        print(f"[flower-sim] run {run} ended with its actor: {sim.status(run)}")
        run = sim.submit(APP, {"num-server-rounds": 2, "slow-s": 300.0, "close-groups": "no"})
    _wait_busy(sim, run)
    left = [p for h in _hosts(sim).values() for p in h["pids"]]
    hosts = _host_pids(sim)
    t = time.monotonic()
    res_stop = sim.stop_run(run)
    assert res_stop.returncode == 0, res_stop.stdout + res_stop.stderr
    wait_until(
        lambda: not any(pid_alive(p) for p in left + hosts), GONE_BOUND_S, "ranks after stop"
    )
    print(
        f"[flower-sim] flwr stop: ranks {left} and hosts {hosts} gone"
        f" {time.monotonic() - t:.1f}s after the command started"
    )


def _wait_busy(sim: Deployment, run: int) -> dict:
    """A host busy with the run's message (its status)."""
    busy: list[dict] = []

    def one_busy() -> bool:
        busy[:] = [s for s in _hosts(sim).values() if s["busy"] and run in s["runs"]]
        return bool(busy)

    wait_until(one_busy, 300, f"a virtual node busy with run {run}'s slow round")
    return busy[0]
