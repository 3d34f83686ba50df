"""FLARE's Recipe API with `rankexec.flare.recipe.use_rank_groups`.

The Client API example's `recipe_job.py` (FedAvgRecipe, cross-site evaluation,
TensorBoard tracking, `recipe.execute(SimEnv(...))`) run as a user runs it, 2 sites x 2
ranks, 2 rounds; then what the recipe exports: per-site config, per-site group arguments,
an external-process (torchrun) runner, and the mistakes it refuses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from .flare_helpers import REPO, SIM_CAP_S, assert_no_errors, descendants, rank_pids, site_log

EXAMPLE = REPO / "examples" / "flare" / "client-api"
SITES = ("site-1", "site-2")


def _run_example(ws_root: Path, *args: str, cap: float = SIM_CAP_S) -> str:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("NVFLARE_SIMULATOR_WORKSPACE_ROOT", None)
    out = ws_root.parent / f"{ws_root.name}.out"
    with open(out, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "recipe_job.py", *args, "--workspace", str(ws_root)],
            cwd=EXAMPLE,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
        try:
            rc = proc.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            for pid in descendants(proc.pid):  # the simulator runs in a session of its own
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            proc.kill()
            proc.wait(timeout=30)
            pytest.fail(f"recipe_job.py did not finish within {cap} s:\n{out.read_text()[-4000:]}")
    text = out.read_text(errors="replace")
    assert rc == 0, f"recipe_job.py exited {rc}:\n{text[-4000:]}"
    return text


def _scalars(event_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    found: dict[str, list[tuple[int, float]]] = {}
    for f in sorted(event_dir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(f)).Load():
            for v in event.summary.value:
                value = v.simple_value if v.HasField("simple_value") else v.tensor.float_val[0]
                found.setdefault(v.tag, []).append((event.step, value))
    return found


def test_fedavg_recipe_with_cross_site_eval_and_tracking_runs_as_rank_groups(tmp_path):
    ws_root = tmp_path / "ws"
    output = _run_example(ws_root, "--rounds", "2", "--ranks", "2")
    ws = ws_root / "digits"
    assert_no_errors(ws)
    run = ws / "server" / "simulate_job"

    # What the recipe deployed: the script on a rank group, rankexec not shipped.
    for site in SITES:
        app = ws / site / "simulate_job" / f"app_{site}"
        cfg = json.loads((app / "config" / "config_fed_client.json").read_text())
        (executor,) = [e["executor"] for e in cfg["executors"]]
        assert executor["path"] == "rankexec.flare.script_executor.ScriptExecutor"
        assert executor["args"] == {
            "script": "custom/client.py",
            "script_args": "--epochs 2",
            "num_of_processes": 2,
            "params_exchange_format": "pytorch",
        }
        assert (app / "custom" / "client.py").read_bytes() == (EXAMPLE / "client.py").read_bytes()
        assert not (app / "custom" / "rankexec").exists()
        log = site_log(ws, site)
        assert "rank group of 2 ready" in log and "rank group stopped cooperatively" in log

    # FedAvg: each site's rank 0 trained 2 rounds (and printed the global accuracy).
    firsts = []
    for site in SITES:
        out = (ws / site / "simulate_job" / "rankexec" / "rank-0" / "stdout.log").read_text()
        rounds = [line for line in out.splitlines() if "global accuracy" in line]
        assert len(rounds) == 2, out
        firsts.append(float(rounds[0].split("global accuracy ")[1].split(",")[0]))
        for r in (0, 1):
            err = (ws / site / "simulate_job" / "rankexec" / f"rank-{r}" / "stderr.log").read_text()
            assert "Traceback" not in err, err[-3000:]

    # Cross-site evaluation: every site validated the global model and both local ones.
    cse = json.loads((run / "cross_site_val" / "cross_val_results.json").read_text())
    print("cross-site evaluation:", json.dumps(cse))
    assert sorted(cse) == list(SITES)
    for site in SITES:
        assert {"SRV_FL_global_model.pt", *SITES} <= set(cse[site])
        for model, metrics in cse[site].items():
            assert 0.0 <= metrics["accuracy"] <= 1.0, (site, model)
    final = cse["site-1"]["SRV_FL_global_model.pt"]["accuracy"]
    # All sites share one held-out split: the same model scores the same everywhere.
    assert cse["site-2"]["SRV_FL_global_model.pt"]["accuracy"] == final
    print(f"global accuracy: round 0 {firsts}, final model {final:.4f}")
    assert final >= 0.8 and final > max(firsts) + 0.5

    # Tracking: the scripts' SummaryWriter reached the server's TensorBoard receiver.
    for site in SITES:
        scalars = _scalars(run / "tb_events" / site)
        print(f"{site} tensorboard: {scalars}")
        assert [step for step, _ in scalars.get("train_loss", [])] == [0, 1]

    assert rank_pids(ws) == []
    assert "Traceback" not in output


# ---- what use_rank_groups makes a recipe export ------------------------------------


@pytest.fixture
def in_example(monkeypatch):
    monkeypatch.chdir(EXAMPLE)
    monkeypatch.syspath_prepend(str(EXAMPLE))


def _recipe(**kw):
    from net import Net
    from nvflare.app_opt.pt.recipes.fedavg import FedAvgRecipe

    args = {"name": "digits", "model": Net(), "min_clients": 2, "num_rounds": 2}
    args.update(train_script="client.py", train_args="--epochs 2")
    return FedAvgRecipe(**{**args, **kw})


def _exported(recipe, tmp_path: Path) -> dict[str, dict]:
    """Every client app's executor (path and args) in the recipe's export, by app."""
    recipe.export(str(tmp_path / "out"))
    job = tmp_path / "out" / recipe.name
    found = {}
    for cfg in sorted(job.glob("*/config/config_fed_client.json")):
        assert not (cfg.parent.parent / "custom" / "rankexec").exists()
        (executor,) = [e["executor"] for e in json.loads(cfg.read_text())["executors"]]
        found[cfg.parent.parent.name] = executor
    return found


def test_per_site_config_and_per_site_group_args_in_any_order(tmp_path, in_example):
    from nvflare.recipe import add_cross_site_evaluation, set_per_site_config

    from rankexec.flare.recipe import use_rank_groups

    recipe = _recipe()
    # Before set_per_site_config and add_cross_site_evaluation: the swap waits for export.
    use_rank_groups(
        recipe,
        num_of_processes=2,
        all_ranks_receive=True,
        sites={"site-2": {"num_of_processes": 3}},
    )
    set_per_site_config(recipe, {"site-1": {"train_args": "--epochs 1"}, "site-2": {}})
    add_cross_site_evaluation(recipe)
    apps = _exported(recipe, tmp_path)
    assert sorted(apps) == ["app_site-1", "app_site-2"]
    one, two = apps["app_site-1"], apps["app_site-2"]
    assert one["path"] == two["path"] == "rankexec.flare.script_executor.ScriptExecutor"
    assert one["args"]["script_args"] == "--epochs 1" and one["args"]["num_of_processes"] == 2
    assert two["args"]["script_args"] == "--epochs 2" and two["args"]["num_of_processes"] == 3
    assert one["args"]["all_ranks_receive"] is two["args"]["all_ranks_receive"] is True


def test_external_process_runner_keeps_script_and_args_and_drops_the_launcher(tmp_path, in_example):
    from nvflare.client.config import ExchangeFormat

    from rankexec.flare.recipe import use_rank_groups

    recipe = _recipe(
        server_expected_format=ExchangeFormat.PYTORCH,
        launch_external_process=True,
        command="python3 -m nvflare.app_opt.pt.torchrun_node --nproc-per-node=2",
        train_args="--epochs 2 --lr 0.1",
        client_memory_gc_rounds=2,
    )
    use_rank_groups(recipe, num_of_processes=4, launcher="builtin")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apps = _exported(recipe, tmp_path)
    assert any("memory_gc_rounds=2" in str(w.message) for w in caught), caught
    (executor,) = apps.values()
    assert executor["args"] == {
        "script": "custom/client.py",
        "script_args": "--epochs 2 --lr 0.1",
        "num_of_processes": 4,
        "params_exchange_format": "pytorch",
        "server_expected_format": "pytorch",
    }


def test_mistakes_are_refused(tmp_path, in_example):
    from nvflare.app_common.workflows.fedavg import FedAvg
    from nvflare.job_config.api import FedJob
    from nvflare.recipe.spec import Recipe

    from rankexec.flare.recipe import use_rank_groups

    with pytest.raises(ValueError, match="num_of_processes"):
        use_rank_groups(_recipe(), num_of_processes=0)
    with pytest.raises(ValueError, match="come from the recipe"):
        use_rank_groups(_recipe(), script_args="--epochs 9")
    with pytest.raises(TypeError, match="nprocs"):
        use_rank_groups(_recipe(), nprocs=2)
    with pytest.raises(TypeError, match="Recipe"):
        use_rank_groups(object())
    recipe = use_rank_groups(_recipe(), num_of_processes=2)
    with pytest.raises(RuntimeError, match="already"):
        use_rank_groups(recipe, num_of_processes=2)
    # Per-site group arguments need per-site client apps.
    recipe = use_rank_groups(_recipe(), sites={"site-1": {"num_of_processes": 2}})
    with pytest.raises(ValueError, match="set_per_site_config"):
        recipe.export(str(tmp_path / "a"))
    # A recipe with no Client API script.
    job = FedJob(name="no-script", min_clients=1)
    job.to_server(FedAvg(num_clients=1, num_rounds=1))
    job.to_clients({"some": "param"})
    recipe = use_rank_groups(Recipe(job), num_of_processes=2)
    with pytest.raises(ValueError, match="no Client API script executor"):
        recipe.export(str(tmp_path / "b"))
