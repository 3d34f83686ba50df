"""rankexec.flare.MultiProcessExecutor under the real `nvflare simulator`: lifecycle,
failures, abort, SIGKILL, events; mostly with Rust ranks (the `rankexec-worker`
builtins), the abort case with Python ranks.

Each test runs `nvflare simulator JOB -w WS -n 2 -t 2` under a time cap and checks the
workspace's error logs, the persisted model and, through /proc, that no rank is left.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import docrun
import numpy as np

from .flare_helpers import (
    allow_rankexec,
    assert_no_errors,
    client_config,
    descendants,
    error_logs,
    parent_of,
    rank_pids,
    run_sim,
    server_config,
    server_model,
    simple_job,
    site_log,
    wait_until,
    write_job,
)

INITIAL = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=np.float32)


def test_echo_ranks_return_the_model_unchanged(tmp_path, rust_worker):
    job = simple_job(
        tmp_path,
        "echo",
        {"num_of_processes": 2, "rank_component": "Echo", "worker": {"program": rust_worker}},
    )
    ws = tmp_path / "ws"
    allow_rankexec(ws, worker=rust_worker, components=("Echo",))
    run_sim(job, ws)
    assert_no_errors(ws)
    np.testing.assert_array_equal(server_model(ws), INITIAL)
    for site in ("site-1", "site-2"):
        log = site_log(ws, site)
        m = re.search(r"rank group of 2 ready in ([\d.]+) ms \(pids \[(\d+), (\d+)\]", log)
        assert m, log[-3000:]
        assert "rank group stopped" in log
        print(f"{site}: START_RUN to ready {m.group(1)} ms")
        for r in (0, 1):
            assert (ws / site / "simulate_job" / "rankexec" / f"rank-{r}" / "stderr.log").exists()
        for pid in (int(m.group(2)), int(m.group(3))):
            assert not os.path.exists(f"/proc/{pid}") or _zombie_or_gone(pid)
    assert rank_pids(ws) == []


def _zombie_or_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return b"RANKEXEC_LOG_DIR" not in f.read()  # pid reused by something else
    except OSError:
        return True


def test_without_the_allow_list_flare_refuses_the_executor(tmp_path, rust_worker):
    job = simple_job(
        tmp_path,
        "refused",
        {"num_of_processes": 2, "rank_component": "Echo", "worker": {"program": rust_worker}},
        num_rounds=1,
        error_logger=False,
    )
    ws = tmp_path / "ws"
    run_sim(job, ws)
    logs = error_logs(ws)
    text = "\n".join(logs.values())
    assert "rankexec.flare.MultiProcessExecutor" in text and "allow_list" in text, logs
    print(next(line for line in text.splitlines() if "allow_list" in line)[:300])
    assert rank_pids(ws) == []


def test_a_raising_rank_is_in_the_client_and_server_logs(tmp_path, rust_worker):
    job = simple_job(
        tmp_path,
        "raises",
        {
            "num_of_processes": 2,
            "rank_component": "Fail",
            "rank_args": {"ranks": [1], "message": "bad batch on purpose"},
            "worker": {"program": rust_worker},
        },
        num_rounds=1,
    )
    ws = tmp_path / "ws"
    allow_rankexec(ws, worker=rust_worker, components=("Fail",))
    run_sim(job, ws, check=False)  # the failed round ends the run: exit code 2
    # With -t 2 one client process runs both sites and logs into one site's files.
    client = "".join((ws / site / "error_log.txt").read_text() for site in ("site-1", "site-2"))
    server = (ws / "server" / "error_log.txt").read_text()
    assert "rank 1 failed: exception: bad batch on purpose" in client, client
    assert "rank group on site-" in server and "bad batch on purpose" in server, server
    assert "EXECUTION_EXCEPTION" in server, server
    print("client:", next(s for s in client.splitlines() if "bad batch" in s)[:300])
    print("server:", next(s for s in server.splitlines() if "bad batch" in s)[:300])
    # The lines docs/flare-jobs.md shows, in the run's logs.
    logs = "\n".join(p.read_text(errors="replace") for p in ws.rglob("*log.txt"))
    shown = docrun.log_lines("docs/flare-jobs.md", "rank-fails")
    assert not docrun.missing_lines(shown, logs), (docrun.missing_lines(shown, logs), logs)
    assert rank_pids(ws) == []


SLEEPERS = '''
import os
import time

import rankexec


class SleepUntilAborted:
    """Marks that its task started, sleeps until its abort signal fires, marks that."""

    def __init__(self, dir):
        self.dir = dir

    def execute(self, task, input, ctx, abort):
        open(os.path.join(self.dir, f"started-{ctx.rank}"), "w").close()
        if abort.wait(600):
            with open(os.path.join(self.dir, f"aborted-{ctx.rank}"), "w") as f:
                f.write(abort.reason or "")
            raise rankexec.TaskAborted("aborted")
        return rankexec.Shareable()


class EchoOnceOthersSleep:
    """Returns the model unchanged once every sleeping rank is inside its task."""

    def __init__(self, dir, sleepers):
        self.dir, self.sleepers = dir, sleepers

    def execute(self, task, input, ctx, abort):
        deadline = time.monotonic() + 120
        want = [os.path.join(self.dir, f"started-{r}") for r in range(self.sleepers)]
        while not all(os.path.exists(w) for w in want):
            if time.monotonic() > deadline or abort.wait(0.01):
                raise RuntimeError("the sleeping ranks never started their task")
        meta = {"dxo_arrays": input.meta.get("dxo_arrays"), "NUM_STEPS_CURRENT_ROUND": 1}
        return rankexec.Shareable(meta=meta, blobs=dict(input.blobs))
'''


def test_workflow_end_aborts_a_sleeping_rank_group(tmp_path):
    """site-1's Python ranks sleep in their task; site-2 answers once they do; the
    workflow (min_clients 1, one round) ends; site-1's task is aborted through FLARE's
    abort_signal: every rank's abort signal fires and no rank is left."""
    marks = tmp_path / "marks"
    marks.mkdir()
    slow = {
        "num_of_processes": 2,
        "rank_component": "custom/sleepers.py:SleepUntilAborted",
        "rank_args": {"dir": str(marks)},
    }
    fast = {
        "num_of_processes": 2,
        "rank_component": "custom/sleepers.py:EchoOnceOthersSleep",
        "rank_args": {"dir": str(marks), "sleepers": 2},
    }
    files = {"custom/sleepers.py": SLEEPERS}
    job = write_job(
        tmp_path,
        "abort",
        {
            "app_server": {"server": server_config(num_rounds=1, min_clients=1)},
            "app_slow": {"client": client_config(slow), "files": files},
            "app_fast": {"client": client_config(fast), "files": files},
        },
        {"app_server": ["server"], "app_slow": ["site-1"], "app_fast": ["site-2"]},
    )
    ws = tmp_path / "ws"
    allow_rankexec(ws)
    run_sim(job, ws)
    assert_no_errors(ws)
    log = site_log(ws, "site-1") + site_log(ws, "site-2")
    assert "aborted in every rank" in log and "FLARE's abort_signal fired" in log, log[-3000:]
    for line in log.splitlines():
        if "aborted in every rank" in line or "rank group stopped" in line:
            print(line[:400])
    shown = docrun.log_lines("docs/flare-jobs.md", "task-aborted")  # as the page shows
    assert not docrun.missing_lines(shown, log), (docrun.missing_lines(shown, log), log)
    for r in (0, 1):
        reason = (marks / f"aborted-{r}").read_text()
        print(f"rank {r} of site-1: abort signal fired ({reason})")
        assert reason == "FLARE's abort_signal fired"
    assert rank_pids(ws) == []


def test_sigkill_of_the_client_process_leaves_no_rank(tmp_path, rust_worker, sim_runner):
    job = simple_job(
        tmp_path,
        "killed",
        {
            "num_of_processes": 2,
            "rank_component": "Sleep",
            "rank_args": {"secs": 600},
            "worker": {"program": rust_worker},
        },
        num_rounds=1,
    )
    ws = tmp_path / "ws"
    allow_rankexec(ws, worker=rust_worker, components=("Sleep",))
    sim = sim_runner(job, ws)
    ranks = wait_until(lambda: len(rank_pids(ws)) == 4 and rank_pids(ws), timeout=90, step=0.1)
    assert ranks and len(ranks) == 4, f"ranks never came up:\n{sim.output()[-3000:]}"
    # The client process is the ranks' parent and descends from our simulator.
    client = parent_of(ranks[0])
    assert client in descendants(sim.proc.pid)
    mine = [p for p in ranks if parent_of(p) == client]
    assert len(mine) == 2
    t0 = time.monotonic()
    os.kill(client, signal.SIGKILL)
    left = wait_until(lambda: not [p for p in rank_pids(ws) if p in mine], timeout=1.0)
    took = time.monotonic() - t0
    assert left, f"ranks {mine} outlived their client by 1 s"
    print(f"SIGKILLed client {client}; its ranks {mine} gone after {took * 1e3:.1f} ms")
    sim.kill()


PROBE = '''
import json
import json
import os

from nvflare.apis.fl_component import FLComponent


class RankEventProbe(FLComponent):
    """Records every `metrics_ready` event with the rank it came from."""

    def handle_event(self, event_type, fl_ctx):
        if event_type == "metrics_ready":
            rank = fl_ctx.get_prop("__rankexec_from_rank__")
            props = fl_ctx.get_prop("__rankexec_event_props__") or {}
            path = os.path.join(os.environ["PROBE_DIR"], fl_ctx.get_identity_name() + ".jsonl")
            with open(path, "a") as f:
                f.write(json.dumps({"rank": rank, "fired_from": props.get("fired_from")}) + "\\n")
'''


def test_events_fired_in_ranks_reach_flare_with_the_rank(tmp_path, rust_worker, monkeypatch):
    args = {
        "num_of_processes": 2,
        "rank_component": "FireEvent",
        "rank_args": {"event": "metrics_ready"},
        "worker": {"program": rust_worker},
    }
    client = client_config(args)
    client["components"] = [{"id": "probe", "path": "event_probe.RankEventProbe", "args": {}}]
    job = write_job(
        tmp_path,
        "events",
        {
            "app": {
                "server": server_config(num_rounds=1),
                "client": client,
                "files": {"custom/event_probe.py": PROBE},
            }
        },
        {"app": ["@ALL"]},
    )
    probe = tmp_path / "probe"
    probe.mkdir()
    monkeypatch.setenv("PROBE_DIR", str(probe))
    ws = tmp_path / "ws"
    run_sim(job, ws, check=False)  # FireEvent returns no model: the round fails after
    for site in ("site-1", "site-2"):
        lines = (probe / f"{site}.jsonl").read_text().splitlines()
        seen = sorted(json.loads(line)["rank"] for line in lines)
        print(f"{site}: metrics_ready from ranks {seen}")
        assert seen == [0, 1]
    assert rank_pids(ws) == []


def test_a_rank_group_that_cannot_start_fails_the_run_with_its_reason(tmp_path, rust_worker):
    job = simple_job(
        tmp_path,
        "nostart",
        {"num_of_processes": 2, "rank_component": "NoSuchRank", "worker": {"program": rust_worker}},
        num_rounds=1,
    )
    ws = tmp_path / "ws"
    allow_rankexec(ws, worker=rust_worker, components=("NoSuchRank",))
    run_sim(job, ws, check=False)
    client = "".join((ws / s / "error_log.txt").read_text() for s in ("site-1", "site-2"))
    assert "cannot start the rank group" in client and "unknown path `NoSuchRank`" in client
    print(next(s for s in client.splitlines() if "cannot start the rank group" in s)[:300])
    assert rank_pids(ws) == []
