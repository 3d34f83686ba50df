"""Benchmark of Python ranks: round trip, start-up, fan-out as numpy, parent memory.

    cargo build --release            # rankexec-pydriver and rankexec-worker
    (cd python && maturin develop --release)
    python benchmarks/python/bench_python_ranks.py [--quick] [--json OUT]

Every figure comes from a real rank group driven by `rankexec-pydriver` (the
executor in a host process); ranks run `python -m rankexec.worker` with the
components in `bench_components.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DRIVER = Path(os.environ.get("RANKEXEC_PYDRIVER", REPO / "target/release/rankexec-pydriver"))
RUST_WORKER = REPO / "target/release/rankexec-worker"
MIB = 1 << 20


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PATH"] = str(Path(sys.executable).parent) + os.pathsep + e.get("PATH", "")
    e.setdefault("RANKEXEC_LOG", "error")
    return e


class Host:
    def __init__(self) -> None:
        self.p = subprocess.Popen(
            [str(DRIVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env()
        )

    def send(self, **cmd) -> dict:
        assert self.p.stdin and self.p.stdout
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        r = json.loads(self.p.stdout.readline())
        if not r.get("ok"):
            raise RuntimeError(f"{cmd['op']} failed: {r}")
        return r

    def close(self) -> None:
        assert self.p.stdin
        self.p.stdin.close()
        self.p.wait(60)


def config(n: int, path: str, python: bool = True) -> dict:
    worker = (
        {"program": "python", "args": ["-m", "rankexec.worker"]}
        if python
        else {"program": str(RUST_WORKER), "args": []}
    )
    return {
        "executor_id": "b",
        "num_of_processes": n,
        "components": [{"id": "b", "path": path, "args": {}}],
        "worker": worker,
        "env": {"set": {"PYTHONPATH": str(HERE)}},
        "gpu": {"mode": "none"},
        "log_dir": "/tmp/rankexec-bench-py",
    }


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def roundtrip(n: int, count: int, python: bool) -> dict:
    h = Host()
    try:
        h.send(op="start", config=config(n, "bench_empty:Empty" if python else "Echo", python))
        h.send(op="rtt", n=50)  # warm-up
        us = h.send(op="rtt", n=count)["us"]
        h.send(op="stop")
    finally:
        h.close()
    us.sort()
    return {"median_us": med(us), "p99_us": us[int(0.99 * (len(us) - 1))], "count": len(us)}


def start_group(n: int, python: bool) -> float:
    h = Host()
    try:
        cfg = config(n, "bench_empty:Empty" if python else "Echo", python)
        ms = h.send(op="start", config=cfg)["ms"]
        h.send(op="stop")
    finally:
        h.close()
    return ms


def start_interpreters(n: int, code: str) -> float:
    """`n` interpreters started at once (as the executor starts its ranks), until all
    have exited."""
    t = time.perf_counter()
    ps = [subprocess.Popen([sys.executable, "-c", code], env=env()) for _ in range(n)]
    for p in ps:
        p.wait()
    return (time.perf_counter() - t) * 1e3


TORCHRUN_WORKER = """import os, sys, time
with open(os.path.join(sys.argv[1], "started-" + os.environ["RANK"]), "w") as f:
    f.write(repr(time.time()))
"""


def start_torchrun(n: int) -> float:
    """torchrun (torch.distributed.run, standalone) launching `n` workers whose script
    only notes the time of its first line: launch to the last worker's first line."""
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "worker.py"
        script.write_text(TORCHRUN_WORKER)
        t = time.time()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={n}",
                str(script),
                d,
            ],
            env=env(),
            check=True,
            capture_output=True,
            timeout=300,
        )
        last = max(float((Path(d) / f"started-{r}").read_text()) for r in range(n))
    return (last - t) * 1e3


def startup(n: int, reps: int) -> dict[str, dict]:
    """Spawn to ready of `n` Python ranks and of `n` Rust ranks, beside `n` bare
    interpreters running `pass` and `import rankexec` and torchrun launching `n`
    workers, interleaved rep by rep so that
    the machine's load affects them alike."""
    runs: dict[str, list[float]] = {
        "python": [],
        "rust": [],
        "pass": [],
        "import": [],
        "torchrun": [],
    }
    for _ in range(reps):
        runs["python"].append(start_group(n, True))
        runs["rust"].append(start_group(n, False))
        runs["pass"].append(start_interpreters(n, "pass"))
        runs["import"].append(start_interpreters(n, "import rankexec"))
        runs["torchrun"].append(start_torchrun(n))
    names = {
        "python": f"startup python n={n}",
        "rust": f"startup rust n={n}",
        "pass": f"interpreter x{n} `pass`",
        "import": f"interpreter x{n} `import rankexec`",
        "torchrun": f"torchrun x{n}: launch to every worker's first line",
    }
    return {
        names[k]: {"median_ms": med(v), "min_ms": min(v), "max_ms": max(v), "count": reps}
        for k, v in runs.items()
    }


def fanout(n: int, nbytes: int, reps: int) -> dict:
    h = Host()
    try:
        h.send(op="start", config=config(n, "bench_components:ReadNumpy"))
        r = h.send(op="fanout", task="read", len=nbytes, n=reps)
        h.send(op="stop")
    finally:
        h.close()
    t, c = med(r["task_ms"]), med(r["memcpy_ms"])
    return {
        "task_ms": t,
        "memcpy_ms": c,
        "memcpy_warm_ms": med(r["memcpy_warm_ms"]),
        "ratio": t / c,
        "count": len(r["task_ms"]),
    }


def parent_memory(n: int, nbytes: int) -> dict:
    h = Host()
    try:
        h.send(op="start", config=config(n, "bench_components:ReadNumpy"))
        before = h.send(op="rss")["rss_kib"]
        h.send(op="reset_peak")
        h.send(op="fanout", task="read", len=nbytes, n=1, yardstick=False)
        peak = h.send(op="rss")["peak_kib"]
        h.send(op="stop")
    finally:
        h.close()
    return {"rss_before_kib": before, "peak_kib": peak, "growth_kib": peak - before}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer samples, 256 MiB fan-out")
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--only", help="run only the figures whose name contains this")
    a = ap.parse_args()
    count = 300 if a.quick else 2000
    reps = 2 if a.quick else 5
    big = 256 * MIB if a.quick else 1024 * MIB
    out: dict[str, dict] = {}

    def want(name: str) -> bool:
        return a.only is None or a.only in name

    def show(name: str, fig: dict) -> None:
        out[name] = fig
        print(f"{name:40s} {json.dumps(fig)}", flush=True)

    if want("roundtrip"):
        show("roundtrip_empty python n=8", roundtrip(8, count, True))
        show("roundtrip_empty rust n=8", roundtrip(8, count, False))
    if want("startup"):
        for name, fig in startup(8, 2 * reps).items():
            show(name, fig)
    if want("fanout"):
        show(f"fanout python n=8 {big // MIB} MiB numpy", fanout(8, big, reps))
    if want("parent_memory"):
        for n in (1, 2, 4, 8):
            show(f"parent_memory n={n} {big // MIB} MiB", parent_memory(n, big))
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
