"""Python code runs on the rank's main thread: components are built there, their
events handled there, tasks run there, so thread-bound state (`threading.local`,
torch's grad mode, CUDA's current device, signal handlers) set while building or in a
`START_RUN` handler holds in `execute`. An unknown start mode poisons nothing."""

from __future__ import annotations

from conftest import COMPONENTS, executor_config, pid_alive, pids_with_env, wait_until


def test_state_set_in_init_and_in_start_run_holds_in_execute(host, tmp_path):
    cfg = executor_config("threads:ThreadState", 2, log_dir=tmp_path)
    started = host.send(op="start", config=cfg, engine=True)
    print("start:", started.get("error", "ok"))
    assert started["ok"], started
    assert host.send(op="event", event="_start_run")["ok"]
    r = host.send(op="task", task="state")
    print("state seen by execute:", r.get("meta"), r.get("error"))
    assert r["ok"], r
    m = r["meta"]
    assert m["built_on_main"] and m["execute_on_main"], m
    assert m["from_init"] == "init", "a threading.local set in __init__"
    assert m["from_start_run"] == "start_run", "a threading.local set in a START_RUN handler"
    assert m["grad_enabled"] is False, "torch.set_grad_enabled(False) in __init__"
    assert m["events"] == [["_start_run", True]], "handle_event ran on the main thread"


def test_events_a_task_fires_reach_its_component_on_the_main_thread(host, tmp_path):
    cfg = executor_config("threads:ThreadState", 1, log_dir=tmp_path)
    assert host.send(op="start", config=cfg, engine=True)["ok"]
    r = host.send(op="task", task="fire")
    print("fired from a task:", r.get("meta"), r.get("error"))
    assert r["ok"], r
    assert r["meta"]["events"] == [["mine", True]]
    assert ["mine", 0] in host.send(op="events")["events"], "then the host got it"


def test_signal_handler_installed_in_init(host, tmp_path):
    cfg = executor_config("threads:ThreadState", 1, {"install_signal": True}, log_dir=tmp_path)
    started = host.start(cfg)
    print("start with signal.signal in __init__:", started.get("error", "ok"))
    assert started["ok"], started
    r = host.send(op="task", task="usr1")
    assert r["ok"] and r["meta"]["usr1"] == 1, r
    assert host.send(op="pids")["pids"] == started["pids"], "SIGUSR1 was handled, not fatal"


def test_script_on_event_runs_on_the_main_thread(host, tmp_path):
    cfg = executor_config(
        "script", 1, log_dir=tmp_path, program=[str(COMPONENTS / "script_threads.py")]
    )
    assert host.start(cfg)["ok"]
    assert host.send(op="event", event="_start_run")["ok"]
    r = host.send(op="task", task="t")
    print("script on_event:", r.get("meta"), r.get("error"))
    assert r["ok"] and r["meta"]["events"] == [["_start_run", True]], r


def test_an_unknown_mode_does_not_poison_the_next_start(host, tmp_path):
    cfg = executor_config(
        "script", 1, log_dir=tmp_path, program=[str(COMPONENTS / "script_bogus_mode.py")]
    )
    started = host.start(cfg)
    print("start after start('bogus'):", started.get("error", "ok"))
    assert started["ok"], started
    r = host.send(op="task", task="t")
    assert r["ok"], r
    assert "unknown mode `bogus`" in r["meta"]["refused"], r


def test_a_rank_that_never_calls_receive_is_ended_by_the_startup_deadline(host, tmp_path):
    cfg = executor_config(
        "threads:ThreadState",
        1,
        log_dir=tmp_path,
        program=[str(COMPONENTS / "never_receive.py")],
    )
    cfg["deadlines"].update({"startup": "3s", "shutdown_grace": "1s", "term_grace": "1s"})
    started = host.start(cfg)
    print("start without receive():", started)
    assert not started["ok"], started
    wait_until(lambda: pids_with_env(str(tmp_path)) == [], 30, "the rank gone")


def test_close_while_the_main_thread_is_in_an_event_handler(host, tmp_path):
    cfg = executor_config(
        "threads:SlowEvents", 2, {"out_dir": str(tmp_path), "hold": 60.0}, log_dir=tmp_path
    )
    cfg["deadlines"].update({"event": "2s", "shutdown_grace": "1s", "term_grace": "1s"})
    started = host.start(cfg)
    assert started["ok"], started
    # The handler outlives the event deadline: the host closes the group while every
    # rank's main thread is still inside it.
    r = host.send(op="event", event="slow")
    print("slow event:", r)
    assert not r["ok"] and "slow" in r["error"], r
    wait_until(lambda: not any(pid_alive(p) for p in started["pids"]), 30, "every rank gone")
    nxt = host.send(op="task", task="seen")
    print("next task on a fresh group:", nxt.get("meta"), nxt.get("error"))
    assert nxt["ok"] and nxt["meta"]["seen"] == [], nxt
