"""`DigitsDDP`: PyTorch DistributedDataParallel on scikit-learn's digits, as a rankexec
rank component (component style).

Every rank of a client's group trains the same MLP data-parallel on its part of the
client's shard (gradients all-reduced by DDP over `gloo` on CPU, `nccl` on GPUs); rank
0 returns the model as one float32 blob per tensor, which the server averages across
clients (FedAvg). Run it from the repository root:

    rankexec simulate examples/python/ddp_digits/job

Tasks:
- `train`: load the global model (if any), evaluate it on the client's test share
  (`val_accuracy`), train `epochs` epochs, return the weights, `num_samples`,
  `train_loss`;
- `validate`: evaluate the global model: `accuracy`, `loss`, `num_samples`.

The rank, world size and rendezvous come from the environment the launcher gives
(rankexec's builtin launcher or torchrun): `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
`MASTER_ADDR`, `MASTER_PORT`.
"""

from __future__ import annotations

import os
import time

import numpy as np
import rankexec
import torch
import torch.distributed as dist
from rankexec.tensors import from_blobs, to_blobs
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def _split(seed: int, test_fraction: float):
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return (x[train], y[train]), (x[test], y[test])


class DigitsDDP:
    """An MLP trained data-parallel across the group's ranks."""

    def __init__(
        self,
        epochs: int = 3,
        lr: float = 0.05,
        batch_size: int = 32,
        hidden: int = 128,
        seed: int = 2026,
        test_fraction: float = 0.2,
    ) -> None:
        self.epochs = epochs
        self.lr = lr
        self.batch_size = batch_size
        self.seed = seed
        (self.x_train, self.y_train), (self.x_test, self.y_test) = _split(seed, test_fraction)
        torch.manual_seed(seed)  # every rank and every client starts from the same model
        self.model = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
        # The component is built on the thread that runs its tasks and events (the
        # rank's main thread), so the CUDA device chosen here holds in `execute`.
        if torch.cuda.is_available():
            # torchrun's convention: device LOCAL_RANK is the GPU placed for this rank.
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
            backend = "nccl"
        else:
            self.device = torch.device("cpu")
            backend = "gloo"
        dist.init_process_group(backend)
        self.model.to(self.device)
        ids = [self.device.index] if self.device.type == "cuda" else None
        self.ddp = DDP(self.model, device_ids=ids)

    def _evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        with torch.no_grad():
            logits = self.model(torch.from_numpy(x).to(self.device))
            target = torch.from_numpy(y).to(self.device)
            loss = nn.functional.cross_entropy(logits, target).item()
            acc = (logits.argmax(1) == target).float().mean().item()
        return acc, loss

    def execute(self, task, input, ctx, abort):
        ddp = self.ddp
        site = int(ctx.get_prop("__site_index__", 0))
        sites = int(ctx.get_prop("__num_sites__", 1))
        rank, world = dist.get_rank(), dist.get_world_size()
        if input.blobs:
            state = from_blobs(input.blobs, self.model.state_dict())
            self.model.load_state_dict(state)  # the same global model on every rank
        xt, yt = self.x_test[site::sites], self.y_test[site::sites]
        val_acc, val_loss = self._evaluate(xt, yt)
        if task == "validate":
            return rankexec.Shareable(
                meta={"accuracy": val_acc, "loss": val_loss, "num_samples": len(xt)}
            )
        if task != "train":
            raise ValueError(f"unknown task {task!r} (DigitsDDP runs train and validate)")
        # The client's shard, then this rank's equal part of it (DDP needs every rank to
        # take the same number of steps).
        xc, yc = self.x_train[site::sites], self.y_train[site::sites]
        per_rank = len(xc) // world
        xr = torch.from_numpy(xc[rank::world][:per_rank]).to(self.device)
        yr = torch.from_numpy(yc[rank::world][:per_rank]).to(self.device)
        round_ = int(input.meta.get("round", 0))
        gen = torch.Generator().manual_seed(self.seed + 1000 * round_ + 10 * site + rank)
        opt = torch.optim.SGD(ddp.parameters(), lr=self.lr, momentum=0.9)
        started = time.monotonic()
        total, steps = 0.0, 0
        for _ in range(self.epochs):
            perm = torch.randperm(per_rank, generator=gen).to(self.device)
            for i in range(0, per_rank, self.batch_size):
                if abort.triggered:
                    raise rankexec.TaskAborted(abort.reason or "aborted")
                idx = perm[i : i + self.batch_size]
                opt.zero_grad()
                loss = nn.functional.cross_entropy(ddp(xr[idx]), yr[idx])
                loss.backward()  # DDP all-reduces the gradients here
                opt.step()
                total += loss.item()
                steps += 1
        return rankexec.Shareable(
            meta={
                "num_samples": per_rank * world,
                "train_loss": total / max(steps, 1),
                "val_accuracy": val_acc,
                "val_loss": val_loss,
                "world_size": world,
                "backend": dist.get_backend(),
                "train_seconds": time.monotonic() - started,
            },
            blobs=to_blobs({k: v.cpu() for k, v in self.model.state_dict().items()}),
        )

    def handle_event(self, event, ctx):
        if event == "_end_run" and dist.is_initialized():
            dist.destroy_process_group()
