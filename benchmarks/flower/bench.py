"""The same Flower training three ways, under one real Deployment Engine, in one run.

    python benchmarks/flower/bench.py [--rounds 5] [--out benchmarks/flower/results.json]

Variants (examples/flower/ddp-digits: FedAvg, 2 SuperNodes, digits MLP, 5 local epochs):

- ``rankexec``: the example, ``rankexec.flower.ClientApp(num_of_processes=2)``: the
  handlers run on a 2-rank gloo DDP group that lives for the whole run;
- ``torchrun``: a plain Flower ClientApp that starts ``torchrun --nproc-per-node 2``
  from its handler for every message (client_torchrun.py, ddp_worker.py);
- ``single``: a plain Flower ClientApp training in its own process (client_single.py).

Per variant, from the ServerApp's result file: time from a message's creation on the
ServerApp to the handler's first line (first round; later rounds), the first round,
the per-round overhead (a round's wall time minus its slowest node's training loop,
rounds 2..N), the same overhead beyond the single-process ClientApp's, and the whole
run (FedAvg's start to its end). Flower's own per-message costs (the SuperNode's 3 s
poll, one ``flwr-clientapp`` process per message) are in every variant.
"""

from __future__ import annotations

import argparse
import json
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
    "rankexec": None,
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


def summarize(res: dict) -> dict:
    ends = res["round_end"]
    starts = [res["started"], *ends[:-1]]
    round_s = [e - s for s, e in zip(starts, ends, strict=True)]
    compute = [max(r["compute_s"] for r in reps) for reps in res["replies"]]
    arrival = [
        statistics.mean(r["t_first"] - r["created_at"] for r in reps)
        for reps in res["replies"]
    ]
    later = range(1, len(round_s))
    return {
        "accuracy": res["accuracy"],
        "arrival_to_first_line_round1_s": arrival[0],
        "arrival_to_first_line_later_s": statistics.mean(arrival[i] for i in later),
        "first_round_s": round_s[0],
        "round_s_later": statistics.mean(round_s[i] for i in later),
        "overhead_per_round_s": statistics.mean(round_s[i] - compute[i] for i in later),
        "training_loop_s_later": statistics.mean(compute[i] for i in later),
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
        env={"RANKEXEC_FLOWER_DIR": str(root / "rx"), "RANKEXEC_LOG": "warn"},
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
            s = summarize(json.loads(result.read_text()))
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
    single = v["single"]["overhead_per_round_s"]
    for name in v:
        v[name]["overhead_beyond_single_s"] = v[name]["overhead_per_round_s"] - single
    rx, tr = v["rankexec"], v["torchrun"]
    out["ratio_overhead_torchrun_over_rankexec"] = (
        tr["overhead_per_round_s"] / rx["overhead_per_round_s"]
    )
    beyond = max(rx["overhead_beyond_single_s"], 1e-3)
    out["ratio_beyond_single_torchrun_over_rankexec"] = (
        tr["overhead_beyond_single_s"] / beyond
    )
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    print("| | rankexec | torchrun per message | single process |")
    print("|---|---|---|---|")
    rows = [
        (
            "message created -> handler's first line, round 1",
            "arrival_to_first_line_round1_s",
        ),
        (
            "message created -> handler's first line, rounds 2..N",
            "arrival_to_first_line_later_s",
        ),
        ("first round", "first_round_s"),
        ("a later round", "round_s_later"),
        ("per-round overhead (round - training loop)", "overhead_per_round_s"),
        (
            "per-round overhead beyond the single-process ClientApp",
            "overhead_beyond_single_s",
        ),
        ("whole run (FedAvg start to end)", "run_s"),
        ("held-out accuracy", "accuracy"),
    ]
    for label, key in rows:
        cells = [
            f"{v[n][key]:.3f}" if key == "accuracy" else f"{v[n][key]:.2f} s"
            for n in VARIANTS
        ]
        print(f"| {label} | " + " | ".join(cells) + " |")
    print(
        f"ratios (torchrun / rankexec): overhead {out['ratio_overhead_torchrun_over_rankexec']:.1f}x,"
        f" beyond single {out['ratio_beyond_single_torchrun_over_rankexec']:.1f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
