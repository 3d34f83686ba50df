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


def map_memfd_writable(inode: int, nbytes: int):
    """A writable shared mapping, made with Python's `mmap`, of this process's memory
    file with `inode` (found through /proc/self/fd), as user code could make."""
    import mmap

    for entry in Path("/proc/self/fd").iterdir():
        try:
            if "memfd:" in os.readlink(entry) and os.stat(entry).st_ino == inode:
                fd = os.open(entry, os.O_RDWR)
                try:
                    return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_WRITE)
                finally:
                    os.close(fd)
        except OSError:
            continue
    raise AssertionError(f"no memory file with inode {inode}")


class UserMappingRank:
    """Replies with a `SharedBuffer` whose memory file user code also mapped writable
    (and keeps mapped): sealing it in place is impossible, so a sealed copy is sent."""

    def __init__(self) -> None:
        self.kept: list = []

    def execute(self, task, input, ctx, abort):
        n = 1 << 20
        buf = rankexec.SharedBuffer(n)
        np.frombuffer(buf, dtype=np.uint8)[:] = int(input.meta["fill"])
        self.kept.append(map_memfd_writable(buf.inode, n))
        blob = buf.seal()
        return rankexec.Shareable(
            meta={"copied": blob.inode != buf.inode, "pid": os.getpid()},
            blobs={"out": blob},
        )
