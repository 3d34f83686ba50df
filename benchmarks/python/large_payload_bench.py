"""The core path alone, large: a host's payload to N Python ranks and back, 1-8 GiB,
against a plain memcpy of the same size.

A ``rankexec.host.RankGroup`` (the host path ``rankexec.flare.ScriptExecutor`` is built
on) runs ``N`` ranks of ``python -m rankexec.worker`` with the ``Touch`` component of this
file. Each task carries one numpy array of ``S`` bytes (filled and touched before the
clock starts); every rank reads one word of every page of it (so every page is really
mapped, not just the file), and rank 0 sends the same bytes back (its input blob as its
output). The host then reads one word of every page of the result. Figures:

- ``there_ms``: ``execute()`` with rank 0 returning nothing (host to N ranks, each
  touching every page);
- ``round_trip_ms``: ``execute()`` with rank 0 returning the payload, plus the host
  touching every page of what came back;
- ``memcpy_fresh_ms``: ``np.copyto`` of ``S`` bytes into freshly allocated memory (what
  any design that copies the payload once pays); ``memcpy_warm_ms``: into memory already
  touched. Before each timed step ``S`` bytes are touched and freed (``warm``), as
  ``rankexec bench`` does, so that fresh memory costs what it costs on bare metal.

``consume=True``: the host's array is released once it is in shared memory, as
``ScriptExecutor`` does with FLARE's decoded copy. Sizes that do not fit the machine's
available memory (2 x ``S`` plus 2 GiB: at most two copies of the payload exist at once,
the payload and the memcpy's target or the memory file, or the payload and the ``S``
bytes ``warm`` touches) are skipped and reported as such. One
run of each figure (``--reps`` for more; the median is reported).

    python benchmarks/python/large_payload_bench.py [--sizes 1,2,4,8] [--ranks 1,2,4,8]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
PYPATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
GIB = 1 << 30
PAGE = 4096


class Touch:
    """Every rank reads one word of every page of `x`; rank 0 returns `x` when asked."""

    def execute(self, task, input, ctx, abort):
        import rankexec

        x = np.frombuffer(input.blobs["x"], dtype=np.uint8)
        total = int(x[::PAGE].sum(dtype=np.uint64))
        if ctx.rank != 0:
            return None
        if input.meta.get("echo"):
            return rankexec.Shareable(meta={"sum": total}, blobs={"y": input.blobs["x"]})
        return rankexec.Shareable(meta={"sum": total})


def available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def warm(size: int) -> None:
    """Touches and frees `size` bytes, so that the timed step that follows allocates
    recently backed pages: on this VM free pages are handed back to the host after about
    2 s (free-page reporting, see BENCHMARKS.md "Machine"), and touching them again costs
    a fault in the host. The memcpy yardstick and the group's steps get the same."""
    a = np.ones(size, dtype=np.uint8)
    del a


def memcpy(src: np.ndarray, reps: int) -> tuple[float, float]:
    fresh = []
    for _ in range(reps):
        warm(src.nbytes)
        dst = np.empty_like(src)
        t = time.perf_counter()
        np.copyto(dst, src)
        fresh.append(time.perf_counter() - t)
        del dst
    dst = np.empty_like(src)
    np.copyto(dst, src)
    warmed = []
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        warmed.append(time.perf_counter() - t)
    return statistics.median(fresh) * 1e3, statistics.median(warmed) * 1e3


def group(n: int):
    from rankexec.host import RankGroup

    return RankGroup(
        {
            "executor_id": "b",
            "num_of_processes": n,
            "components": [{"id": "b", "path": "large_payload_bench:Touch", "args": {}}],
            "worker": {"program": "python", "args": ["-m", "rankexec.worker"]},
            # The host's own PYTHONPATH after this folder: the ranks import the same
            # rankexec as the host (a before/after run points it at another build).
            "env": {"set": {"PYTHONPATH": os.pathsep.join([str(HERE), *PYPATH])}},
            "gpu": {"mode": "none"},
            "deadlines": {"task": "600s"},
        }
    )


def payload(size: int) -> np.ndarray:
    x = np.empty(size, dtype=np.uint8)
    x[::PAGE] = 1  # touched: every page exists before the clock starts
    return x


def one(g, size: int, echo: bool) -> tuple[float, int]:
    x = payload(size)
    blobs = {"x": x}
    del x
    warm(size)
    t = time.perf_counter()
    r = g.execute("t", {"echo": echo}, blobs, consume=True)
    if echo:
        y = np.frombuffer(r.blobs["y"], dtype=np.uint8)
        got = int(y[::PAGE].sum(dtype=np.uint64))
        del y
    else:
        got = r.meta["sum"]
    ms = (time.perf_counter() - t) * 1e3
    assert r.meta["sum"] == size // PAGE and got == size // PAGE, (r.meta, got)
    del r
    return ms, got


def shmem_huge() -> str:
    """The kernel's setting for huge pages in memory files (BENCHMARKS.md, "Huge pages
    for memory files")."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unknown"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,2,4,8", help="GiB")
    p.add_argument("--ranks", default="1,2,4,8")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--out", default=None)
    p.add_argument("--label", default=None)
    args = p.parse_args()
    sizes = [int(float(s) * GIB) for s in args.sizes.split(",")]
    ranks = [int(n) for n in args.ranks.split(",")]
    results = []

    def emit(r: dict) -> None:
        r.update(
            label=args.label,
            shmem_huge=shmem_huge(),
            loadavg=[round(v, 2) for v in os.getloadavg()],
        )
        print(json.dumps(r), flush=True)
        results.append(r)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(r) + "\n")

    groups = {}
    try:
        for n in ranks:
            groups[n] = group(n)
            groups[n].start()
            one(groups[n], 1 << 20, True)  # warm-up: the component's first task
        for size in sizes:
            need = 2 * size + 2 * GIB  # see the module docs
            if available() < need:
                emit(
                    {
                        "figure": "large_payload",
                        "bytes": size,
                        "skipped": f"MemAvailable {available() / GIB:.1f} GiB < {need / GIB:.1f}",
                    }
                )
                continue
            src = payload(size)
            fresh, warm = memcpy(src, args.reps)
            del src
            emit({"figure": "memcpy", "bytes": size, "fresh_ms": fresh, "warm_ms": warm})
            for n in ranks:
                there = statistics.median(one(groups[n], size, False)[0] for _ in range(args.reps))
                back = statistics.median(one(groups[n], size, True)[0] for _ in range(args.reps))
                emit(
                    {
                        "figure": "large_payload",
                        "bytes": size,
                        "ranks": n,
                        "there_ms": there,
                        "round_trip_ms": back,
                        "there_over_memcpy": there / fresh,
                        "round_trip_over_memcpy": back / fresh,
                    }
                )
    finally:
        for g in groups.values():
            g.close()
    print(
        "| payload | memcpy fresh (warm) | ranks | to the ranks | / memcpy | and back | / memcpy |"
    )
    print("|---|---|---|---|---|---|---|")
    copies = {r["bytes"]: r for r in results if r["figure"] == "memcpy"}
    for r in results:
        if r["figure"] != "large_payload":
            continue
        gib = r["bytes"] / GIB
        if "skipped" in r:
            print(f"| {gib:g} GiB | skipped: {r['skipped']} | | | | | |")
            continue
        c = copies[r["bytes"]]
        print(
            f"| {gib:g} GiB | {c['fresh_ms']:.0f} ms ({c['warm_ms']:.0f}) | {r['ranks']} | "
            f"{r['there_ms']:.0f} ms | {r['there_over_memcpy']:.2f}x | "
            f"{r['round_trip_ms']:.0f} ms | {r['round_trip_over_memcpy']:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
