"""A FLARE Client API script that trains ``TinyGPT`` with FSDP2, every rank taking its
shards from the one memory file the site received the global model in.

Every rank calls ``flare.receive()`` (the executor's ``all_ranks_receive=True``:
rankexec's ``ScriptExecutor``; FLARE has no such mode) and gets the same ``FLModel``, its
params copy-on-write views of one shared memory file. Each rank builds the model on the
meta device (no memory), applies ``fully_shard`` to every block and to the root, and
loads its own part of every parameter (FSDP2's ``Shard(0)``: the ``torch.chunk`` of dim 0
for its rank) from those views (``--load``):

- ``shards`` (the default): a copy of its chunk of each tensor, nothing else: reads only
  those pages of the file, and the file can go as soon as every rank has its shards;
- ``view``: its chunk itself, no copy: the parameter's storage is the mapping, and the
  pages are copied (privately, page by page) only when the optimizer writes them;
- ``dsd``: torch's ``set_model_state_dict(..., full_state_dict=True)`` fed with the
  views (rank 0 scatters every shard through the process group: copies on every rank).

Two more ways, for comparison (``benchmarks/python/fsdp_memory_bench.py``): ``own``, each
rank first makes its own full copy (what a rank that loads a checkpoint itself holds), and
``broadcast``, only rank 0 receives (FLARE's semantics: the job without
``all_ranks_receive``) and sends the model to the others with
``dist.broadcast_object_list`` (FLARE's LLM examples); each rank then takes its shards from
its copy.

Then every rank trains ``--steps`` steps on synthetic tokens (gloo on CPU; NCCL on the
rank's GPU, ``LOCAL_RANK``, when every rank has a GPU of its own and ``--device`` allows:
NCCL refuses two ranks on one GPU), the full state
dict is gathered on rank 0 only (``get_model_state_dict(..., full_state_dict=True,
cpu_offload=True)``: the other ranks get an empty dict) and rank 0 sends it; the other ranks
do not send (their part of the task is answered at their next ``is_running()``). At
END_RUN ``is_running()`` is False on every rank and the loop ends everywhere.

Each rank prints per round ``rank R: round N: its shards of a M MiB model (LOAD) in S s,
+X MiB allocated`` (what its malloc handed out over the load and still holds once every
rank has its shards: the copies it made; mapped pages of the received file are not in
it) and ``rank R: round N: loss A -> B``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import time

import nvflare.client as flare
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tiny_gpt import TinyGPT, config, synthetic_batch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

LOADS = ("shards", "view", "dsd", "own", "broadcast")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in [
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        ]
    ]


def allocated() -> int:
    """Bytes this process's malloc has handed out and not taken back (glibc's
    ``mallinfo2``: in use in the arenas plus mapped chunks): torch's CPU tensors, numpy's
    arrays, pickles. Unlike RSS it falls when memory is freed and is not raised by pages
    the process only maps (the received memory file)."""
    try:
        info = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):  # not glibc, or older than 2.33
        return 0
    info.restype = _MallInfo2
    m = info()
    return m.uordblks + m.hblkhd


def sharded_model(cfg: dict, mesh) -> torch.nn.Module:
    """``TinyGPT`` on the meta device, each block and the root under ``fully_shard``: no
    parameter has memory yet."""
    with torch.device("meta"):
        model = TinyGPT(**cfg)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def load_shards(model: torch.nn.Module, full: dict, device: torch.device, copy: bool) -> None:
    """Gives every parameter of the meta-device `model` its shard, taken from `full`
    (the full tensors, views of the received memory file) without a full copy: the
    rank's ``torch.chunk`` of dim 0 (FSDP2's ``Shard(0)``), copied (`copy`, or to a GPU)
    or as it is (a view of the mapping), then assigned (``assign=True``: FSDP2 keeps the
    tensor as its sharded storage when the chunks are even, pads it when not)."""
    sharded = {}
    for name, meta in model.state_dict().items():
        t = full[name]
        mesh = meta.device_mesh
        local = torch.chunk(t, mesh.size(), dim=0)[mesh.get_local_rank()]
        if device.type != "cpu":
            local = local.to(device)
        elif copy:
            local = local.clone()
        sharded[name] = torch.nn.Parameter(
            DTensor.from_local(
                local, mesh, meta.placements, shape=t.shape, stride=t.stride(), run_check=False
            )
        )
    model.load_state_dict(sharded, assign=True)


def train(model, cfg: dict, args, rank: int, current_round: int, device) -> tuple[float, float]:
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        seed = 1000 * current_round + 100 * rank + step
        tokens = synthetic_batch(cfg, args.batch, args.seq, seed, device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg["vocab"]), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses[0], losses[-1]


def main() -> None:
    p = argparse.ArgumentParser()
    for name, default in (("vocab", 256), ("width", 64), ("layers", 2), ("heads", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--positions", type=int, default=64)
    p.add_argument("--load", choices=LOADS, default="shards")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--device", choices=("auto", "cpu"), default="auto")
    args = p.parse_args()
    cfg = config(args.vocab, args.width, args.layers, args.heads, args.positions)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    gpus = torch.cuda.device_count() if args.device == "auto" else 0
    if gpus and world <= gpus:  # NCCL needs a GPU of its own for every rank
        device = torch.device("cuda", local_rank)  # rankexec: device LOCAL_RANK is ours
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend)
    mesh = init_device_mesh(device.type, (world,))
    flare.init(rank=str(rank))
    every_rank = args.load != "broadcast"
    print(f"rank {rank}: {backend} on {device}, world {world}, load {args.load}", flush=True)

    while True:
        # Every rank gets the same answer (all_ranks_receive); with --load broadcast
        # rank 0 alone asks and tells the others.
        if every_rank:
            if not flare.is_running():
                break
            input_model = flare.receive()
            params = input_model.params
        else:
            go = torch.zeros(1, dtype=torch.int64, device=device)
            input_model = params = None
            if rank == 0 and flare.is_running():
                input_model = flare.receive()
                params = input_model.params
                go[0] = 1
            dist.broadcast(go, 0)
            if go.item() == 0:
                break
        current_round = int(input_model.current_round or 0) if input_model else 0

        before, t0 = allocated(), time.monotonic()
        model = sharded_model(cfg, mesh)
        if args.load == "broadcast":
            box = [params]
            dist.broadcast_object_list(box, src=0)
            params = box.pop()  # the list must not keep it past this round
            rounds = torch.tensor([current_round], device=device)
            dist.broadcast(rounds, 0)
            current_round = int(rounds.item())
        elif args.load == "own":
            params = {k: v.clone() for k, v in params.items()}
        if args.load == "dsd":
            # set_model_state_dict replaces the dict's values: give it a dict of its own.
            set_model_state_dict(
                model, dict(params), options=StateDictOptions(full_state_dict=True)
            )
        else:
            load_shards(model, params, device, copy=args.load != "view")
        size = sum(t.numel() * t.element_size() for t in params.values())
        dist.barrier()  # every rank holds its shards: the received views can go
        took, grew = time.monotonic() - t0, allocated() - before
        print(
            f"rank {rank}: round {current_round}: its shards of a {size / (1 << 20):.1f} MiB "
            f"model ({args.load}) in {took:.2f} s, +{grew / (1 << 20):.1f} MiB allocated",
            flush=True,
        )
        if args.load != "view":  # a view keeps the mapping: it is the shard
            if input_model is not None:
                input_model.params = None
            params = None

        first, last = train(model, cfg, args, rank, current_round, device)
        print(f"rank {rank}: round {current_round}: loss {first:.4f} -> {last:.4f}", flush=True)
        # Every rank takes part in the gather; rank 0 alone gets the tensors (on the CPU).
        state = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if rank == 0:
            meta = {"NUM_STEPS_CURRENT_ROUND": args.steps, "loss": last}
            flare.send(flare.FLModel(params=state, meta=meta))
        del model, state, params, input_model
        gc.collect()  # FSDP's modules hold cycles: free this round's shards now, not later
    dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)


if __name__ == "__main__":
    main()
