"""A rank's `Context.fire_event` whose event thread dies without answering (a panic
on it) raises `EventFailed` at once. Before, it waited on the closed channel in a
loop that never blocked: 100% of a core until the task deadline."""

from __future__ import annotations

import os

import pytest
from conftest import PYBIN, executor_config

from rankexec.host import RankGroup


@pytest.fixture(autouse=True)
def python_on_path(monkeypatch):
    monkeypatch.setenv("PATH", PYBIN + os.pathsep + os.environ.get("PATH", ""))


def test_fire_event_fails_when_the_event_thread_dies(tmp_path):
    cfg = executor_config("event_thread_dies:EventThreadDies", 1, log_dir=tmp_path)
    # Before the fix the task spun until this deadline (and was then timed out).
    cfg["deadlines"]["task"] = "60s"
    with RankGroup(cfg, workspace=str(tmp_path)) as g:
        g.start()
        pids = g.pids()
        r = g.execute("t")
        assert r.meta["error"] == "the event thread ended without an answer", r.meta
        # Generous: the failing call should cost milliseconds, not a spinning core.
        assert r.meta["cpu_s"] < 5.0, r.meta
        assert g.pids() == pids
