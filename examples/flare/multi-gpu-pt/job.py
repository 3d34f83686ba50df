# Copyright (c) 2025, NVIDIA CORPORATION.  All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

"""
Job configuration for PyTorch federated learning.

FLARE's own example (NVFlare ``examples/advanced/multi-gpu/pt/job.py``) with the one line
rankexec documents, ``use_rank_groups(recipe, num_of_processes=2)``.
"""

import argparse

from model import Net

from nvflare.app_opt.pt.recipes.fedavg import FedAvgRecipe
from nvflare.recipe import SimEnv, add_experiment_tracking, set_per_site_config
from rankexec.flare.recipe import use_rank_groups


def define_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--num_rounds", type=int, default=5)
    parser.add_argument("--use_tracking", action="store_true", help="Enable TensorBoard tracking")
    return parser.parse_args()


def main():
    args = define_parser()

    train_script = "client.py"
    model = Net()
    num_clients = 2

    # Build train_args based on mode
    train_args = ""
    if args.use_tracking:
        train_args = "--use_tracking"

    recipe = FedAvgRecipe(
        name="pt_ddp",
        model=model,
        min_clients=num_clients,
        num_rounds=args.num_rounds,
        train_script=train_script,
        train_args=train_args,
        launch_external_process=True,  # DDP modes require external process launch
    )
    set_per_site_config(
        recipe,
        {
            "site-1": {
                "command": "python3 -m torch.distributed.run --nnodes=1 --nproc_per_node=2 --master_port=7777",
            },
            "site-2": {
                "command": "python3 -m torch.distributed.run --nnodes=1 --nproc_per_node=2 --master_port=8888",
            },
        },
    )

    # rankexec: each site's client.py runs as a rank group of 2 (the torchrun commands
    # above are dropped: the group starts the ranks, with torchrun's variables set).
    use_rank_groups(recipe, num_of_processes=2)

    if args.use_tracking:
        add_experiment_tracking(recipe, tracking_type="tensorboard")

    env = SimEnv(clients=["site-1", "site-2"], num_threads=2, log_config="full")
    run = recipe.execute(env)
    print()
    print("Result:", run.get_result())
    print("Status:", run.get_status())
    print()


if __name__ == "__main__":
    main()
