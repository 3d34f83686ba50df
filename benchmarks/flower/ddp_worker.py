"""The training script client_torchrun.py starts under torchrun for every message."""

import time

T_FIRST = (
    time.time()
)  # the script's first line: what a handler's first line is elsewhere

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from ddp_digits import task
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    d = Path(sys.argv[1])
    cfg = json.loads((d / "cfg.json").read_text())
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = task.make_model()
    inp = np.load(d / "in.npz")
    model.load_state_dict({k: torch.from_numpy(inp[k]) for k in inp.files})
    ddp = DDP(model)
    x, y = task.partition(
        int(cfg.get("partition-id", 0)), int(cfg.get("num-partitions", 1))
    )
    per_rank = len(x) // world
    xr, yr = x[rank::world][:per_rank], y[rank::world][:per_rank]
    t0 = time.time()
    loss = task.train_epochs(
        ddp,
        xr,
        yr,
        epochs=int(cfg["local-epochs"]),
        lr=float(cfg["lr"]),
        batch_size=int(cfg["batch-size"]),
        seed=task.SEED + 1000 * int(cfg["server-round"]) + rank,
    )
    compute_s = time.time() - t0
    pids = [0] * world
    dist.all_gather_object(pids, os.getpid())
    if rank == 0:
        np.savez(d / "out.npz", **{k: v.numpy() for k, v in model.state_dict().items()})
        (d / "metrics.json").write_text(
            json.dumps(
                {
                    "num-examples": per_rank * world,
                    "train_loss": loss,
                    "pids": pids,
                    "world_size": world,
                    "t_first": T_FIRST,
                    "compute_s": compute_s,
                }
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
