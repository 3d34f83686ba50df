"""Failures: exceptions, crashes, a rank killed inside a collective, aborts, Ctrl-C,
and a SIGKILLed host."""

from __future__ import annotations

import os
import signal

import pytest
from conftest import (
    COMPONENTS,
    Host,
    executor_config,
    pid_alive,
    pids_with_env,
    read_notes,
    wait_until,
)


def test_exception_on_rank_1_has_rank_and_traceback_and_group_stays(host, tmp_path):
    cfg = executor_config("ranks:Probe", 2, {"out_dir": str(tmp_path)}, log_dir=tmp_path)
    started = host.start(cfg)
    assert started["ok"]
    r = host.send(op="task", task="fail")
    print("exception:", r["error"])
    assert not r["ok"] and r["class"] == "exception" and r["rank"] == 1
    assert "Traceback (most recent call last)" in r["error"]
    assert "ValueError: bad batch on rank 1" in r["error"]
    assert "ranks.py" in r["error"], "the traceback names the user's file"
    ok = host.send(op="task", task="look", blobs={"x": {"len": 8, "byte": 1}})
    assert ok["ok"], ok
    assert host.send(op="pids")["pids"] == started["pids"], "same processes"


def test_heartbeats_do_not_need_the_gil(host, tmp_path):
    cfg = executor_config("ranks:Probe", 2, {"out_dir": str(tmp_path)}, log_dir=tmp_path)
    cfg["deadlines"].update({"heartbeat_interval": "100ms", "heartbeat_timeout": "1s"})
    started = host.start(cfg)
    assert started["ok"]
    # Each rank holds the GIL for 3 heartbeat timeouts; its heartbeats go on.
    r = host.send(op="task", task="hold_gil", meta={"seconds": 3.0})
    print("GIL held 3 s with a 1 s heartbeat timeout:", r.get("meta"), r.get("error"))
    assert r["ok"] and r["meta"]["held"] == 3.0, r
    assert host.send(op="pids")["pids"] == started["pids"]


@pytest.mark.parametrize(("how", "cls"), [("exit", "exit_code"), ("segv", "signal")])
def test_crash_is_detected(host, tmp_path, how, cls):
    cfg = executor_config("ranks:Probe", 2, {"out_dir": str(tmp_path)}, log_dir=tmp_path)
    started = host.start(cfg)
    r = host.send(op="task", task="crash", meta={"how": how})
    print(f"crash ({how}):", r["error"])
    assert not r["ok"] and r["class"] == cls and r["rank"] == 1
    wait_until(lambda: not any(pid_alive(p) for p in started["pids"]), 10, "group torn down")


def test_rank_killed_inside_gloo_allreduce_ends_task_and_leaves_nothing(host, tmp_path):
    out = tmp_path / "notes"
    out.mkdir()
    cfg = executor_config("ranks:Collective", 3, {"out_dir": str(out)}, log_dir=tmp_path)
    started = host.start(cfg)
    assert started["ok"], started
    ok = host.send(op="task", task="allreduce")
    assert ok["ok"] and ok["meta"]["sum"] == 6.0, ok
    pids = [n["pid"] for n in read_notes(out, "pid", 3)]
    r = host.send(op="task", task="kill_in_allreduce", timeout=60)
    print("killed in all-reduce:", r["error"], f"{r['ms']:.0f} ms")
    assert not r["ok"] and r["class"] == "signal" and r["rank"] == 1
    wait_until(lambda: not any(pid_alive(p) for p in pids), 10, "every rank gone")


def test_abort_reaches_every_python_rank_and_next_task_runs(host, tmp_path):
    out = tmp_path / "notes"
    out.mkdir()
    cfg = executor_config("ranks:Probe", 3, {"out_dir": str(out)}, log_dir=tmp_path)
    started = host.start(cfg)
    r = host.send(op="task", task="wait_abort", abort_after_ms=300)
    print("abort:", r["error"])
    assert not r["ok"] and r["aborted"] and not r["forced"], r
    notes = read_notes(out, "abort", 3)
    assert all(n["triggered"] and n["got"] for n in notes), notes
    nxt = host.send(op="task", task="look", blobs={"x": {"len": 16, "byte": 3}})
    assert nxt["ok"], nxt
    assert host.send(op="pids")["pids"] == started["pids"], "the group survived the abort"


def test_ctrl_c_in_a_blocking_call_raises_keyboard_interrupt(host, tmp_path):
    out = tmp_path / "notes"
    out.mkdir()
    cfg = executor_config("ranks:Probe", 1, {"out_dir": str(out)}, log_dir=tmp_path)
    assert host.start(cfg)["ok"]
    host.proc.stdin.write('{"op": "task", "task": "sleep"}\n')
    host.proc.stdin.flush()
    (note,) = read_notes(out, "sleeping", 1)
    os.kill(note["pid"], signal.SIGINT)
    assert host.sel.select(30), "the task ended"
    import json

    r = json.loads(host.proc.stdout.readline())
    print("Ctrl-C:", r["error"])
    assert not r["ok"] and "KeyboardInterrupt" in r["error"], r


def _main_thread_sleeps(pid: int) -> bool:
    """Whether `pid`'s main thread is asleep (blocked in a call), per /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "S"
    except (OSError, IndexError):
        return False


def test_ctrl_c_in_receive_raises_keyboard_interrupt_in_a_script(host, tmp_path):
    cfg = executor_config(
        "script", 1, log_dir=tmp_path, program=[str(COMPONENTS / "script_interrupt.py")]
    )
    cfg["env"] = {"set": {"OUT_DIR": str(tmp_path)}}
    assert host.start(cfg)["ok"]
    pid = host.send(op="task", task="t")["meta"]["pid"]
    # The reply reaches the host before the script is back in receive(): a Ctrl-C
    # then would interrupt reply() (seen once in 2 idle runs of scripts/flake-check.sh).
    # Wait until it waits for the next task.
    waiting = tmp_path / "waiting-0"
    wait_until(
        lambda: waiting.exists() and waiting.read_text() == "1" and _main_thread_sleeps(pid),
        30,
        "the script in receive() after its first task",
    )
    os.kill(pid, signal.SIGINT)
    wait_until(lambda: (tmp_path / "interrupted-0").exists(), 10, "KeyboardInterrupt noted")
    wait_until(lambda: not pid_alive(pid), 10, "the script exited")


@pytest.mark.parametrize("launcher", ["builtin", "torchrun"])
def test_sigkill_of_the_host_leaves_no_rank(tmp_path, launcher):
    out = tmp_path / "notes"
    out.mkdir()
    extra = {} if launcher == "builtin" else {"launcher": {"torchrun": {}}}
    cfg = executor_config("ranks:Probe", 2, {"out_dir": str(out)}, log_dir=tmp_path, **extra)
    h = Host()
    try:
        started = h.start(cfg)
        assert started["ok"], started
        assert h.send(op="task", task="pid")["ok"]
        notes = read_notes(out, "pid", 2)
        workers = [n["pid"] for n in notes]
        group = h.send(op="pids")["pids"]
        print(
            f"{launcher}: workers {workers} (sessions {[n['sid'] for n in notes]}), group {group}"
        )
        assert all(pid_alive(p) for p in workers)
        assert set(workers) <= set(pids_with_env(str(tmp_path))), "the scan sees the ranks"
        h.proc.kill()
        h.proc.wait(10)
        wait_until(lambda: not any(pid_alive(p) for p in workers + group), 15, "no rank left")
    finally:
        if h.proc.poll() is None:
            h.proc.kill()
    # Nor any process we did not know the pid of (torchrun itself, its workers).
    assert pids_with_env(str(tmp_path)) == []


@pytest.mark.parametrize("launcher", ["builtin", "torchrun"])
def test_no_worker_outlives_a_forced_abort_or_a_finalize(host, tmp_path, launcher):
    out = tmp_path / "notes"
    out.mkdir()
    extra = {} if launcher == "builtin" else {"launcher": {"torchrun": {}}}
    cfg = executor_config("ranks:Probe", 2, {"out_dir": str(out)}, log_dir=tmp_path, **extra)
    cfg["deadlines"].update({"abort_grace": "1s", "term_grace": "1s"})
    assert host.start(cfg)["ok"]

    def workers() -> list[int]:
        assert host.send(op="task", task="pid")["ok"]
        pids = [n["pid"] for n in read_notes(out, "pid", 2)]
        for p in out.glob("pid-*.json"):
            p.unlink()
        return pids

    first = workers()
    r = host.send(op="task", task="ignore_abort", abort_after_ms=300)
    print(f"{launcher} forced abort:", r["error"])
    assert not r["ok"] and r["aborted"] and r["forced"], r
    wait_until(lambda: not any(pid_alive(p) for p in first), 15, "workers gone after abort")
    second = workers()  # the next task relaunches the group
    assert not set(first) & set(second)
    stop = host.send(op="stop")
    assert stop["ok"] and stop["unkillable"] == [], stop
    wait_until(lambda: not any(pid_alive(p) for p in second), 15, "workers gone after finalize")
