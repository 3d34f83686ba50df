"""`DigitsTrainer`: a PyTorch training component written the way PyTorch users write
one, as a rankexec rank component (component style).

Everything a real job does is here, in the usual places:

- `__init__` picks the device (`torch.cuda.set_device(LOCAL_RANK)` on GPUs), joins the
  process group (`init_process_group`: nccl on GPUs, gloo on CPU), wraps the model in
  `DistributedDataParallel` and builds a `DataLoader` with `num_workers=2,
  persistent_workers=True` (worker processes forked from the rank, alive across
  tasks);
- `execute` loads the global model, trains with a `DistributedSampler` over this rank's
  part of the client's shard, and returns the model's `state_dict()`;
- `handle_event` leaves the process group at the end of the run.

The component runs unchanged under `rankexec simulate` (float32 blobs, averaged by the
server) and under FLARE (`examples/flare/torch-digits`, FLARE's PyTorch exchange
format: the adapter turns the torch tensors of the task into blobs and back).

    rankexec simulate examples/python/torch_digits/job
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import rankexec
import torch
import torch.distributed as dist
from rankexec.tensors import from_blobs, to_blobs
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Net(nn.Module):
    """A small MLP for the 8x8 digits."""

    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


# The repository's copy of the digits (examples/data/README.md); scikit-learn's
# `load_digits()` is the same data, used where the file is not beside the examples (a
# FLARE job deploys this file alone).
_DIGITS = Path(__file__).resolve().parents[2] / "data" / "digits.bin"


def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    if _DIGITS.is_file():
        raw = _DIGITS.read_bytes()
        n, f = np.frombuffer(raw, "<u4", 2, 8)
        x = np.frombuffer(raw, np.uint8, n * f, 16).reshape(n, f)
        return x.astype(np.float64), np.frombuffer(raw, np.uint8, n, 16 + n * f).astype(np.int64)
    from sklearn.datasets import load_digits

    return load_digits(return_X_y=True)


def _digits(seed: int, test_fraction: float):
    x, y = _load_digits()
    x = (x / 16.0).astype(np.float32)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return (x[train], y[train]), (x[test], y[test])


class DigitsTrainer:
    """DDP training of `Net` with a multi-worker DataLoader."""

    def __init__(
        self,
        epochs: int = 3,
        lr: float = 0.05,
        batch_size: int = 32,
        hidden: int = 128,
        num_workers: int = 2,
        seed: int = 2026,
        test_fraction: float = 0.2,
        site: int = 0,
        num_sites: int = 1,
    ) -> None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)  # torchrun's numbering: the rank's own GPU
            self.device = torch.device("cuda", torch.cuda.current_device())
            backend = "nccl"
        else:
            self.device = torch.device("cpu")
            backend = "gloo"
        dist.init_process_group(backend)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.epochs, self.lr, self.seed = epochs, lr, seed
        self.site, self.num_sites = site, num_sites
        torch.manual_seed(seed)  # every rank and every client starts from the same model
        self.model = Net(hidden).to(self.device)
        ids = [self.device.index] if self.device.type == "cuda" else None
        self.ddp = DDP(self.model, device_ids=ids)
        (xtr, ytr), (xte, yte) = _digits(seed, test_fraction)
        self.test = (xte, yte)
        self.batch_size, self.num_workers = batch_size, num_workers
        self._loaders: dict[int, DataLoader] = {}
        self._train = (xtr, ytr)

    def _loader(self, site: int, sites: int) -> DataLoader:
        """This client's shard, split across the ranks by a DistributedSampler; built
        once per shard (its workers persist across tasks)."""
        if site not in self._loaders:
            x, y = self._train
            shard = TensorDataset(
                torch.from_numpy(x[site::sites]), torch.from_numpy(y[site::sites])
            )
            self.sampler = DistributedSampler(shard, self.world, self.rank, seed=self.seed)
            self._loaders[site] = DataLoader(
                shard,
                batch_size=self.batch_size,
                sampler=self.sampler,
                num_workers=self.num_workers,
                persistent_workers=self.num_workers > 0,
            )
        return self._loaders[site]

    def _evaluate(self, site: int, sites: int) -> tuple[float, float, int]:
        x, y = self.test[0][site::sites], self.test[1][site::sites]
        with torch.no_grad():
            logits = self.model(torch.from_numpy(x).to(self.device))
            target = torch.from_numpy(y).to(self.device)
            loss = nn.functional.cross_entropy(logits, target).item()
            acc = (logits.argmax(1) == target).float().mean().item()
        return acc, loss, len(x)

    def load(self, state: dict) -> None:
        """Loads the global model (the same on every rank)."""
        self.model.load_state_dict(state)

    def train(self, round_: int, site: int, sites: int, abort) -> dict:
        """Trains `epochs` epochs over this rank's part of the shard; returns metrics."""
        loader = self._loader(site, sites)
        opt = torch.optim.SGD(self.ddp.parameters(), lr=self.lr, momentum=0.9)
        started, total, steps = time.monotonic(), 0.0, 0
        for epoch in range(self.epochs):
            self.sampler.set_epoch(round_ * self.epochs + epoch)
            for xb, yb in loader:
                if abort.triggered:
                    raise rankexec.TaskAborted(abort.reason or "aborted")
                opt.zero_grad()
                loss = nn.functional.cross_entropy(self.ddp(xb.to(self.device)), yb.to(self.device))
                loss.backward()  # DDP all-reduces the gradients here
                opt.step()
                total += loss.item()
                steps += 1
        return {
            "num_samples": len(self.sampler) * self.world,
            "train_loss": total / max(steps, 1),
            "world_size": self.world,
            "backend": dist.get_backend(),
            "loader_workers": self.num_workers,
            "train_seconds": time.monotonic() - started,
        }

    def execute(self, task, input, ctx, abort):
        site = int(ctx.get_prop("__site_index__", self.site))
        sites = int(ctx.get_prop("__num_sites__", self.num_sites))
        if input.blobs:
            self.load(from_blobs(input.blobs, self.model.state_dict()))
        val_acc, val_loss, n_test = self._evaluate(site, sites)
        if task == "validate":
            return rankexec.Shareable(
                meta={"accuracy": val_acc, "loss": val_loss, "num_samples": n_test}
            )
        if task != "train":
            raise ValueError(f"unknown task {task!r} (DigitsTrainer runs train and validate)")
        meta = self.train(int(input.meta.get("round", 0)), site, sites, abort)
        meta.update(val_accuracy=val_acc, val_loss=val_loss)
        return rankexec.Shareable(meta=meta, blobs=to_blobs(self.model.state_dict()))

    def handle_event(self, event, ctx):
        if event == "_end_run" and dist.is_initialized():
            dist.destroy_process_group()
