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

import json
import os
import signal
import sys
import textwrap
from pathlib import Path

import docrun
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


def _install_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, package: str, source: str):
    """Writes ``source`` as ``package.client_app`` under ``tmp_path/app``, points the
    ranks' host at ``tmp_path/rx`` and returns the module's ``app``."""
    import importlib

    pkg = tmp_path / "app" / package
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "client_app.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path / "app"))
    monkeypatch.setenv("RANKEXEC_FLOWER_DIR", str(tmp_path / "rx"))
    monkeypatch.setenv("RANKEXEC_LOG", "warn")
    return importlib.import_module(f"{package}.client_app").app


def _forget_app(package: str) -> None:
    sys.modules.pop(f"{package}.client_app", None)
    sys.modules.pop(package, None)


@pytest.fixture
def app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    yield _install_app(tmp_path, monkeypatch, "tinyapp", APP)
    _forget_app("tinyapp")


def _call(app, node: int, raise_rank: int = -1, run: int = 41):
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run, 0, 1
    content = RecordDict(
        {
            "arrays": ArrayRecord([np.arange(4, dtype=np.float32)]),
            "config": ConfigRecord({"raise": raise_rank}),
        }
    )
    msg = Message(content, dst_node_id=node, message_type="train")
    # The app's node config is not the site's: the host reads the site itself.
    ctx = Context(run, node, {"rankexec-lease": 1.0}, RecordDict(), {})
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


def test_the_lease_ends_a_group_and_its_host(app, tmp_path: Path, monkeypatch) -> None:
    node = 7002
    site = tmp_path / "site.json"
    site.write_text('{"lease_s": 1.0}')
    monkeypatch.setenv("RANKEXEC_FLOWER_SITE", str(site))  # the host's own environment
    reply, _ = _call(app, node)
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


# ---- the site decides, in the host; runs apart; one host per node (issue 33) ----------


def _start_host(node: int, tmp_path: Path, *extra: str):
    import subprocess

    log = open(tmp_path / f"host-{node}-{len(list(tmp_path.iterdir()))}.log", "wb")  # noqa: SIM115
    argv = [sys.executable, "-m", "rankexec.flower.host", "--node-id", str(node), *extra]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return proc


def _raw(node: int, req: dict) -> dict:
    """A request sent straight to the host's socket, as any process of this uid can."""
    from rankexec.flower import _channel

    sock = _channel.connect(_channel.node_dir(node), timeout=10)
    with sock:
        _channel.send(sock, req)
        return _channel.recv(sock)


def _stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)


def test_crafted_requests_are_refused_by_the_host_naming_the_site_rule(app, tmp_path) -> None:
    """The host builds the group from the site's rules; a request sent straight to its
    socket that asks for more than the site allows is refused, naming the rule, and no
    rank starts."""
    node = 7004
    site = tmp_path / "site.json"
    site.write_text(
        '{"launchers": ["builtin", "mpirun"], "max_processes": 2, "gpu": {"devices": ["0"]}}'
    )
    host = _start_host(node, tmp_path, "--site", str(site), "--lease", "60")
    try:
        wait_until(lambda: host_status(node) is not None, 60, "the host listening")
        ref = app._ref()
        cases = {
            "extra launcher arguments": (
                {"launcher": {"mpirun": {"extra_args": ["-x", "LD_PRELOAD=/tmp/evil.so"]}}},
                "this node allows exactly",
                "`launchers` in the site file",
            ),
            "another interpreter": (
                {"python": "/tmp/evil/python"},
                "the request sets `python`",
                "`python` in the site file",
            ),
            "another rank program": (
                {"worker": {"program": "/bin/sh", "args": ["-c", "id"]}},
                "the request sets `worker`",
                "`python` in the site file",
            ),
            "an environment variable": (
                {"env": {"set": {"LD_PRELOAD": "/tmp/evil.so"}}},
                "the request sets `env`",
                "`env` in the site file",
            ),
            "more processes": (
                {"num_of_processes": 3},
                "num_of_processes=3: this node allows 1 to 2",
                "`max_processes` in the site file",
            ),
            "more GPUs": (
                {"gpu": {"devices": ["0", "1"]}},
                "GPU devices ['1']; this node allows ['0']",
                "`gpu.devices` in the site file",
            ),
        }
        for what, (request, says, rule) in cases.items():
            out = _raw(
                node,
                {"op": "execute", "run_id": 5, "app": ref, "request": request, "blobs": {}},
            )
            print(f"\n[flower-site] {what}: {out.get('error')}")
            assert out.get("kind") == "SiteError", (what, out)
            assert says in out["error"] and rule in out["error"], (what, out)
            assert str(site) in out["error"], "the message names the site file"
            if what == "extra launcher arguments":  # the refusal docs/flower-site.md shows
                shown = docrun.log_lines(
                    "docs/flower-site.md",
                    "refused-launcher",
                    paths={"/etc/rankexec/flower.json": site},
                )
                assert not docrun.missing_lines(shown, out["error"]), (shown, out["error"])
        st = host_status(node)
        assert st is not None and st["pids"] == [] and st["run_ids"] == [], st
        # The same request through the ClientApp is answered with Flower's Error.
        app._settings["num_of_processes"] = 3
        try:
            reply, _ = _call(app, node)
        finally:
            app._settings["num_of_processes"] = 2
        assert reply.has_error() and "refused by the node's site" in reply.error.reason
        assert "this node allows 1 to 2" in reply.error.reason
    finally:
        _stop(host)


def test_two_runs_on_one_node_keep_their_own_groups(app, tmp_path, monkeypatch) -> None:
    """Two runs on one node each keep their own group; a request for one run can neither
    close the other's group nor import another app into it; a third run is refused by
    the site's ``max_runs``, naming the runs that hold the node."""
    node = 7005
    site = tmp_path / "site.json"
    site.write_text('{"max_runs": 2, "lease_s": 300}')
    monkeypatch.setenv("RANKEXEC_FLOWER_SITE", str(site))
    reply_a, _ = _call(app, node, run=41)
    reply_b, _ = _call(app, node, run=42)
    assert not reply_a.has_error() and not reply_b.has_error(), (reply_a, reply_b)
    st = host_status(node)
    assert st is not None
    host_pid = st["pid"]
    a, b = list(st["runs"][41]["pids"]), list(st["runs"][42]["pids"])
    print(f"\n[flower-runs] run 41's ranks {a}, run 42's ranks {b}")
    assert len(a) == 2 and len(b) == 2 and not set(a) & set(b)
    for _ in range(2):  # interleaved: each run's rank 0 serves each of its messages
        for run, pids in ((41, a), (42, b)):
            reply, _ = _call(app, node, run=run)
            assert not reply.has_error(), reply.error
            assert int(reply.content["metrics"]["pid"]) == pids[0], (run, pids)
    # A request for run 42 that names another app is refused; run 42's ranks stay.
    evil = {"app_dir": str(tmp_path), "module": "evil_app", "attr": "app"}
    out = _raw(node, {"op": "execute", "run_id": 42, "app": evil, "request": {}, "blobs": {}})
    print(f"[flower-runs] another app for run 42: {out.get('error')}")
    assert "one app per run" in out["error"]
    assert host_status(node)["runs"][42]["pids"] == b
    # A third run: refused by the site's limit, said clearly.
    reply, _ = _call(app, node, run=43)
    print(f"[flower-runs] a third run: {reply.error.reason if reply.has_error() else 'served'}")
    assert reply.has_error() and "at most 2 runs" in reply.error.reason
    assert "[41, 42]" in reply.error.reason and "max_runs" in reply.error.reason
    # Run 41's close ends run 41's group only.
    close = Message(RecordDict(), dst_node_id=node, message_type=CLOSE_MESSAGE_TYPE)
    reply = app(close, Context(41, node, {}, RecordDict(), {}))
    assert dict(reply.content["rankexec"]) == {"closed": 1, "ranks": 2}
    wait_until(lambda: not any(pid_alive(p) for p in a), 30, "run 41's ranks gone")
    assert all(pid_alive(p) for p in b), "run 42's ranks live on"
    reply, _ = _call(app, node, run=42)
    assert int(reply.content["metrics"]["pid"]) == b[0]
    assert not (tmp_path / "rx" / f"node-{node}" / "run-41").exists(), "run 41's logs went"
    reply = app(close, Context(42, node, {}, RecordDict(), {}))
    assert dict(reply.content["rankexec"]) == {"closed": 1, "ranks": 2}
    os.kill(host_pid, signal.SIGTERM)
    wait_until(lambda: not pid_alive(host_pid), 30, "the host gone")
    assert all(not pid_alive(p) for p in a + b)


def test_one_host_per_node(app, tmp_path) -> None:
    """A second host for a node refuses to start, naming the first's pid, and leaves the
    first's socket and secret alone; a host removes only what it created."""
    node = 7006
    first = _start_host(node, tmp_path, "--lease", "60")
    try:
        wait_until(lambda: host_status(node) is not None, 60, "the first host listening")
        directory = tmp_path / "rx" / f"node-{node}"
        secret = (directory / "secret").read_bytes()
        second = _start_host(node, tmp_path, "--lease", "60")
        code = second.wait(60)
        log = max(tmp_path.glob(f"host-{node}-*.log")).read_text()
        print(f"\n[flower-host] a second host: exit {code}: {log.strip().splitlines()[-1]}")
        assert code == 3, log
        assert f"another rankexec host (pid {first.pid}) serves node {node}" in log
        shown = docrun.log_lines(
            "docs/flower-site.md",
            "second-host",
            paths={"/run/user/1000/rankexec-flower/node-7006": directory},
        )
        assert not docrun.missing_lines(shown, log), (shown, log)
        assert (directory / "secret").read_bytes() == secret, "the first's secret stays"
        assert host_status(node)["pid"] == first.pid, "the first host still serves"
        reply, _ = _call(app, node)
        assert not reply.has_error(), reply.error
        ranks = host_status(node)["pids"]
    finally:
        _stop(first)
    assert all(not pid_alive(p) for p in ranks)
    left = sorted(p.name for p in directory.iterdir())
    print(f"[flower-host] the node's folder after the host: {left}")
    assert not {"host.sock", "secret", "host.pid"} & set(left), left


def test_the_host_log_is_bounded(tmp_path) -> None:
    """host.log lives in memory ($XDG_RUNTIME_DIR): a host cuts it to its last MiB once
    it passes 4 MiB, instead of letting it grow with every run."""
    import subprocess

    node = 7007
    directory = tmp_path / "rx" / f"node-{node}"
    directory.mkdir(parents=True, mode=0o700)
    log_path = directory / "host.log"
    log_path.write_bytes(b"an old line of an earlier host\n" * (5 << 20 >> 5))
    before = log_path.stat().st_size
    with open(log_path, "ab") as log:
        host = subprocess.Popen(
            [sys.executable, "-m", "rankexec.flower.host", "--node-id", str(node)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_until(lambda: host_status(node) is not None, 60, "the host listening")
        wait_until(lambda: b"serving node" in log_path.read_bytes()[-4096:], 30, "its log line")
        after = log_path.stat().st_size
        print(f"\n[flower-host] host.log: {before} bytes before the host, {after} after")
        assert after < 2 << 20, after
        assert b"[host.log cut to its last bytes]" in log_path.read_bytes()[:64]
    finally:
        _stop(host)


SLOW_APP = """
import os
import time
from pathlib import Path

from flwr.app import Message, MetricRecord, RecordDict

from rankexec.flower import ClientApp

# abort_grace longer than the test: the ranks are never killed for ignoring the abort.
app = ClientApp(num_of_processes=2, deadlines={"startup": "120s", "abort_grace": "300s"})


@app.train()
def train(msg, context):
    cfg = msg.content["config"]
    Path(cfg["mark"] + f".{os.environ['RANK']}").write_text(str(os.getpid()))
    time.sleep(float(cfg["sleep"]))  # busy in user code: the abort is not looked at
    return Message(RecordDict({"metrics": MetricRecord({"pid": os.getpid()})}), reply_to=msg)
"""


@pytest.mark.parametrize("wait", ["default", "short"])
def test_a_host_stopped_under_a_task_waits_for_it_then_closes_its_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wait: str
) -> None:
    """SIGTERM to a host while a rank is busy in user code that ignores the abort: the
    host waits for the task (up to ``--shutdown-wait``) instead of exiting under it; the
    task's own serving thread closes its group when the task returns, never the shutdown
    under it; the host removes its socket, secret and pid file, exits 0, and no rank is
    left. With a wait shorter than the task, the host says so and exits; its ranks follow
    it (their parent watch)."""
    import threading

    node = 7008 if wait == "default" else 7009
    app = _install_app(tmp_path, monkeypatch, "slowapp", SLOW_APP)
    extra = ["--shutdown-wait", "1"] if wait == "short" else []
    host = _start_host(node, tmp_path, "--lease", "60", *extra)
    directory = tmp_path / "rx" / f"node-{node}"
    mark = tmp_path / "in-train"
    replies: list[Message] = []
    try:
        wait_until(lambda: host_status(node) is not None, 60, "the host listening")
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 44, 0, 1
        content = RecordDict({"config": ConfigRecord({"mark": str(mark), "sleep": 4.0})})
        msg = Message(content, dst_node_id=node, message_type="train")
        ctx = Context(44, node, {}, RecordDict(), {})
        caller = threading.Thread(target=lambda: replies.append(app(msg, ctx)), daemon=True)
        caller.start()
        marks = [Path(f"{mark}.{r}") for r in (0, 1)]
        wait_until(lambda: all(m.exists() and m.read_text() for m in marks), 120, "in train")
        ranks = [int(m.read_text()) for m in marks]
        host.send_signal(signal.SIGTERM)
        code = host.wait(60)
        caller.join(60)
    finally:
        if host.poll() is None:
            _stop(host)
        _forget_app("slowapp")
    log = max(tmp_path.glob(f"host-{node}-*.log")).read_text()
    print(f"\n[flower-host] stopped under a task ({wait} wait): exit {code}")
    print("\n".join("  " + line for line in log.strip().splitlines()[-4:]))
    assert code == 0, log
    wait_until(lambda: not any(pid_alive(p) for p in ranks), 30, "no rank left")
    left = {p.name for p in directory.iterdir()}
    assert not {"host.sock", "secret", "host.pid"} & left, left
    assert len(replies) == 1, "the ClientApp was answered"
    if wait == "default":
        # The task returned within the wait: its thread closed the group, then the host.
        assert "did not return within" not in log, log
        assert replies[0].has_error() and "aborted: signal 15" in replies[0].error.reason, replies
    else:
        assert "task did not return within 1.0s of its abort" in log, log


def test_a_node_folder_longer_than_a_socket_address(app, tmp_path, monkeypatch) -> None:
    """A node folder whose ``host.sock`` path passes the 107 bytes a Unix socket's
    address holds (a long ``RANKEXEC_FLOWER_DIR``, Flower's 20-digit node ids): the host
    binds and the ClientApp connects through ``/proc/self/fd/N/`` of the folder."""
    base = tmp_path / ("d" * 80) / "rx"
    monkeypatch.setenv("RANKEXEC_FLOWER_DIR", str(base))
    node = 14842636390935620781
    sock = base / f"node-{node}" / "host.sock"
    assert len(str(sock)) > 107
    reply, _ = _call(app, node)
    assert not reply.has_error(), reply.error
    st = host_status(node)
    assert st is not None and len(st["pids"]) == 2 and sock.exists()
    close = Message(RecordDict(), dst_node_id=node, message_type=CLOSE_MESSAGE_TYPE)
    assert dict(app(close, Context(41, node, {}, RecordDict(), {})).content["rankexec"])["closed"]
    os.kill(st["pid"], signal.SIGTERM)
    wait_until(lambda: not pid_alive(st["pid"]), 30, "the host gone")
    assert all(not pid_alive(p) for p in st["pids"]) and not sock.exists()


GPU_APP = """
import json, os

from flwr.app import Message, MetricRecord, RecordDict

from rankexec.flower import ClientApp

app = ClientApp(num_of_processes=2, deadlines={"startup": "120s", "task": "120s"})


@app.train()
def train(msg, context):
    keys = ("RANK", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
    path = os.path.join(os.environ["GPU_MARKS"], f"rank-{os.environ['RANK']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({k: os.environ.get(k) for k in keys}, f)
    os.rename(path + ".tmp", path)
    return Message(RecordDict({"metrics": MetricRecord({"ok": 1})}), reply_to=msg)
"""


def test_the_node_host_numbers_gpus_as_torchrun(tmp_path, monkeypatch) -> None:
    # A node that declares 3 GPUs (no GPU needed): its 2 ranks each see the group's
    # two GPUs in rank order, so device LOCAL_RANK is the rank's own, as for every
    # launcher (tests/gpu_numbering.rs) and FLARE's GPU authority.
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("GPU_MARKS", str(marks))
    monkeypatch.setenv("RANKEXEC_GPU_INVENTORY", "3x16GiB")
    for var in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "RANKEXEC_GPU_GRANT"):
        monkeypatch.delenv(var, raising=False)  # another test's grant would restrict it
    gpu_app = _install_app(tmp_path, monkeypatch, "gpuapp", GPU_APP)
    node = 7301
    try:
        reply, _ = _call(gpu_app, node)
        assert not reply.has_error(), reply.error
        st = host_status(node)
        assert st is not None
        host_pid, ranks = st["pid"], st["pids"]
        seen = {r: json.loads((marks / f"rank-{r}.json").read_text()) for r in (0, 1)}
        print("\n[flower-host] ranks see:", seen)
        for r, env in seen.items():
            visible = env["CUDA_VISIBLE_DEVICES"].split(",")
            assert visible == ["0", "1"], env
            assert visible[int(env["LOCAL_RANK"])] == str(r), env
            assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        close = Message(RecordDict(), dst_node_id=node, message_type=CLOSE_MESSAGE_TYPE)
        gpu_app(close, Context(41, node, {}, RecordDict(), {}))
        wait_until(lambda: not any(pid_alive(p) for p in ranks), 30, "the closed group gone")
        os.kill(host_pid, signal.SIGTERM)
        wait_until(lambda: not pid_alive(host_pid), 30, "the host gone")
    finally:
        _forget_app("gpuapp")


def test_rank_logs_go_to_disk_not_the_memory_folder(tmp_path, monkeypatch) -> None:
    # The default node folder is under $XDG_RUNTIME_DIR (memory); a run's rank logs go to
    # $XDG_STATE_HOME/rankexec-flower/node-<id> on disk, and go with the run.
    app = _install_app(tmp_path, monkeypatch, "diskapp", APP)
    monkeypatch.delenv("RANKEXEC_FLOWER_DIR")
    (tmp_path / "runtime").mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    node = 7302
    try:
        reply, _ = _call(app, node)
        assert not reply.has_error(), reply.error
        st = host_status(node)
        assert st is not None
        host_pid, ranks = st["pid"], st["pids"]
        on_disk = tmp_path / "state" / "rankexec-flower" / f"node-{node}" / "run-41"
        in_memory = tmp_path / "runtime" / "rankexec-flower" / f"node-{node}" / "run-41"
        assert (on_disk / "rank-0" / "stderr.log").is_file(), sorted(tmp_path.rglob("*.log"))
        assert not in_memory.exists()
        close = Message(RecordDict(), dst_node_id=node, message_type=CLOSE_MESSAGE_TYPE)
        app(close, Context(41, node, {}, RecordDict(), {}))
        wait_until(lambda: not any(pid_alive(p) for p in ranks), 30, "the closed group gone")
        wait_until(lambda: not on_disk.exists(), 30, "the run's logs removed with it")
        os.kill(host_pid, signal.SIGTERM)
        wait_until(lambda: not pid_alive(host_pid), 30, "the host gone")
    finally:
        _forget_app("diskapp")
