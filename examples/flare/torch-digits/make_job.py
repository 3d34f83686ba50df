"""Exports the FLARE job of the realistic PyTorch example with FLARE's own Job API:

    python examples/flare/torch-digits/make_job.py [OUT]    # default: examples/flare/torch-digits/job

- server: FLARE's `FedAvg` controller, 5 rounds of 2 clients, and `PTModel` with
  `allow_numpy_conversion=False`: the model travels as torch tensors (FLARE's PyTorch
  exchange format);
- each client: `rankexec.flare.MultiProcessExecutor`, 2 ranks running
  `custom/torch_rank.py:FlareDigitsTrainer` (DataLoader workers, DDP over gloo on CPU,
  nccl on GPUs), `server_expected_format="pytorch"`.

The job ships custom code (the model and the rank component), so FLARE marks it BYOC
and the site policy trusts it by default (README, "Site set-up").
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAINER = HERE.parents[1] / "python" / "torch_digits" / "trainer.py"
sys.path.insert(0, str(TRAINER.parent))

from nvflare.app_common.workflows.fedavg import FedAvg
from nvflare.app_opt.pt.job_config.model import PTModel
from nvflare.job_config.api import FedJob
from rankexec.flare import MultiProcessExecutor
from trainer import Net


def make_job(out: Path, num_rounds: int = 5, sites: int = 2) -> Path:
    job = FedJob(name="torch-digits", min_clients=sites)
    job.to(FedAvg(num_clients=sites, num_rounds=num_rounds), "server")
    job.to(PTModel(Net(hidden=128), allow_numpy_conversion=False), "server")
    for i in range(1, sites + 1):
        site = f"site-{i}"
        executor = MultiProcessExecutor(
            num_of_processes=2,
            rank_component="custom/torch_rank.py:FlareDigitsTrainer",
            rank_args={
                "epochs": 3,
                "lr": 0.05,
                "batch_size": 32,
                "hidden": 128,
                "num_workers": 2,
                "num_sites": sites,
            },
            deadlines={"startup": "180s", "task": "300s"},
            server_expected_format="pytorch",
        )
        job.to(executor, site, tasks=["train"])
        job.to(str(HERE / "torch_rank.py"), site)
        job.to(str(TRAINER), site)
    job.export_job(str(out))
    return out / job.name


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "job"
    print(make_job(out))
