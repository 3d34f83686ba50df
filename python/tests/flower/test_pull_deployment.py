"""``rankexec-flower-superexec`` under Flower's real Deployment Engine (flwr 1.42): one
SuperLink and one SuperNode with ``--isolation process`` beside rankexec's SuperExec
(``Deployment(pull="files")``), offline.

1. rankexec's ``ClientApp`` with two ranks: the ServerApp sends a model of three
   multi-chunk arrays (random bytes) and a small one; both ranks see every array's bytes
   as the server sent them (SHA-256 of each, compared on the server), the node's
   ClientApp process says it pulled the three into memory files, and rank 0's reply
   (each weight + 1) reaches the server.
2. Flower's own ``ClientApp`` on the same node: ``to_torch_state_dict()`` of the arrays
   pulled into memory files gives the server's values.
3. In each, two messages: the array the handler kept in ``context.state`` from the
   first is there in the second (Flower saves the state as protobuf ``bytes``); and
   the same with rankexec's ``ClientApp`` under Flower's own SuperExec.

Every process is stopped by pid afterwards; nothing that carries the test's folder in
its environment is left (the SuperExec, its ClientApp processes, and the node's host
and ranks, which leave with the SuperNode: the host finds it by the Runtime API port
the ClientApp process talks to, the SuperNode not being its ancestor here).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

pytest.importorskip("flwr")
pytest.importorskip("torch")

from rankexec.flower.deployment import Deployment

from .helpers import leave_nothing
from .pull_app import write_app


@contextlib.contextmanager
def _deployment(root: Path, pull: str):
    d = Deployment(
        root,
        ["partition-id=0 num-partitions=1"],
        env={"RANKEXEC_FLOWER_DIR": str(root / "rx"), "RANKEXEC_LOG": "warn"},
        pull=pull,
    )
    try:
        d.start()
        yield d
    finally:
        d.stop()
        leave_nothing(root, "flower-pull")


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory):
    with _deployment(tmp_path_factory.mktemp("flower-pull"), "files") as d:
        yield d


def _run(dep: Deployment, tmp_path: Path, impl: str, rounds: int = 2) -> dict:
    result = tmp_path / "result.json"
    run = dep.submit(write_app(tmp_path, impl), {"result-file": str(result), "rounds": rounds})
    status = dep.wait_run(run, 600)
    assert status == "finished:completed", f"{status}\n{dep.last_failure}\n{dep.log_tail()}"
    return json.loads(result.read_text())


def _superexec_log(dep: Deployment) -> str:
    return (dep.root / "superexec-0.log").read_text(errors="replace")


def test_ranks_see_the_arrays_pulled_into_memory_files(dep: Deployment, tmp_path: Path) -> None:
    res = _run(dep, tmp_path, "rankexec")
    assert "error" not in res, res
    assert res["plus_one"], res
    # Each rank wrote what it saw; the node pulled a, b, c into files.
    result = tmp_path / "result.json"
    for rank in (0, 1):
        seen = json.loads(Path(f"{result}.rank{rank}").read_text())
        for k, want in res["digests"].items():
            assert seen[k][0] == want, (rank, k, seen[k], want)
    assert "rankexec: 3 arrays of the message pulled into memory files" in _superexec_log(dep)
    # Rank 0 kept the array "a" in context.state: the node's state came back in round 2.
    assert res["kept"] == ["", res["digests"]["a"]], res["kept"]


def test_flowers_own_clientapp_reads_the_arrays_pulled_into_memory_files(
    dep: Deployment, tmp_path: Path
) -> None:
    before = _superexec_log(dep).count("pulled into memory files")
    res = _run(dep, tmp_path, "flower")
    assert "error" not in res, res
    assert res["plus_one"], res
    seen = res["seen"]["0"]
    for k, want in res["digests"].items():
        assert seen[k][0] == want, (k, seen[k], want)
    # The multi-chunk arrays reached Flower's handler as memory files, the small one as bytes.
    assert {seen[k][1] for k in ("a", "b", "c")} == {"Blob"}, seen
    assert seen["bias"][1] == "bytes", seen
    assert _superexec_log(dep).count("pulled into memory files") == before + 2
    # The handler kept a memory file's array in context.state: Flower saved it as bytes.
    assert res["kept"] == ["", res["digests"]["a"]], res["kept"]


def test_a_rank_groups_state_with_arrays_survives_flowers_own_superexec(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """Under Flower's own SuperExec and ``flwr-clientapp``: rank 0 keeps a 12 MB array
    in ``context.state``; the node's state (which Flower serializes into protobuf
    ``bytes``) comes back with it in the next message."""
    with _deployment(tmp_path_factory.mktemp("flower-state"), "flower") as d:
        res = _run(d, tmp_path, "rankexec")
    assert "error" not in res and res["plus_one"], res
    assert res["kept"] == ["", res["digests"]["a"]], res["kept"]
