"""A Python rank's main thread serves the exec channel itself: a task reaches
`execute`, and its result the host, without waking another thread of the rank (that
hop cost two wake-ups per task, most of an empty task's round trip on a busy 2-core
machine). A process forked from the rank that carries on in the worker loop takes no
task of the rank's, answers none, and ends."""

from __future__ import annotations

import os

import pytest
from conftest import PYBIN, executor_config


@pytest.fixture(autouse=True)
def python_on_path(monkeypatch):
    monkeypatch.setenv("PATH", PYBIN + os.pathsep + os.environ.get("PATH", ""))


def test_tasks_do_not_wake_the_runtime_thread(host, tmp_path):
    cfg = executor_config("handoff:Switches", 1, log_dir=tmp_path)
    assert host.start(cfg)["ok"]
    tasks = 40
    seen = [host.send(op="task", task="t") for _ in range(tasks)]
    assert all(r["ok"] for r in seen), seen[-1]
    first, last = seen[0]["meta"]["switches"], seen[-1]["meta"]["switches"]
    woke = last["rx-runtime"] - first["rx-runtime"]
    print(f"rx-runtime woke {woke} times in {tasks - 1} tasks; all threads: {first} -> {last}")
    # Before: the runtime's thread read every task and waited for every answer (at
    # least two wake-ups per task). Now it waits for the group's end only.
    assert woke < tasks // 4, (first, last)


def test_a_forked_child_that_carries_on_answers_nothing_and_ends(host, tmp_path):
    cfg = executor_config("handoff:ForkCarriesOn", 1, log_dir=tmp_path)
    started = host.start(cfg)
    assert started["ok"], started
    for i in range(2):
        r = host.send(op="task", task="t")
        print(f"task {i}:", r.get("meta"), r.get("error"))
        assert r["ok"], r
        # The parent's answer, not the child's; and the child ended by itself (its
        # `receive()` answered None) instead of waiting for tasks forever.
        assert r["meta"]["who"] == "parent", r
        assert r["meta"]["child_status"] is not None, "the child did not end"
    assert host.send(op="pids")["pids"] == started["pids"], "the rank was relaunched"
