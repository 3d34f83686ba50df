"""rankexec.flower under Flower's real Deployment Engine (flwr 1.42), offline.

1. the example, as docs/flower.md runs it: the page's script,
   ``examples/flower/ddp-digits/federation.sh`` (its own SuperLink and two SuperNodes,
   with this test's ``FLWR_HOME``, free ports and run config): held-out accuracy
   >= 0.95, every node's ranks the same pids in every round, every group closed by the
   ServerApp's ``close_groups`` at the end, and the script's processes and the ranks
   gone when it exits; the script SIGTERMed while ``flwr run`` runs stops everything
   it started too.

Then one SuperLink and two SuperNodes started by ``rankexec.flower.deployment``
(``--insecure``, a private ``FLWR_HOME``, free ports, telemetry and update checks off)
serve five runs of the example (two DDP ranks per node, gloo, FedAvg):

2. a rank that raises: the node answers with Flower's ``Error`` naming the rank and
   the exception, the next round runs on a relaunched group; meanwhile a second run
   with slow rounds shares both nodes (one group per run on each node) and its
   ``flwr stop`` ends its groups only;
3. rank 1 of one node SIGKILLed mid-round: ``restart.retry_task`` runs the node's
   message again on a relaunched group, and the round aggregates both nodes;
4. a SuperNode SIGSTOPped: the ServerApp's ``close_groups`` reports it ``False``;
5. a SuperNode SIGKILLed mid-round (its host and ranks go), then ``flwr stop`` of the
   run mid-round (the other node's task is aborted and its group closes).

Every Flower process is stopped by pid afterwards, and no process that carries the
test's folder in its environment is left. What each case saw is printed (``-s``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import docrun
import pytest

pytest.importorskip("flwr")
pytest.importorskip("torch")
pytest.importorskip("sklearn")

from rankexec.flower import host_status
from rankexec.flower.deployment import Deployment, free_port

from .helpers import leave_nothing, pid_alive, pids_with_env, wait_until

REPO = Path(__file__).resolve().parents[3]
APP = REPO / "examples" / "flower" / "ddp-digits"
# What examples/flower/ddp-digits/federation.sh prints of each process it starts.
STARTED = re.compile(r"^federation: (?:superlink|supernode \d+) pid (\d+)$", re.MULTILINE)


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("flower")
    d = Deployment(
        root,
        ["partition-id=0 num-partitions=2", "partition-id=1 num-partitions=2"],
        env={"RANKEXEC_FLOWER_DIR": str(root / "rx"), "RANKEXEC_LOG": "warn"},
    )
    try:
        d.start()
        yield d
    finally:
        d.stop()
        left = leave_nothing(root, "flower")
        print(f"\n[flower] after stop: {len(left)} processes left")


def _nodes(dep: Deployment) -> list[int]:
    return sorted(int(p.name.split("-", 1)[1]) for p in (dep.root / "rx").glob("node-*"))


def _result(path: Path) -> dict:
    return json.loads(path.read_text())


def test_ddp_digits_keeps_its_ranks_across_rounds(tmp_path: Path) -> None:
    """docs/flower.md's federation, the page's script itself (a SuperLink, two
    SuperNodes, ``flwr run ... --stream``) with this test's FLWR_HOME, free ports and a
    run config: the example completes 3 rounds on the same ranks in every round with a
    held-out accuracy of at least 0.95, and when the script exits the processes it
    started, the ranks and every process of the test's folder are gone."""
    script = REPO / "examples" / "flower" / "ddp-digits" / "federation.sh"
    out = tmp_path / "result-1.json"
    bindir = str(Path(sys.executable).parent)  # flower-superlink, flwr: the test venv's
    env = {
        **os.environ,
        "PATH": os.pathsep.join([bindir, os.environ.get("PATH", "")]),
        "FLWR_HOME": str(tmp_path / "flwr-home"),
        "APP": str(APP),
        "LINK_PORT": str(free_port()),
        "NODE_PORTS": f"{free_port()} {free_port()}",
        "RUN_CONFIG": f"result-file={json.dumps(str(out))} num-server-rounds=3",
        "RANKEXEC_FLOWER_DIR": str(tmp_path / "rx"),
        "RANKEXEC_LOG": "warn",
        "PYTHONUNBUFFERED": "1",
    }
    log = tmp_path / "federation.out"
    t0 = time.monotonic()
    try:
        p = docrun.start(["bash", str(script)], log, cwd=tmp_path, env=env)
        # Past the deadline: SIGTERM first, the script's trap stops what it started.
        rc = docrun.finish(p, log, 420, str(script), grace=60)
        text = log.read_text(errors="replace")
        print(text[-3000:])
        assert rc == 0, f"{script} exited {rc}:\n{text[-4000:]}"
        started = [int(x) for x in STARTED.findall(text)]
        assert len(started) == 3, text[-4000:]  # the SuperLink and the two SuperNodes
        # The script waited for them: gone when it returns.
        assert not [p for p in started if pid_alive(p)], text[-4000:]
        res = _result(out)
        print(
            f"\n[flower] {script.name}: exited {rc} in {time.monotonic() - t0:.1f}s,"
            f" held-out accuracy {res['accuracy']:.4f}"
        )
        assert res["accuracy"] >= 0.95
        per_round = [sorted(tuple(r["pids"]) for r in replies) for replies in res["replies"]]
        print(f"[flower] rank pids per round (one pair per node): {per_round}")
        assert len(per_round) == 3 and all(len(r) == 2 for r in per_round)
        assert all(len(p) == 2 for p in per_round[0]), "two ranks per node"
        assert per_round[0] == per_round[1] == per_round[2], "the same ranks in every round"
        assert all(res["closed"].values()) and len(res["closed"]) == 2
        pids = [p for pair in per_round[0] for p in pair]
        wait_until(lambda: not any(pid_alive(p) for p in pids), 30, "ranks gone after the run")
        wait_until(lambda: not pids_with_env(str(tmp_path)), 30, "no process of the test left")
    finally:
        for pid in pids_with_env(str(tmp_path)):  # never leave anything, even on a failure
            os.kill(pid, signal.SIGKILL)


def test_the_federation_script_stops_what_it_started_on_sigterm(tmp_path: Path) -> None:
    """The page's script SIGTERMed while ``flwr run`` runs (as a service manager stops
    it; Ctrl-C is SIGINT, the same trap): it exits 143 and its SuperLink, SuperNodes
    and ``flwr run`` are gone, nothing of the test's folder left."""
    script = REPO / "examples" / "flower" / "ddp-digits" / "federation.sh"
    bindir = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PATH": os.pathsep.join([bindir, os.environ.get("PATH", "")]),
        "FLWR_HOME": str(tmp_path / "flwr-home"),
        "APP": str(APP),
        "LINK_PORT": str(free_port()),
        "NODE_PORTS": f"{free_port()} {free_port()}",
        "RUN_CONFIG": "num-server-rounds=1 slow-s=120.0",
        "RANKEXEC_FLOWER_DIR": str(tmp_path / "rx"),
        "RANKEXEC_LOG": "warn",
    }
    log = tmp_path / "federation.out"
    try:
        p = docrun.start(["bash", str(script)], log, cwd=tmp_path, env=env)
        wait_until(
            lambda: "federation: flwr run pid" in log.read_text() or p.poll() is not None,
            120,
            "the script running flwr run",
        )
        assert p.poll() is None, log.read_text()[-4000:]
        p.send_signal(signal.SIGTERM)  # the script only, not its process group
        rc = p.wait(timeout=90)
        text = log.read_text(errors="replace")
        print(text[-1500:])
        assert rc == 143, f"{script} exited {rc}:\n{text[-4000:]}"
        started = [int(x) for x in STARTED.findall(text)]
        m = re.search(r"^federation: flwr run pid (\d+)$", text, re.MULTILINE)
        assert m, text[-4000:]
        run_pid = int(m.group(1))
        assert len(started) == 3, text[-4000:]
        assert not [p for p in [*started, run_pid] if pid_alive(p)], text[-4000:]
        wait_until(lambda: not pids_with_env(str(tmp_path)), 30, "no process of the test left")
    finally:
        for pid in pids_with_env(str(tmp_path)):  # never leave anything, even on a failure
            os.kill(pid, signal.SIGKILL)


def test_a_raising_rank_answers_an_error_and_the_group_is_relaunched(dep: Deployment) -> None:
    """A rank that raises, while another run (A, slow rounds) shares both SuperNodes:
    each node keeps one group per run; ``flwr stop`` of A mid-round ends A's groups
    only (A is forgotten by both hosts, its rank logs with it), and the raising run
    completes on its own groups."""
    out = dep.root / "result-2.json"
    run_a = dep.submit(APP, {"num-server-rounds": 2, "slow-s": 120.0})
    run = dep.submit(
        APP,
        {
            "result-file": str(out),
            "num-server-rounds": 2,
            "raise-round": 1,
            "raise-rank": 1,
            "raise-partition": 0,
        },
    )
    nodes: list[int] = []

    def a_busy() -> bool:
        nodes[:] = _nodes(dep)
        st = [host_status_in(dep, n) for n in nodes]
        return len(st) == 2 and all(
            s is not None and run_a in s["runs"] and s["runs"][run_a]["busy"] for s in st
        )

    wait_until(a_busy, 240, "both nodes' groups of run A busy with the slow round")
    a_ranks = [p for n in nodes for p in host_status_in(dep, n)["runs"][run_a]["pids"]]
    t = time.monotonic()
    stopped = dep.stop_run(run_a)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    wait_until(lambda: not any(pid_alive(p) for p in a_ranks), 60, "run A's ranks gone")
    wait_until(
        lambda: all(run_a not in host_status_in(dep, n)["runs"] for n in nodes),
        60,
        "run A forgotten by both hosts",
    )
    assert not any((dep.root / "rx" / f"node-{n}" / f"run-{run_a}").exists() for n in nodes)
    print(f"\n[flower] flwr stop {run_a}: its ranks {a_ranks} gone in {time.monotonic() - t:.1f}s")
    status = dep.wait_run(run, 300)
    res = _result(out)
    print(f"\n[flower] run {run}: {status}; errors per round: {res['errors']}")
    assert status == "finished:completed"
    (reason,) = res["errors"][0]
    assert "rank 1" in reason and "RuntimeError" in reason and "raises in round 1" in reason
    assert res["errors"][1] == []
    assert len(res["replies"][0]) == 1 and len(res["replies"][1]) == 2
    survivor = res["replies"][0][0]["pids"]
    later = [r["pids"] for r in res["replies"][1]]
    assert survivor in later, "the other node kept its ranks"
    relaunched = next(p for p in later if p != survivor)
    print(f"[flower] the failed node's new ranks: {relaunched}")
    served = [p for r in res["replies"][0] + res["replies"][1] for p in r["pids"]]
    assert not set(a_ranks) & set(served), "run A's ranks never served the other run"
    wait_until(lambda: not any(pid_alive(p) for p in relaunched), 30, "ranks gone")


def test_a_killed_rank_costs_a_retry_not_the_round(dep: Deployment) -> None:
    """restart.retry_task (the example asks for 1): rank 1 of one node SIGKILLed
    mid-round; the node's message runs again on a relaunched group and the round
    aggregates both nodes."""
    out = dep.root / "result-retry.json"
    run = dep.submit(APP, {"result-file": str(out), "num-server-rounds": 1, "slow-s": 15.0})
    nodes: list[int] = []

    def both_busy() -> bool:
        nodes[:] = _nodes(dep)
        st = [host_status_in(dep, n) for n in nodes]
        return len(st) == 2 and all(s is not None and run in s["runs"] and s["busy"] for s in st)

    wait_until(both_busy, 180, "both nodes' groups busy with the slow round")
    node = nodes[0]
    old = host_status_in(dep, node)["runs"][run]["pids"]
    os.kill(old[1], signal.SIGKILL)
    status = dep.wait_run(run, 300)
    res = _result(out)
    print(f"\n[flower] run {run}: {status}; rank 1 (pid {old[1]}) of node {node} SIGKILLed")
    assert status == "finished:completed", dep.last_failure[-4000:]
    assert res["errors"] == [[]], res["errors"]
    (replies,) = res["replies"]
    assert len(replies) == 2, "the round aggregated both nodes"
    pids = [p for r in replies for p in r["pids"]]
    assert not set(old) & set(pids), "the killed node answered from a relaunched group"
    log = (dep.root / "rx" / f"node-{node}" / "host.log").read_text()
    line = next(ln for ln in log.splitlines() if "ran again after" in ln)
    print(f"[flower] {line.strip()}")
    assert f"rank 1 (pid {old[1]})" in line
    wait_until(lambda: not any(pid_alive(p) for p in pids + old), 30, "ranks gone")


def test_close_groups_reports_a_node_that_does_not_answer(dep: Deployment) -> None:
    """``close_groups`` maps every node the grid knows to whether it answered: a
    SuperNode stopped (SIGSTOP, still listed by the SuperLink) reads ``False`` once
    the close timeout passes, the other ``True``; the run still completes."""
    out = dep.root / "result-close.json"
    stopped = dep.supernodes[1]
    hosts = {n: host_status_in(dep, n) for n in _nodes(dep)}
    stopped_node = [n for n, st in hosts.items() if st and st["supernode_pid"] == stopped.pid]
    stopped.send_signal(signal.SIGSTOP)
    try:
        run = dep.submit(
            APP, {"result-file": str(out), "num-server-rounds": 0, "close-timeout": 20.0}
        )
        status = dep.wait_run(run, 180)
    finally:
        stopped.send_signal(signal.SIGCONT)
    assert status == "finished:completed", dep.run_log(run)
    closed = _result(out)["closed"]
    print(f"\n[flower] close_groups with a stopped SuperNode: {closed}")
    assert len(closed) == 2, closed
    assert sorted(closed.values()) == [False, True], closed
    for n in stopped_node:  # where an earlier run left that node's host to say its id
        assert closed[str(n)] is False, (n, closed)


def test_sigkilled_supernode_and_flwr_stop_leave_nothing(dep: Deployment) -> None:
    run = dep.submit(APP, {"num-server-rounds": 2, "slow-s": 120.0})
    nodes: list[int] = []

    def both_busy() -> bool:
        nodes[:] = _nodes(dep)
        st = [host_status_in(dep, n) for n in nodes]
        return len(st) == 2 and all(s is not None and s["busy"] for s in st)

    wait_until(both_busy, 180, "both nodes' groups busy with the slow round")
    by_node = {n: host_status_in(dep, n) for n in nodes}
    print(f"\n[flower] run {run} busy: {by_node}")

    # 1. SIGKILL the second SuperNode: its host sees it gone, closes its group, exits.
    killed = dep.kill_supernode(1)
    victim = next(n for n, s in by_node.items() if s["supernode_pid"] == killed)
    gone = by_node[victim]["pids"] + [by_node[victim]["pid"]]
    t = time.monotonic()
    wait_until(lambda: not any(pid_alive(p) for p in gone), 30, "the killed node's host/ranks")
    print(
        f"[flower] SuperNode {killed} SIGKILLed: host and ranks {gone} gone in"
        f" {time.monotonic() - t:.1f}s"
    )

    # 2. flwr stop: the other node's task in flight is aborted, its group closes.
    other = next(n for n in nodes if n != victim)
    ranks = by_node[other]["pids"]
    t = time.monotonic()
    res = dep.stop_run(run)
    assert res.returncode == 0, res.stdout + res.stderr
    t_returned = time.monotonic()
    wait_until(lambda: not any(pid_alive(p) for p in ranks), 30, "the stopped run's ranks")
    print(
        f"[flower] flwr stop: ranks {ranks} gone {time.monotonic() - t:.1f}s after the"
        f" command started, {time.monotonic() - t_returned:.1f}s after it returned"
    )
    # Its ranks are gone; the host closes the group when the abort lands.
    wait_until(lambda: host_status_in(dep, other)["pids"] == [], 30, "the group closed")


def host_status_in(dep: Deployment, node: int) -> dict | None:
    old = os.environ.get("RANKEXEC_FLOWER_DIR")
    os.environ["RANKEXEC_FLOWER_DIR"] = str(dep.root / "rx")
    try:
        return host_status(node)
    finally:
        if old is None:
            del os.environ["RANKEXEC_FLOWER_DIR"]
        else:
            os.environ["RANKEXEC_FLOWER_DIR"] = old
