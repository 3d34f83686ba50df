"""What a process of the node's user can and cannot make the node's host do (issue 39
item 1): nothing a peer sends is code (no pickle is read from it), a run's ranks
import only the app the host recorded for the run, a refusal never names another
run's app, and a close that does not name the run's app ends nothing.

Each test drives a real host and real ranks (``tinyapp`` from ``test_host``), the way a
process of this uid can: straight through the host's socket.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import struct
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from rankexec.flower import _channel, _codec, host_status

from .helpers import pid_alive, wait_until
from .test_host import _call, _raw, app  # noqa: F401 - `app` is a fixture

_FIXED = struct.Struct("<QQQ")


class _Mkdir:
    """Unpickled, it makes a folder: the proof that a pickle ran."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _evil_module(tmp_path: Path, marker: Path) -> dict[str, str]:
    """A module whose import leaves ``marker``; its reference as the ranks take one."""
    d = tmp_path / "evil"
    d.mkdir(exist_ok=True)
    (d / "evil_mod.py").write_text(
        textwrap.dedent(
            f"""
            import os
            os.mkdir({str(marker)!r})
            app = None
            """
        )
    )
    return {"app_dir": str(d), "module": "evil_mod", "attr": "app"}


def _serve_run(app, node: int, run: int) -> list[int]:  # noqa: F811 - the fixture's value
    reply, _ = _call(app, node, run=run)
    assert not reply.has_error(), reply.error
    st = host_status(node)
    assert st is not None
    pids = list(st["runs"][run]["pids"])
    assert len(pids) == 2
    return pids


def _end(node: int) -> None:
    st = host_status(node)
    if st is None:
        return
    os.kill(st["pid"], signal.SIGTERM)
    wait_until(lambda: not pid_alive(st["pid"]), 60, "the host gone")
    assert all(not pid_alive(p) for p in st["pids"])


def _message_spec(run: int, node: int, blobs: dict) -> tuple[dict, dict]:
    content = RecordDict(
        {
            "arrays": ArrayRecord([np.arange(4, dtype=np.float32)]),
            "config": ConfigRecord({"raise": -1}),
        }
    )
    msg = Message(content, dst_node_id=node, message_type="train")
    ctx = Context(run, node, {}, RecordDict(), {})
    return _codec.encode_message(msg, blobs), _codec.encode_context(ctx, blobs)


def test_a_pickled_request_is_refused_and_never_runs(app, tmp_path: Path) -> None:  # noqa: F811
    """(a) A frame whose header is a pickle that would make a folder when unpickled:
    the host refuses it naming the channel's format, and the folder never appears."""
    node = 7601
    ranks = _serve_run(app, node, 61)
    marker = tmp_path / "pickle-ran-in-the-host"
    head = pickle.dumps({"op": "status", "x": _Mkdir(marker)}, protocol=5)
    with _channel.connect(_channel.node_dir(node), timeout=10) as sock:
        sock.sendall(_FIXED.pack(len(head), 0, 0) + head)
        sock.shutdown(socket.SHUT_WR)
        try:
            out = _channel.recv(sock)
        except Exception as e:  # noqa: BLE001 - whatever came back, the marker decides
            out = {"error": f"no answer: {e}"}
    print(f"\n[flower-security] a pickled header: {out}")
    assert not marker.exists(), "the host unpickled a peer's pickle"
    assert "JSON" in str(out.get("error")), out
    assert host_status(node)["runs"][61]["pids"] == ranks
    _end(node)


def test_a_pickled_spec_blob_never_reaches_a_rank(app, tmp_path: Path) -> None:  # noqa: F811
    """(a) The spec the ranks read, sent by the peer as a pickle blob: refused, never
    unpickled by a rank."""
    node = 7604
    ranks = _serve_run(app, node, 61)
    marker2 = tmp_path / "pickle-ran-in-a-rank"
    blobs: dict = {}
    mspec, cspec = _message_spec(61, node, blobs)
    spec_pickle = pickle.dumps(
        {"app": app._ref(), "message": mspec, "context": cspec, "x": _Mkdir(marker2)}, protocol=5
    )
    blobs[_codec.SPEC_BLOB] = spec_pickle
    req = {
        "op": "execute",
        "run_id": 61,
        "app": app._ref(),
        "request": {},
        "blobs": {k: pickle.PickleBuffer(v) for k, v in blobs.items()},
    }
    out = _raw(node, req)
    print(f"[flower-security] a pickled spec blob: {out.get('error')}")
    assert not marker2.exists(), "a rank unpickled a peer's pickle"
    assert "error" in out, out
    assert host_status(node)["runs"][61]["pids"] == ranks
    _end(node)


def test_another_app_is_never_imported_into_a_runs_ranks(app, tmp_path: Path) -> None:  # noqa: F811
    """(b) A request for run A naming another app: refused, the other module is never
    imported into run A's ranks, and the refusal does not name run A's app."""
    node = 7602
    ranks = _serve_run(app, node, 62)
    marker = tmp_path / "evil-imported"
    evil = _evil_module(tmp_path, marker)

    out = _raw(node, {"op": "execute", "run_id": 62, "app": evil, "request": {}, "blobs": {}})
    print(f"\n[flower-security] another app for run 62: {out.get('error')}")
    assert "error" in out, out
    assert "tinyapp" not in str(out), "the refusal discloses run 62's app"
    assert not marker.exists()
    assert host_status(node)["runs"][62]["pids"] == ranks
    _end(node)


def test_a_spec_naming_another_module_is_refused(app, tmp_path: Path) -> None:  # noqa: F811
    """(b) Run A's own app in the request, another module in the spec the ranks read."""
    node = 7605
    ranks = _serve_run(app, node, 62)
    ref = app._ref()
    marker = tmp_path / "evil-imported"
    evil = _evil_module(tmp_path, marker)
    blobs: dict = {}
    mspec, cspec = _message_spec(62, node, blobs)
    spec = {"app": evil, "message": mspec, "context": cspec, "task_id": 1}
    blobs[_codec.SPEC_BLOB] = _codec.pack(spec)
    req = {
        "op": "execute",
        "run_id": 62,
        "app": ref,
        "request": {},
        "spec": spec,
        "blobs": {k: pickle.PickleBuffer(v) for k, v in blobs.items()},
    }
    out = _raw(node, req)
    print(f"[flower-security] a spec naming another module: {out.get('error')}")
    assert not marker.exists(), "another module was imported into run 62's ranks"
    assert "error" in out, out
    assert "tinyapp" not in str(out.get("error")), "the refusal discloses run 62's app"
    assert host_status(node)["runs"][62]["pids"] == ranks
    reply, _ = _call(app, node, run=62)
    assert not reply.has_error(), reply.error
    assert int(reply.content["metrics"]["pid"]) == ranks[0], "run 62's rank 0 serves on"
    _end(node)


def test_a_rank_imports_only_its_first_app(tmp_path: Path) -> None:
    """The rank side: a rank serves one app for its life and refuses any other."""
    from rankexec.flower._rank import FlowerRank

    good = tmp_path / "good"
    good.mkdir()
    (good / "good_mod.py").write_text("app = object()\n")
    marker = tmp_path / "evil-imported-in-a-rank"
    evil = _evil_module(tmp_path, marker)
    rank = FlowerRank()
    first = rank._app({"app_dir": str(good), "module": "good_mod", "attr": "app"})
    assert first is not None
    with pytest.raises(Exception, match="does not match"):
        rank._app(evil)
    assert not marker.exists()


def test_a_close_must_name_the_runs_app(app, tmp_path: Path) -> None:  # noqa: F811
    """(c) A close that names no app, or another app, does not end the run's group."""
    node = 7603
    ranks = _serve_run(app, node, 63)
    marker = tmp_path / "never"
    evil = _evil_module(tmp_path, marker)
    for what, req in (
        ("no app", {"op": "close", "run_id": 63}),
        ("another app", {"op": "close", "run_id": 63, "app": evil}),
    ):
        out = _raw(node, req)
        print(f"\n[flower-security] a close naming {what}: {out}")
        assert not out.get("closed"), (what, out)
        assert "tinyapp" not in str(out), "the refusal discloses run 63's app"
        st = host_status(node)
        assert st is not None and st["runs"][63]["pids"] == ranks, (what, st)
        assert all(pid_alive(p) for p in ranks), what
    out = _raw(node, {"op": "close", "run_id": 63, "app": app._ref()})
    assert out.get("closed") is True, out
    wait_until(lambda: not any(pid_alive(p) for p in ranks), 30, "run 63's ranks gone")
    _end(node)
