"""Events and aborts: an abort reaches a running task at once even while an event
handler is slow (events wait for the task, aborts never wait for events), and a rank
queues a bounded number of events, refusing the rest with a typed error naming it."""

from __future__ import annotations

import sys

from conftest import executor_config, read_notes

EVENT_QUEUE = 16  # rankexec_sub_worker::rank::EVENT_QUEUE


def test_a_slow_event_handler_does_not_delay_an_abort(host, tmp_path):
    cfg = executor_config("threads:SlowEvents", 1, {"out_dir": str(tmp_path)}, log_dir=tmp_path)
    assert host.start(cfg)["ok"]
    during = {
        "event": "slow",
        "after_path": str(tmp_path / "waiting-0.json"),
        "abort_after_ms": 1000,
    }
    r = host.send(op="task", task="wait_abort", events_during=during)
    print("task:", r.get("error"), "events:", r.get("events"))
    assert not r["ok"] and r["aborted"], r
    assert r["events"] == [{"ok": True}], r
    (abort,) = read_notes(tmp_path, "abort", 1)
    (slow,) = read_notes(tmp_path, "slow", 1)
    print(
        f"abort seen at {abort['seen_at']:.3f}, slow handler {slow['start']:.3f}..{slow['end']:.3f}"
    )
    assert abort["got"], abort
    assert abort["seen_at"] < slow["end"], "the abort waited for the slow handler"
    assert slow["start"] > abort["seen_at"], "the event waited for the task to end"
    assert slow["main"], "the handler ran on the main thread"


def test_a_full_event_queue_refuses_events_naming_the_rank(host, tmp_path):
    cfg = executor_config("threads:SlowEvents", 1, {"out_dir": str(tmp_path)}, log_dir=tmp_path)
    started = host.start(cfg)
    assert started["ok"]
    n = EVENT_QUEUE + 4
    during = {
        "event": "tick",
        "n": n,
        "after_path": str(tmp_path / "waiting-0.json"),
        # Events beyond the queue are refused at once; the task (which holds every
        # accepted event up) ends when three refusals are in.
        "abort_after_answers": 3,
    }
    r = host.send(op="task", task="wait_abort", events_during=during)
    events = r.get("events", [])
    refused = [e for e in events if not e["ok"]]
    print(f"{len(refused)} of {len(events)} refused:", refused[:1])
    assert len(events) == n, r
    assert len(refused) >= 3, events
    for e in refused:
        assert "rank 0 failed to handle event `tick`" in e["error"], e
        assert "event queue is full" in e["error"], e
    seen = host.send(op="task", task="seen")
    assert seen["ok"], seen
    handled = sum(1 for e in seen["meta"]["seen"] if e == "tick")
    assert handled == n - len(refused), "every accepted event was handled, none dropped"
    assert host.send(op="pids")["pids"] == started["pids"]


def test_an_event_sent_during_a_long_task_waits_for_it_without_failing_the_group(tmp_path):
    """A Python rank handles events after its running task: an event sent while a task
    runs longer than the event deadline is answered once the task ends, and neither
    the event nor the group fails (the event's deadline runs from the task's end)."""
    import threading

    from rankexec.host import RankGroup

    cfg = executor_config("threads:LongTask", 2, {"out_dir": str(tmp_path)}, log_dir=tmp_path)
    cfg["deadlines"] = {"startup": "60s", "task": "60s", "event": "1s"}
    cfg["worker"]["program"] = sys.executable
    with RankGroup(cfg) as g:
        g.start()
        pids = g.pids()
        answers: list = []

        def fire() -> None:
            read_notes(tmp_path, "busy", 2)
            try:
                answers.append(("ok", g.fire_event("during")))
            except Exception as e:  # noqa: BLE001 - the test reports what it got
                answers.append(("error", repr(e)))

        t = threading.Thread(target=fire)
        t.start()
        r = g.execute("work", {"secs": 3.0})
        t.join(60)
        print("task:", r.meta["ended"], "event answer:", answers)
        assert answers and answers[0][0] == "ok", answers
        assert g.pids() == pids, "the group was not torn down"
        after = g.execute("work", {"secs": 0})
        (event, ran_at) = after.meta["events"][0]
        assert event == "during" and ran_at >= r.meta["ended"], after.meta
