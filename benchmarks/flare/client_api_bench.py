"""FLARE Client API scripts, side by side: FLARE 2.9's ``ClientAPIExecutor`` +
``torchrun_node`` against ``rankexec.flare.ScriptExecutor``, in one run.

Every scenario runs the same job (exported by FLARE's Job API, see
examples/flare/client-api/job.py) under the real ``nvflare simulator`` twice; the two
jobs differ only in the client executor. Figures come from the site logs'
timestamps:

- ``first_task_s``: from the executor's START_RUN (FLARE: ``launching external
  trainer``; rankexec: the group's start, ``ready in X ms`` before its log line) to
  the end of the first task;
- ``script_startup_s``: the part of it that is the script's own work, from probes
  printed by the example script on rank 0 (the same probes on both sides, see
  ``_probed``): its first line to ``flare.init()``, ``flare.init()`` returning to its
  first ``is_running()``, and round 0 from ``receive()`` returning to ``send()``;
  ``executor_startup_s`` is the rest (launching the interpreters, ``flare.init()``,
  delivering the first task and its result);
- ``round_overhead_s``: the executor's time per later round (``invoking task
  executor`` to ``finished processing task``) minus the script's own work in it
  (``receive()`` returning to ``send()`` being called; ``script_round_s``);
- ``wall_s``: the whole simulator run;
- ``raise_to_error_s``: a rank raising during a gloo collective in round 1 (the time
  it printed) to the client's first error log line about it;
- ``big_round_s``: one round of a 1 GiB model (16 x 64 MiB float32 tensors, echoed by
  rank 0; one client), the executor's task time.

Usage (from the repository root, in the venv with nvflare 2.9.0, torch and rankexec):
``python benchmarks/flare/client_api_bench.py [--skip-big] [--out FILE]``. Prints a
table and JSON lines. Every process a run starts is killed with its simulator.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "flare" / "client-api"
NVFLARE = Path(sys.executable).parent / "nvflare"
#: Rounds of the digits job (``--rounds``): every round after the first is a sample
#: of the per-round overhead, on each of the two sites.
ROUNDS = 10
TS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")

RAISING = """
import time
import numpy as np
import torch
import torch.distributed as dist
import nvflare.client as flare

dist.init_process_group("gloo")
rank = dist.get_rank()
flare.init(rank=str(rank))
while True:
    order = torch.zeros(2, dtype=torch.int64)
    if rank == 0 and flare.is_running():
        m = flare.receive()
        order[:] = torch.tensor([1, m.current_round])
    dist.broadcast(order, 0)
    if order[0].item() == 0:
        break
    if order[1].item() == 1:
        if rank == 1:
            print(f"RAISE_AT {time.time():.6f}", flush=True)
            raise RuntimeError("bad batch on rank 1")
        dist.all_reduce(torch.ones(4))
    if rank == 0:
        flare.send(flare.FLModel(params=m.params, meta={"NUM_STEPS_CURRENT_ROUND": 1}))
dist.destroy_process_group()
"""

ABORTED = """
import os
import time
import torch
import torch.distributed as dist
import nvflare.client as flare

dist.init_process_group("gloo")
rank = dist.get_rank()
flare.init(rank=str(rank))
slow = flare.get_site_name() == "site-1"
while True:
    order = torch.zeros(1, dtype=torch.int64)
    if rank == 0 and flare.is_running():
        m = flare.receive()
        order[0] = 1
        if slow:
            print(f"SLOW_TASK_AT {time.time():.6f}", flush=True)
            open(os.path.join(os.environ["CA_BENCH_MARKS"], "slow-has-task"), "w").close()
            while flare.is_running():  # honours the abort at its next call
                time.sleep(0.01)
            print(f"ABORT_SEEN_AT {time.time():.6f}", flush=True)
            order[0] = 0
        else:  # answers once site-1 holds its task: the workflow's end then aborts it
            mark = os.path.join(os.environ["CA_BENCH_MARKS"], "slow-has-task")
            deadline = time.monotonic() + 300
            while not os.path.exists(mark) and time.monotonic() < deadline:
                time.sleep(0.01)
            flare.send(flare.FLModel(params=m.params, meta={"NUM_STEPS_CURRENT_ROUND": 1}))
    dist.broadcast(order, 0)
    if order[0].item() == 0:
        break
dist.destroy_process_group()
"""

BIG_NET = '''
import torch
from torch import nn


class Big(nn.Module):
    """1 GiB of float32 parameters: 16 tensors of 64 MiB."""

    def __init__(self):
        super().__init__()
        self.p = nn.ParameterList([nn.Parameter(torch.zeros(16 << 20)) for _ in range(16)])
'''

ECHO = """
import time
import nvflare.client as flare

flare.init()
while flare.is_running():
    m = flare.receive()
    t0 = time.perf_counter()
    out = flare.FLModel(params=m.params, meta={"NUM_STEPS_CURRENT_ROUND": 1})
    print(f"round {m.current_round}: training took {time.perf_counter() - t0:.3f} s", flush=True)
    flare.send(out)
"""


_PROBE = """import os as _bench_os, time as _bench_time


def _bench(what):
    print(f"BENCH {what} {_bench_os.environ.get('RANK', '0')} {_bench_time.time():.6f}", flush=True)


"""


def _probed(script: str) -> str:
    """The example script with timestamps printed around its Client API calls (the
    same probes on both sides): ``BENCH <what> <rank> <time.time()>``. They split a
    round into the script's own work (receive() returning to send() being called) and
    the executor's, and the start-up into the script's own (its first line to
    ``flare.init``, and ``flare.init`` returning to the first ``is_running``) and the
    executor's (the rest)."""

    def probe(what: str, indent: str) -> str:
        return f"{indent}_bench({what!r})\n"

    out = _PROBE + probe("script_start", "") + script
    swaps = [
        (
            "    flare.init(rank=str(rank))\n",
            probe("init_begin", "    ")
            + "    flare.init(rank=str(rank))\n"
            + probe("init_end", "    "),
        ),
        (
            "        if rank == 0 and flare.is_running():\n            input_model = flare.receive()\n",
            probe("ask", "        ")
            + "        if rank == 0 and flare.is_running():\n            input_model = flare.receive()\n"
            + probe("received", "            "),
        ),
        (
            "            flare.send(\n                flare.FLModel(\n                    params=model.state_dict(),\n",
            probe("sending", "            ")
            + "            flare.send(\n                flare.FLModel(\n                    params=model.state_dict(),\n",
        ),
    ]
    for a, b in swaps:
        if a not in out:
            raise RuntimeError(f"the example script changed: no {a!r}")
        out = out.replace(a, b, 1)
    return out


def _probes(text: str) -> list[tuple[str, int, float]]:
    return [
        (m.group(1), int(m.group(2)), float(m.group(3)))
        for m in re.finditer(r"BENCH (\w+) (\d+) ([\d.]+)", text)
    ]


def _epoch(line: str) -> float | None:
    m = TS.match(line)
    if not m:
        return None
    return dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _descendants(root: int) -> list[int]:
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


def simulate(job: Path, ws: Path, clients: int = 2, cap: float = 600) -> tuple[int, float]:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    subprocess.run(
        [sys.executable, "-m", "rankexec.flare", "allow-list", str(ws)],
        check=True,
        capture_output=True,
    )
    t0 = time.monotonic()
    with open(ws.parent / f"{ws.name}.out", "w") as out:
        proc = subprocess.Popen(
            [
                str(NVFLARE),
                "simulator",
                str(job),
                "-w",
                str(ws),
                "-n",
                str(clients),
                "-t",
                str(min(2, clients)),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
        try:
            rc = proc.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            rc = -1
        finally:
            for pid in [*_descendants(proc.pid), proc.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
    if rc != 0:
        # Kept for a look afterwards (the run's temporary folder is removed).
        keep = REPO / "target" / "client-api-bench-logs" / ws.name
        keep.mkdir(parents=True, exist_ok=True)
        for log in [ws.parent / f"{ws.name}.out", *ws.glob("*/*log*.txt")]:
            dest = keep / log.relative_to(ws.parent).as_posix().replace("/", "__")
            shutil.copyfile(log, dest)
    return rc, time.monotonic() - t0


def _job(
    kind: str, root: Path, name: str, script: str | None = None, args=None, rounds=None
) -> Path:
    job = root / name
    shutil.copytree(EXAMPLE / "jobs" / kind, job)
    if rounds is not None:
        server = job / "app_server" / "config" / "config_fed_server.json"
        cfg = json.loads(server.read_text())
        cfg["workflows"][0]["args"]["num_rounds"] = rounds
        server.write_text(json.dumps(cfg, indent=2))
    for app in job.glob("app_site-*"):
        if script is not None:
            (app / "custom" / "client.py").write_text(script)
        cfg_file = app / "config" / "config_fed_client.json"
        cfg = json.loads(cfg_file.read_text())
        ex = cfg["executors"][0]["executor"]["args"]
        if args is not None:
            if kind == "torchrun":
                ex["command"] = [*ex["command"][:5], *args]
            else:
                ex["script_args"] = args
        cfg_file.write_text(json.dumps(cfg, indent=2))
    return job


def _site_lines(ws: Path, site: str) -> list[str]:
    return (ws / site / "log.txt").read_text(errors="replace").splitlines()


def _train_times(ws: Path, site: str, kind: str) -> list[float]:
    text = _rank_text(ws, site, kind)  # only rank 0 prints it
    return [float(x) for x in re.findall(r"training took ([\d.]+) s", text)]


def _tasks(lines: list[str]) -> list[tuple[float, float]]:
    spans, start = [], None
    for line in lines:
        if "invoking task executor" in line:
            start = _epoch(line)
        elif "finished processing task" in line and start is not None:
            spans.append((start, _epoch(line)))
            start = None
    return spans


def _start_run(lines: list[str], kind: str) -> float:
    for line in lines:
        if kind == "torchrun" and "launching external trainer" in line:
            return _epoch(line)
        m = re.search(r"rank group of \d+ ready in ([\d.]+) ms", line)
        if kind == "rankexec" and m:
            return _epoch(line) - float(m.group(1)) / 1e3
    raise RuntimeError("no START_RUN line")


def _rank_text(ws: Path, site: str, kind: str) -> str:
    if kind == "torchrun":
        return "\n".join(_site_lines(ws, site))
    ranks = ws / site / "simulate_job" / "rankexec"
    return "\n".join(f.read_text() for f in sorted(ranks.glob("rank-*/stdout.log")))


def digits(root: Path, kind: str) -> dict:
    script = _probed((EXAMPLE / "client.py").read_text())
    job = _job(kind, root, f"digits-{kind}", script=script, rounds=ROUNDS)
    ws = root / f"ws-digits-{kind}"
    rc, wall = simulate(job, ws)
    out = {"scenario": "digits", "executor": kind, "rc": rc, "wall_s": wall}
    firsts, own_startups, overheads, own_rounds, trains = [], [], [], [], []
    for site in ("site-1", "site-2"):
        lines = _site_lines(ws, site)
        spans, train = _tasks(lines), _train_times(ws, site, kind)
        probes = sorted(set(_probes(_rank_text(ws, site, kind))), key=lambda p: p[2])
        at = {
            w: [t for (w2, r, t) in probes if w2 == w and r == 0]
            for w in ("script_start", "init_begin", "init_end", "ask", "received", "sending")
        }
        # The script's own work in round i: receive() returned -> send() called.
        own = [s - r for r, s in zip(at["received"], at["sending"], strict=False)]
        first = spans[0][1] - _start_run(lines, kind)
        own_start = (at["init_begin"][0] - at["script_start"][0]) + (
            at["ask"][0] - at["init_end"][0]
        )
        firsts.append(first)
        own_startups.append(own_start + own[0])
        overheads += [(b - a) - o for (a, b), o in zip(spans[1:], own[1:], strict=False)]
        own_rounds += own[1:]
        trains += train
    out["first_task_s"] = sum(firsts) / len(firsts)
    out["script_startup_s"] = sum(own_startups) / len(own_startups)
    out["executor_startup_s"] = out["first_task_s"] - out["script_startup_s"]
    out["round_overhead_s"] = sum(overheads) / len(overheads)
    out["round_overhead_median_s"] = sorted(overheads)[len(overheads) // 2]
    out["round_overhead_samples"] = len(overheads)
    out["round_overheads_ms"] = [round(o * 1e3, 2) for o in overheads]
    out["script_round_s"] = sum(own_rounds) / len(own_rounds)
    out["training_s"] = sum(trains) / len(trains)
    out["tracebacks"] = sum(
        "Traceback" in line for s in ("site-1", "site-2") for line in _site_lines(ws, s)
    )
    return out


def raising(root: Path, kind: str) -> dict:
    job = _job(kind, root, f"raise-{kind}", script=RAISING, args=[] if kind == "torchrun" else "")
    ws = root / f"ws-raise-{kind}"
    rc, wall = simulate(job, ws)
    raised, seen = None, None
    for site in ("site-1", "site-2"):
        texts = [*_site_lines(ws, site)]
        ranks = ws / site / "simulate_job" / "rankexec"
        for f in ranks.glob("rank-*/stdout.log"):
            texts += f.read_text().splitlines()
        for t in texts:
            m = re.search(r"RAISE_AT ([\d.]+)", t)
            if m:
                raised = min(raised or 1e18, float(m.group(1)))
        for line in (ws / site / "error_log.txt").read_text(errors="replace").splitlines():
            e = _epoch(line)
            if e is not None and raised is not None and e >= raised - 1:
                seen = min(seen or 1e18, e)
    delay = None if raised is None or seen is None else seen - raised
    return {
        "scenario": "raise",
        "executor": kind,
        "rc": rc,
        "wall_s": wall,
        "raise_to_error_s": delay,
    }


def big(root: Path, kind: str) -> dict:
    job = _job(kind, root, f"big-{kind}", script=ECHO, args=[] if kind == "torchrun" else "")
    for app in job.iterdir():
        if (app / "custom").is_dir():
            (app / "custom" / "net.py").write_text(BIG_NET)
    cfg_file = job / "app_server" / "config" / "config_fed_server.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["workflows"][0]["args"].update({"num_rounds": 1, "num_clients": 1})
    for c in cfg["components"]:
        if c["id"] == "persistor":
            c["args"]["model"]["path"] = "net.Big"
    cfg_file.write_text(json.dumps(cfg, indent=2))
    meta = json.loads((job / "meta.json").read_text())
    meta["min_clients"] = 1
    (job / "meta.json").write_text(json.dumps(meta))
    ws = root / f"ws-big-{kind}"
    rc, wall = simulate(job, ws, clients=1)
    spans = _tasks(_site_lines(ws, "site-1"))
    return {
        "scenario": "big",
        "executor": kind,
        "rc": rc,
        "wall_s": wall,
        "big_round_s": spans[0][1] - spans[0][0] if spans else None,
    }


def aborted(root: Path, kind: str) -> dict:
    """site-1 never answers round 0; site-2 does; ScatterAndGather (min_clients 1,
    one round) ends the workflow, which aborts site-1's task."""
    job = _job(kind, root, f"abort-{kind}", script=ABORTED, args=[] if kind == "torchrun" else "")
    cfg_file = job / "app_server" / "config" / "config_fed_server.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["workflows"] = [
        {
            "id": "sag",
            "path": "nvflare.app_common.workflows.scatter_and_gather.ScatterAndGather",
            "args": {
                "min_clients": 1,
                "num_rounds": 1,
                "wait_time_after_min_received": 0,
                "aggregator_id": "aggregator",
                "persistor_id": "persistor",
                "shareable_generator_id": "shareable_generator",
                "train_task_name": "train",
                "train_timeout": 0,
            },
        }
    ]
    cfg["components"] += [
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
    cfg_file.write_text(json.dumps(cfg, indent=2))
    ws = root / f"ws-abort-{kind}"
    marks = root / f"marks-{kind}"
    marks.mkdir()
    os.environ["CA_BENCH_MARKS"] = str(marks)
    rc, wall = simulate(job, ws)
    site2_done = None
    for line in _site_lines(ws, "site-2"):
        if "finished processing task" in line:
            site2_done = _epoch(line)
    lines = _site_lines(ws, "site-1")
    started = [i for i, x in enumerate(lines) if "invoking task executor" in x]
    ended = None
    if started:
        for x in lines[started[0] + 1 :]:
            if "finished processing task" in x or "abort" in x.lower() and "task" in x.lower():
                ended = _epoch(x)
                break
    return {
        "scenario": "abort",
        "executor": kind,
        "rc": rc,
        "wall_s": wall,
        "abort_to_task_end_s": None if ended is None or site2_done is None else ended - site2_done,
        "tracebacks": sum("Traceback" in x for x in lines),
    }


def main() -> int:
    global ROUNDS
    p = argparse.ArgumentParser()
    p.add_argument("--skip-big", action="store_true")
    p.add_argument("--only", default="", help="comma-separated: digits,raise,big")
    p.add_argument("--out", default=None)
    p.add_argument("--keep", action="store_true")
    p.add_argument("--rounds", type=int, default=ROUNDS, help="rounds of the digits job")
    p.add_argument("--impl", default="torchrun,rankexec", help="which sides to run")
    args = p.parse_args()
    ROUNDS = args.rounds
    root = Path(tempfile.mkdtemp(prefix="rankexec-ca-bench-"))
    results = []
    try:
        scenarios = [digits, raising, aborted] + ([] if args.skip_big else [big])
        if args.only:
            names = {"digits": digits, "raise": raising, "big": big, "abort": aborted}
            scenarios = [names[n] for n in args.only.split(",")]
        for scenario in scenarios:
            for kind in args.impl.split(","):
                r = scenario(root, kind)
                print(json.dumps(r), flush=True)
                results.append(r)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    by = {(r["scenario"], r["executor"]): r for r in results}
    print(
        "\n| figure | FLARE ClientAPIExecutor + torchrun_node | rankexec ScriptExecutor | ratio |"
    )
    print("|---|---|---|---|")
    for scenario, key, label in (
        ("digits", "first_task_s", "time to first task (START_RUN to its result), s"),
        ("digits", "script_startup_s", "  of which the script's own (imports, set-up, round 0), s"),
        ("digits", "executor_startup_s", "  of which the executor's (launch, init, delivery), s"),
        ("digits", "round_overhead_s", "per-round overhead (task time minus the script's), s"),
        ("digits", "round_overhead_median_s", "  its median over the rounds, s"),
        ("digits", "script_round_s", "  the script's own work per round (not overhead), s"),
        ("digits", "wall_s", f"whole job ({ROUNDS} rounds, 2 clients x 2 ranks), s"),
        ("raise", "raise_to_error_s", "a rank raising: to the client's error log, s"),
        ("abort", "abort_to_task_end_s", "an abort: workflow end to the aborted task's end, s"),
        ("abort", "wall_s", "whole job with the abort, s"),
        ("big", "big_round_s", "1 GiB model, one round's task time, s"),
    ):
        a, b = (
            by.get((scenario, "torchrun"), {}).get(key),
            by.get((scenario, "rankexec"), {}).get(key),
        )
        if a is None or b is None:
            continue
        ratio = f"{a / b:.1f}x" if b > 0 else "-"
        print(f"| {label} | {a:.3f} | {b:.3f} | {ratio} |")
    if args.out:
        with open(args.out, "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
