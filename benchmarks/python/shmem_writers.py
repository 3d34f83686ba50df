"""Why a large copy into shared memory is split into several files written at once.

Copies ``--size`` GiB of ordinary memory into new memory files with ``os.pwrite`` (what
``Blob::copied_many`` does), four ways, beside one memcpy into fresh memory: one file by
one thread; one file by two threads (the kernel's shmem write path locks the file per
write, so they take turns); two files by two threads; four files by four threads. Before
each timed step as many bytes are touched and freed (BENCHMARKS.md, "Method").

    python benchmarks/python/shmem_writers.py [--size 2] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import numpy as np

CHUNK = 64 << 20


def warm(size: int) -> None:
    a = np.ones(size, dtype=np.uint8)
    del a


def memcpy(src: np.ndarray) -> float:
    warm(src.nbytes)
    t = time.perf_counter()
    dst = np.empty_like(src)
    np.copyto(dst, src)
    took = time.perf_counter() - t
    del dst
    return took


def write(src: np.ndarray, files: int, threads: int) -> float:
    """`src` into `files` new memory files by `threads` threads (threads >= files, each
    file's share of the bytes split among its threads); seconds."""
    size = src.nbytes
    fds = [os.memfd_create("rankexec-bench") for _ in range(files)]
    for fd in fds:
        os.ftruncate(fd, -(-size // files))
    per = -(-size // threads)
    view = memoryview(src)

    def run(i: int) -> None:
        lo, hi = i * per, min(size, (i + 1) * per)
        fd = fds[i * files // threads]
        base = (i * files // threads) * -(-size // files)
        at = lo
        while at < hi:
            at += os.pwrite(fd, view[at : min(hi, at + CHUNK)], at - base)

    warm(size)
    t = time.perf_counter()
    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    took = time.perf_counter() - t
    for fd in fds:
        os.close(fd)
    return took


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=float, default=2.0, help="GiB")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    src = np.ones(int(args.size * (1 << 30)), dtype=np.uint8)
    ways = [("one file, 1 thread", 1, 1), ("one file, 2 threads", 1, 2)]
    ways += [("2 files, 2 threads", 2, 2), ("4 files, 4 threads", 4, 4)]
    for rep in range(args.reps):
        figures = [f"memcpy {memcpy(src) * 1e3:.0f} ms"]
        figures += [f"{name} {write(src, f, t) * 1e3:.0f} ms" for name, f, t in ways]
        load = os.getloadavg()[0]
        print(f"rep {rep}: " + " | ".join(figures) + f" | load {load:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
