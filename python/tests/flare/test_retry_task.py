"""A rank's death costs a retry, not the federated job (issue 27, item 4).

The Client API example job (examples/flare/client-api/jobs/rankexec: 2 clients x 2
ranks, the unchanged gloo DDP script) under the real ``nvflare simulator``, with rank 1
of site-1 SIGKILLed once, when site-1 gets the task of round ``KILL_ROUND``. With
``restart: {"retry_task": 2}`` the task runs again on a relaunched group (the script
restarts and receives the same task), the simulator exits 0 after every round, and the
model is as accurate as an undisturbed run's; without it, site-1's task fails and
FLARE's FedAvg ends the run (rc 2), as before.

The victim is found through /proc (its environment names the test's workspace, site-1
and ``RANK=1``); the kill is triggered by site-1's log line for the task assignment.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

from .flare_helpers import REPO, Sim, allow_rankexec, rank_pids, site_log, wait_until

EXAMPLE = REPO / "examples" / "flare" / "client-api"
ROUNDS = 4
KILL_ROUND = 1  # 0-based: the second round
EPOCHS = 10


def _job(tmp_path: Path, retry: dict | None) -> Path:
    job = tmp_path / "job"
    shutil.copytree(EXAMPLE / "jobs" / "rankexec", job)
    server = job / "app_server" / "config" / "config_fed_server.json"
    cfg = json.loads(server.read_text())
    cfg["workflows"][0]["args"]["num_rounds"] = ROUNDS
    server.write_text(json.dumps(cfg, indent=2))
    if retry is not None:
        for app in ("app_site-1", "app_site-2"):
            f = job / app / "config" / "config_fed_client.json"
            cfg = json.loads(f.read_text())
            cfg["executors"][0]["executor"]["args"]["restart"] = retry
            f.write_text(json.dumps(cfg, indent=2))
    for app in ("app_site-1", "app_site-2"):
        # Training long enough (about a second) to be killed in the middle of it.
        f = job / app / "config" / "config_fed_client.json"
        cfg = json.loads(f.read_text())
        cfg["executors"][0]["executor"]["args"]["script_args"] = f"--epochs {EPOCHS}"
        f.write_text(json.dumps(cfg, indent=2))
    return job


def site_rank(ws: Path, site: str, rank: int) -> list[int]:
    """The live rank processes of `site` with `RANK=rank` (by their environment)."""
    needle = f"{ws}/{site}/".encode()
    found = []
    for pid in rank_pids(ws):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and any(
            v.startswith(b"RANKEXEC_LOG_DIR=") and needle in v for v in env
        ):
            found.append(pid)
    return found


def cpu_ticks(pid: int) -> int:
    """User plus system CPU time of `pid`, in clock ticks (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


class Killer(threading.Thread):
    """SIGKILLs rank 1 of site-1 in the middle of the train task of round `round_`: once
    site-1 got that task and rank 1 is training (its CPU time grows; while it waits in
    gloo for rank 0 between tasks it uses none)."""

    def __init__(self, ws: Path, round_: int, site: str = "site-1") -> None:
        super().__init__(daemon=True)
        self.ws, self.round, self.site = ws, round_, site
        self.killed: int | None = None
        self.error: str | None = None

    def _assigned(self) -> int:
        try:
            return site_log(self.ws, self.site).count("got task assignment: name=train")
        except OSError:
            return 0

    def run(self) -> None:
        if not wait_until(lambda: self._assigned() > self.round, 300, step=0.01):
            self.error = f"{self.site} never got the task of round {self.round}"
            return
        pids = wait_until(lambda: site_rank(self.ws, self.site, 1), 60, step=0.01)
        if not pids:
            self.error = f"no rank 1 of {self.site} found"
            return
        base = cpu_ticks(pids[0])
        if not wait_until(lambda: cpu_ticks(pids[0]) >= base + 3, 300, step=0.002):
            self.error = f"rank 1 of {self.site} never trained after round {self.round}"
            return
        os.kill(pids[0], signal.SIGKILL)
        self.killed = pids[0]


def _run(tmp_path: Path, retry: dict | None) -> tuple[int, Path, Killer, Sim]:
    ws = tmp_path / "ws"
    allow_rankexec(ws)
    job = _job(tmp_path, retry)
    t0 = time.monotonic()
    sim = Sim(job, ws)
    killer = Killer(ws, KILL_ROUND)
    killer.start()
    rc = sim.wait(400)
    killer.join(timeout=5)
    print(f"simulator rc {rc} after {time.monotonic() - t0:.1f} s; killed pid {killer.killed}")
    assert killer.error is None, killer.error
    assert killer.killed is not None
    return rc, ws, killer, sim


def _rounds_trained(ws: Path, site: str) -> list[int]:
    out = (ws / site / "simulate_job" / "rankexec" / "rank-0" / "stdout.log").read_text()
    return [
        int(line.split(" round ")[1].split(":")[0])
        for line in out.splitlines()
        if " round " in line
    ]


def test_a_killed_rank_costs_a_retry_and_the_job_completes(tmp_path):
    import torch

    from .test_client_api_sim import _accuracy

    rc, ws, killer, sim = _run(tmp_path, {"retry_task": 2})
    log1 = site_log(ws, "site-1")
    assert rc == 0, f"simulator exited {rc}:\n{sim.output()[-4000:]}\n{log1[-4000:]}"
    retried = [line for line in log1.splitlines() if "succeeded after" in line]
    print("\n".join(retried))
    assert retried and f"pid {killer.killed} was killed by signal 9 (SIGKILL)" in retried[0]
    # Killed in the middle of the task: the retry is try 1 (the relaunched script
    # received the same task: site-1 trained every round, and the job went on).
    assert "(try 1: rank 1: pid" in retried[0], retried[0]
    for site in ("site-1", "site-2"):
        trained = _rounds_trained(ws, site)
        print(f"{site} trained rounds {trained}")
        assert set(trained) == set(range(ROUNDS)), trained
    assert _rounds_trained(ws, "site-2") == list(range(ROUNDS))
    saved = torch.load(
        ws / "server" / "simulate_job" / "app_server" / "FL_global_model.pt", weights_only=False
    )
    final = _accuracy(saved.get("model", saved))
    print(f"final global model accuracy {final:.4f}")
    # An undisturbed 3-round run of this job reaches 0.8 (test_client_api_sim).
    assert final >= 0.8
    assert rank_pids(ws) == []


def test_without_the_retry_a_killed_rank_ends_the_job(tmp_path):
    rc, ws, _, sim = _run(tmp_path, None)
    assert rc == 2, f"simulator exited {rc}:\n{sim.output()[-4000:]}"
    log1 = site_log(ws, "site-1")
    assert "EXECUTION_EXCEPTION" in log1 or "killed by signal 9" in log1, log1[-4000:]
    assert "succeeded after" not in log1
    assert max(_rounds_trained(ws, "site-1"), default=-1) < ROUNDS - 1
    assert rank_pids(ws) == []
