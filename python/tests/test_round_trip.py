"""A component and a script each round-trip a task; start-up failures are fast and
clear; the worker answers job validation."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import COMPONENTS, env_with_python, executor_config, pid_alive, wait_until


def test_component_round_trip(host, tmp_path):
    cfg = executor_config("echo:Echo", 2, {"tag": "hi", "lr": 0.5}, log_dir=tmp_path)
    started = host.start(cfg)
    assert started["ok"], started
    pids = started["pids"]
    r = host.send(op="task", task="train", meta={"x": 5, "nested": {"a": [1, 2.5, "s"]}})
    print("component round trip:", r)
    assert r["ok"], r
    m = r["meta"]
    assert m["task"] == "train" and m["x"] == 5 and m["tag"] == "hi"
    assert m["nested"] == {"a": [1, 2.5, "s"]}
    assert (m["rank"], m["world_size"], m["local_rank"]) == (0, 2, 0)
    assert m["events"] == []
    ev = host.send(op="event", event="custom_event")
    assert ev["ok"], ev
    r = host.send(op="task", task="again")
    assert r["meta"]["events"] == ["custom_event"], "handle_event saw the event"
    assert r["meta"]["lr"] == 0.5, "extra args reach **kwargs"
    stop = host.send(op="stop")
    assert stop["ok"] and stop["unkillable"] == []
    wait_until(lambda: not any(pid_alive(p) for p in pids), 10, "ranks gone")


def test_file_path_component(host, tmp_path):
    cfg = executor_config(f"{COMPONENTS / 'echo.py'}:Echo", 1, {"tag": "file"}, log_dir=tmp_path)
    cfg["env"] = {}
    assert host.start(cfg)["ok"]
    r = host.send(op="task", task="t")
    assert r["ok"] and r["meta"]["tag"] == "file", r


def test_script_round_trip(host, tmp_path):
    cfg = executor_config(
        "script", 2, log_dir=tmp_path, program=[str(COMPONENTS / "script_echo.py")]
    )
    started = host.start(cfg)
    assert started["ok"], started
    r1 = host.send(op="task", task="train", meta={"x": 3})
    r2 = host.send(op="task", task="train", meta={"x": 4})
    print("script round trip:", r1, r2)
    assert r1["ok"] and r2["ok"], (r1, r2)
    assert (r1["meta"]["x"], r2["meta"]["x"]) == (3, 4)
    assert r2["meta"]["steps"] == 2 and r2["meta"]["world_size"] == 2
    assert r1["meta"]["events"] == []
    assert host.send(op="event", event="custom_event")["ok"]
    assert host.send(op="task", task="t")["meta"]["events"] == ["custom_event"]
    failed = host.send(op="task", task="fail")
    assert not failed["ok"] and failed["class"] == "exception"
    assert "RuntimeError: script failed on rank 0" in failed["error"]
    assert host.send(op="task", task="train", meta={"x": 5})["meta"]["x"] == 5


def test_import_error_fails_startup_fast_with_its_message(host, tmp_path):
    cfg = executor_config("no_such_module_xyz:Trainer", 2, log_dir=tmp_path)
    r = host.start(cfg)
    print("import failure:", r)
    assert not r["ok"]
    assert "No module named 'no_such_module_xyz'" in r["error"], r
    assert "ModuleNotFoundError" in r["error"]
    # Far below the 60 s start-up deadline: the build error ends start-up at once.
    assert r["ms"] < 30_000, r


def test_bad_args_fail_startup_with_the_constructor_error(host, tmp_path):
    cfg = executor_config("ranks:Probe", 1, {"tag": 1}, log_dir=tmp_path)
    r = host.start(cfg)
    assert not r["ok"]
    assert "TypeError: Probe.__init__() got an unexpected keyword argument 'tag'" in r["error"]


def test_worker_answers_job_validation():
    def check(components):
        out = subprocess.run(
            [sys.executable, "-m", "rankexec.worker", "--check-components", json.dumps(components)],
            check=False,
            capture_output=True,
            text=True,
            env={**env_with_python(), "PYTHONPATH": str(COMPONENTS)},
            timeout=60,
        )
        return out.returncode, json.loads(out.stdout)

    code, ok = check([{"id": "a", "path": "echo:Echo", "args": {"tag": "x"}}])
    assert code == 0 and ok["ok"], ok
    code, bad = check(
        [
            {"id": "a", "path": "ranks:Probe", "args": {"out_dir": "/tmp", "nope": 1}},
            {"id": "b", "path": "missing_mod:X", "args": {}},
            {"id": "c", "path": "NotAPath", "args": {}},
        ]
    )
    print("validation:", bad)
    assert code == 1 and not bad["ok"]
    errors = {e["id"]: e["error"] for e in bad["errors"]}
    assert "unexpected keyword argument 'nope'" in errors["a"]
    assert "No module named 'missing_mod'" in errors["b"]
    assert "not 'module:Class'" in errors["c"]
