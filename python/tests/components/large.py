"""Components for the large-model tests (python/tests/test_large_models.py)."""

from __future__ import annotations

import mmap
import os

import numpy as np

import rankexec


class Bump:
    """Returns every input blob with its first and last byte plus one (a new array,
    as a trainer's updated weights are), and where each input blob was mapped."""

    def execute(self, task, input, ctx, abort):
        out = {}
        where = {}
        for name, blob in input.blobs.items():
            a = np.frombuffer(blob, dtype=np.uint8).copy()
            a[0] += 1
            a[-1] += 1
            out[name] = a
            where[name] = [blob.inode, blob.shared]
        return rankexec.Shareable(meta={"where": where, "pid": os.getpid()}, blobs=out)


class Big:
    """Replies with one blob of ``n`` bytes (meta ``n``): zeros with the first byte 1
    and the last 2, built as a trainer builds its result (an ordinary array)."""

    def execute(self, task, input, ctx, abort):
        n = int(input.meta["n"])
        a = np.zeros(n, dtype=np.uint8)
        a[0], a[-1] = 1, 2
        return rankexec.Shareable(meta={"pid": os.getpid()}, blobs={"big": a})


class Sparse:
    """Replies with a read-only mapping of a sparse file of ``n`` bytes (meta ``n``,
    ``path``): a buffer larger than the host's memory that costs no memory itself."""

    def execute(self, task, input, ctx, abort):
        n = int(input.meta["n"])
        path = input.meta["path"]
        with open(path, "wb") as f:
            f.truncate(n)
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), n, prot=mmap.PROT_READ)
        return rankexec.Shareable(blobs={"huge": m})


class Hold:
    """Writes its pid to ``meta["started"]`` (rank 0), then waits (60 s at most) for
    the file ``meta["go"]`` before it answers: the host is measured while it runs."""

    def execute(self, task, input, ctx, abort):
        import time
        from pathlib import Path

        if int(os.environ["RANK"]) == 0:
            Path(input.meta["started"]).write_text(str(os.getpid()))
        deadline = time.monotonic() + 60
        while not Path(input.meta["go"]).exists() and time.monotonic() < deadline:
            abort.wait(0.05)
        return rankexec.Shareable(meta={"pid": os.getpid()})
