"""The same Flower training three ways, under one real Deployment Engine, in one run.

    python benchmarks/flower/bench.py [--rounds 5] [--out benchmarks/flower/results.json]

Variants (examples/flower/ddp-digits: FedAvg, 2 SuperNodes, digits MLP, 5 local epochs):

- ``rankexec``: the example, ``rankexec.flower.ClientApp(num_of_processes=2)``: the
  handlers run on a 2-rank gloo DDP group that lives for the whole run;
- ``torchrun``: a plain Flower ClientApp that starts ``torchrun --nproc-per-node 2``
  from its handler for every message (client_torchrun.py, ddp_worker.py);
- ``single``: a plain Flower ClientApp training in its own process (client_single.py).

Per variant, from the ServerApp's result file: time from a message's creation on the
ServerApp to the handler's first line, and from Flower's call of the ClientApp to the
handler's first line (round 1; rounds 2..N); the first round; a later round; the
per-round overhead in the ClientApp (call to reply minus the training loop, rounds
2..N: what the ClientApp adds beyond training); a later round minus its training loop
(Flower's own delivery included: the SuperNode's 3 s poll and one ``flwr-clientapp``
process per message, in every variant); and the whole run (FedAvg's start to its end).

rankexec's variant serves the example's app through client_rankexec_timed.py, which
logs each message's call and reply times to the file ``BENCH_FLOWER_TIMINGS`` names
(set here; nothing in rankexec writes them); the plain variants put their handler's
call and end times in their metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
APP = REPO / "examples" / "flower" / "ddp-digits"
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO / "python"))

from rankexec.flower.deployment import Deployment

VARIANTS = {
    "rankexec": ("client_rankexec_timed", ["client_rankexec_timed.py"]),
    "torchrun": ("client_torchrun", ["client_torchrun.py", "ddp_worker.py"]),
    "single": ("client_single", ["client_single.py"]),
}


def prepare(variant: str, dest: Path) -> Path:
    shutil.copytree(APP, dest, ignore=shutil.ignore_patterns("__pycache__"))
    spec = VARIANTS[variant]
    if spec is not None:
        module, files = spec
        for f in files:
            shutil.copy(HERE / f, dest / "ddp_digits" / f)
        py = dest / "pyproject.toml"
        text = re.sub(
            r'clientapp = "ddp_digits\.client_app:app"',
            f'clientapp = "ddp_digits.{module}:app"',
            py.read_text(),
        )
        text = text.replace('name = "ddp-digits"', f'name = "ddp-digits-{variant}"')
        py.write_text(text)
    return dest


def summarize(res: dict, timings: list[dict]) -> dict:
    """The figures of one variant's run (see the module docs). ``timings``: what
    client_rankexec_timed.py logged per message (BENCH_FLOWER_TIMINGS); the
    plain variants carry their handler's call and end in their metrics instead."""
    ends = res["round_end"]
    starts = [res["started"], *ends[:-1]]
    round_s = [e - s for s, e in zip(starts, ends, strict=True)]
    compute = [max(r["compute_s"] for r in reps) for reps in res["replies"]]
    created = [
        statistics.mean(r["t_first"] - r["created_at"] for r in reps)
        for reps in res["replies"]
    ]
    # The ClientApp's own time per message beyond the training loop, and from its call
    # to the handler's first line (the rank's, torchrun's script's, or the handler's).
    own: list[list[float]] = []
    to_first: list[list[float]] = []
    for reps in res["replies"]:
        o, f = [], []
        for r in reps:
            if "t_call" in r:
                call, end = r["t_call"], r["t_end"]
            else:
                t = min(
                    (
                        t
                        for t in timings
                        if abs(t["created_at"] - r["created_at"]) < 1e-3
                        and t["call"] <= r["t_first"] <= t["reply"]
                    ),
                    key=lambda t: t["call"],
                )
                call, end = t["call"], t["reply"]
            o.append(end - call - r["compute_s"])
            f.append(r["t_first"] - call)
        own.append(o)
        to_first.append(f)
    later = range(1, len(round_s))
    flat = lambda xs: [x for i in later for x in xs[i]]
    return {
        "accuracy": res["accuracy"],
        "created_to_first_line_round1_s": created[0],
        "created_to_first_line_later_s": statistics.mean(created[i] for i in later),
        "call_to_first_line_round1_s": statistics.mean(to_first[0]),
        "call_to_first_line_later_s": statistics.mean(flat(to_first)),
        "first_round_s": round_s[0],
        "round_s_later": statistics.mean(round_s[i] for i in later),
        "round_minus_training_later_s": statistics.mean(
            round_s[i] - compute[i] for i in later
        ),
        "clientapp_overhead_round1_s": statistics.mean(own[0]),
        "clientapp_overhead_later_s": statistics.mean(flat(own)),
        "clientapp_overhead_later_median_s": statistics.median(flat(own)),
        "training_loop_later_s": statistics.mean(compute[i] for i in later),
        "run_s": res["ended"] - res["started"],
        "pids_per_round": [[r["pids"] for r in reps] for reps in res["replies"]],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=HERE / "results.json")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rankexec-flower-bench-"))
    dep = Deployment(
        root,
        ["partition-id=0 num-partitions=2", "partition-id=1 num-partitions=2"],
        env={
            "RANKEXEC_FLOWER_DIR": str(root / "rx"),
            "RANKEXEC_LOG": "warn",
            "BENCH_FLOWER_TIMINGS": str(root / "timings.jsonl"),
        },
    )
    out: dict = {"rounds": a.rounds, "variants": {}}
    try:
        dep.start()
        for variant in VARIANTS:
            app = prepare(variant, root / f"app-{variant}")
            result = root / f"result-{variant}.json"
            cfg: dict = {"result-file": str(result), "num-server-rounds": a.rounds}
            if variant != "rankexec":
                cfg["close-groups"] = "no"
            t0 = time.monotonic()
            run = dep.submit(app, cfg)
            status = dep.wait_run(run, 900)
            wall = time.monotonic() - t0
            if status != "finished:completed":
                print(dep.last_failure[-4000:])
                raise SystemExit(f"{variant}: run {run} ended {status}")
            tpath = root / "timings.jsonl"
            timings = (
                [json.loads(ln) for ln in tpath.read_text().splitlines()]
                if tpath.exists()
                else []
            )
            s = summarize(json.loads(result.read_text()), timings)
            s["flwr_run_to_finished_s"] = wall
            out["variants"][variant] = s
            print(
                variant,
                json.dumps({k: v for k, v in s.items() if k != "pids_per_round"}),
            )
    finally:
        dep.stop()
        shutil.rmtree(root, ignore_errors=True)
    v = out["variants"]
    rx, tr = v["rankexec"], v["torchrun"]
    for key in (
        "clientapp_overhead_later_s",
        "clientapp_overhead_later_median_s",
        "round_minus_training_later_s",
    ):
        out[f"ratio_{key}_torchrun_over_rankexec"] = tr[key] / rx[key]
    out["load_average_at_end"] = os.getloadavg()
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    names = list(VARIANTS)
    print("| figure | " + " | ".join(names) + " | torchrun / rankexec |")
    print("|---|" + "---|" * (len(names) + 1))
    rows = [
        (
            "message created on the ServerApp -> handler's first line, round 1",
            "created_to_first_line_round1_s",
        ),
        ("... rounds 2..N", "created_to_first_line_later_s"),
        (
            "ClientApp called -> handler's first line, round 1",
            "call_to_first_line_round1_s",
        ),
        ("... rounds 2..N", "call_to_first_line_later_s"),
        ("first round (FedAvg's start to its first aggregation)", "first_round_s"),
        ("a later round", "round_s_later"),
        (
            "per-round overhead in the ClientApp (call to reply minus training loop), rounds 2..N, mean",
            "clientapp_overhead_later_s",
        ),
        ("... its median", "clientapp_overhead_later_median_s"),
        (
            "a later round minus its training loop (Flower's delivery included)",
            "round_minus_training_later_s",
        ),
        ("the training loop itself, rounds 2..N", "training_loop_later_s"),
        ("whole run (FedAvg's start to its end)", "run_s"),
        ("held-out accuracy", "accuracy"),
    ]
    for label, key in rows:
        cells = [
            f"{v[n][key]:.3f}" if key == "accuracy" else f"{v[n][key]:.3f} s"
            for n in names
        ]
        ratio = (
            ""
            if key == "accuracy"
            else f"{tr[key] / rx[key]:.1f}x"
            if rx[key] > 0
            else ""
        )
        print(f"| {label} | " + " | ".join(cells) + f" | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
