"""The site decides what a FLARE job runs, under the real `nvflare simulator`: a job
without custom code that picks its own rank program is refused with the key and the
policy file named, and the program never runs; a job with custom code (FLARE's BYOC)
may pick it, unless the site's policy restricts such jobs too."""

from __future__ import annotations

import json

import docrun
import numpy as np

from .flare_helpers import (
    allow_rankexec,
    assert_no_errors,
    client_config,
    error_logs,
    rank_pids,
    run_sim,
    server_config,
    server_model,
    simple_job,
    site_policy,
    write_job,
)

INITIAL = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=np.float32)


def _marker_worker(marker) -> dict:
    """A 'rank program' that only leaves a marker file behind if it ever runs."""
    return {"program": "/bin/sh", "args": ["-c", f"touch {marker}"]}


def test_a_job_without_custom_code_cannot_pick_the_rank_program(tmp_path):
    marker = tmp_path / "the-job-ran-its-program"
    job = simple_job(
        tmp_path,
        "no-byoc",
        {"num_of_processes": 2, "rank_component": "Echo", "worker": _marker_worker(marker)},
        num_rounds=1,
    )
    ws = tmp_path / "ws"
    allow_rankexec(ws)  # the executor class is allowed; no policy file
    run_sim(job, ws, check=False)
    text = "\n".join(error_logs(ws).values())
    policy_file = ws / "site-1" / "local" / "rankexec.json"
    assert "rank group refused: job arg `worker`" in text, text[-3000:]
    assert str(policy_file) in text, text[-3000:]
    print(next(line for line in text.splitlines() if "rank group refused" in line)[:500])
    assert not marker.exists(), "the job's rank program ran"
    assert rank_pids(ws) == []


def test_a_job_without_custom_code_cannot_name_a_component_outside_the_policy(
    tmp_path, rust_worker
):
    job = simple_job(
        tmp_path,
        "no-byoc-component",
        {
            "num_of_processes": 1,
            "rank_component": "subprocess:Popen",
            "rank_args": {"args": ["touch", str(tmp_path / "popen-ran")]},
        },
        num_rounds=1,
    )
    ws = tmp_path / "ws"
    allow_rankexec(ws, worker=rust_worker, components=("Echo",))
    run_sim(job, ws, check=False)
    text = "\n".join(error_logs(ws).values())
    assert "job arg `rank_component`: the rank component `subprocess:Popen`" in text, text[-3000:]
    assert str(ws / "site-2" / "local" / "rankexec.json") in text
    print(next(line for line in text.splitlines() if "rank group refused" in line)[:500])
    assert not (tmp_path / "popen-ran").exists()
    assert rank_pids(ws) == []


def _byoc_job(tmp_path, name, worker):
    files = {"custom/site_notes.py": "# this app ships code: FLARE marks the job BYOC\n"}
    app = {
        "server": server_config(num_rounds=1),
        "client": client_config(
            {"num_of_processes": 2, "rank_component": "Echo", "worker": worker}
        ),
        "files": files,
    }
    return write_job(tmp_path, name, {"app": app}, {"app": ["@ALL"]})


def test_a_job_with_custom_code_may_pick_the_rank_program(tmp_path, rust_worker):
    job = _byoc_job(tmp_path, "byoc", {"program": rust_worker})
    ws = tmp_path / "ws"
    run_sim(job, ws)  # no allow-list and no policy: FLARE trusts BYOC jobs, so do we
    assert_no_errors(ws)
    np.testing.assert_array_equal(server_model(ws), INITIAL)
    log = (ws / "site-1" / "log.txt").read_text()
    assert "job with custom code: not restricted" in log
    assert "rank group of 2 ready" in log
    assert rank_pids(ws) == []


def test_a_site_can_restrict_jobs_with_custom_code_too(tmp_path):
    marker = tmp_path / "the-job-ran-its-program"
    job = _byoc_job(tmp_path, "byoc-restricted", _marker_worker(marker))
    ws = tmp_path / "ws"
    site_policy(ws, byoc_jobs="restricted")
    run_sim(job, ws, check=False)
    text = "\n".join(error_logs(ws).values())
    assert "rank group refused: job arg `worker`" in text, text[-3000:]
    print(next(line for line in text.splitlines() if "rank group refused" in line)[:500])
    assert not marker.exists()
    assert rank_pids(ws) == []


def test_a_client_api_script_outside_the_policy_is_refused_at_start_run(tmp_path):
    """A job without custom code whose ScriptExecutor names a script the site's policy
    does not list is refused at START_RUN with the rule named; the script never runs.
    Allowing the executor class, or any component, is not enough. (Other arguments for
    an allowed script: test_policy_units.py, the same check.)"""
    site_dir = tmp_path / "site-scripts"
    site_dir.mkdir()
    marker = tmp_path / "the-script-ran"
    evil = tmp_path / "elsewhere.py"
    evil.write_text(f"open({str(marker)!r}, 'w').close()\n")
    allowed = site_dir / "train.py"
    allowed.write_text(f"open({str(marker)!r}, 'w').close()\n")
    cases = {
        "another script": ({"script": str(evil)}, "job arg `script`: the script"),
    }
    for i, (what, (args, says)) in enumerate(cases.items()):
        client = client_config({"num_of_processes": 2, **args})
        client["executors"][0]["executor"]["path"] = "rankexec.flare.ScriptExecutor"
        app = {"server": server_config(num_rounds=1), "client": client}
        job = write_job(tmp_path, f"script-{i}", {"app": app}, {"app": ["@ALL"]})
        ws = tmp_path / f"ws-{i}"
        allow_rankexec(ws)
        # The site allows the class too (FLARE's class_allow_list): still not enough.
        res = ws / "local" / "resources.json"
        doc = json.loads(res.read_text())
        doc["class_allow_list"].append("rankexec.flare.ScriptExecutor")
        res.write_text(json.dumps(doc))
        site_policy(ws, components=["*"], scripts=[str(allowed)])
        run_sim(job, ws, check=False)
        text = "\n".join(error_logs(ws).values())
        assert f"rank group refused: {says}" in text, (what, text[-3000:])
        # The line docs/flare-script-policy.md shows, its site's folder being `ws`.
        shown = docrun.log_lines(
            "docs/flare-script-policy.md", "refused", tmp=tmp_path, paths={"/opt/flare": ws}
        )
        assert not docrun.missing_lines(shown, text), (shown, text[-3000:])
        assert str(ws / "site-1" / "local" / "rankexec.json") in text
        assert "under `scripts` there" in text
        print(
            f"\n[flare-policy] {what}: "
            + next(line for line in text.splitlines() if "rank group refused" in line)[:400]
        )
        assert not marker.exists(), "the script ran"
        assert rank_pids(ws) == []
