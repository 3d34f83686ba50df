"""The FSDP2 job with FLARE's Recipe API: FedAvg over ``TinyGPT``, each site a rank group
whose ranks all receive the global model (``all_ranks_receive``) and train it sharded.

``FedAvgRecipe`` with the model as a class path and arguments (the server's persistor
builds it; this process never allocates it), ``server_expected_format="pytorch"`` (the
tensors travel as tensors), then ``use_rank_groups(recipe, num_of_processes=R,
all_ranks_receive=True)``. ``--load broadcast`` leaves ``all_ranks_receive`` off (rank 0
alone receives and broadcasts, for comparison). The ranks run with glibc's
``MALLOC_MMAP_THRESHOLD_`` fixed (``--mmap-threshold``, 128 KiB; see ``make_recipe``). Run from this folder::

    python job.py                                   # simulator, 2 sites x 2 ranks, 2 rounds
    python job.py --size 512MiB --clients 1 --ranks 4
    python job.py --export --export-dir jobs        # only write the job (jobs/fsdp)

then ``nvflare simulator jobs/fsdp -w WS -n 2 -t 2``. Sites need ``rankexec`` installed and
``python -m rankexec.flare allow-list WS`` once.
"""

from __future__ import annotations

import argparse
import os
import sys

from nvflare.app_opt.pt.recipes.fedavg import FedAvgRecipe
from nvflare.client.config import ExchangeFormat
from nvflare.recipe import SimEnv
from rankexec.flare.recipe import use_rank_groups
from tiny_gpt import config_for, num_params, parse_size, script_args

HERE = os.path.dirname(os.path.abspath(__file__))
LOADS = ("shards", "view", "dsd", "own", "broadcast")


def make_recipe(args: argparse.Namespace) -> FedAvgRecipe:
    cfg = config_for(args.size)
    print(f"model: {cfg}, {4 * num_params(cfg)} bytes", flush=True)
    train_args = f"{script_args(cfg)} --load {args.load} --steps {args.steps}"
    if args.cpu:
        train_args += " --device cpu"
    recipe = FedAvgRecipe(
        name="fsdp",
        model={"class_path": "tiny_gpt.TinyGPT", "args": cfg},
        min_clients=args.clients,
        num_rounds=args.rounds,
        train_script="client.py",  # relative: FLARE ships it as custom/client.py
        train_args=train_args,
        server_expected_format=ExchangeFormat.PYTORCH,
    )
    # The server's persistor imports tiny_gpt; the ranks too (next to client.py).
    recipe.add_server_file(os.path.join(HERE, "tiny_gpt.py"))
    recipe.add_client_file(os.path.join(HERE, "tiny_gpt.py"))
    # glibc raises its mmap threshold to the largest block freed so far, and then keeps
    # FSDP's freed all-gather and gradient buffers in a heap it does not give back. A
    # fixed threshold returns them to the system at once (docs/sharded-training.md).
    env = {"set": {"MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)}}
    return use_rank_groups(
        recipe,
        num_of_processes=args.ranks,
        all_ranks_receive=args.load != "broadcast",
        env=env if args.mmap_threshold else None,
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=parse_size, default=parse_size("2MiB"), help="float32")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--load", choices=LOADS, default="shards")
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU even with GPUs")
    p.add_argument(
        "--mmap-threshold",
        type=int,
        default=128 << 10,
        help="the ranks' MALLOC_MMAP_THRESHOLD_ (bytes); 0: glibc's default (adaptive)",
    )
    p.add_argument("--workspace", default="/tmp/nvflare/fsdp")
    args = p.parse_args()
    recipe = make_recipe(args)
    # FLARE's own flags: `--export --export-dir DIR` writes the job and exits.
    run = recipe.execute(
        SimEnv(num_clients=args.clients, num_threads=args.clients, workspace_root=args.workspace)
    )
    print(f"job {run.get_job_id()}: {run.get_status()}; results in {run.get_result()}")


if __name__ == "__main__":
    sys.exit(main())
