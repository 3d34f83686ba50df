"""rankexec.flower's ClientApp and per-node host without a federation: this process
plays ``flwr-clientapp`` and calls the ClientApp as Flower does (``app(message,
context)``), so the real host and real ranks (two, running a tiny app of plain Flower
handlers) serve it. Checks what a Deployment Engine run takes minutes to show:

- the ranks stay from call to call, every rank gets the message, rank 0 answers, the
  arrays come back, ``context.state`` is rank 0's;
- a raising rank answers Flower's ``Error`` naming the rank; the next call relaunches;
- the ServerApp's close message closes the group;
- the idle lease closes the group, then the host leaves.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from rankexec.flower import CLOSE_MESSAGE_TYPE, host_status

from .helpers import pid_alive, wait_until

APP = """
import os

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from rankexec.flower import ClientApp, ndarrays

app = ClientApp(num_of_processes=2, deadlines={"startup": "120s", "task": "120s"})


@app.train()
def train(msg, context):
    rank = int(os.environ["RANK"])
    if msg.content["config"]["raise"] == rank:
        raise ValueError(f"rank {rank} was told to raise")
    (w,) = ndarrays(msg.content["arrays"])
    assert not w.flags.writeable
    context.state["seen"] = ConfigRecord({"rank": rank, "pid": os.getpid()})
    metrics = MetricRecord({"pid": os.getpid(), "world": int(os.environ["WORLD_SIZE"])})
    content = RecordDict({"arrays": ArrayRecord([w * 2]), "metrics": metrics})
    return Message(content, reply_to=msg)
"""


@pytest.fixture
def app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    pkg = tmp_path / "app" / "tinyapp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "client_app.py").write_text(textwrap.dedent(APP))
    monkeypatch.syspath_prepend(str(tmp_path / "app"))
    monkeypatch.setenv("RANKEXEC_FLOWER_DIR", str(tmp_path / "rx"))
    monkeypatch.setenv("RANKEXEC_LOG", "warn")
    import importlib

    mod = importlib.import_module("tinyapp.client_app")
    yield mod.app
    sys.modules.pop("tinyapp.client_app", None)
    sys.modules.pop("tinyapp", None)


def _call(app, node: int, raise_rank: int = -1, lease: float = 300.0):
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 41, 0, 1
    content = RecordDict(
        {
            "arrays": ArrayRecord([np.arange(4, dtype=np.float32)]),
            "config": ConfigRecord({"raise": raise_rank}),
        }
    )
    msg = Message(content, dst_node_id=node, message_type="train")
    ctx = Context(41, node, {"rankexec-lease": lease}, RecordDict(), {})
    return app(msg, ctx), ctx


def test_ranks_stay_a_raise_relaunches_and_the_lease_ends_everything(app) -> None:
    node = 7001
    reply, ctx = _call(app, node)
    assert not reply.has_error(), reply.error
    first = int(reply.content["metrics"]["pid"])
    assert reply.content["metrics"]["world"] == 2
    (w,) = reply.content["arrays"].to_numpy_ndarrays()
    np.testing.assert_array_equal(w, np.arange(4, dtype=np.float32) * 2)
    assert dict(ctx.state["seen"]) == {"rank": 0, "pid": first}
    st = host_status(node)
    assert st is not None and first in st["pids"] and len(st["pids"]) == 2
    group = list(st["pids"])

    reply, _ = _call(app, node)
    assert int(reply.content["metrics"]["pid"]) == first, "the same rank 0 serves the next call"

    reply, _ = _call(app, node, raise_rank=1)
    assert reply.has_error()
    print(f"\n[flower-host] error reply: {reply.error.reason.splitlines()[0]}")
    assert reply.error.reason.startswith("rank 1 (pid ")
    assert "ValueError: rank 1 was told to raise" in reply.error.reason
    wait_until(lambda: not any(pid_alive(p) for p in group), 30, "the failed group gone")

    reply, _ = _call(app, node)  # the next call relaunches the group
    assert not reply.has_error(), reply.error
    assert int(reply.content["metrics"]["pid"]) not in group
    st = host_status(node)
    assert st is not None
    host_pid, ranks = st["pid"], st["pids"]

    # The ServerApp's close_groups sends this query to every node.
    close = Message(RecordDict(), dst_node_id=node, message_type=CLOSE_MESSAGE_TYPE)
    reply = app(close, Context(41, node, {}, RecordDict(), {}))
    assert dict(reply.content["rankexec"]) == {"closed": 1, "ranks": 2}
    wait_until(lambda: not any(pid_alive(p) for p in ranks), 30, "the closed group gone")
    os.kill(host_pid, signal.SIGTERM)  # its lease is 300 s: stop it by pid
    wait_until(lambda: not pid_alive(host_pid), 30, "the host gone")


def test_the_lease_ends_a_group_and_its_host(app) -> None:
    node = 7002
    reply, _ = _call(app, node, lease=1.0)
    assert not reply.has_error(), reply.error
    st = host_status(node)
    assert st is not None
    host_pid, ranks = st["pid"], st["pids"]
    wait_until(lambda: not any(pid_alive(p) for p in ranks), 30, "the idle lease closing")
    wait_until(lambda: not pid_alive(host_pid), 30, "the host leaving after its lease")
    assert host_status(node) is None


def test_an_explicit_host_and_a_message_during_a_teardown(app, tmp_path: Path) -> None:
    """The site starts the host itself (beside its SuperNode); a message that arrives
    while the group is being closed waits and gets a new group, never the dead one."""
    import subprocess
    import threading

    node = 7003
    log = open(tmp_path / "host.log", "wb")  # noqa: SIM115 - closed below
    host = subprocess.Popen(
        [sys.executable, "-m", "rankexec.flower.host", "--node-id", str(node), "--lease", "60"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_until(lambda: host_status(node) is not None, 60, "the explicit host listening")
        reply, _ = _call(app, node)
        assert not reply.has_error(), reply.error
        assert host_status(node)["pid"] == host.pid, "the ClientApp used the site's host"
        old = list(host_status(node)["pids"])
        closing = threading.Thread(
            target=app,
            args=(
                Message(RecordDict(), dst_node_id=node, message_type=CLOSE_MESSAGE_TYPE),
                Context(41, node, {}, RecordDict(), {}),
            ),
        )
        closing.start()
        reply, _ = _call(app, node)  # races the close: before it or after it, never during
        closing.join(60)
        assert not reply.has_error(), reply.error
        pid = int(reply.content["metrics"]["pid"])
        now = host_status(node)["pids"]
        # Served by the old group before its close, or by a new group after it.
        assert (pid in old and now == []) or (pid in now and not set(now) & set(old))
        old += now
    finally:
        host.send_signal(signal.SIGTERM)
        host.wait(30)
        log.close()
    assert all(not pid_alive(p) for p in old)
