"""`Abort.wait` with any timeout: `inf` and huge ones mean no deadline, NaN raises
`ValueError`, a negative one does not wait; none of them harms the rank."""

from __future__ import annotations

import pytest
from conftest import executor_config, read_notes


@pytest.mark.parametrize("task", ["inf", "huge"])
def test_wait_without_deadline_returns_on_abort(host, tmp_path, task):
    cfg = executor_config("threads:Waits", 1, {"out_dir": str(tmp_path)}, log_dir=tmp_path)
    started = host.start(cfg)
    assert started["ok"], started
    r = host.send(op="task", task=task, abort_after_ms=500)
    print(f"wait({task}):", r.get("error"))
    (note,) = read_notes(tmp_path, task, 1)
    print("noted:", note)
    assert note["got"] is True and note["reason"], note
    assert host.send(op="pids")["pids"] == started["pids"], "the rank lives on"


def test_nan_raises_and_negative_does_not_wait(host, tmp_path):
    cfg = executor_config("threads:Waits", 1, {"out_dir": str(tmp_path)}, log_dir=tmp_path)
    started = host.start(cfg)
    assert started["ok"], started
    nan = host.send(op="task", task="nan")
    print("wait(nan):", nan.get("meta"), nan.get("error"))
    assert nan["ok"] and nan["meta"]["error"].startswith("ValueError"), nan
    neg = host.send(op="task", task="negative")
    assert neg["ok"] and neg["meta"]["got"] is False, neg
    assert host.send(op="pids")["pids"] == started["pids"]
