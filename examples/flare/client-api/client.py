"""Digits trained with PyTorch DDP, written against FLARE's Client API (FLARE's style).

FLARE launches it with torchrun (``python -m nvflare.app_opt.pt.torchrun_node
--nproc-per-node=2 custom/client.py --epochs 2``); rankexec's ``ScriptExecutor`` runs
it unchanged. Rank 0 talks to FLARE; the other ranks get the task and the model
through broadcasts, as FLARE's Client API gives them nothing (``is_running()`` is
False and ``receive()`` None on ranks other than 0). It answers FLARE's three Client
API tasks: train, validate and submit_model (the last two are cross-site evaluation's).
"""

import argparse
import time

import numpy as np
import nvflare.client as flare
import torch
import torch.distributed as dist
from net import Net
from nvflare.client.tracking import SummaryWriter
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP

TRAIN, EVALUATE, SUBMIT, STOP = 0, 1, 2, 3


def split(site: int, sites: int, seed: int = 2026):
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = len(x) // 5
    test, train = order[:n_test], order[n_test:]
    return (x[train][site::sites], y[train][site::sites]), (x[test], y[test])


def accuracy(model, x, y) -> float:
    with torch.no_grad():
        return (model(torch.from_numpy(x)).argmax(1).numpy() == y).mean().item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--sites", type=int, default=2)
    args = p.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    flare.init(rank=str(rank))
    site = flare.get_site_name()
    index = int(site.rsplit("-", 1)[-1]) - 1 if site[-1:].isdigit() else 0
    (x_train, y_train), (x_test, y_test) = split(index % args.sites, args.sites)
    per_rank = len(x_train) // world  # every rank takes the same number of steps
    xr = torch.from_numpy(x_train[rank::world][:per_rank])
    yr = torch.from_numpy(y_train[rank::world][:per_rank])

    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model)
    writer = SummaryWriter() if rank == 0 else None
    while True:
        # Rank 0 asks FLARE for the next task and tells the other ranks.
        order = torch.tensor([STOP, 0], dtype=torch.int64)
        if rank == 0 and flare.is_running():
            input_model = flare.receive()
            if flare.is_submit_model():  # cross-site evaluation asks for the local model
                order[0] = SUBMIT
            else:
                params = input_model.params
                model.load_state_dict({k: torch.as_tensor(v) for k, v in params.items()})
                order[0] = TRAIN if flare.is_train() else EVALUATE
                order[1] = input_model.current_round or 0
        dist.broadcast(order, 0)
        task, current_round = order.tolist()
        if task == STOP:
            break
        for t in model.state_dict().values():
            dist.broadcast(t, 0)
        global_acc = accuracy(model, x_test, y_test)
        if task == EVALUATE:
            if rank == 0:
                flare.send(flare.FLModel(metrics={"accuracy": global_acc}))
            continue
        if task == SUBMIT:
            if rank == 0:
                flare.send(flare.FLModel(params=model.state_dict()))
            continue
        opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
        gen = torch.Generator().manual_seed(1000 * current_round + rank)
        started, steps, total = time.perf_counter(), 0, 0.0
        for _ in range(args.epochs):
            for batch in torch.randperm(per_rank, generator=gen).split(args.batch_size):
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(ddp(xr[batch]), yr[batch])
                loss.backward()
                opt.step()
                total, steps = total + loss.item(), steps + 1
        if rank == 0:
            train_s = time.perf_counter() - started
            print(
                f"{site} round {current_round}: global accuracy {global_acc:.4f}, "
                f"train loss {total / steps:.4f}, training took {train_s:.3f} s",
                flush=True,
            )
            writer.add_scalar("train_loss", total / steps, global_step=current_round)
            flare.send(
                flare.FLModel(
                    params=model.state_dict(),
                    metrics={"accuracy": global_acc},
                    meta={"NUM_STEPS_CURRENT_ROUND": steps, "train_seconds": train_s},
                )
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
