"""The Client API example (examples/flare/client-api) under the real `nvflare
simulator`: FLARE's exported job with only the client executor changed, 2 clients x 2
ranks, the unchanged DDP script; and a SIGKILLed client leaves no rank."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import docrun
import numpy as np

from .flare_helpers import (
    REPO,
    Sim,
    allow_rankexec,
    assert_no_errors,
    descendants,
    parent_of,
    rank_pids,
    site_log,
    wait_until,
)

EXAMPLE = REPO / "examples" / "flare" / "client-api"

PROBE = '''
import json
import os

from nvflare.apis.dxo import from_shareable
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_constant import FLContextKey


class AnalyticsProbe(FLComponent):
    """Records every analytics event (what FLARE's tracking receivers consume)."""

    def handle_event(self, event_type, fl_ctx):
        if event_type == "analytix_log_stats":
            dxo = from_shareable(fl_ctx.get_prop(FLContextKey.EVENT_DATA))
            path = os.path.join(os.environ["PROBE_DIR"], fl_ctx.get_identity_name() + ".jsonl")
            with open(path, "a") as f:
                f.write(json.dumps({"tag": dxo.data.get("track_key"),
                                    "value": dxo.data.get("track_value")}) + "\\n")
'''


def _client_configs(job):
    return {
        app.name: json.loads((app / "config" / "config_fed_client.json").read_text())
        for app in sorted(job.glob("app_site-*"))
    }


def _accuracy(state: dict) -> float:
    import torch
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    order = np.random.default_rng(2026).permutation(len(x))
    test = order[: len(x) // 5]  # the script's held-out split
    w = {k: torch.as_tensor(np.asarray(v)) for k, v in state.items()}
    with torch.no_grad():
        h = torch.relu(torch.from_numpy(x[test]) @ w["fc1.weight"].T + w["fc1.bias"])
        logits = h @ w["fc2.weight"].T + w["fc2.bias"]
    return float((logits.argmax(1).numpy() == y[test]).mean())


def test_exported_flare_job_runs_with_only_the_executor_changed(tmp_path, monkeypatch):
    import torch

    torchrun, job = EXAMPLE / "jobs" / "torchrun", tmp_path / "rankexec"
    shutil.copytree(EXAMPLE / "jobs" / "rankexec", job)
    # The same script and the same job, but for the client executor.
    ours, theirs = _client_configs(job), _client_configs(torchrun)
    for app in ("app_site-1", "app_site-2"):
        assert (job / app / "custom" / "client.py").read_bytes() == (
            EXAMPLE / "client.py"
        ).read_bytes()
        assert (torchrun / app / "custom" / "client.py").read_bytes() == (
            EXAMPLE / "client.py"
        ).read_bytes()
        a, b = ours[app], theirs[app]
        assert (
            a["executors"][0]["executor"]["path"] == "rankexec.flare.script_executor.ScriptExecutor"
        )
        assert b["executors"][0]["executor"]["path"].endswith("ClientAPIExecutor")
        for cfg in (a, b):
            del cfg["executors"][0]["executor"]
        assert a == b
    assert (job / "app_server").exists()
    # A probe for FLARE's analytics events (the script's SummaryWriter).
    probe = tmp_path / "probe"
    probe.mkdir()
    monkeypatch.setenv("PROBE_DIR", str(probe))
    for app in ("app_site-1", "app_site-2"):
        (job / app / "custom" / "analytics_probe.py").write_text(PROBE)
        cfg_file = job / app / "config" / "config_fed_client.json"
        cfg = json.loads(cfg_file.read_text())
        cfg["components"].append(
            {"id": "probe", "path": "analytics_probe.AnalyticsProbe", "args": {}}
        )
        cfg_file.write_text(json.dumps(cfg, indent=2))

    # docs/flare-jobs.md's commands, as shown there, on this copy (/tmp/ in tmp_path).
    allow, simulate = docrun.console(
        "docs/flare-jobs.md",
        "client-api",
        tmp=tmp_path,
        paths={"examples/flare/client-api/jobs/rankexec": job},
    )
    rc, out = docrun.run(allow, tmp_path / "allow.out", 60)
    assert (why := allow.check(rc, out)) is None, f"{why}:\n{out}"
    ws = tmp_path / "ws-ca"
    t0 = time.monotonic()
    rc, sim_out = docrun.run(simulate, tmp_path / "sim.out", 400)
    print(f"simulator: {time.monotonic() - t0:.1f} s")
    assert (why := simulate.check(rc, sim_out)) is None, f"{why}:\n{sim_out[-4000:]}"
    assert_no_errors(ws)
    saved = torch.load(
        ws / "server" / "simulate_job" / "app_server" / "FL_global_model.pt", weights_only=False
    )
    final = _accuracy(saved.get("model", saved))
    firsts = []
    for site in ("site-1", "site-2"):
        log = site_log(ws, site)
        assert "rank group of 2 ready" in log and "rank group stopped cooperatively" in log
        for r in (0, 1):
            err = (ws / site / "simulate_job" / "rankexec" / f"rank-{r}" / "stderr.log").read_text()
            assert "Traceback" not in err, err[-3000:]
        out = (ws / site / "simulate_job" / "rankexec" / "rank-0" / "stdout.log").read_text()
        print(out.strip())
        rounds = [line for line in out.splitlines() if "global accuracy" in line]
        assert len(rounds) == 3
        firsts.append(float(rounds[0].split("global accuracy ")[1].split(",")[0]))
        logged = [json.loads(line) for line in (probe / f"{site}.jsonl").read_text().splitlines()]
        print(f"{site}: analytics events {logged}")
        assert [e["tag"] for e in logged] == ["train_loss"] * 3
    print(f"global accuracy: round 0 {firsts}, final model {final:.4f}")
    assert final >= 0.8 and final > max(firsts) + 0.5
    assert rank_pids(ws) == []
    assert "Traceback" not in sim_out


def test_sigkill_of_the_flare_client_leaves_no_script_rank(tmp_path, sim_runner):
    job = tmp_path / "rankexec"
    shutil.copytree(EXAMPLE / "jobs" / "rankexec", job)
    ws = tmp_path / "ws"
    allow_rankexec(ws)
    sim: Sim = sim_runner(job, ws)
    ranks = wait_until(lambda: len(rank_pids(ws)) == 4 and rank_pids(ws), timeout=180, step=0.1)
    assert ranks and len(ranks) == 4, f"ranks never came up:\n{sim.output()[-3000:]}"
    # Kill while the scripts train (both sites' rank 0 have printed a round), or as
    # soon as they run, whichever comes first within the cap.
    wait_until(
        lambda: (
            len(list(ws.glob("site-*/simulate_job/rankexec/rank-0/stdout.log"))) == 2
            and all(
                "round" in p.read_text()
                for p in ws.glob("site-*/simulate_job/rankexec/rank-0/stdout.log")
            )
        ),
        timeout=120,
        step=0.05,
    )
    ranks = rank_pids(ws)
    client = parent_of(ranks[0])
    assert client in descendants(sim.proc.pid)
    mine = [p for p in ranks if parent_of(p) == client]
    assert len(mine) == 2
    t0 = time.monotonic()
    os.kill(client, signal.SIGKILL)
    left = wait_until(lambda: not [p for p in rank_pids(ws) if p in mine], timeout=10.0)
    took = time.monotonic() - t0
    assert left, f"script ranks {mine} outlived their client by 10 s"
    print(f"SIGKILLed client {client}; its script ranks {mine} gone after {took * 1e3:.1f} ms")
    sim.kill()
