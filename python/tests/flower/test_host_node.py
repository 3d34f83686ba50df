"""The node host's hold on its node and on its SuperNode (issue 39, item 3 and its last
bullet), with real host processes:

- one host per node whatever happens to the node's folder: with the folder removed
  under a live host (logind removes ``/run/user/<uid>`` at the user's last logout while
  a SuperNode started from that session lives on), a second host for the node refuses
  to start naming the first's pid (its lock is an abstract Unix socket, no file), and
  the first sees its folder gone and shuts down; never do two hosts listen for the node
  at once (read from ``/proc``);
- a base folder that cannot be used is an error naming it, never another folder;
- a SuperNode's death is seen at once (a pidfd) and its groups are killed at once, not
  after ``--shutdown-wait``: nobody takes a task's result from a node that is gone.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from proc_checks import owned

from rankexec.flower import _channel, host_status

from .helpers import pid_alive, wait_until

pytest.importorskip("flwr")


def _start(node: int, tmp_path: Path, *extra: str) -> subprocess.Popen:
    """A host for ``node``; its log is ``tmp_path/host-<node>-<n>.log`` (n: its turn)."""
    n = len(list(tmp_path.glob(f"host-{node}-*.log")))
    argv = [sys.executable, "-m", "rankexec.flower.host", "--node-id", str(node), *extra]
    with open(tmp_path / f"host-{node}-{n}.log", "wb") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _log(tmp_path: Path, node: int, n: int) -> str:
    return (tmp_path / f"host-{node}-{n}.log").read_text(errors="replace")


def _listening_hosts(node: int, under: Path) -> list[int]:
    """Live host processes for ``node`` that listen on a Unix socket bound to a path
    under ``under`` (removed or not: ``/proc/net/unix`` keeps a bound socket's name)."""
    listening: dict[int, str] = {}
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        f = line.split()
        # Num RefCount Protocol Flags Type St Inode [Path]; __SO_ACCEPTCON is 0x10000.
        if len(f) >= 8 and int(f[3], 16) & 0x10000 and f[7].startswith(str(under)):
            listening[int(f[6])] = f[7]
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
            if b"rankexec.flower.host" not in argv or str(node).encode() not in argv:
                continue
            inodes = set()
            for fd in (d / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
        except OSError:
            continue
        if inodes & set(listening) and pid_alive(int(d.name)):
            found.append(int(d.name))
    return found


def test_a_removed_node_folder_never_gives_the_node_two_hosts(tmp_path, monkeypatch) -> None:
    """The node's folder is removed (``rm -rf``) under a live host, then a second host
    for the node starts. The first is held stopped (SIGSTOP) meanwhile, so that it cannot
    have noticed yet: the second refuses (exit 3) naming the first's pid. Let go, the
    first sees its folder gone and shuts down (exit 0); the next host serves the node.
    At no moment do two hosts listen for the node (``/proc``)."""
    monkeypatch.setenv("RANKEXEC_FLOWER_DIR", str(tmp_path / "rx"))
    node = 7401
    directory = tmp_path / "rx" / f"node-{node}"
    with owned(_start(node, tmp_path, "--lease", "60")) as first:
        wait_until(lambda: host_status(node) is not None, 60, "the first host listening")
        assert _listening_hosts(node, tmp_path) == [first.pid]
        first.send_signal(signal.SIGSTOP)
        try:
            shutil.rmtree(directory)  # as logind removes /run/user/<uid>
            with owned(_start(node, tmp_path, "--lease", "60")) as second:
                deadline = time.monotonic() + 60
                while second.poll() is None:
                    hosts = _listening_hosts(node, tmp_path)
                    assert len(hosts) <= 1, f"two hosts serve node {node} at once: pids {hosts}"
                    assert time.monotonic() < deadline, "the second host neither left nor served"
                    time.sleep(0.02)  # sampling /proc: two hosts at once would show here
        finally:
            first.send_signal(signal.SIGCONT)
        log = _log(tmp_path, node, 1)
        print(f"\n[flower-node] second host: exit {second.returncode}: {log.strip()}")
        assert second.returncode == 3, log
        assert f"another rankexec host (pid {first.pid}) serves node {node}" in log
        t0 = time.monotonic()
        code = first.wait(30)  # the first leaves on its own: its folder is gone
        log = _log(tmp_path, node, 0)
        print(
            f"[flower-node] first host: exit {code} {time.monotonic() - t0:.2f}s after"
            f" SIGCONT: {log.strip().splitlines()[-1]}"
        )
        assert code == 0, log
        assert "shutting down: its folder" in log, log
    # The node is served again by the next host that starts, alone.
    with owned(_start(node, tmp_path, "--lease", "60")) as third:
        wait_until(lambda: host_status(node) is not None, 60, "a third host")
        assert host_status(node)["pid"] == third.pid
        assert _listening_hosts(node, tmp_path) == [third.pid]
        third.send_signal(signal.SIGTERM)
        assert third.wait(60) == 0


def test_the_node_lock_outlives_its_folder(tmp_path, monkeypatch) -> None:
    """In one process: the node's lock is no file, so removing the folder does not free
    it; a second take names the holder's pid."""
    from rankexec.flower.host import Host, HostTaken

    monkeypatch.setenv("RANKEXEC_FLOWER_DIR", str(tmp_path / "rx"))
    node = 7402
    first = Host(_channel.node_dir(node), node, None, lease_s=60)
    first._take_node()
    try:
        shutil.rmtree(_channel.node_dir(node))
        second = Host(_channel.node_dir(node), node, None, lease_s=60)
        with pytest.raises(HostTaken) as e:
            second._take_node()
        print(f"\n[flower-node] {e.value}")
        assert f"another rankexec host (pid {os.getpid()}) serves node {node}" in str(e.value)
    finally:
        first._release_node()
    # Released: the node can be taken again.
    again = Host(_channel.node_dir(node), node, None, lease_s=60)
    again._take_node()
    again._release_node()


def test_a_base_folder_that_cannot_be_used_is_an_error_naming_it(tmp_path, monkeypatch) -> None:
    """``$XDG_RUNTIME_DIR`` gone (logind removed it): an error naming it, never a silent
    move to another folder (where a second host would start)."""
    monkeypatch.delenv("RANKEXEC_FLOWER_DIR", raising=False)
    gone = tmp_path / "run-user-gone"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(gone))
    with pytest.raises(_channel.ChannelError) as e:
        _channel.node_dir(7403)
    print(f"\n[flower-node] {e.value}")
    assert str(gone) in str(e.value)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("RANKEXEC_FLOWER_DIR", str(blocked / "rx"))
    with pytest.raises(_channel.ChannelError) as e:
        _channel.node_dir(7403)
    print(f"[flower-node] {e.value}")
    assert str(blocked / "rx") in str(e.value)


BLOCKING_APP = """
import os
import time
from pathlib import Path

from flwr.app import Message, MetricRecord, RecordDict

from rankexec.flower import ClientApp

# abort_grace longer than the test: only a kill ends these ranks' task.
app = ClientApp(num_of_processes=2, deadlines={"startup": "120s", "abort_grace": "300s"})


@app.train()
def train(msg, context):
    cfg = msg.content["config"]
    Path(cfg["mark"] + f".{os.environ['RANK']}").write_text(str(os.getpid()))
    time.sleep(600)  # blocks in user code: never looks at the abort
    return Message(RecordDict({"metrics": MetricRecord({"pid": os.getpid()})}), reply_to=msg)
"""

#: Far below the host's --shutdown-wait (60 s) in the test below.
GONE_BOUND_S = 10.0


def test_a_dead_supernode_kills_its_groups_at_once(tmp_path, monkeypatch) -> None:
    """The host's SuperNode (a ``sleep`` this test owns) is SIGKILLed while a task is in
    flight on the host's ranks: the ranks are gone far within ``--shutdown-wait`` (60 s),
    the host exits, and the ClientApp is answered. The time is printed."""
    import importlib

    from flwr.app import ConfigRecord, Context, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    pkg = tmp_path / "app" / "blockingapp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "client_app.py").write_text(textwrap.dedent(BLOCKING_APP))
    monkeypatch.syspath_prepend(str(tmp_path / "app"))
    monkeypatch.setenv("RANKEXEC_FLOWER_DIR", str(tmp_path / "rx"))
    monkeypatch.setenv("RANKEXEC_LOG", "warn")
    app = importlib.import_module("blockingapp.client_app").app
    node = 7404
    mark = tmp_path / "in-train"
    replies: list[Message] = []
    try:
        with (
            owned(subprocess.Popen(["sleep", "600"])) as supernode,
            owned(
                _start(
                    node,
                    tmp_path,
                    "--lease",
                    "120",
                    "--shutdown-wait",
                    "60",
                    "--supernode-pid",
                    str(supernode.pid),
                )
            ) as host,
        ):
            wait_until(lambda: host_status(node) is not None, 60, "the host listening")
            TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 45, 0, 1
            content = RecordDict({"config": ConfigRecord({"mark": str(mark)})})
            msg = Message(content, dst_node_id=node, message_type="train")
            ctx = Context(45, node, {}, RecordDict(), {})
            caller = threading.Thread(target=lambda: replies.append(app(msg, ctx)), daemon=True)
            caller.start()
            marks = [Path(f"{mark}.{r}") for r in (0, 1)]
            wait_until(lambda: all(m.exists() and m.read_text() for m in marks), 120, "in train")
            ranks = [int(m.read_text()) for m in marks]
            assert host_status(node)["busy"]
            supernode.kill()
            t0 = time.monotonic()
            supernode.wait(10)
            wait_until(lambda: not any(pid_alive(p) for p in ranks), GONE_BOUND_S, "the ranks gone")
            took = time.monotonic() - t0
            wait_until(lambda: host.poll() is not None, 30, "the host gone")
            host_took = time.monotonic() - t0
            caller.join(30)
            log = _log(tmp_path, node, 0)
            print(
                f"\n[flower-node] SuperNode SIGKILLed with a task in flight: ranks {ranks} gone"
                f" in {took:.2f}s, the host (exit {host.returncode}) in {host_took:.2f}s"
                " (--shutdown-wait 60)"
            )
            print("\n".join("  " + line for line in log.strip().splitlines()[-4:]))
            assert host.returncode == 0, log
            assert f"the SuperNode (pid {supernode.pid}) is gone" in log, log
            assert len(replies) == 1 and replies[0].has_error(), replies
            left = {p.name for p in (tmp_path / "rx" / f"node-{node}").iterdir()}
            assert not {"host.sock", "secret", "host.pid"} & left, left
    finally:
        sys.modules.pop("blockingapp.client_app", None)
        sys.modules.pop("blockingapp", None)
