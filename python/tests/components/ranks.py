"""Components for the failure, abort and zero-copy tests (component style).

Each writes what it saw to `OUT_DIR/<what>-<rank>.json` (`out_dir` arg) so a test can
check every rank, not only rank 0's reply.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np

import rankexec


def _note(out_dir: str, what: str, rank: int, data: dict) -> None:
    path = Path(out_dir) / f"{what}-{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.rename(path)


class Probe:
    """`look`: reports how the input blob `x` is mapped; `make`: replies a shared output;
    `fail`: raises on `fail_rank`; `wait_abort`: waits for the abort signal;
    `crash`: dies on `fail_rank` (`how`: exit, segv, kill); `sleep`: blocks in
    `abort.wait`, so Ctrl-C can reach it; `pid`: notes the pid."""

    def __init__(self, out_dir: str, fail_rank: int = 1) -> None:
        self.out_dir = out_dir
        self.fail_rank = fail_rank

    def execute(self, task, input, ctx, abort):
        rank = ctx.rank
        if task == "look":
            blob = input.blobs["x"]
            arr = np.frombuffer(blob, dtype=np.uint8)
            torch_ptr = None
            if input.meta.get("torch"):
                import warnings

                import torch

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # read-only buffer
                    torch_ptr = torch.frombuffer(blob, dtype=torch.uint8).data_ptr()
            _note(
                self.out_dir,
                "look",
                rank,
                {
                    "inode": blob.inode,
                    "shared": blob.shared,
                    "nbytes": blob.nbytes,
                    "same_pointer": arr.ctypes.data == blob.address,
                    "torch_same_pointer": torch_ptr == blob.address,
                    "writeable": bool(arr.flags.writeable),
                    "first": int(arr[0]),
                    "last": int(arr[-1]),
                    "pid": os.getpid(),
                },
            )
            return rankexec.Shareable(meta={"rank": rank})
        if task == "make":
            n = int(input.meta["nbytes"])
            buf = rankexec.SharedBuffer(n)
            view = np.frombuffer(buf, dtype=np.uint8)
            view[:] = 7
            view[-1] = 9
            return rankexec.Shareable(
                meta={"inode": buf.inode, "address": buf.address}, blobs={"y": buf}
            )
        if task == "fail":
            if rank == self.fail_rank:
                raise ValueError(f"bad batch on rank {rank}")
            return rankexec.Shareable(meta={"rank": rank})
        if task == "wait_abort":
            got = abort.wait(60)
            _note(self.out_dir, "abort", rank, {"triggered": abort.triggered, "got": got})
            raise rankexec.TaskAborted(abort.reason or "aborted")
        if task == "crash":
            if rank == self.fail_rank:
                how = input.meta.get("how", "exit")
                if how == "exit":
                    os._exit(7)
                if how == "segv":
                    import ctypes

                    ctypes.string_at(0)
                os.kill(os.getpid(), signal.SIGKILL)
            abort.wait(30)
            return rankexec.Shareable()
        if task == "sleep":
            _note(self.out_dir, "sleeping", rank, {"pid": os.getpid()})
            abort.wait(60)
            return rankexec.Shareable()
        if task == "hold_gil":
            import ctypes

            # PyDLL calls keep the GIL: libc's usleep blocks with the GIL held, as a long
            # C extension call (or a busy trainer) would.
            ctypes.PyDLL(None).usleep(int(input.meta["seconds"] * 1e6))
            return rankexec.Shareable(meta={"held": input.meta["seconds"]})
        if task == "ignore_abort":
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # deliberately deaf to the abort signal
                time.sleep(0.05)
            return rankexec.Shareable()
        if task == "pid":
            _note(self.out_dir, "pid", rank, {"pid": os.getpid(), "sid": os.getsid(0)})
            return rankexec.Shareable(meta={"pid": os.getpid()})
        raise ValueError(f"unknown task {task!r}")


class Collective:
    """Data-parallel ranks: `allreduce` sums a tensor over gloo; on `kill_rank` the rank
    SIGKILLs itself once the others are inside the all-reduce."""

    def __init__(self, out_dir: str, kill_rank: int = 1) -> None:
        import torch.distributed as dist

        self.out_dir = out_dir
        self.kill_rank = kill_rank
        dist.init_process_group("gloo")

    def execute(self, task, input, ctx, abort):
        import torch
        import torch.distributed as dist

        rank = dist.get_rank()
        _note(self.out_dir, "pid", rank, {"pid": os.getpid(), "sid": os.getsid(0)})
        t = torch.ones(4) * (rank + 1)
        if task == "allreduce":
            dist.all_reduce(t)
            return rankexec.Shareable(meta={"sum": float(t[0])})
        if task == "kill_in_allreduce":
            if rank == self.kill_rank:
                time.sleep(1.0)  # the others are blocked in all_reduce by now
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(t)
            return rankexec.Shareable(meta={"sum": float(t[0])})
        raise ValueError(f"unknown task {task!r}")
