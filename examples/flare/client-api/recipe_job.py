"""The digits job written with FLARE's Recipe API, the script's ranks run by rankexec.

FLARE's ``FedAvgRecipe`` with cross-site evaluation and TensorBoard tracking, as FLARE's
own examples write it; one more call, ``use_rank_groups(recipe, num_of_processes=2)``,
makes every site run ``client.py`` (unchanged, DDP over gloo or NCCL) as a group of 2
ranks. Run from this folder:

    python recipe_job.py                        # FLARE's simulator: 2 sites x 2 ranks
    python recipe_job.py --env poc              # a POC deployment (PocEnv starts one)
    python recipe_job.py --env prod --startup-kit /path/to/admin@nvidia.com
    python recipe_job.py --export --export-dir jobs-recipe   # only write the job

Tracking needs ``pip install tensorboard``; the server writes the sites' ``train_loss``
under its run folder's ``tb_events/``. Sites need ``rankexec`` installed.
"""

import argparse

from net import Net
from nvflare.app_opt.pt.recipes.fedavg import FedAvgRecipe
from nvflare.recipe import (
    PocEnv,
    ProdEnv,
    SimEnv,
    add_cross_site_evaluation,
    add_experiment_tracking,
)
from rankexec.flare.recipe import use_rank_groups


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--env", choices=("sim", "poc", "prod"), default="sim")
    p.add_argument("--startup-kit", help="the admin's startup kit (--env prod)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--workspace", default="/tmp/nvflare/simulation", help="--env sim")
    args = p.parse_args()

    recipe = FedAvgRecipe(
        name="digits",
        model=Net(),
        min_clients=2,
        num_rounds=args.rounds,
        train_script="client.py",
        train_args="--epochs 2",
    )
    add_cross_site_evaluation(recipe)
    add_experiment_tracking(recipe, "tensorboard")
    use_rank_groups(recipe, num_of_processes=args.ranks)

    if args.env == "sim":
        env = SimEnv(num_clients=2, workspace_root=args.workspace)
    elif args.env == "poc":
        env = PocEnv(num_clients=2)
    else:
        if not args.startup_kit:
            p.error("--env prod needs --startup-kit")
        env = ProdEnv(startup_kit_location=args.startup_kit)
    run = recipe.execute(env)
    # Waits for the job's end; a POC deployment is then stopped, its workspace kept.
    result = run.get_result(clean_up=False)
    print(f"job {run.get_job_id()}: {run.get_status()}; results in {result}")


if __name__ == "__main__":
    main()
