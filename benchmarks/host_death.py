"""How long a SIGKILLed host's ranks and launcher outlive it, per launcher, on an idle
and on a saturated machine (BENCHMARKS.md, "Host SIGKILL to ranks gone").

For each launcher found (built-in always; torchrun and mpirun when on PATH; srun when
`--slurm-conf` names a running cluster's slurm.conf, e.g. one that
`scripts/slurm-cluster.sh start DIR` started), and each load (idle; `2 x cores + 1`
busy shell loops started after the group is ready and reaped after each trial), it
starts `rankexec run` with two `Sleep` ranks, waits until both are inside their task,
SIGKILLs the host, and polls `/proc` every millisecond until the ranks (processes
running the worker binary) and then the rest (the launcher) are gone (zombies count
as gone). Prints one JSON record per trial and a median table.

    python3 benchmarks/host_death.py --rankexec target/release/rankexec \\
        --worker target/release/rankexec-worker --trials 5 [--slurm-conf PATH]

Caveats: stdlib only, Linux only (`/proc`); as root mpirun gets
`--allow-run-as-root`. A trial whose processes outlive 30 s is recorded as such and
its survivors are SIGKILLed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIVE_UP = 30.0


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def exe(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return ""


def count_in_files(root: Path, needle: str) -> int:
    n = 0
    for p in root.rglob("*"):
        if p.is_file():
            try:
                n += p.read_text(errors="replace").count(needle)
            except OSError:
                pass
    return n


def hogs_start() -> list[subprocess.Popen[bytes]]:
    n = 2 * (os.cpu_count() or 1) + 1
    return [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(n)]


def trial(
    rankexec: str, cfg: dict[str, object], busy: bool, workdir: Path
) -> dict[str, object]:
    logs = Path(tempfile.mkdtemp(dir=workdir))
    cfg = dict(cfg, log_dir=str(logs))
    cfg_path = logs / "cfg.json"
    cfg_path.write_text(json.dumps(cfg))
    host = subprocess.Popen(
        [rankexec, "run", "--task", "t", "--print-pids", "--config", str(cfg_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=dict(os.environ, RANKEXEC_LOG="info"),
    )
    assert host.stdout is not None
    pids: list[int] = []
    for line in host.stdout:
        if line.startswith("pids: "):
            pids = [int(p) for p in line.split()[1:]]
            break
    if not pids:
        host.kill()
        host.wait()
        raise SystemExit(f"the host never printed its pids ({cfg['launcher']})")
    worker = os.path.realpath(str(cfg["worker"]["program"]))  # type: ignore[index]
    ranks = [p for p in pids if exe(p) == worker]
    others = [p for p in pids if p not in ranks]
    deadline = time.monotonic() + 60
    while count_in_files(logs, "sleeping") < len(ranks):
        if time.monotonic() > deadline:
            raise SystemExit("the ranks never started their task")
        time.sleep(0.01)
    hogs = hogs_start() if busy else []
    if hogs:
        time.sleep(0.5)  # let the busy loops take the CPUs
    t0 = time.monotonic()
    os.kill(host.pid, signal.SIGKILL)
    host.wait()
    gone: dict[int, float] = {}
    while len(gone) < len(pids) and time.monotonic() - t0 < GIVE_UP:
        for p in pids:
            if p not in gone and not alive(p):
                gone[p] = time.monotonic() - t0
        time.sleep(0.001)
    for h in hogs:
        h.kill()
        h.wait()
    for p in pids:
        if p not in gone and alive(p):
            os.kill(p, signal.SIGKILL)
    shutil.rmtree(logs, ignore_errors=True)
    ranks_s = max((gone.get(p, float("inf")) for p in ranks), default=0.0)
    launcher_s = max((gone.get(p, float("inf")) for p in others), default=ranks_s)
    return {"ranks_gone_s": ranks_s, "launcher_gone_s": launcher_s, "busy": len(hogs)}


def launchers(args: argparse.Namespace) -> list[tuple[str, object, dict[str, str]]]:
    out: list[tuple[str, object, dict[str, str]]] = [("builtin", "builtin", {})]
    if shutil.which("torchrun"):
        out.append(("torchrun", {"torchrun": {}}, {}))
    if shutil.which("mpirun"):
        extra = ["--oversubscribe"] + (
            ["--allow-run-as-root"] if os.geteuid() == 0 else []
        )
        out.append(("mpirun", {"mpirun": {"extra_args": extra}}, {}))
    if args.slurm_conf:
        out.append(
            (
                "srun",
                {"srun": {"extra_args": ["--overlap"]}},
                {"SLURM_CONF": args.slurm_conf},
            )
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rankexec", default="target/release/rankexec")
    ap.add_argument("--worker", default="target/release/rankexec-worker")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--slurm-conf", default=None)
    ap.add_argument("--json", default=None, help="append the records to this file")
    args = ap.parse_args()
    rankexec, worker = os.path.abspath(args.rankexec), os.path.abspath(args.worker)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, launcher, env in launchers(args):
            for busy in (False, True):
                for i in range(args.trials):
                    cfg = {
                        "executor_id": "e",
                        "num_of_processes": 2,
                        "components": [
                            {"id": "e", "path": "Sleep", "args": {"secs": 120}}
                        ],
                        "worker": {"program": worker},
                        "launcher": launcher,
                        "env": {"set": env},
                    }
                    rec = trial(rankexec, cfg, busy, Path(tmp))
                    rec.update(launcher=name, trial=i)
                    print(json.dumps(rec), flush=True)
                    rows.append(rec)
                    if args.json:
                        with open(args.json, "a") as f:
                            f.write(json.dumps(rec) + "\n")
    print(
        f"\n{os.cpu_count()} cores; medians of {args.trials} trials (max in brackets)"
    )
    print("| launcher | load | ranks gone | launcher gone |")
    print("|---|---|---|---|")
    for name, _, _ in launchers(args):
        for busy in (False, True):
            rs = [r for r in rows if r["launcher"] == name and bool(r["busy"]) == busy]
            ranks = [float(r["ranks_gone_s"]) * 1e3 for r in rs]
            launch = [float(r["launcher_gone_s"]) * 1e3 for r in rs]
            load = f"{rs[0]['busy']} busy loops" if busy and rs else "idle"
            launcher_text = (
                "(none)"
                if name == "builtin"
                else (f"{statistics.median(launch):.0f} ms ({max(launch):.0f})")
            )
            print(
                f"| {name} | {load} | {statistics.median(ranks):.1f} ms ({max(ranks):.1f}) "
                f"| {launcher_text} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
