"""The task contract's edges: one answer per task, unsendable outputs, dropped tasks,
properties and events from a Python rank."""

from __future__ import annotations

from conftest import COMPONENTS, executor_config, wait_until


def _script_host(host, tmp_path, n=2, engine=False):
    cfg = executor_config(
        "script", n, log_dir=tmp_path, program=[str(COMPONENTS / "script_edge.py")]
    )
    assert host.send(op="start", config=cfg, engine=engine)["ok"]


def test_second_reply_is_refused_and_the_first_counts(host, tmp_path):
    _script_host(host, tmp_path)
    r = host.send(op="task", task="twice")
    assert r["ok"] and r["meta"] == {"n": 1}, r
    # The rank prints the refusal after its first reply reached the host, and its
    # output reaches the log through the host's pump: wait for it (bounded).
    log = tmp_path / "rank-0" / "stdout.log"
    said = "second reply refused: this task was already answered"
    wait_until(lambda: log.exists() and said in log.read_text(), 30, "the refusal in the log")


def test_unsendable_output_fails_the_task_with_why(host, tmp_path):
    _script_host(host, tmp_path)
    r = host.send(op="task", task="unsendable")
    print("unsendable:", r["error"])
    assert not r["ok"] and r["class"] == "exception"
    assert "cannot send a value of type `object`" in r["error"], r
    assert host.send(op="task", task="other")["ok"], "the rank goes on"


def test_output_that_is_not_a_shareable_fails_the_task_with_why(host, tmp_path):
    _script_host(host, tmp_path)
    r = host.send(op="task", task="dict_output")
    assert not r["ok"], r
    assert "the output must be a rankexec.Shareable" in r["error"] and "not a dict" in r["error"]


def test_task_dropped_without_reply_fails_clearly(host, tmp_path):
    _script_host(host, tmp_path)
    r = host.send(op="task", task="drop")
    print("dropped:", r["error"])
    assert not r["ok"] and "the task was dropped without a reply" in r["error"], r
    assert host.send(op="task", task="other")["ok"]


def test_context_props_conflicts_and_events(host, tmp_path):
    _script_host(host, tmp_path, engine=True)
    r = host.send(op="task", task="ctx")
    print("ctx:", r)
    assert r["ok"], r
    m = r["meta"]
    assert "`__rank_number__` is private+sticky here" in m["conflict"]
    assert m["mine"] == [1, "two"] and m["rank_prop"] == 0 and m["missing"] == "default"
    assert m["fired"] is True
    events = host.send(op="events")["events"]
    assert sorted(events) == [["py_event", 0], ["py_event", 1]], "both ranks' events arrived"


def test_event_without_a_host_engine_raises_event_failed(host, tmp_path):
    _script_host(host, tmp_path, engine=False)
    r = host.send(op="task", task="ctx")
    assert r["ok"], r
    assert r["meta"]["fired"].startswith("EventFailed: the parent failed to fire event")
