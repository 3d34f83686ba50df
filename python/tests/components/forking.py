"""Rank components that fork while a shared buffer is mapped writable (fork-safety
tests): PyTorch DataLoader workers, and a component that replies with values that
cannot be sent."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

import rankexec


def child_pids() -> list[int]:
    """This process's live children (every thread's), from /proc."""
    pids: list[int] = []
    for task in Path("/proc/self/task").iterdir():
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return sorted(pids)


class Squares:
    """A tiny dataset; workers return (index, index squared)."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[int, int]:
        return i, i * i


class LoaderRank:
    """Each task fills a `SharedBuffer` output first, then iterates a DataLoader whose
    persistent workers are forked (the first time) while that buffer is mapped writable,
    and replies with the buffer."""

    def __init__(self, nbytes: int = 4 << 20) -> None:
        self.nbytes = nbytes
        self.loader = None

    def execute(self, task, input, ctx, abort):
        import torch
        from torch.utils.data import DataLoader

        buf = rankexec.SharedBuffer(self.nbytes)
        fill = int(input.meta["fill"])
        np.frombuffer(buf, dtype=np.uint8)[:] = fill
        if self.loader is None:
            self.loader = DataLoader(
                Squares(),
                batch_size=4,
                num_workers=2,
                persistent_workers=True,
                multiprocessing_context="fork",
            )
        total = sum(int(b[1].sum()) for b in self.loader)
        assert total == sum(i * i for i in range(16))
        del torch
        return rankexec.Shareable(
            meta={"fill": fill, "children": child_pids(), "pid": os.getpid()},
            blobs={"out": buf},
        )
