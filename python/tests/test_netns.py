"""Ranks on another node, emulated with a Linux network namespace and a veth pair
(10.213.N.1 here, 10.213.N.2 there): the ranks reach the host over the encrypted TCP
transport. `torchrun --nnodes=2` with c10d rendezvous trains the DDP digits example
across both namespaces (gloo over the veth pair); when the link goes down the host
reports a named failure within its heartbeat deadline, the remote ranks see the host
gone within seconds (TCP keepalive and `TCP_USER_TIMEOUT`) and exit, and nothing is
left in either namespace.

Needs root and `ip` (iproute2); skipped with the reason otherwise. Every namespace is
deleted, and its processes killed, even when a test fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import BIN, HERE, REPO, env_with_python, pid_alive, wait_until

HELPER = HERE / "two_nodes.py"


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    return None


def _ip(*args: str) -> str:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def _ns_pids(ns: str) -> list[int]:
    try:
        return [int(p) for p in _ip("netns", "pids", ns).split()]
    except RuntimeError:
        return []


class Node:
    """The other node: namespace `ns`, reached over veth `host_if` <-> `peer_if`."""

    def __init__(self, n: int) -> None:
        self.ns = f"rxnode{n}"
        self.host_if, self.peer_if = f"rxh{n}", f"rxp{n}"
        self.host, self.peer = f"10.213.{n}.1", f"10.213.{n}.2"

    def up(self) -> None:
        _ip("netns", "add", self.ns)
        _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.peer_if)
        _ip("link", "set", self.peer_if, "netns", self.ns)
        _ip("addr", "add", f"{self.host}/24", "dev", self.host_if)
        _ip("link", "set", self.host_if, "up")
        for cmd in (
            ["addr", "add", f"{self.peer}/24", "dev", self.peer_if],
            ["link", "set", self.peer_if, "up"],
            ["link", "set", "lo", "up"],
        ):
            _ip("netns", "exec", self.ns, "ip", *cmd)

    def link_down(self) -> None:
        _ip("netns", "exec", self.ns, "ip", "link", "set", self.peer_if, "down")

    def down(self) -> list[int]:
        """Kills what still runs in the namespace and deletes it; returns what ran."""
        left = _ns_pids(self.ns)
        for p in left:
            try:
                os.kill(p, 9)
            except ProcessLookupError:
                pass
        for args in (("netns", "del", self.ns), ("link", "del", self.host_if)):
            try:
                _ip(*args)
            except RuntimeError:
                pass
        return left


@pytest.fixture
def node():
    why = _why_not()
    if why:
        pytest.skip(why)
    n = 100 + os.getpid() % 100
    nd = Node(n)
    nd.down()  # a leftover of an earlier, killed run
    try:
        nd.up()
    except RuntimeError as e:
        nd.down()
        pytest.skip(f"cannot make a network namespace here: {e}")
    try:
        yield nd
    finally:
        left = nd.down()
        assert not left, f"processes left in {nd.ns}: {left}"


def _config(
    tmp: Path, node: Node, launcher_argv: list[str], components, worker, source="torchrun"
) -> Path:
    cfg = {
        "executor_id": components[0]["id"],
        "num_of_processes": 2,
        "components": components,
        "worker": worker,
        "launcher": {"command": {"argv": launcher_argv, "rank_source": source}},
        "transport": {"tcp": {"bind": f"{node.host}:0"}},
        "gpu": {"mode": "none"},
        "restart": {"max_restarts": 0},
        "deadlines": {
            "startup": "180s",
            "task": "600s",
            "heartbeat_interval": "500ms",
            "heartbeat_timeout": "5s",
            "shutdown_grace": "5s",
            "term_grace": "2s",
        },
    }
    path = tmp / "executor.json"
    path.write_text(json.dumps(cfg))
    return path


def test_torchrun_across_two_nodes_trains_ddp_digits(tmp_path, node):
    if not (Path(sys.executable).parent / "torchrun").exists():
        pytest.skip("torch is absent: no torchrun beside this interpreter")
    argv = [
        sys.executable,
        str(HELPER),
        "torchrun",
        node.ns,
        node.host,
        node.peer,
        node.host_if,
        node.peer_if,
        "{nproc}",
        "{program}",
        "{args}",
    ]
    components = [
        {
            "id": "ddp",
            "path": "examples/python/ddp_digits/trainer.py:DigitsDDP",
            "args": {"epochs": 3, "lr": 0.05, "batch_size": 32, "hidden": 128},
        }
    ]
    worker = {"program": "python", "args": ["-m", "rankexec.worker"]}
    cfg = _config(tmp_path, node, argv, components, worker)
    out = subprocess.run(
        [str(BIN), "run", "--config", str(cfg), "--task", "train", "--rounds", "4"],
        cwd=REPO,
        env=env_with_python(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    print(out.stdout[-3000:], out.stderr[-3000:])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rounds = [
        json.loads(line.split(" returned ", 1)[1])
        for line in out.stdout.splitlines()
        if line.startswith("round ") and " returned " in line
    ]
    assert len(rounds) == 4, out.stdout
    # The model persists in the ranks: round 4 evaluates it after 9 epochs.
    last = rounds[-1]
    assert last["world_size"] == 2 and last["backend"] == "gloo", last
    assert last["val_accuracy"] >= 0.95, last
    # Remote ranks end on `Close` (or their connections' end), shortly after the host.
    wait_until(lambda: not _ns_pids(node.ns), 60, f"nothing left in {node.ns}")


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def test_mpirun_across_two_nodes(tmp_path, node):
    if shutil.which("mpirun") is None:
        pytest.skip("Open MPI is not installed (no mpirun)")
    argv = [
        sys.executable,
        str(HELPER),
        "mpirun",
        node.ns,
        node.host,
        node.peer,
        "{nproc}",
        "{program}",
        "{args}",
    ]
    # Each task lasts a second: the ranks outlive the check below by that much at
    # least (with 10 ms tasks the three rounds and the close could be over before the
    # check read /proc, as one CI run found).
    components = [{"id": "sleep", "path": "Sleep", "args": {"secs": 1.0}}]
    worker = {"program": str(BIN), "args": ["worker"]}
    cfg = _config(tmp_path, node, argv, components, worker, source="openmpi")
    host = subprocess.Popen(
        [str(BIN), "run", "--config", str(cfg), "--task", "t", "--rounds", "3", "--print-pids"],
        cwd=REPO,
        env=env_with_python(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert host.stdout is not None
        line = host.stdout.readline()
        while line and not line.startswith("pids: "):
            line = host.stdout.readline()
        assert line.startswith("pids: "), "the group started"
        # While the group is up: a rank runs in the other namespace, under Open MPI's
        # daemon there, with the rank Open MPI gave it.
        there = [_environ(p) for p in _ns_pids(node.ns)]
        ranks_there = [e["OMPI_COMM_WORLD_RANK"] for e in there if "OMPI_COMM_WORLD_RANK" in e]
        assert ranks_there, f"no rank in {node.ns}: {there}"
        rest, err = host.communicate(timeout=300)
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()
    print(rest[-2000:], err[-2000:])
    assert host.returncode == 0, rest[-3000:] + err[-3000:]
    assert rest.count('"rank":0') == 3, rest
    wait_until(lambda: not _ns_pids(node.ns), 30, f"nothing left in {node.ns}")
    print(f"mpirun across two namespaces: rank(s) {ranks_there} in {node.ns}; 3 tasks")


def test_link_down_is_a_named_failure_and_remote_ranks_exit(tmp_path, node):
    # Ranks only in the other namespace, started the way ssh leaves processes on
    # another host: the host cannot signal them; only their connections tell them.
    argv = [
        sys.executable,
        str(HELPER),
        "detached",
        node.ns,
        "{nproc}",
        "{program}",
        "{args}",
    ]
    components = [{"id": "sleep", "path": "Sleep", "args": {"secs": 600}}]
    worker = {"program": str(BIN), "args": ["worker"]}
    cfg = _config(tmp_path, node, argv, components, worker)
    host = subprocess.Popen(
        [str(BIN), "run", "--config", str(cfg), "--task", "t", "--print-pids"],
        cwd=REPO,
        env=dict(env_with_python(), RANKEXEC_LOG="info"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert host.stdout is not None
        line = host.stdout.readline()
        while line and not line.startswith("pids: "):
            line = host.stdout.readline()
        assert line.startswith("pids: "), "the group started"
        remote = _ns_pids(node.ns)
        assert remote, "ranks run in the other namespace"
        t0 = time.monotonic()
        node.link_down()
        # The host: a named failure within its heartbeat deadline (5 s), bounded here
        # generously for a busy machine.
        rest, err = host.communicate(timeout=120)
        host_took = time.monotonic() - t0
        assert host.returncode != 0, rest + err
        failure = [ln for ln in (rest + err).splitlines() if "failed" in ln or "unresponsive" in ln]
        assert any("rank" in ln for ln in failure), rest[-2000:] + err[-3000:]
        # The remote ranks: the host is gone (no FIN can cross a dead link), so only
        # TCP keepalive / TCP_USER_TIMEOUT tells them; without them they would wait
        # for the kernel's ~15-minute retransmission limit.
        wait_until(
            lambda: not any(pid_alive(p) for p in remote),
            120,
            f"remote ranks {remote} to exit with the link down",
        )
        ranks_took = time.monotonic() - t0
        wait_until(lambda: not _ns_pids(node.ns), 30, f"nothing left in {node.ns}")
        print(
            f"link down: host failed after {host_took:.1f} s: {failure[:2]}; "
            f"remote ranks {remote} gone after {ranks_took:.1f} s; {node.ns} empty"
        )
        logs = list(tmp_path.rglob("rank-*/stderr.log"))
        said = [p.read_text()[-400:] for p in logs]
        print("remote ranks said:", said)
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()
