"""rankexec.host.RankGroup against real rank processes (the Rust `rankexec-worker`
builtins): results, zero-copy blobs, events to Python, and every typed failure."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

import rankexec
from rankexec.host import (
    Aborted,
    ConfigError,
    RankFailed,
    RankGroup,
    StartupFailed,
    TimedOut,
)

from .flare_helpers import wait_until


def cfg(worker: str, component: str, n: int = 2, args: dict | None = None, **extra) -> dict:
    c = {
        "executor_id": "c",
        "num_of_processes": n,
        "components": [{"id": "c", "path": component, "args": args or {}}],
        "worker": {"program": worker},
    }
    c.update(extra)
    return c


def when_busy(g: RankGroup, action) -> threading.Thread:
    """Runs `action` from another thread once the group has a task in flight."""

    def run():
        if wait_until(lambda: g.phase == "busy", timeout=30, step=0.01):
            action()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def gone(pids: list[int]) -> bool:
    return all(not os.path.exists(f"/proc/{p}") for p in pids)


def test_execute_returns_rank0_meta_and_blobs_without_copy(rust_worker, tmp_path):
    with RankGroup(cfg(rust_worker, "Echo"), workspace=str(tmp_path)) as g:
        g.start()
        assert len(g.pids()) == 2
        small = np.arange(12, dtype=np.float32).reshape(3, 4)
        big = np.random.default_rng(0).random(4 << 20, dtype=np.float32)  # 16 MiB
        r = g.execute("t", {"x": 5, "l": [1, 2.5, "s", None]}, {"small": small, "big": big})
        assert r.meta["x"] == 5 and r.meta["l"] == [1, 2.5, "s", None] and r.meta["rank"] == 0
        np.testing.assert_array_equal(np.frombuffer(r.blobs["small"], np.float32), small.ravel())
        out = np.frombuffer(r.blobs["big"], np.float32)
        np.testing.assert_array_equal(out, big)
        assert r.blobs["big"].shared and not r.blobs["small"].shared
        assert not out.flags.writeable
        # After a task, a memory file for the next input of this size is prepared.
        assert wait_until(lambda: g.staged_bytes == big.nbytes, timeout=10)
        assert g.log_dir and os.path.isdir(os.path.join(g.log_dir, "rank-1"))
        pids = g.pids()
    assert wait_until(lambda: gone(pids), timeout=10)


def test_rank_events_reach_the_callback_with_the_rank(rust_worker):
    seen: list[tuple[str, int | None]] = []

    def on_event(event, rank, props):
        seen.append((event, rank))
        return {"answer": 42}

    g = RankGroup(cfg(rust_worker, "FireEvent", args={"event": "metrics"}), on_event=on_event)
    try:
        r = g.execute("t")
        assert sorted(seen) == [("metrics", 0), ("metrics", 1)]
        assert r.meta.get("ctx:answer") == 42, r.meta  # FireEvent returns the props it got back
        props = g.fire_event("host_event", {"k": 1})
        assert props["k"] == 1
    finally:
        g.close()


def test_a_failing_rank_raises_rank_failed_with_rank_pid_and_stderr(rust_worker):
    g = RankGroup(cfg(rust_worker, "Fail", args={"ranks": [1], "message": "bad batch"}))
    try:
        with pytest.raises(RankFailed) as ei:
            g.execute("t")
        e = ei.value
        assert isinstance(e, rankexec.RankexecError)
        assert e.rank == 1 and e.pid and e.error_class == "exception"
        assert "bad batch" in e.cause and "bad batch" in str(e)
        assert any("rank ready" in line for line in e.stderr_tail)
        print("RankFailed:", e, "| pid", e.pid)
    finally:
        g.close()


def test_a_crashed_rank_raises_rank_failed_and_the_group_is_gone(rust_worker):
    g = RankGroup(cfg(rust_worker, "Exit", args={"ranks": [1], "code": 7}))
    try:
        g.start()
        pids = g.pids()
        with pytest.raises(RankFailed) as ei:
            g.execute("t")
        assert ei.value.rank == 1 and ei.value.error_class == "exit_code"
        assert "exited with code 7" in ei.value.cause
        assert wait_until(lambda: gone(pids), timeout=10)
    finally:
        g.close()


def test_startup_failure_is_typed(rust_worker):
    g = RankGroup(cfg(rust_worker, "NoSuchComponent"))
    try:
        with pytest.raises(StartupFailed) as ei:
            g.start()
        assert ei.value.rank is not None
        print("StartupFailed:", ei.value)
    finally:
        g.close()


def test_bad_configuration_is_a_config_error(rust_worker):
    with pytest.raises(ConfigError, match="num_of_processes"):
        RankGroup(cfg(rust_worker, "Echo", n="two"))
    with pytest.raises(ConfigError):
        RankGroup({**cfg(rust_worker, "Echo"), "no_such_key": 1})


def test_task_deadline_raises_timed_out(rust_worker):
    g = RankGroup(
        cfg(rust_worker, "Sleep", args={"secs": 60, "ignore_abort": True}, deadlines={"task": "1s"})
    )
    try:
        g.start()
        pids = g.pids()
        with pytest.raises(TimedOut) as ei:
            g.execute("t")
        assert sorted(ei.value.pending) == [0, 1] and ei.value.timeout_s == 1.0
        assert wait_until(lambda: gone(pids), timeout=20)
    finally:
        g.close()


def test_abort_check_aborts_the_task_in_every_rank(rust_worker):
    g = RankGroup(cfg(rust_worker, "Sleep", args={"secs": 60}))
    try:
        g.start()
        t0 = time.monotonic()
        with pytest.raises(Aborted) as ei:
            g.execute("t", abort_check=lambda: time.monotonic() - t0 > 0.3, poll_s=0.002)
        took = time.monotonic() - t0
        assert not ei.value.forced and "aborted by the host" in ei.value.reason
        print(f"aborted through abort_check after {took:.3f} s")
        r = g.execute("t", {"secs": 0.0})  # the group stays usable
        assert r.meta["slept"] == 0.0
    finally:
        g.close()


def test_abort_from_another_thread(rust_worker):
    g = RankGroup(cfg(rust_worker, "Sleep", args={"secs": 60}))
    try:
        g.start()
        assert not g.abort()  # nothing in flight
        when_busy(g, lambda: g.abort("stop now"))
        with pytest.raises(Aborted, match="stop now"):
            g.execute("t")
    finally:
        g.close()


def test_ctrl_c_aborts_the_task_then_raises_keyboard_interrupt(rust_worker):
    # Ctrl-C raises KeyboardInterrupt however pytest was started: a script's background
    # job (`pytest &`) ignores SIGINT, and Python then installs no handler of its own.
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    g = RankGroup(cfg(rust_worker, "Sleep", args={"secs": 60}))
    try:
        g.start()
        pids = g.pids()
        when_busy(g, lambda: os.kill(os.getpid(), signal.SIGINT))
        with pytest.raises(KeyboardInterrupt):
            g.execute("t")
        # The ranks were told and returned: the group is still there and usable.
        assert g.pids() == pids
        assert g.execute("t", {"secs": 0.0}).meta["slept"] == 0.0
    finally:
        g.close()
        signal.signal(signal.SIGINT, old)


def test_close_reports_what_it_tore_down(rust_worker):
    g = RankGroup(cfg(rust_worker, "Echo", n=3))
    g.start()
    pids = g.pids()
    report = g.close()
    assert sorted(report["pids"]) == sorted(pids) and report["unkillable"] == []
    assert report["escalated"] is None
    assert gone(pids)
    print("close:", report)
