"""Sharded training (FSDP2) from one mapping: a site's memory, three ways (and two more).

Each run is ``examples/flare/fsdp`` under the real ``nvflare simulator``: one client whose
``R`` ranks train a float32 ``TinyGPT`` of ``--size`` with FSDP2 (gloo on the CPU, every
block and the root under ``fully_shard``, ``--steps`` SGD steps a round) and rank 0 sends
the gathered full state dict; only ``--load`` (the script's) changes how the ranks get
their shards:

- ``shards`` (a): rankexec's ``all_ranks_receive``: every rank receives the model as
  copy-on-write views of the one memory file and copies its own chunks out of it;
- ``own`` (b): every rank holds a full copy of its own first (what a rank that loads the
  model itself, as under torchrun with a plain script, holds), then takes its shards from
  it;
- ``broadcast`` (c): rank 0 alone receives (FLARE's semantics, no ``all_ranks_receive``)
  and sends the model to the others with ``dist.broadcast_object_list``;
- ``view``: as ``shards`` with the chunks used in place (copied page by page when the
  optimizer writes them); ``dsd``: torch's ``set_model_state_dict(full_state_dict=True)``
  fed with the views (rank 0 scatters).

What is measured, per run:

- **site peak**: every ``--interval`` s the anonymous PSS (``Pss_Anon`` of
  ``/proc/PID/smaps_rollup``) of the client side (FLARE's client job process and every
  rank) plus the memory files (memfd, ``/dev/shm``) they hold or map, each file once,
  whole: PSS, so shared pages count once; anonymous, so that the shared libraries' pages
  (whose PSS moves with every other torch process on the machine) are left out (the
  processes are found and classified as ``benchmarks/flare/large_model_bench.py`` does).
  Its baseline is the same
  figure for the same job with a model of ``--base-size`` (2 MiB: the processes, torch,
  gloo, FLARE, no model to speak of), run first; ``above`` is the peak minus that baseline,
  in model sizes;
- **load**: the bytes every rank's malloc handed out over taking its shards and still
  held once every rank had them (``mallinfo2``, printed by the script), summed over the
  ranks, in the last round (round 0 also pays the first use of torch's machinery); pages
  of the received file a rank only maps are not in it, and the file is counted by the
  site peak;
- the slowest rank's load time in the last round, and the whole job's time.

Usage (from the repository root, in the venv with nvflare 2.9, torch and rankexec)::

    python benchmarks/python/fsdp_memory_bench.py --size 512MiB --ranks 2,4 \\
        --ways shards,own,broadcast --out benchmarks/python/results-fsdp.jsonl

Prints a JSON line per run and a table; ``--out`` appends the lines to a file. A watchdog
stops a run (its own processes, by pid) when ``MemAvailable`` falls under ``--min-avail``
GiB and the record says so.

``RANKEXEC_DRY_RUN=1``: the arguments are parsed and checked as for a run (``--ways``
from the five above, ``--ranks`` numbers, the example's ``job.py`` there, ``--out``'s
folder there), one ``dry run: ...`` line per simulation it would run (each rank count's
baseline, then each way) is printed, and it exits 0 without running anything
(python/tests/test_docs.py runs docs/sharded-training.md's commands so).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "flare" / "fsdp"
sys.path.insert(0, str(REPO / "benchmarks" / "flare"))
sys.path.insert(0, str(EXAMPLE))

import large_model_bench as lmb  # its sampler, watchdog and /proc readers
from tiny_gpt import config_for, num_params, parse_size

GIB = 1 << 30
MIB = 1 << 20
WAYS = ("shards", "own", "broadcast", "view", "dsd")
LOADED = re.compile(
    r"rank (\d+): round (\d+): its shards of a [\d.]+ MiB model \((\w+)\) in ([\d.]+) s, "
    r"\+(-?[\d.]+) MiB allocated"
)


def export_job(size: int, ranks: int, way: str, args: argparse.Namespace, out: Path) -> Path:
    argv = [sys.executable, "job.py", "--size", str(size), "--clients", "1"]
    argv += ["--ranks", str(ranks), "--rounds", str(args.rounds), "--steps", str(args.steps)]
    argv += ["--load", way, "--cpu", "--export", "--export-dir", str(out)]
    if args.mmap_threshold is not None:
        argv += ["--mmap-threshold", str(args.mmap_threshold)]
    subprocess.run(argv, cwd=EXAMPLE, check=True, capture_output=True, timeout=300)
    return out / "fsdp"


class Sampler(threading.Thread):
    """Every `interval` s: the anonymous PSS (``Pss_Anon``) of each client-side process
    below `root` (FLARE's client job process and the ranks) and the memory files they
    hold or map, each once, whole. Anonymous only: the pages of shared libraries (torch's
    are 0.5 GiB) are left out, whose PSS moves with every other process on the machine
    that maps them."""

    def __init__(self, root: int, interval: float) -> None:
        super().__init__(daemon=True)
        self.root, self.interval = root, interval
        self.samples: list[dict] = []
        self.kinds: dict[int, str] = {}
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            own = dict.fromkeys(lmb.CLIENT_KINDS, 0)
            files: dict[tuple[int, int], int] = {}
            for pid in lmb.descendants(self.root):
                kind = self.kinds.get(pid) or lmb.classify(pid, self.root)
                if kind not in lmb.CLIENT_KINDS:
                    continue
                self.kinds[pid] = kind
                r = lmb._rollup(pid)
                if r is not None:
                    own[kind] += r.get("Pss_Anon", 0)
                    files.update(lmb.memory_files(pid))
            avail = lmb.meminfo().get("MemAvailable", 0)
            sample = {"t": time.time(), "own": own, "files": sum(files.values()), "avail": avail}
            self.samples.append(sample)
            self.stopped.wait(self.interval)


def client_side(sample: dict) -> int:
    return sum(sample["own"].values()) + sample["files"]


def run_one(size: int, ranks: int, way: str, args: argparse.Namespace, root: Path) -> dict:
    """One simulation under the sampler; returns its record."""
    name = f"{way}-{ranks}-{size}"
    job = export_job(size, ranks, way, args, root / f"job-{name}")
    ws = root / f"ws-{name}"
    subprocess.run(
        [sys.executable, "-m", "rankexec.flare", "allow-list", str(ws)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    load0, t0 = os.getloadavg(), time.monotonic()
    with open(root / f"sim-{name}.out", "w") as log:
        argv = [str(Path(sys.executable).parent / "nvflare"), "simulator", str(job)]
        proc = subprocess.Popen(
            [*argv, "-w", str(ws), "-n", "1", "-t", "1"],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
        min_avail = int(args.min_avail * GIB)
        sampler = Sampler(proc.pid, args.interval)
        sampler.start()
        guard = lmb.Guard(proc.pid, min_avail, sampler.stopped)
        guard.start()
        try:
            rc = proc.wait(timeout=args.cap)
        except subprocess.TimeoutExpired:
            rc = -1
        finally:
            sampler.stopped.set()
            sampler.join(timeout=30)
            guard.join(timeout=30)
            lmb.kill_tree(proc.pid)
            proc.wait()
    wall = time.monotonic() - t0
    samples = sampler.samples
    peak = max(samples, key=client_side) if samples else None
    loads: dict[int, list[tuple[int, float, float]]] = {}
    for f in sorted((ws / "site-1" / "simulate_job" / "rankexec").glob("rank-*/stdout.log")):
        for rank, rnd, _, took, grew in LOADED.findall(f.read_text(errors="replace")):
            loads.setdefault(int(rnd), []).append((int(rank), float(took), float(grew) * MIB))
    errors = {
        str(p.relative_to(ws)): p.read_text(errors="replace")[-2000:]
        for p in ws.rglob("error_log.txt")
        if p.read_text(errors="replace").strip()
    }
    last = max(loads) if loads else None
    model_bytes = 4 * num_params(config_for(size))
    record = {
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "label": args.label,
        "way": way,
        "ranks": ranks,
        "model_bytes": model_bytes,
        "rounds": args.rounds,
        "steps": args.steps,
        "mmap_threshold": args.mmap_threshold,
        "rc": rc,
        "oom_guard": guard.tripped,
        "errors": errors,
        "wall_s": round(wall, 1),
        "samples": len(samples),
        "site_peak_bytes": client_side(peak) if peak else None,
        "site_peak_parts_bytes": ({**peak["own"], "memory_files": peak["files"]} if peak else None),
        "load_ranks": {str(r): [[k, t, g] for k, t, g in v] for r, v in sorted(loads.items())},
        "load_allocated_bytes_last_round": (
            round(sum(g for _, _, g in loads[last])) if last is not None else None
        ),
        "load_allocated_bytes_round0": round(sum(g for _, _, g in loads.get(0, []))) or None,
        "load_s_last_round": max(t for _, t, _ in loads[last]) if last is not None else None,
        "loadavg_start_end": [round(load0[0], 2), round(os.getloadavg()[0], 2)],
        "mem_available_min_bytes": min(s["avail"] for s in samples) if samples else None,
    }
    if args.samples:
        args.samples.mkdir(parents=True, exist_ok=True)
        (args.samples / f"samples-{name}.json").write_text(json.dumps(samples))
    if not args.keep:
        shutil.rmtree(ws, ignore_errors=True)
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=parse_size("512MiB"))
    p.add_argument("--base-size", type=parse_size, default=parse_size("2MiB"))
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--ways", default="shards,own,broadcast")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--interval", type=float, default=0.2)
    p.add_argument("--min-avail", type=float, default=2.0, help="GiB")
    p.add_argument("--cap", type=float, default=900.0, help="seconds per run")
    p.add_argument(
        "--mmap-threshold",
        type=int,
        help="the ranks' MALLOC_MMAP_THRESHOLD_ (job.py's --mmap-threshold; 0: glibc's default)",
    )
    p.add_argument("--label", default="")
    p.add_argument("--out", type=Path)
    p.add_argument("--keep", action="store_true", help="keep the workspaces (under /tmp)")
    p.add_argument("--samples", type=Path, help="a folder: every run's samples, as JSON")
    args = p.parse_args()
    ways = args.ways.split(",")
    bad = sorted(set(ways) - set(WAYS))
    if bad:
        raise SystemExit(f"unknown ways {bad}: choose from {WAYS}")
    try:
        rank_counts = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        raise SystemExit(f"--ranks {args.ranks}: numbers, as 2,4") from None
    if os.environ.get("RANKEXEC_DRY_RUN") == "1":
        if not (EXAMPLE / "job.py").is_file():
            raise SystemExit(f"{EXAMPLE / 'job.py'} is missing")
        if args.out and not args.out.resolve().parent.is_dir():
            raise SystemExit(f"--out {args.out}: no such folder")
        extra = "" if args.mmap_threshold is None else f", mmap threshold {args.mmap_threshold}"
        for ranks in rank_counts:
            for size, way in [(args.base_size, "shards (baseline)")] + [
                (args.size, w) for w in ways
            ]:
                print(
                    f"dry run: {ranks} ranks, {way}, a {size} B model, {args.rounds} rounds of "
                    f"{args.steps} steps{extra}" + (f", appended to {args.out}" if args.out else "")
                )
        return

    root = Path(tempfile.mkdtemp(prefix="fsdp-bench-"))
    rows = []
    for ranks in rank_counts:
        base = run_one(args.base_size, ranks, "shards", args, root)
        base["role"] = "baseline"
        print(json.dumps(base), flush=True)
        rows.append(base)
        for way in ways:
            rec = run_one(args.size, ranks, way, args, root)
            rec["role"] = "run"
            rec["baseline_bytes"] = base["site_peak_bytes"]
            if rec["site_peak_bytes"] and base["site_peak_bytes"]:
                above = rec["site_peak_bytes"] - base["site_peak_bytes"]
                rec["site_above_baseline_models"] = round(above / rec["model_bytes"], 2)
            if rec["load_allocated_bytes_last_round"] is not None:
                rec["load_allocated_models"] = round(
                    rec["load_allocated_bytes_last_round"] / rec["model_bytes"], 2
                )
            print(json.dumps(rec), flush=True)
            rows.append(rec)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)

    print()
    print(
        "| ranks | way | outcome | site peak | baseline | above (models) | load: allocated, "
        "all ranks (models) | slowest load | whole job |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["role"] != "run":
            continue
        outcome = "completed" if r["rc"] == 0 and not r["errors"] else f"rc {r['rc']}"
        if r["oom_guard"]:
            outcome = "stopped by the memory watchdog"

        def gib(b):
            return "-" if b is None else f"{b / GIB:.2f} GiB"

        alloc = r.get("load_allocated_bytes_last_round")
        print(
            f"| {r['ranks']} | {r['way']} | {outcome} | {gib(r['site_peak_bytes'])} | "
            f"{gib(r['baseline_bytes'])} | {r.get('site_above_baseline_models', '-')} | "
            f"{gib(alloc)} ({r.get('load_allocated_models', '-')}) | "
            f"{r['load_s_last_round']} s | {r['wall_s']} s |"
        )


if __name__ == "__main__":
    main()
