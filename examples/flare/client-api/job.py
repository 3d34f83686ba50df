"""Exports the digits job with FLARE's Job API, twice:

- ``jobs/torchrun``: FLARE's own way, ``ScriptRunner(..., launch_external_process=True,
  command="python3 -m nvflare.app_opt.pt.torchrun_node --nproc-per-node=2")``, which
  FLARE exports as a ``ClientAPIExecutor``;
- ``jobs/rankexec``: the same job with ``rankexec.flare.job.ScriptRunner``, which
  exports a ``rankexec.flare.ScriptExecutor``. The two differ only in the client
  executor's ``path`` and ``args``; ``custom/client.py`` is the same file.

(``recipe_job.py`` is the same job written with FLARE's Recipe API.) Run from this
folder: ``python job.py`` (then ``nvflare simulator jobs/rankexec -w WS -n
2 -t 2``).
"""

import argparse

from net import Net
from nvflare.app_opt.pt.job_config.fed_avg import FedAvgJob
from nvflare.job_config.script_runner import ScriptRunner
from rankexec.flare.job import ScriptRunner as RankexecScriptRunner

SCRIPT_ARGS = "--epochs 2"
TORCHRUN = "python3 -m nvflare.app_opt.pt.torchrun_node --nproc-per-node=2"


def export(runner_of, name: str, out: str, rounds: int) -> None:
    job = FedAvgJob(name=name, initial_model=Net(), n_clients=2, num_rounds=rounds, min_clients=2)
    for site in ("site-1", "site-2"):
        job.to(runner_of(), site)
    job.export_job(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="jobs")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    export(
        lambda: ScriptRunner(
            "client.py", script_args=SCRIPT_ARGS, launch_external_process=True, command=TORCHRUN
        ),
        "torchrun",
        args.out,
        args.rounds,
    )
    export(
        lambda: RankexecScriptRunner("client.py", script_args=SCRIPT_ARGS, num_of_processes=2),
        "rankexec",
        args.out,
        args.rounds,
    )


if __name__ == "__main__":
    main()
