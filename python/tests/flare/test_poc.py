"""rankexec on a real FLARE deployment: `nvflare poc prepare` (a provisioned kit with
certificates, `resources.json.default`, its own resource manager and job launcher),
`nvflare poc start` (server and two clients as separate processes), jobs submitted,
aborted and watched through FLARE's admin API (`nvflare.fuel.flare_api`).

The site steps are the guide's own script, `examples/flare/poc/site-steps.sh`
(docs/flare-admins.md includes it): `nvflare poc prepare`, `python -m rankexec.flare
allow-list` (a dry run, then written) on the server and both clients, `python -m
rankexec.flare policy` that allows the one rank component installed on the sites, and
`nvflare poc start`. Then, on the same deployment, in order:

- a job of FLARE's own (NPTrainer, no rankexec) runs: the site steps broke nothing;
- a SIGKILL of a client's job process mid-round: its ranks are gone, and the client runs
  the next job;
- two jobs at once on the same sites;
- `examples/flare/client-api/recipe_job.py` (FLARE's Recipe API with
  `use_rank_groups`) through `ProdEnv` with the deployment's admin kit.

The Client API example, a job without custom code under the site policy and an admin
abort while the ranks train run on a provisioned deployment instead
(`test_provisioned.py`: production kits, where users run them).

The SIGKILL test submits, reads the status of and aborts its job with
docs/flare-admins.md's admin-API block itself (`run-in: admin-api`), statement by
statement, with the page's kit and job folders mapped to this test's.

Finally `nvflare poc stop` and nothing of the deployment is left (`Poc.stop` returns
what it had to kill).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import docrun
import pytest

from .flare_helpers import REPO, rank_pids, wait_until
from .poc import START_CAP_S, Poc, assert_completed, log_dir_of, numpy_job_without_custom_code

JOB_CAP_S = float(os.environ.get("RANKEXEC_POC_JOB_CAP", "240"))
CLIENT_API = REPO / "examples" / "flare" / "client-api" / "jobs" / "rankexec"


def flare_own_job(root: Path, rounds: int = 2) -> Path:
    """FLARE's hello-numpy-sag: only FLARE's classes, no custom code."""
    job = root / "hello-numpy-sag"
    cfg = job / "app" / "config"
    cfg.mkdir(parents=True)
    server = {
        "format_version": 2,
        "task_data_filters": [],
        "task_result_filters": [],
        "components": [
            {
                "id": "persistor",
                "path": "nvflare.app_common.np.np_model_persistor.NPModelPersistor",
                "args": {},
            },
            {
                "id": "shareable_generator",
                "path": "nvflare.app_common.shareablegenerators."
                "full_model_shareable_generator.FullModelShareableGenerator",
                "args": {},
            },
            {
                "id": "aggregator",
                "path": "nvflare.app_common.aggregators.intime_accumulate_model_aggregator."
                "InTimeAccumulateWeightedAggregator",
                "args": {"expected_data_kind": "WEIGHTS"},
            },
        ],
        "workflows": [
            {
                "id": "scatter_and_gather",
                "path": "nvflare.app_common.workflows.scatter_and_gather.ScatterAndGather",
                "args": {
                    "min_clients": 2,
                    "num_rounds": rounds,
                    "wait_time_after_min_received": 0,
                    "aggregator_id": "aggregator",
                    "persistor_id": "persistor",
                    "shareable_generator_id": "shareable_generator",
                    "train_task_name": "train",
                    "train_timeout": 0,
                },
            }
        ],
    }
    client = {
        "format_version": 2,
        "executors": [
            {
                "tasks": ["train"],
                "executor": {"path": "nvflare.app_common.np.np_trainer.NPTrainer", "args": {}},
            }
        ],
        "task_result_filters": [],
        "task_data_filters": [],
        "components": [],
    }
    (cfg / "config_fed_server.json").write_text(json.dumps(server, indent=2))
    (cfg / "config_fed_client.json").write_text(json.dumps(client, indent=2))
    meta = {"name": "hello-numpy-sag", "resource_spec": {}, "deploy_map": {"app": ["@ALL"]}}
    (job / "meta.json").write_text(json.dumps(meta, indent=2))
    return job


def long_client_api_job(root: Path, rounds: int = 50, epochs: int = 40) -> Path:
    """The Client API example with rounds long enough to be interrupted mid-training."""
    job = root / "client-api-long"
    shutil.copytree(CLIENT_API, job)
    server_cfg = job / "app_server" / "config" / "config_fed_server.json"
    server = json.loads(server_cfg.read_text())
    server["workflows"][0]["args"]["num_rounds"] = rounds
    server_cfg.write_text(json.dumps(server, indent=2))
    for site in ("app_site-1", "app_site-2"):
        cfg = job / site / "config" / "config_fed_client.json"
        client = json.loads(cfg.read_text())
        client["executors"][0]["executor"]["args"]["script_args"] = f"--epochs {epochs}"
        cfg.write_text(json.dumps(client, indent=2))
    return job


def rank_log_says(poc: Poc, job_id: str, site: str, text: str) -> bool:
    for log in (poc.job_dir(site, job_id)).rglob("rankexec/rank-0/stdout.log"):
        if text in log.read_text(errors="replace"):
            return True
    return False


def job_rank_pids(poc: Poc, job_id: str, site: str | None = None) -> list[int]:
    where = poc.job_dir(site, job_id) if site else poc.ws
    return [p for p in rank_pids(where) if job_id in log_dir_of(p)]


@pytest.fixture(scope="module")
def poc(tmp_path_factory):
    root = tmp_path_factory.mktemp("poc")
    d = Poc(root)
    # The site's own rank code, installed by the site (not shipped by jobs).
    code = root / "site-code"
    code.mkdir()
    shutil.copy(REPO / "examples/flare/numpy-fedavg/app/custom/np_delta.py", code)
    d.component = code / "np_delta.py"
    # docs/flare-admins.md's walk-through, the page's script itself, with this test's
    # kit (free ports), sites and rank code: prepare, allow-list (dry run, then
    # written) on every site, the clients' policy, `nvflare poc start`.
    env = dict(
        d.env,
        KIT=str(d.prod),
        PREPARE_ARGS=f"-i {d.yml} --force",
        SITES=" ".join(d.sites),
        COMPONENT=f"{d.component}:AddDelta",
        START_ARGS=f"--timeout {int(START_CAP_S)}",
    )
    site_steps = REPO / "examples" / "flare" / "poc" / "site-steps.sh"
    out = root / "site-steps.out"
    try:  # whatever fails here, the deployment the script may have started is stopped
        steps = docrun.start(["bash", str(site_steps)], out, cwd=root, env=env)
        rc = docrun.finish(steps, out, START_CAP_S + 180, str(site_steps))
        text = out.read_text(errors="replace")
        print(text[-6000:])
        assert rc == 0, f"{site_steps} exited {rc}:\n{text[-4000:]}"
        assert (d.site("site-1") / "local" / "resources.json.default").exists(), text[-4000:]
        assert text.count("wrote ") >= 1 + len(d.sites), text[-4000:]  # a resources.json a site
        for site in d.sites:
            assert (d.site(site) / "local" / "rankexec.json").exists(), site
        ok = wait_until(lambda: d._clients_up(d.session()), START_CAP_S, step=0.5)
        assert ok, f"clients did not connect: {d.session().get_system_info()}"
    except BaseException:
        d.stop()
        raise
    yield d
    left = d.stop()
    assert not left, f"nvflare poc stop left these processes behind: {left}"
    assert not rank_pids(d.ws)


def test_a_job_of_flares_own_runs_after_the_site_steps(poc, tmp_path):
    for site in ("server", *poc.sites):
        resources = json.loads((poc.site(site) / "local" / "resources.json").read_text())
        default = json.loads((poc.site(site) / "local" / "resources.json.default").read_text())
        assert set(default) <= set(resources), site
        assert "rankexec.flare.MultiProcessExecutor" in resources["class_allow_list"]
    job_id = poc.submit(flare_own_job(tmp_path))
    meta = poc.wait_status(job_id, "FINISHED", JOB_CAP_S)
    assert_completed(poc, job_id, meta)


def test_a_killed_job_process_takes_its_ranks_with_it(poc, tmp_path):
    """docs/flare-admins.md's admin-API block runs as shown (its kit folder and job mapped
    to this deployment's): its session and `submit_job`; once site-1's ranks train, its
    status (RUNNING); then the SIGKILL of site-1's job process; then its `abort_job`."""
    stmts = docrun.statements(
        "docs/flare-admins.md",
        "admin-api",
        paths={
            "/tmp/nvflare/poc/example_project/prod_00": poc.prod,
            "examples/flare/client-api/jobs/rankexec": long_client_api_job(tmp_path),
        },
    )
    ns: dict[str, Any] = {}
    where = "docs/flare-admins.md (admin-api)"
    rest = iter(stmts)
    for stmt in rest:  # up to and including the submission
        docrun.execute(stmt, ns, where)
        if ".submit_job(" in stmt:
            break
    job_id = ns["job_id"]
    assert wait_until(lambda: rank_log_says(poc, job_id, "site-1", "round 0:"), JOB_CAP_S, 0.2)
    for stmt in rest:  # the status
        assert ".get_job_meta(" in stmt, stmt
        assert docrun.execute(stmt, ns, where) == "RUNNING"
        break
    ranks = job_rank_pids(poc, job_id, "site-1")
    assert len(ranks) == 2, ranks
    procs = poc.job_processes(job_id)
    victims = [p for p in procs if str(poc.site("site-1")).encode() in _cmdline(p)]
    assert len(victims) == 1, (procs, victims)
    t0 = time.monotonic()
    os.kill(victims[0], signal.SIGKILL)
    gone = wait_until(lambda: not job_rank_pids(poc, job_id, "site-1"), 30, step=0.01)
    print(f"client job process SIGKILLed -> its ranks gone: {time.monotonic() - t0:.3f} s")
    assert gone, f"site-1's ranks outlived their job process: {ranks}"
    for stmt in rest:  # the abort: site-1 will never answer, the admin ends the job
        docrun.execute(stmt, ns, where)
    try:
        ns["s"].close()
    except Exception as e:  # noqa: BLE001 (a session already closed)
        print(f"closing the page's admin session: {type(e).__name__}: {e}")
    meta = poc.wait_status(job_id, "FINISHED", JOB_CAP_S)
    assert str(meta.get("status", "")).startswith("FINISHED"), meta
    assert wait_until(lambda: not job_rank_pids(poc, job_id), 60, step=0.1)
    nxt = poc.submit(numpy_job_without_custom_code(tmp_path, poc.component, rounds=1))
    assert_completed(poc, nxt, poc.wait_status(nxt, "FINISHED", JOB_CAP_S))


def test_two_jobs_at_once_on_the_same_sites(poc, tmp_path):
    a = poc.submit(numpy_job_without_custom_code(tmp_path / "a", poc.component, rounds=3))
    b = poc.submit(numpy_job_without_custom_code(tmp_path / "b", poc.component, rounds=3))
    for job_id in (a, b):
        assert_completed(poc, job_id, poc.wait_status(job_id, "FINISHED", JOB_CAP_S))
    assert not job_rank_pids(poc, a) and not job_rank_pids(poc, b)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_a_recipe_runs_as_rank_groups_through_prod_env(poc, tmp_path):
    """`examples/flare/client-api/recipe_job.py --env prod`: FLARE's FedAvgRecipe with
    cross-site evaluation and TensorBoard tracking, `use_rank_groups`, and
    `recipe.execute(ProdEnv(startup_kit_location=...))` against this deployment."""
    example = tmp_path / "client-api"
    shutil.copytree(REPO / "examples" / "flare" / "client-api", example, ignore=_no_jobs)
    out = tmp_path / "recipe.out"
    with out.open("w") as f:
        proc = subprocess.Popen(
            [sys.executable, "recipe_job.py", "--env", "prod", "--rounds", "2"]
            + ["--startup-kit", str(poc.admin_kit)],
            cwd=example,
            env=poc.env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=JOB_CAP_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            pytest.fail(f"recipe_job.py did not finish:\n{out.read_text()[-4000:]}")
    text = out.read_text(errors="replace")
    assert rc == 0, text[-4000:]
    line = [x for x in text.splitlines() if x.startswith("job ")][-1]
    assert "FINISHED:COMPLETED" in line, text[-4000:]
    job_id = line.split()[1].rstrip(":")
    results = Path(line.rsplit("results in ", 1)[1])
    cse = list(results.rglob("cross_val_results.json"))
    assert cse, f"no cross-site results under {results}"
    scores = json.loads(cse[0].read_text())
    print(f"cross-site evaluation: {json.dumps(scores)}")
    assert all(v["accuracy"] > 0.5 for site in scores.values() for v in site.values()), scores
    assert list(results.rglob("events.out.tfevents.*")), "no TensorBoard events"
    for site in poc.sites:
        cfg = poc.job_dir(site, job_id).rglob("config_fed_client.json")
        assert any("ScriptExecutor" in c.read_text() for c in cfg), site
    assert wait_until(lambda: not job_rank_pids(poc, job_id), 30, step=0.1)


def _no_jobs(folder: str, names: list[str]) -> list[str]:
    return ["jobs"] if Path(folder).name == "client-api" else []
