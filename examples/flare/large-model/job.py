"""The large-model job with FLARE's Recipe API: FedAvg over a generated GPT-2-shaped model.

``FedAvgRecipe`` with the model given as a class path and arguments (the server's
persistor builds it; this process never allocates it) and ``server_expected_format=
"pytorch"``, so that tensors travel as tensors and bfloat16 stays bfloat16 end to end
(with FLARE's default, ``numpy``, the server's persistor upcasts bfloat16 to float32).
``--executor rankexec`` (the default) adds ``use_rank_groups``: every site runs
``client.py`` as a rankexec group of ``--ranks`` ranks; ``--executor flare`` leaves FLARE's
own ``ClientAPIExecutor`` with ``torchrun_node`` as the launch command, for comparison.
Run from this folder::

    python job.py --size 256MiB                      # simulator, 2 sites x 2 ranks, 3 rounds
    python job.py --size 4.5GiB --clients 1 --ranks 2
    python job.py --share all                        # every rank receives (rankexec only)
    python job.py --size 1GiB --dtype float32 --layout flat   # 8 tensors of 128 MiB
    python job.py --export --export-dir jobs         # only write the job (jobs/large-model)

then ``nvflare simulator jobs/large-model -w WS -n 2 -t 2``. Sites need ``rankexec``
installed and ``python -m rankexec.flare allow-list WS`` once.
"""

import argparse
import os
import sys

from gpt_shape import DTYPES, config_for, flat_config, nbytes, parse_size
from nvflare.app_opt.pt.recipes.fedavg import FedAvgRecipe
from nvflare.client.config import ExchangeFormat
from nvflare.recipe import SimEnv

HERE = os.path.dirname(os.path.abspath(__file__))


def make_recipe(args: argparse.Namespace) -> FedAvgRecipe:
    if args.share == "all" and args.executor != "rankexec":
        raise SystemExit("--share all needs --executor rankexec (all_ranks_receive)")
    if args.layout == "flat":
        cfg = flat_config(args.size, args.dtype, args.tensors)
        model = {"class_path": "gpt_shape.FlatShape", "args": cfg}
        size = cfg["tensors"] * cfg["elements"] * DTYPES[args.dtype].itemsize
    else:
        cfg = config_for(args.size, args.dtype)
        model = {"class_path": "gpt_shape.GPTShape", "args": cfg}
        size = nbytes(**cfg)
    print(f"model: {cfg}, {size} bytes", flush=True)
    torchrun = f"python3 -m nvflare.app_opt.pt.torchrun_node --nproc-per-node={args.ranks}"
    recipe = FedAvgRecipe(
        name="large-model",
        model=model,
        min_clients=args.clients,
        num_rounds=args.rounds,
        train_script="client.py",  # relative: FLARE ships it as custom/client.py
        train_args=f"--share {args.share} --delta {args.delta}",
        server_expected_format=ExchangeFormat.PYTORCH,
        launch_external_process=args.executor == "flare",
        command=torchrun,
    )
    # The server's persistor imports gpt_shape: ship it in the job's custom code.
    recipe.add_server_file(os.path.join(HERE, "gpt_shape.py"))
    if args.executor == "rankexec":
        from rankexec.flare.recipe import use_rank_groups

        use_rank_groups(recipe, num_of_processes=args.ranks, all_ranks_receive=args.share == "all")
    return recipe


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=parse_size, default=parse_size("256MiB"))
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument(
        "--layout", choices=("gpt2", "flat"), default="gpt2", help="flat: --tensors equal tensors"
    )
    p.add_argument("--tensors", type=int, default=8, help="--layout flat: how many")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--delta", type=float, default=1.0)
    p.add_argument("--share", choices=("wait", "broadcast", "all"), default="wait")
    p.add_argument("--executor", choices=("rankexec", "flare"), default="rankexec")
    p.add_argument("--workspace", default="/tmp/nvflare/large-model")
    args = p.parse_args()
    recipe = make_recipe(args)
    # FLARE's own flags: `--export --export-dir DIR` writes the job and exits.
    run = recipe.execute(
        SimEnv(num_clients=args.clients, num_threads=args.clients, workspace_root=args.workspace)
    )
    print(f"job {run.get_job_id()}: {run.get_status()}; results in {run.get_result()}")


if __name__ == "__main__":
    sys.exit(main())
