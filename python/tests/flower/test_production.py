"""rankexec.flower in Flower's production shapes: TLS, and TLS with SuperNode
authentication (flwr 1.42, offline, a CA and node keys made by the test).

Each shape gets its own SuperLink and two SuperNodes (``Deployment(tls=True)``,
``Deployment(node_auth=True)``) and runs ``examples/flower/ddp-digits`` (two DDP ranks
per node):

1. (with node authentication, which runs over TLS too) the example trains (held-out
   accuracy >= 0.9) and every node keeps its ranks across rounds; the node hosts were given nothing but what the ClientApp process gives every
   host (its folder, node id and SuperNode pid): they read the SuperNode's own TLS
   settings and key and ask the SuperLink's Fleet API, never its Control API;
2. ``flwr stop`` of a run in the middle of a slow round: every rank of both nodes goes
   (the hosts see the run finished through the Fleet API and abort the task). In the
   node-authentication shape one SuperNode is down (SIGSTOPped: it answers nothing)
   when the run is stopped, and its ranks go too.

What each case saw (seconds from ``flwr stop`` to every rank gone) is printed (``-s``).
Every Flower process is stopped by pid afterwards, and no process that carries the
test's folder in its environment is left.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")
pytest.importorskip("torch")
pytest.importorskip("sklearn")

from rankexec.flower import _runcheck, host_status
from rankexec.flower.deployment import Deployment

from .helpers import pid_alive, pids_with_env, wait_until

APP = Path(__file__).resolve().parents[3] / "examples" / "flower" / "ddp-digits"
# The target is 15 s from `flwr stop` to every rank gone (measured and printed);
# the bound below leaves room for a loaded 2-core machine.
GONE_BOUND_S = 30.0


@pytest.fixture(params=["tls", "node-auth"])
def dep(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    shape = request.param
    root = tmp_path_factory.mktemp(f"flower-{shape}")
    d = Deployment(
        root,
        ["partition-id=0 num-partitions=2", "partition-id=1 num-partitions=2"],
        env={"RANKEXEC_FLOWER_DIR": str(root / "rx"), "RANKEXEC_LOG": "warn"},
        tls=True,
        node_auth=shape == "node-auth",
    )
    d.shape = shape  # type: ignore[attr-defined]
    try:
        d.start()
        yield d
    finally:
        for p in d.supernodes:  # a SuperNode left stopped by the test
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
        d.stop()
        try:
            wait_until(lambda: not pids_with_env(str(root)), 60, "no process of the test left")
        finally:
            for pid in pids_with_env(str(root)):  # never leave anything behind
                os.kill(pid, signal.SIGKILL)


def _status(dep: Deployment, node: int) -> dict | None:
    old = os.environ.get("RANKEXEC_FLOWER_DIR")
    os.environ["RANKEXEC_FLOWER_DIR"] = str(dep.root / "rx")
    try:
        return host_status(node)
    finally:
        if old is None:
            del os.environ["RANKEXEC_FLOWER_DIR"]
        else:
            os.environ["RANKEXEC_FLOWER_DIR"] = old


def _nodes(dep: Deployment) -> list[int]:
    return sorted(int(p.name.split("-", 1)[1]) for p in (dep.root / "rx").glob("node-*"))


def _argv(pid: int) -> list[str]:
    return [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]


def test_trains_keeps_ranks_and_flwr_stop_ends_them(dep: Deployment) -> None:
    shape = dep.shape  # type: ignore[attr-defined]
    if shape == "node-auth":  # TLS and node keys: training there covers TLS alone too
        _trains_and_keeps_its_ranks(dep, shape)
    _flwr_stop_ends_every_rank(dep, shape)


def _trains_and_keeps_its_ranks(dep: Deployment, shape: str) -> None:
    out = dep.root / "result.json"
    t0 = time.monotonic()
    run = dep.submit(APP, {"result-file": str(out), "num-server-rounds": 2})
    status = dep.wait_run(run, 400)
    assert status == "finished:completed", dep.last_failure[-4000:]
    res = json.loads(out.read_text())
    per_round = [sorted(tuple(r["pids"]) for r in replies) for replies in res["replies"]]
    print(
        f"\n[flower-{shape}] run {run}: {status} in {time.monotonic() - t0:.1f}s, held-out"
        f" accuracy {res['accuracy']:.4f}, rank pids per round {per_round}"
    )
    assert res["accuracy"] >= 0.9
    assert len(per_round) == 2 and all(len(r) == 2 for r in per_round)
    assert per_round[0] == per_round[1], "the same ranks in every round"
    assert all(res["closed"].values()) and len(res["closed"]) == 2


def _flwr_stop_ends_every_rank(dep: Deployment, shape: str) -> None:
    # A slow run, stopped mid-round.
    run = dep.submit(APP, {"num-server-rounds": 2, "slow-s": 300.0})
    nodes: list[int] = []

    def both_busy() -> bool:
        nodes[:] = _nodes(dep)
        st = [_status(dep, n) for n in nodes]
        return len(st) == 2 and all(s is not None and run in s["runs"] and s["busy"] for s in st)

    wait_until(both_busy, 240, "both nodes' groups busy with the slow round")
    by_node = {n: _status(dep, n) for n in nodes}
    ranks = [p for s in by_node.values() for p in s["runs"][run]["pids"]]
    for s in by_node.values():
        argv = _argv(s["pid"])
        # The host got no credential: it reads the SuperNode's own settings.
        assert not {"--node-key", "--root-certificates", "--superlink"} & set(argv), argv
        assert s["supernode_pid"] in dep.pids()
    down = None
    if shape == "node-auth":
        down = dep.supernodes[1].pid
        os.kill(down, signal.SIGSTOP)  # the node is down: its SuperNode answers nothing
    t = time.monotonic()
    res_stop = dep.stop_run(run)
    assert res_stop.returncode == 0, res_stop.stdout + res_stop.stderr
    t_returned = time.monotonic()
    wait_until(lambda: not any(pid_alive(p) for p in ranks), GONE_BOUND_S, "the ranks gone")
    print(
        f"[flower-{shape}] flwr stop: ranks {ranks} gone {time.monotonic() - t:.1f}s after"
        f" the command started, {time.monotonic() - t_returned:.1f}s after it returned"
        f"{f' (SuperNode {down} SIGSTOPped)' if down else ''}"
    )
    for n in nodes:  # the host has closed the group (its ranks may be gone first)
        wait_until(lambda n=n: (_status(dep, n) or {}).get("pids") == [], 30, "group closed")
    logs = " ".join((dep.root / "rx" / f"node-{n}" / "host.log").read_text() for n in nodes)
    assert "is finished" in logs
    if shape == "tls":
        assert "registered probe node" in logs, "self-registered nodes: a probe identity"
    else:
        assert "registered probe node" not in logs, "node auth: the node's own key"
    if down is not None:
        os.kill(down, signal.SIGCONT)
        # Without the node's key a host cannot ask a SuperLink with node authentication
        # (it refuses the probe's registration): no answer, said once, naming the key.
        said: list[str] = []
        assert dep.tls is not None
        keyless = _runcheck.Fleet(f"127.0.0.1:{dep.port}", False, str(dep.tls.ca_cert), None)
        assert _runcheck.RunCheck(keyless, 0, said.append).finished(run) is None
        assert len(said) == 1 and "needs the node's key" in said[0], said
