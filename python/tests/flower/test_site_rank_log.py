"""The Flower site bounds its ranks' logs (issue 39): ``max_rank_log`` in the node
operator's site file is the cap of each rank's stdout and stderr on disk while the
group lives, and a request cannot set one.

A real host (started by the ClientApp call, as the first message of a node does) and
two real ranks, one of which prints several times the cap; this process plays
``flwr-clientapp`` and calls the app as Flower does.
"""

from __future__ import annotations

import json
import signal
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from rankexec.flower import _channel, host_status

from .helpers import pid_alive, wait_until

CAP = 256 << 10  # the site's max_rank_log
LINE = 100  # bytes per printed line, the newline included
LINES = 30_000  # about 2.9 MiB, more than ten times the cap

APP = f"""
import os
import sys

from flwr.app import Message, MetricRecord, RecordDict

from rankexec.flower import ClientApp

app = ClientApp(num_of_processes=2, deadlines={{"startup": "120s", "task": "120s"}})


@app.train()
def train(msg, context):
    if os.environ["RANK"] == "0":
        pad = "x" * ({LINE} - 20)
        for i in range({LINES}):
            print(f"line {{i:08d}} {{pad}}")
        print("LAST line")
        sys.stdout.flush()
    return Message(RecordDict({{"m": MetricRecord({{"pid": os.getpid()}})}}), reply_to=msg)
"""


def test_the_sites_max_rank_log_bounds_a_rank_printing_past_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = tmp_path / "app" / "logapp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "client_app.py").write_text(textwrap.dedent(APP))
    monkeypatch.syspath_prepend(str(tmp_path / "app"))
    logs = tmp_path / "logs"
    site = tmp_path / "site.json"
    site.write_text(json.dumps({"max_rank_log": "256KiB", "log_dir": str(logs), "lease_s": 60}))
    monkeypatch.setenv("RANKEXEC_FLOWER_DIR", str(tmp_path / "rx"))
    monkeypatch.setenv("RANKEXEC_FLOWER_SITE", str(site))  # the host's own environment
    monkeypatch.setenv("RANKEXEC_LOG", "warn")
    import importlib

    app = importlib.import_module("logapp.client_app").app
    node, run = 7201, 71
    host_pid = None
    try:
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run, 0, 1
        msg = Message(
            RecordDict({"a": ArrayRecord([np.zeros(2, dtype=np.float32)])}),
            dst_node_id=node,
            message_type="train",
        )
        reply = app(msg, Context(run, node, {}, RecordDict(), {}))
        assert not reply.has_error(), reply.error
        st = host_status(node)
        assert st is not None
        host_pid, ranks = st["pid"], st["pids"]
        rank0 = logs / f"run-{run}" / "rank-0"

        def kept() -> tuple[int, str]:
            files = sorted(rank0.glob("stdout.log*"))
            return sum(f.stat().st_size for f in files), (rank0 / "stdout.log").read_text()

        # The rank's output pump may lag the reply: wait for its last line on disk.
        wait_until(
            lambda: (rank0 / "stdout.log").exists() and "LAST line" in kept()[1],
            60,
            "rank 0's last line in its log",
        )
        size, text = kept()
        printed = LINES * LINE
        print(f"\n[site max_rank_log] printed {printed} bytes, kept {size} (cap {CAP})")
        assert all(pid_alive(p) for p in ranks), "the group lives while its logs are measured"
        assert size <= CAP, f"{size} bytes kept past the site's cap of {CAP}"
        assert f"line {LINES - 1:08d}" in text, "the newest lines are kept"
        assert "line 00000000 " not in text, "the oldest are gone"

        # A request cannot raise the cap: the site's key decides it.
        sock = _channel.connect(_channel.node_dir(node), timeout=10)
        with sock:
            _channel.send(
                sock,
                {
                    "op": "execute",
                    "run_id": run,
                    "app": app._ref(),
                    "request": {"num_of_processes": 2, "max_rank_log": "1GiB"},
                    "spec": {},
                    "blobs": {},
                },
            )
            out = _channel.recv(sock)
        assert out.get("kind") == "SiteError", out
        assert "the request sets `max_rank_log`" in out["error"], out
        assert f"`max_rank_log` in the site file {site}" in out["error"], out
        assert host_status(node)["pids"] == ranks, "the refused request changed nothing"
    finally:
        sys.modules.pop("logapp.client_app", None)
        sys.modules.pop("logapp", None)
        if host_pid is not None:
            import os

            os.kill(host_pid, signal.SIGTERM)
            wait_until(lambda: not pid_alive(host_pid), 60, "the host gone")


def test_max_rank_log_is_the_sites_size() -> None:
    """The site's value goes to the group's configuration as it is (rankexec checks the
    size and its 64 KiB floor when the group starts); one that is not a size is refused
    naming the key."""
    from rankexec.flower import _site

    cfg = _site.group_config({"max_rank_log": "4MiB"}, {}, "/tmp/logs")
    assert cfg["max_rank_log"] == "4MiB"
    assert "max_rank_log" not in _site.group_config({}, {}, "/tmp/logs")
    for bad in ([1], True, 1.5):
        with pytest.raises(_site.SiteError, match="is not a size .*`max_rank_log` of the site"):
            _site.group_config({"max_rank_log": bad}, {}, "/tmp/logs")
