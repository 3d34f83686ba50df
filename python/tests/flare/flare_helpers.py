"""Helpers for the FLARE tests: jobs written on the fly, the real `nvflare simulator`
run under a time cap, and checks on what the OS and the workspace say afterwards.

(A module of its own, not conftest.py: the Python-ranks suite one folder up has a
conftest.py too, and `from conftest import ...` would find either.)

Rank processes are found through /proc: a rank's environment holds
RANKEXEC_LOG_DIR, which the adapter puts under the job's workspace, so a process
whose environment names the test's workspace is one of this test's ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
NVFLARE = Path(sys.executable).parent / "nvflare"
SIM_CAP_S = float(os.environ.get("RANKEXEC_FLARE_CAP", "150"))


def worker_program() -> str:
    """The Rust rank program (`cargo build --release -p rankexec-sub-worker`)."""
    return os.environ.get("RANKEXEC_WORKER", str(REPO / "target" / "release" / "rankexec-worker"))


def server_config(num_rounds: int = 3, min_clients: int = 2, error_logger: bool = True) -> dict:
    components = [
        {
            "id": "persistor",
            "path": "nvflare.app_common.np.np_model_persistor.NPModelPersistor",
            "args": {},
        },
        {
            "id": "shareable_generator",
            "path": "nvflare.app_common.shareablegenerators.full_model_shareable_generator."
            "FullModelShareableGenerator",
            "args": {},
        },
        {
            "id": "aggregator",
            "path": "nvflare.app_common.aggregators.intime_accumulate_model_aggregator."
            "InTimeAccumulateWeightedAggregator",
            "args": {"expected_data_kind": "WEIGHTS"},
        },
    ]
    if error_logger:
        components.append(
            {"id": "rankexec_errors", "path": "rankexec.flare.RankErrorLogger", "args": {}}
        )
    return {
        "format_version": 2,
        "task_data_filters": [],
        "task_result_filters": [],
        "components": components,
        "workflows": [
            {
                "id": "scatter_and_gather",
                "path": "nvflare.app_common.workflows.scatter_and_gather.ScatterAndGather",
                "args": {
                    "min_clients": min_clients,
                    "num_rounds": num_rounds,
                    "start_round": 0,
                    "wait_time_after_min_received": 0,
                    "aggregator_id": "aggregator",
                    "persistor_id": "persistor",
                    "shareable_generator_id": "shareable_generator",
                    "train_task_name": "train",
                    "train_timeout": 0,
                },
            }
        ],
    }


def client_config(executor_args: dict) -> dict:
    return {
        "format_version": 2,
        "executors": [
            {
                "tasks": ["train"],
                "executor": {"path": "rankexec.flare.MultiProcessExecutor", "args": executor_args},
            }
        ],
        "task_result_filters": [],
        "task_data_filters": [],
        "components": [],
    }


def write_job(root: Path, name: str, apps: dict[str, dict], deploy_map: dict) -> Path:
    """Writes a job: `apps` maps an app folder to {"server": cfg} / {"client": cfg}
    (and optional "files": {relative path: text})."""
    job = root / name
    for app, parts in apps.items():
        cfg = job / app / "config"
        cfg.mkdir(parents=True)
        if "server" in parts:
            (cfg / "config_fed_server.json").write_text(json.dumps(parts["server"], indent=2))
        if "client" in parts:
            (cfg / "config_fed_client.json").write_text(json.dumps(parts["client"], indent=2))
        for rel, text in parts.get("files", {}).items():
            f = job / app / rel
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(text)
    meta = {"name": name, "resource_spec": {}, "deploy_map": deploy_map, "min_clients": 1}
    (job / "meta.json").write_text(json.dumps(meta, indent=2))
    return job


def simple_job(root: Path, name: str, executor_args: dict, **server_kw) -> Path:
    app = {"server": server_config(**server_kw), "client": client_config(executor_args)}
    return write_job(root, name, {"app": app}, {"app": ["@ALL"]})


def allow_rankexec(ws: Path, worker: str | None = None, components: tuple[str, ...] = ()) -> None:
    """What a site operator does once: `python -m rankexec.flare allow-list WS`, and,
    for jobs without custom code that pick a rank program or component, the site
    policy: `python -m rankexec.flare policy WS --worker W --component C...`."""
    subprocess.run(
        [sys.executable, "-m", "rankexec.flare", "allow-list", str(ws)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    if worker or components:
        site_policy(ws, workers=[worker] if worker else [], components=list(components))


def site_policy(ws: Path, **keys: list[str] | str) -> Path:
    """Writes WS/local/rankexec.json with `python -m rankexec.flare policy`."""
    argv = [sys.executable, "-m", "rankexec.flare", "policy", str(ws), "--force"]
    for key, flag in (
        ("workers", "--worker"),
        ("components", "--component"),
        ("launchers", "--launcher"),
        ("env", "--env"),
        ("scripts", "--script"),
    ):
        for v in keys.get(key, []):
            argv += [flag, v]
    if "byoc_jobs" in keys:
        argv += ["--byoc-jobs", str(keys["byoc_jobs"])]
    subprocess.run(argv, check=True, capture_output=True, timeout=60)
    return ws / "local" / "rankexec.json"


class Sim:
    """A running `nvflare simulator` in its own session (so its tree can be capped)."""

    def __init__(self, job: Path, ws: Path, clients: int = 2, cwd: Path | None = None) -> None:
        self.ws = ws
        self.log = open(ws.parent / f"{ws.name}.out", "w")  # noqa: SIM115
        env = dict(os.environ)
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        self.proc = subprocess.Popen(
            [str(NVFLARE), "simulator", str(job), "-w", str(ws), "-n", str(clients), "-t", "2"],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            cwd=cwd,
        )

    def wait(self, cap: float = SIM_CAP_S) -> int:
        try:
            return self.proc.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"nvflare simulator did not finish within {cap} s")
        finally:
            self.log.close()

    def kill(self) -> None:
        """SIGKILLs the simulator and every process descended from it (its client
        processes start sessions of their own, so its process group is not enough)."""
        if self.proc.poll() is None:
            for pid in descendants(self.proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def output(self) -> str:
        return (self.ws.parent / f"{self.ws.name}.out").read_text(errors="replace")


def run_sim(
    job: Path,
    ws: Path,
    clients: int = 2,
    cap: float = SIM_CAP_S,
    check: bool = True,
    cwd: Path | None = None,
) -> Sim:
    """Runs the simulator to its end; `check`: it must exit 0 (a run that a client's
    failure ends exits 2)."""
    s = Sim(job, ws, clients, cwd)
    rc = s.wait(cap)
    if check:
        assert rc == 0, f"simulator exited {rc}:\n{s.output()[-4000:]}"
    return s


def error_logs(ws: Path) -> dict[str, str]:
    """Every error_log.txt in the workspace with its content."""
    return {
        str(p.relative_to(ws)): p.read_text(errors="replace") for p in ws.rglob("error_log.txt")
    }


def assert_no_errors(ws: Path) -> None:
    logs = error_logs(ws)
    assert logs, f"no error_log.txt under {ws}: did the simulator run?"
    bad = {k: v for k, v in logs.items() if v.strip()}
    assert not bad, f"errors logged: {json.dumps(bad, indent=1)[:6000]}"


def site_log(ws: Path, site: str) -> str:
    return (ws / site / "log.txt").read_text(errors="replace")


def server_model(ws: Path):
    import numpy as np

    return np.load(ws / "server" / "simulate_job" / "models" / "server.npy")


def rank_pids(ws: Path) -> list[int]:
    """Live processes whose environment names this workspace (our ranks)."""
    needle = str(ws).encode()
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            env = (d / "environ").read_bytes()
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "Z":
            continue
        for var in env.split(b"\0"):
            if var.startswith(b"RANKEXEC_LOG_DIR=") and needle in var:
                found.append(int(d.name))
                break
    return found


def descendants(root: int) -> list[int]:
    """Every live process below `root` (by parent links, read from /proc)."""
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = parent_of(int(d.name))
            except (OSError, ValueError, IndexError):
                continue
    out: list[int] = []
    frontier = [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out.extend(kids)
        frontier.extend(kids)
    return out


def run_capped(cmd: list[str], cwd: Path, env: dict[str, str], out: Path, cap: float) -> str:
    """Runs `cmd` as its user would (its own session, output to `out`), failing the test
    when it runs past `cap` seconds (then killing it and every process below it, the
    simulator included) or exits non-zero; returns its output."""
    with open(out, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        try:
            rc = proc.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            for pid in descendants(proc.pid):  # the simulator runs in a session of its own
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            proc.kill()
            proc.wait(timeout=30)
            pytest.fail(f"{cmd} did not finish within {cap} s:\n{out.read_text()[-4000:]}")
    text = out.read_text(errors="replace")
    assert rc == 0, f"{cmd} exited {rc}:\n{text[-4000:]}"
    return text


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def wait_until(cond, timeout: float, step: float = 0.005):
    """Polls `cond` until it returns a truthy value or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() >= deadline:
            return v
        time.sleep(step)


def rmtree(p: Path) -> None:
    shutil.rmtree(p, ignore_errors=True)
