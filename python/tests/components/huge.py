"""A rank that reads every page of its input and reports how much of each mapping the
kernel maps with huge pages (``test_huge_pages.py``)."""

from __future__ import annotations

import numpy as np

import rankexec


def pmd_kib(addr: int) -> int:
    """``ShmemPmdMapped`` of the mapping of this process holding ``addr``, in KiB: the
    shared memory it maps with whole huge pages (``/proc/self/smaps``)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "ShmemPmdMapped:":
                return int(line.split()[1])
    return 0


class HugeReader:
    """Every rank reads one byte of every page of each input blob; rank 0 returns them
    as views (no copy: the host maps the file it sent) with meta ``pmd_kib`` (each
    blob's ``pmd_kib`` in the rank) and ``sums`` (each blob's bytes summed)."""

    def execute(self, task, input, ctx, abort):
        pmd, sums, out = {}, {}, {}
        for name, blob in input.blobs.items():
            view = np.frombuffer(blob, dtype=np.uint8)
            sums[name] = int(view.sum(dtype=np.uint64))
            pmd[name] = pmd_kib(view.ctypes.data)
            out[name] = view
        if ctx.rank != 0:
            return None
        return rankexec.Shareable(meta={"pmd_kib": pmd, "sums": sums}, blobs=out)
