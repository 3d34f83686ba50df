"""Chaos: random rank kills across a FLARE job, with and without ``retry_task``.

The Client API example job (examples/flare/client-api/jobs/rankexec: FedAvg, 2
clients x 2 ranks, the unchanged gloo DDP script) runs under the real ``nvflare
simulator`` for ``--rounds`` rounds, once per setting (``restart: {"retry_task": N}``
on both clients, and without it). A seeded schedule picks the rounds with a kill (each
round after the first with probability ``--p``), and for each a site and a rank (0 or
1); the same schedule serves both runs. A kill is made in the middle of that site's
train task: once the site's log shows the round's task assignment and the victim's CPU
time grows (it is training; waiting in gloo between tasks costs none), or after
``--mid-wait`` seconds without that (then it may land between tasks).

Per run, a JSON record: the setting, the simulator's exit code, the rounds the server
completed (``Round N started`` lines before any ``Aborting current RUN``, the last one
counted only if FedAvg finished),
the kills made (round, site, rank, pid, whether the victim was seen training), the
retries the clients logged (``succeeded after``), the final global model's accuracy on
the script's held-out split (when the run saved one) and the wall time.

Usage (repository root, the venv): ``python benchmarks/flare/chaos_retry.py --rounds 20
--p 0.25 --seed 8 [--out benchmarks/flare/results-chaos.jsonl]``; a fixed plan:
``--rounds 8 --kill 2:site-1:1`` (rank 1 of site-1 in the third round); an undisturbed
run: ``--p 0 --only retry``. Every process a run
starts is killed with its simulator. Caveats: Linux only (``/proc``); the victims are
found by their environment (``RANKEXEC_LOG_DIR`` under the run's workspace, ``RANK``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "flare" / "client-api" / "jobs" / "rankexec"
NVFLARE = Path(sys.executable).parent / "nvflare"
SITES = ("site-1", "site-2")


def schedule(rounds: int, p: float, seed: int) -> list[tuple[int, str, int]]:
    """(round, site, rank) of each kill, in round order."""
    rng = random.Random(seed)
    out = []
    for r in range(1, rounds):
        if rng.random() < p:
            out.append((r, rng.choice(SITES), rng.choice((0, 1))))
    return out


def make_job(root: Path, rounds: int, epochs: int, retry: int) -> Path:
    job = root / "job"
    shutil.copytree(EXAMPLE, job)
    f = job / "app_server" / "config" / "config_fed_server.json"
    cfg = json.loads(f.read_text())
    cfg["workflows"][0]["args"]["num_rounds"] = rounds
    f.write_text(json.dumps(cfg, indent=2))
    for app in ("app_site-1", "app_site-2"):
        f = job / app / "config" / "config_fed_client.json"
        cfg = json.loads(f.read_text())
        args = cfg["executors"][0]["executor"]["args"]
        args["script_args"] = f"--epochs {epochs}"
        if retry:
            args["restart"] = {"retry_task": retry}
        f.write_text(json.dumps(cfg, indent=2))
    return job


def cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def site_rank(ws: Path, site: str, rank: int) -> list[int]:
    """Live processes whose environment names `site`'s rank log directory under `ws`
    and `RANK=rank`."""
    needle = f"{ws}/{site}/".encode()
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "Z" or f"RANK={rank}".encode() not in env:
            continue
        if any(v.startswith(b"RANKEXEC_LOG_DIR=") and needle in v for v in env):
            found.append(int(d.name))
    return found


def wait_until(cond, timeout: float, step: float = 0.005):
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v or time.monotonic() >= deadline:
            return v
        time.sleep(step)


def assigned(ws: Path, site: str) -> int:
    try:
        text = (ws / site / "log.txt").read_text(errors="replace")
    except OSError:
        return 0
    return text.count("got task assignment: name=train")


class Chaos(threading.Thread):
    """Makes the scheduled kills while the simulator runs (`stop` ends it early)."""

    def __init__(
        self, ws: Path, plan: list[tuple[int, str, int]], mid_wait: float, sim: subprocess.Popen
    ) -> None:
        super().__init__(daemon=True)
        self.ws, self.plan, self.mid_wait, self.sim = ws, plan, mid_wait, sim
        self.kills: list[dict] = []

    def alive(self) -> bool:
        return self.sim.poll() is None

    def run(self) -> None:
        for rnd, site, rank in self.plan:
            if not wait_until(
                lambda s=site, r=rnd: assigned(self.ws, s) > r or not self.alive(), 900
            ):
                return
            if not self.alive():
                return
            pids = wait_until(lambda s=site, k=rank: site_rank(self.ws, s, k), 120, step=0.01)
            if not pids:
                continue
            base = cpu_ticks(pids[0])
            training = bool(
                wait_until(
                    lambda p=pids[0], b=base: cpu_ticks(p) >= b + 3, self.mid_wait, step=0.002
                )
            )
            try:
                os.kill(pids[0], signal.SIGKILL)
            except ProcessLookupError:
                continue
            self.kills.append(
                {"round": rnd, "site": site, "rank": rank, "pid": pids[0], "training": training}
            )


def descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, frontier = [], [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out.extend(kids)
        frontier.extend(kids)
    return out


def rounds_completed(ws: Path) -> int:
    """Rounds the server finished: FedAvg starts the next round after an aborted one
    (and then stops), so only rounds started before the run was aborted count, the
    last of them only if FedAvg finished."""
    text = (ws / "server" / "log.txt").read_text(errors="replace")
    aborted = "Aborting current RUN" in text
    text = text.split("Aborting current RUN")[0]
    started = len(set(re.findall(r"Round (\d+) started\.", text)))
    return started if "Finished FedAvg." in text and not aborted else max(started - 1, 0)


def accuracy(ws: Path) -> float | None:
    import numpy as np
    import torch
    from sklearn.datasets import load_digits

    f = ws / "server" / "simulate_job" / "app_server" / "FL_global_model.pt"
    if not f.exists():
        return None
    saved = torch.load(f, weights_only=False)
    state = saved.get("model", saved)
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    test = np.random.default_rng(2026).permutation(len(x))[: len(x) // 5]
    w = {k: torch.as_tensor(np.asarray(v)) for k, v in state.items()}
    with torch.no_grad():
        h = torch.relu(torch.from_numpy(x[test]) @ w["fc1.weight"].T + w["fc1.bias"])
        logits = h @ w["fc2.weight"].T + w["fc2.bias"]
    return float((logits.argmax(1).numpy() == y[test]).mean())


def run(args: argparse.Namespace, retry: int, plan: list[tuple[int, str, int]]) -> dict:
    root = Path(tempfile.mkdtemp(prefix=f"chaos-retry{retry}-"))
    ws = root / "ws"
    subprocess.run(
        [sys.executable, "-m", "rankexec.flare", "allow-list", str(ws)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    job = make_job(root, args.rounds, args.epochs, retry)
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    t0 = time.monotonic()
    with open(root / "sim.out", "w") as log:
        sim = subprocess.Popen(
            [str(NVFLARE), "simulator", str(job), "-w", str(ws), "-n", "2", "-t", "2"],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
        chaos = Chaos(ws, plan, args.mid_wait, sim)
        chaos.start()
        try:
            rc = sim.wait(timeout=args.cap)
        except subprocess.TimeoutExpired:
            for pid in descendants(sim.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            sim.kill()
            rc = sim.wait(timeout=30)
        chaos.join(timeout=10)
    wall = time.monotonic() - t0
    retried = []
    for site in SITES:
        try:
            text = (ws / site / "log.txt").read_text(errors="replace")
        except OSError:
            continue
        retried += [
            f"{site}: " + line.split(" - ")[-1]
            for line in text.splitlines()
            if "succeeded after" in line
        ]
    record = {
        "retry_task": retry,
        "rounds": args.rounds,
        "rc": rc,
        "rounds_completed": rounds_completed(ws),
        "kills": chaos.kills,
        "retries_logged": retried,
        "accuracy": accuracy(ws) if rc == 0 else None,
        "wall_s": round(wall, 1),
        "seed": args.seed,
        "p": args.p,
        "workspace": str(ws),
    }
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--p", type=float, default=0.25, help="kill probability per round")
    ap.add_argument("--seed", type=int, default=8)
    ap.add_argument("--retry", type=int, default=2, help="retry_task of the run with retries")
    ap.add_argument("--epochs", type=int, default=10, help="the script's epochs per round")
    ap.add_argument("--mid-wait", type=float, default=30.0)
    ap.add_argument("--cap", type=float, default=1800.0, help="seconds per simulator run")
    ap.add_argument(
        "--kill",
        action="append",
        default=None,
        metavar="ROUND:SITE:RANK",
        help="a kill of the plan instead of the random schedule (repeatable; "
        "ROUND is 0-based); --p 0 and no --kill: an undisturbed run",
    )
    ap.add_argument("--only", choices=("retry", "off"), default=None)
    ap.add_argument("--keep", action="store_true", help="keep the workspaces")
    ap.add_argument("--out", type=Path, default=None, help="append JSON lines here")
    args = ap.parse_args()
    if args.kill:
        plan = [(int(r), site, int(k)) for r, site, k in (x.split(":") for x in args.kill)]
    else:
        plan = schedule(args.rounds, args.p, args.seed)
    print(f"kill plan (round, site, rank): {plan}", flush=True)
    settings = {"retry": [args.retry], "off": [0], None: [args.retry, 0]}[args.only]
    for retry in settings:
        rec = run(args, retry, plan)
        line = json.dumps(rec)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
        print(
            f"retry_task={retry}: rc {rec['rc']}, {rec['rounds_completed']}/{args.rounds} rounds, "
            f"{len(rec['kills'])} kills, {len(rec['retries_logged'])} retried tasks, "
            f"accuracy {rec['accuracy']}, {rec['wall_s']} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
