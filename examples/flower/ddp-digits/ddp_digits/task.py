"""The model, the data and the training loop shared by the ClientApps and the ServerApp.

scikit-learn's 8x8 digits (1797 images, shipped with scikit-learn, so no download):
a fixed 20% is held out for the ServerApp's evaluation; the rest is split across the
nodes by their `partition-id` / `num-partitions` node config, and within a node across
the ranks (DDP needs every rank to take the same number of steps).
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

SEED = 2026


def make_model() -> nn.Module:
    torch.manual_seed(SEED)  # every client and the server start from the same weights
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def split() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    order = np.random.default_rng(SEED).permutation(len(x))
    n_test = int(len(x) * 0.2)
    test, train = order[:n_test], order[n_test:]
    return (x[train], y[train]), (x[test], y[test])


def partition(partition_id: int, num_partitions: int) -> tuple[np.ndarray, np.ndarray]:
    (x, y), _ = split()
    return x[partition_id::num_partitions], y[partition_id::num_partitions]


def evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    with torch.no_grad():
        logits = model(torch.from_numpy(x))
        target = torch.from_numpy(y)
        loss = nn.functional.cross_entropy(logits, target).item()
        acc = (logits.argmax(1) == target).float().mean().item()
    return acc, loss


def train_epochs(
    net: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
    should_stop=lambda: False,
) -> float:
    """Trains `net` (a DDP wrapper or a plain module); returns the mean loss."""
    xr, yr = torch.from_numpy(x), torch.from_numpy(y)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    total, steps = 0.0, 0
    for _ in range(epochs):
        perm = torch.randperm(len(xr), generator=gen)
        for i in range(0, len(xr), batch_size):
            if should_stop():
                raise RuntimeError("aborted")
            idx = perm[i : i + batch_size]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(xr[idx]), yr[idx])
            loss.backward()
            opt.step()
            total += loss.item()
            steps += 1
    return total / max(steps, 1)
