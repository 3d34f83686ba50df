"""``restart.retry_task`` through ``rankexec.host.RankGroup`` (the host FLARE's executors
use), with real rank processes (the Rust ``rankexec-worker`` builtins): a task whose
rank was SIGKILLed once returns a ``TaskResult`` naming the retry; a rank that dies on
every try raises ``RankFailed`` with every try in ``retries``; an exception is raised
as before, with ``retries == []``."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from rankexec.host import RankFailed, RankGroup

from .flare_helpers import wait_until
from .test_host import cfg


def test_a_rank_killed_once_costs_a_retry(rust_worker, tmp_path):
    config = cfg(rust_worker, "Sleep", args={"secs": 2}, restart={"retry_task": 2})
    config["log_dir"] = str(tmp_path / "logs")
    with RankGroup(config, workspace=str(tmp_path)) as g:
        g.start()
        first = g.pids()
        log = Path(config["log_dir"]) / "rank-1" / "stderr.log"

        def kill_when_sleeping() -> None:
            if wait_until(lambda: log.exists() and "sleeping" in log.read_text(), 30):
                os.kill(first[1], signal.SIGKILL)

        killer = threading.Thread(target=kill_when_sleeping, daemon=True)
        killer.start()
        r = g.execute("t")
        killer.join(timeout=30)
        print("retries:", r.retries)
        assert r.meta["slept"] == 2.0
        assert [(x["attempt"], x["rank"], x["pid"]) for x in r.retries] == [(1, 1, first[1])]
        assert r.retries[0]["error_class"] == "signal"
        assert "killed by signal 9 (SIGKILL)" in r.retries[0]["cause"]
        assert not set(g.pids()) & set(first), "the task ran on a relaunched group"


def test_a_rank_dying_on_every_try_names_every_cause(rust_worker, tmp_path):
    config = cfg(
        rust_worker, "Exit", args={"ranks": [1], "signal": "SIGKILL"}, restart={"retry_task": 2}
    )
    with RankGroup(config, workspace=str(tmp_path)) as g:
        g.start()
        with pytest.raises(RankFailed) as e:
            g.execute("t")
        print(e.value)
        assert [x["attempt"] for x in e.value.retries] == [1, 2]
        assert e.value.rank == 1 and e.value.error_class == "signal"
        assert str(e.value).startswith("retried 2 times after ranks died (try 1: rank 1: pid ")


def test_an_exception_is_not_retried(rust_worker, tmp_path):
    config = cfg(rust_worker, "Fail", args={"ranks": [1]}, restart={"retry_task": 2})
    with RankGroup(config, workspace=str(tmp_path)) as g:
        g.start()
        pids = g.pids()
        with pytest.raises(RankFailed) as e:
            g.execute("t")
        assert e.value.retries == [] and e.value.error_class == "exception"
        assert g.pids() == pids, "the group stays"
