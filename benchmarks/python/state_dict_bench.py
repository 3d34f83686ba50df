"""The core path with a state dict: a GPT-shaped dict of 2-byte tensors from a host to N
Python ranks and back, step by step, against one fresh memcpy of the same bytes.

A ``rankexec.host.RankGroup`` (the host path ``rankexec.flare.ScriptExecutor`` is built
on) runs ``N`` ranks of ``python -m rankexec.worker`` with the ``Read`` component of this
file. The host's model is a dict of bfloat16 torch tensors in a transformer's shapes
(``--dim`` wide, as many layers as fit ``--size``; the matrices are 1-64 MiB, the norms a
few KiB). One round:

1. ``stage``: the host's tensors into shared memory, as ``execute(consume=True)`` does
   (``--stage execute``, the default: numpy views handed to ``execute``) or as Flower's
   host did until issue 41 (``--stage releasing``: ``rankexec._staging.stage_releasing``
   first: one file, one thread) or as Flower's host and ``ScriptExecutor`` do now
   (``--stage parts``: ``rankexec._staging.stage_in_parts``);
2. ``ranks``: every rank makes a torch tensor of every blob and reads one word of every
   4 KiB page; rank 0 then sends every tensor back (the views of its input as they are);
3. ``read back``: the host reads one word of every page of every returned blob.

Each step's wall time and page faults (``getrusage`` minor faults: the host's own, and
rank 0's as it reports them) are printed, beside ``memcpy``: ``np.copyto`` of the same
number of bytes into freshly allocated memory (``fresh``) and into memory already touched
(``warm``). Before each timed step as many bytes are touched and freed (see
``large_payload_bench.py`` and BENCHMARKS.md "Method").

    python benchmarks/python/state_dict_bench.py [--size 2] [--ranks 4] [--reps 3]
        [--stage execute|releasing|parts] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from large_payload_bench import shmem_huge  # this folder: the script's own

HERE = Path(__file__).resolve().parent
PYPATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
GIB = 1 << 30
PAGE = 4096


def minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class Read:
    """Every rank reads one word of every page of every blob (as torch tensors); rank 0
    sends every tensor back and reports its time and page faults."""

    def execute(self, task, input, ctx, abort):
        import warnings

        import rankexec
        import torch

        t, f = time.perf_counter(), minflt()
        tensors = {}
        total = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about read-only buffers
            for name, blob in input.blobs.items():
                raw = torch.frombuffer(blob, dtype=torch.uint8)
                x = raw.view(torch.bfloat16)  # the tensor a script would use
                total += int(x.view(torch.int16)[:: PAGE // 2].sum())
                # Sent as its bytes: byte_view cannot export bfloat16 through numpy.
                tensors[name] = raw
        meta = {"read_ms": (time.perf_counter() - t) * 1e3, "read_faults": minflt() - f}
        if ctx.rank != 0:
            return None
        return rankexec.Shareable(meta={**meta, "total": total}, blobs=tensors)


def gpt_shapes(size: int, dim: int) -> dict[str, tuple[int, ...]]:
    """A transformer's parameter shapes, as many layers as fit `size` bytes of bf16."""
    vocab = min(32768, (64 << 20) // (2 * dim))
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (vocab, dim)}
    per_layer = 12 * dim * dim * 2
    layers = max(1, (size - vocab * dim * 2) // per_layer)
    for i in range(layers):
        p = f"h.{i}."
        shapes |= {
            p + "ln_1.weight": (dim,),
            p + "ln_1.bias": (dim,),
            p + "attn.q.weight": (dim, dim),
            p + "attn.k.weight": (dim, dim),
            p + "attn.v.weight": (dim, dim),
            p + "attn.proj.weight": (dim, dim),
            p + "ln_2.weight": (dim,),
            p + "ln_2.bias": (dim,),
            p + "mlp.fc.weight": (4 * dim, dim),
            p + "mlp.proj.weight": (dim, 4 * dim),
        }
    return shapes


def state_dict(shapes: dict[str, tuple[int, ...]]):
    import torch

    sd = {}
    for name, shape in shapes.items():
        t = torch.empty(shape, dtype=torch.bfloat16)
        t.view(torch.int16).view(-1)[:: PAGE // 2] = 1  # every page exists
        sd[name] = t
    return sd


def warm(size: int) -> None:
    a = np.ones(size, dtype=np.uint8)
    del a


def memcpy(size: int, reps: int) -> tuple[float, float]:
    src = np.ones(size, dtype=np.uint8)
    fresh = []
    for _ in range(reps):
        warm(size)
        dst = np.empty_like(src)
        t = time.perf_counter()
        np.copyto(dst, src)
        fresh.append(time.perf_counter() - t)
        del dst
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t = time.perf_counter()
    np.copyto(dst, src)
    return statistics.median(fresh) * 1e3, (time.perf_counter() - t) * 1e3


def group(n: int):
    from rankexec.host import RankGroup

    return RankGroup(
        {
            "executor_id": "b",
            "num_of_processes": n,
            "components": [{"id": "b", "path": "state_dict_bench:Read", "args": {}}],
            "worker": {"program": "python", "args": ["-m", "rankexec.worker"]},
            # The host's own PYTHONPATH after this folder: the ranks import the same
            # rankexec as the host (a before/after run points it at another build).
            "env": {"set": {"PYTHONPATH": os.pathsep.join([str(HERE), *PYPATH])}},
            "gpu": {"mode": "none"},
            "deadlines": {"task": "600s"},
        }
    )


def one(g, shapes, size: int, stage: str) -> dict:
    import torch
    from rankexec._staging import stage_in_parts, stage_releasing

    sd = state_dict(shapes)
    blobs = {k: t.view(-1).view(torch.uint8).numpy() for k, t in sd.items()}
    del sd
    want = sum(
        int(np.prod(s)) // (PAGE // 2) + (1 if int(np.prod(s)) % (PAGE // 2) else 0)
        for s in shapes.values()
    )
    warm(size)
    t0, f0 = time.perf_counter(), minflt()
    if stage == "releasing":
        stage_releasing(blobs)
    elif stage == "parts":
        stage_in_parts(blobs)
    t1, f1 = time.perf_counter(), minflt()
    r = g.execute("t", {}, blobs, consume=True)
    t2, f2 = time.perf_counter(), minflt()
    got = 0
    for name in shapes:
        y = np.frombuffer(r.blobs[name], dtype=np.int16)
        got += int(y[:: PAGE // 2].sum())
        del y
    t3, f3 = time.perf_counter(), minflt()
    assert r.meta["total"] == want and got == want, (r.meta, got, want)
    out = {
        "stage_ms": (t1 - t0) * 1e3,
        "stage_faults": f1 - f0,
        "execute_ms": (t2 - t1) * 1e3,
        "execute_faults": f2 - f1,
        "rank0_read_ms": r.meta["read_ms"],
        "rank0_read_faults": r.meta["read_faults"],
        "read_back_ms": (t3 - t2) * 1e3,
        "read_back_faults": f3 - f2,
        "total_ms": (t3 - t0) * 1e3,
    }
    del r
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=float, default=2.0, help="GiB")
    p.add_argument("--ranks", default="4")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--stage", choices=["execute", "releasing", "parts"], default="execute")
    p.add_argument("--label", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    shapes = gpt_shapes(int(args.size * GIB), args.dim)
    size = sum(int(np.prod(s)) * 2 for s in shapes.values())
    large = sum(1 for s in shapes.values() if int(np.prod(s)) * 2 >= 1 << 20)

    def emit(r: dict) -> None:
        r.update(
            bytes=size,
            tensors=len(shapes),
            large_tensors=large,
            stage=args.stage,
            label=args.label,
            shmem_huge=shmem_huge(),
            loadavg=[round(v, 2) for v in os.getloadavg()],
        )
        print(json.dumps(r), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(r) + "\n")

    fresh, warm_ms = memcpy(size, args.reps)
    emit({"figure": "memcpy", "fresh_ms": fresh, "warm_ms": warm_ms})
    for n in [int(x) for x in args.ranks.split(",")]:
        g = group(n)
        try:
            g.start()
            one(g, gpt_shapes(64 << 20, 256), 64 << 20, args.stage)  # warm-up
            runs = [one(g, shapes, size, args.stage) for _ in range(args.reps)]
        finally:
            g.close()
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        emit(
            {
                "figure": "state_dict",
                "ranks": n,
                **med,
                "total_ms_all": [round(r["total_ms"], 1) for r in runs],
                "memcpy_fresh_ms": fresh,
                "total_over_memcpy": med["total_ms"] / fresh,
            }
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
