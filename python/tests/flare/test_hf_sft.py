"""FLARE's own LLM example (``nvflare.client.hf`` on a TRL ``SFTTrainer``) as rank groups,
run as its user runs it.

``examples/flare/hf-sft`` is NVFlare's ``examples/advanced/llm_hf`` (``client.py``,
``job.py``, ``hf_sft_model.py``, ``hf_peft_model.py``): ``flare.patch(trainer,
params_scope="auto", server_key_prefix="model.", local_epochs=...)``, the loop ``while
flare.is_running(): trainer.evaluate(); trainer.train()``, and a ``FedAvgRecipe`` whose
model is a ``{"class_path": ..., "args": ...}`` dict the server builds. ``job.py`` adds
``use_rank_groups(recipe, num_of_processes=2)``; ``client.py`` runs on CPU ranks where
there is no GPU and wraps the model in DDP after ``evaluate()`` (see its "rankexec copy"
comments). ``prepare_model.py`` builds the model (a GPT-Neo of 0.1M parameters, from a
config), its tokenizer and Dolly-style records, offline.

``python job.py ...`` under FLARE's simulator, 2 sites x 2 ranks, 2 rounds, once with
``--train_mode SFT`` and once with ``PEFT``: the job completes with no error logged,
every round is aggregated from both sites, each site's ranks are one group of 2 for the
whole run that stops cooperatively, both ranks of every site trained each round under
DDP (``DistributedDataParallel``, world size 2) and the server weighed each result by
both ranks' samples, the eval loss each site reports to the server falls from the first
round to the second, only the LoRA adapter travels in PEFT mode (the full model in SFT),
and nothing is left running.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import docrun
import pytest

from .flare_helpers import REPO, SIM_CAP_S, assert_no_errors, rank_pids, run_capped, site_log

for _module in ("transformers", "trl", "peft", "datasets", "accelerate", "tokenizers"):
    pytest.importorskip(_module)

EXAMPLE = REPO / "examples" / "flare" / "hf-sft"
SITES = ("site-1", "site-2")
ROUNDS = 2
# Per round and site: 2 optimizer steps (160 records, 2 ranks, batch x accumulation 40)
# of 80 samples each, as the patch counts them (steps x batch x accumulation x world size).
STEPS_PER_ROUND = 2
SAMPLES_PER_ROUND = 160


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["HF_HUB_OFFLINE"] = "1"  # everything is local; a Hub lookup fails at once
    env["HF_HOME"] = str(tmp / "hf-home")  # datasets' cache of the records
    env["TOKENIZERS_PARALLELISM"] = "false"
    env.pop("WANDB_API_KEY", None)  # the example reports to TensorBoard, in its folder
    return env


def _steps(tmp: Path, example: Path, ws: Path) -> list[docrun.Step]:
    """The guide's two commands (docs/flare-jobs.md, read from the page): its `/tmp/`
    is `tmp`, its workspace `ws`, and its example folder `example`."""
    paths = {"examples/flare/hf-sft": example, "/tmp/hf-sft/ws": ws}
    steps = docrun.console("docs/flare-jobs.md", "hf-sft", tmp=tmp, paths=paths)
    assert len(steps) == 2, steps
    return steps


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """The folder that stands for the guide's `/tmp/`, with the model and the records
    the guide's ``prepare_model.py`` command writes in it."""
    from nvflare.fuel.utils.gpu_utils import get_host_gpu_ids

    gpus = get_host_gpu_ids()
    if 0 < len(gpus) < 4:
        pytest.skip(f"FLARE's simulator refuses --gpu [0,1],[2,3] on a host with {len(gpus)} GPUs")
    tmp = tmp_path_factory.mktemp("hf-sft")
    step = _steps(tmp, EXAMPLE, tmp / "unused")[0]
    assert step.argv[1:2] == [str(EXAMPLE / "prepare_model.py")], step
    out = run_capped(step.argv, step.cwd, _env(tmp) | step.env, tmp / "prepare.out", 120)
    assert (why := step.check(0, out)) is None, why
    return tmp


@pytest.mark.parametrize("mode", ["SFT", "PEFT"])
def test_flare_s_llm_hf_example_trains_with_ddp_on_rank_groups(prepared, tmp_path, mode):
    import torch

    app = tmp_path / "hf-sft"
    shutil.copytree(EXAMPLE, app, ignore=shutil.ignore_patterns("__pycache__"))
    root = tmp_path / "ws"
    # The guide's command, FLARE's README command for two sites of two GPUs each (the GPU
    # groups and ports only shape the torchrun command that use_rank_groups drops; on a
    # host without GPUs the simulator takes the groups as they are), in `mode` (the page:
    # "# or --train_mode PEFT").
    step = _steps(prepared, app, root)[1]
    cmd = list(step.argv)
    assert cmd[1:2] == ["job.py"] and step.cwd == app, step
    assert cmd[cmd.index("--train_mode") + 1] == "SFT", cmd
    cmd[cmd.index("--train_mode") + 1] = mode
    assert cmd[cmd.index("--num_rounds") + 1] == str(ROUNDS), cmd
    assert cmd[cmd.index("--client_ids") + 1 : cmd.index("--num_rounds")] == list(SITES), cmd
    env = _env(tmp_path) | step.env
    env["NVFLARE_SIMULATOR_WORKSPACE_ROOT"] = str(root)  # the same as --workspace_dir
    output = run_capped(cmd, step.cwd, env, tmp_path / "job.out", 2 * SIM_CAP_S)
    assert (why := step.check(0, output)) is None, why

    ws = root / f"llm_hf_{mode.lower()}"
    assert_no_errors(ws)
    assert "Traceback" not in output, output[-4000:]
    server = (ws / "server" / "log.txt").read_text(errors="replace")
    for r in range(ROUNDS):
        assert f"Round {r} started" in server, server[-3000:]
    assert server.count("Aggregated 2/2 results") == ROUNDS, server[-3000:]

    for site in SITES:
        log = site_log(ws, site)
        # One group for the whole run, ended at END_RUN by its scripts' own return.
        assert log.count("rank group of 2 ready") == 1, log[-3000:]
        assert "rank group stopped cooperatively" in log, log[-3000:]
        ranks = ws / site / "simulate_job" / "rankexec"
        for r in (0, 1):
            out = (ranks / f"rank-{r}" / "stdout.log").read_text(errors="replace")
            err = (ranks / f"rank-{r}" / "stderr.log").read_text(errors="replace")
            assert "Traceback" not in err, err[-3000:]
            # FLARE's own line, once: the script started once, as rank r of 2.
            started = re.findall(r"DDP rank (\d+) initialized: world_size=(\d+)", out)
            assert started == [(str(r), "2")], out[-3000:]
            # Every round, on both ranks: the Trainer trained the model wrapped in DDP,
            # over a world of 2, for the round's steps.
            trained = re.findall(
                rf"rank {r} trained: (\w+), world size (\d+), global step (\d+)", out
            )
            steps = [str(STEPS_PER_ROUND * (i + 1)) for i in range(ROUNDS)]
            assert trained == [("DistributedDataParallel", "2", s) for s in steps], out[-3000:]

    # What each site reported to the server, per round: the eval loss of the global model
    # it received (FLARE's ModelScoreCallback adds model_score = -eval_loss), and the
    # weight of its result (samples of both ranks).
    rounds = [
        json.loads(line)
        for line in (ws / "server" / "simulate_job" / "metrics" / "round_metrics.jsonl")
        .read_text()
        .splitlines()
        if line.strip()
    ]
    assert [m["round"] for m in rounds] == list(range(ROUNDS)), rounds
    losses: dict[str, list[float]] = {site: [] for site in SITES}
    for m in rounds:
        assert sorted(s["name"] for s in m["sites"]) == list(SITES), m
        for s in m["sites"]:
            metrics = {x["name"]: x["value"] for x in s["metrics"]}
            assert metrics["model_score"] == pytest.approx(-metrics["eval_loss"]), metrics
            assert s["weight"] == SAMPLES_PER_ROUND, s
            losses[s["name"]].append(metrics["eval_loss"])
    print(f"{mode}: eval loss by round {losses}")
    for site, seq in losses.items():
        assert seq[-1] < seq[0], f"{site}: eval loss did not fall: {seq}"

    # What travelled: the server's model is the adapter alone in PEFT mode (its wrapper's
    # state_dict), the whole model in SFT mode; every client result the server downloaded
    # was that model's size (float32), not the full model's.
    saved = torch.load(
        ws / "server" / "simulate_job" / "app_server" / "FL_global_model.pt", weights_only=False
    )["model"]
    lora = [k for k in saved if "lora_" in k]
    if mode == "PEFT":
        assert lora and len(lora) == len(saved), sorted(saved)[:10]
    else:
        assert not lora and "model.transformer.wte.weight" in saved, sorted(saved)[:10]
    nbytes = sum(v.numel() * 4 for v in saved.values())
    sizes = [
        int(b.replace(",", ""))
        for b in re.findall(r"\[client\] download .*\(([\d,]+) bytes\)", server)
    ]
    assert len(sizes) == ROUNDS * len(SITES), server[-3000:]
    for size in sizes:
        assert nbytes <= size < nbytes + 16384, (size, nbytes)
    assert rank_pids(ws) == []
