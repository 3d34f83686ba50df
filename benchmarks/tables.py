"""Markdown tables from the raw records of one `scripts/bench-all.sh` run.

    python benchmarks/tables.py            # prints every table BENCHMARKS.md quotes

Reads `benchmarks/rankexec-bench.jsonl` (`rankexec bench --json`),
`benchmarks/python/results.json` and `benchmarks/flare/results-client-api.jsonl`;
the peer harness's tables come from its own `summarize.py` (`side-by-side.md`,
`flare/summary.md`). Ratios are computed from figures of the same run only.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
MIB = 1 << 20


def _size(b: int | None) -> str:
    if not b:
        return "–"
    return f"{b // (1 << 30)} GiB" if b >= 1 << 30 else f"{b // MIB} MiB"


def _num(v: float, unit: str) -> str:
    if unit == "ms":
        return f"{v:.2f} ms" if v < 100 else f"{v:.1f} ms"
    if unit == "us":
        return f"{v:.0f} µs"
    if unit == "events/s":
        return f"{v:,.0f} /s"
    if unit == "bytes":
        return f"{v:,.0f} B"
    return f"{v:g} {unit}"


def rankexec_bench() -> None:
    recs = [
        json.loads(x) for x in (HERE / "rankexec-bench.jsonl").read_text().splitlines()
    ]
    print("| figure | ranks | payload | median | min – max | samples | notes |")
    print("|---|---|---|---|---|---|---|")
    for r in recs:
        lo, hi = r.get("min"), r.get("max")
        spread = "–" if lo is None else f"{lo:.4g} – {hi:.4g}"
        extra = {
            k: (round(v, 3) if isinstance(v, float) else v)
            for k, v in r.items()
            if k
            not in (
                "impl",
                "name",
                "ranks",
                "payload_bytes",
                "value",
                "unit",
                "samples",
                "min",
                "max",
            )
        }
        notes = ", ".join(f"{k} {v}" for k, v in extra.items())
        print(
            f"| {r['name']} | {r.get('ranks') or '–'} | {_size(r.get('payload_bytes'))} | "
            f"{_num(r['value'], r['unit'])} | {spread} | {r.get('samples', '–')} | {notes} |"
        )


def python_ranks() -> None:
    figs = json.loads((HERE / "python" / "results.json").read_text())
    print("| figure | value |")
    print("|---|---|")
    for name, fig in figs.items():
        print(f"| {name} | {json.dumps(fig)} |")


def client_api() -> None:
    path = HERE / "flare" / "results-client-api.jsonl"
    recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    by = {(r["scenario"], r["executor"]): r for r in recs}
    print("| figure | FLARE 2.9 | rankexec | FLARE / rankexec |")
    print("|---|---|---|---|")
    for scenario, key in (
        ("digits", "first_task_s"),
        ("digits", "script_startup_s"),
        ("digits", "executor_startup_s"),
        ("digits", "round_overhead_s"),
        ("digits", "script_round_s"),
        ("digits", "training_s"),
        ("digits", "wall_s"),
        ("raise", "raise_to_error_s"),
        ("abort", "abort_to_task_end_s"),
        ("abort", "wall_s"),
        ("big", "big_round_s"),
        ("big", "wall_s"),
    ):
        a = by.get((scenario, "torchrun"), {}).get(key)
        b = by.get((scenario, "rankexec"), {}).get(key)
        if a is None or b is None:
            continue
        print(f"| {scenario} {key} | {a:.4f} s | {b:.4f} s | {a / b:.1f}x |")


if __name__ == "__main__":
    for title, fn in (
        ("rankexec bench", rankexec_bench),
        ("Python ranks", python_ranks),
        ("Client API", client_api),
    ):
        print(f"\n## {title}\n")
        try:
            fn()
        except FileNotFoundError as e:
            print(f"(no records: {e.filename})")
