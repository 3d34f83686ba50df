"""An output that cannot be sent fails that task only, with the reason; the next task
runs on the same processes."""

from __future__ import annotations

import pytest
from conftest import executor_config


@pytest.mark.parametrize(
    ("task", "reason"),
    [
        ("dict", "must be a rankexec.Shareable"),
        ("array", "must be a rankexec.Shareable"),
        ("object_meta", "obj"),
    ],
)
def test_a_bad_output_fails_the_task_and_the_rank_lives_on(host, tmp_path, task, reason):
    cfg = executor_config("threads:Outputs", 2, log_dir=tmp_path)
    started = host.start(cfg)
    assert started["ok"], started
    r = host.send(op="task", task=task)
    print(f"{task}:", r.get("class"), r.get("error"))
    assert not r["ok"] and r["class"] == "exception", r
    assert reason in r["error"], r
    ok = host.send(op="task", task="good")
    assert ok["ok"], ok
    assert host.send(op="pids")["pids"] == started["pids"], "the same processes"
