"""rankexec as a FLARE site's one GPU authority, in a real FLARE deployment.

A POC system (`nvflare poc prepare -n 1`, a free port, `nvflare poc start` without
the admin console) whose site-1 declares 2 GPUs of 16 GiB and runs
`rankexec.flare.resources.GpuResourceManager` (installed with `python -m
rankexec.flare gpus`). Jobs are submitted through FLARE's admin API
(`new_secure_session`); each runs 1 FedAvg round whose client is a rankexec
MultiProcessExecutor with CPU ranks that record `CUDA_VISIBLE_DEVICES`, the grant and
their start and end times. The server's scheduler may run 4 jobs at once and retries
every second or two, so only the site's manager keeps the jobs apart.

- Two jobs asking for 2 GPUs x 8 GiB each run one after the other, never together,
  and each one's ranks get the 2 GPUs its grant names (their executor asks for 6 GiB a
  rank, which fits only because a job's groups do not count their own grant).
- A job asking for 3 GPUs is refused; the reason is in the admin API's job meta
  (`schedule_history`).
- Two jobs of 1 GPU each run together on different GPUs; killing one's job process
  (SIGKILL) and aborting the other through the admin API frees both reservations.
- The admin API's `report_resources` shows the site's inventory and ledger.
- `nvflare poc stop`, and no process of the deployment is left.

The ledger is the real one, in a private XDG_RUNTIME_DIR given to the whole POC.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import tempfile
import time
from pathlib import Path

import pytest

from rankexec import _rankexec

from .flare_helpers import client_config, rmtree, server_config
from .poc import Poc

SITE = "site-1"
CAP_S = 240.0

PROBE = r'''
"""Records what the rank was given and when it ran (rankexec.flare resources test)."""
import json
import os
import time
from pathlib import Path

import rankexec
from rankexec.flare.arrays import ARRAYS_KEY, from_blobs


class GpuProbe:
    def __init__(self, out, name, hold_s=2.0):
        self.path = Path(out) / f"{name}-rank{os.environ.get('RANK', '0')}.json"
        self.hold_s = float(hold_s)
        # The job process (FLARE's, which hosts the rank group) is the parent: what
        # the site's consumer gave the job is in its environment.
        job = dict(
            kv.split(b"=", 1)
            for kv in Path(f"/proc/{os.getppid()}/environ").read_bytes().split(b"\0")
            if b"=" in kv
        )
        self.record = {
            "name": name,
            "rank": int(os.environ.get("RANK", "0")),
            "pid": os.getpid(),
            "job_pid": os.getppid(),
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "inventory": os.environ.get("RANKEXEC_GPU_INVENTORY"),
            "job_visible": job.get(b"CUDA_VISIBLE_DEVICES", b"").decode(),
            "job_grant": job.get(b"RANKEXEC_GPU_GRANT", b"").decode(),
            "start": time.time(),
        }
        self._write()

    def _write(self):
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.record))
        os.replace(tmp, self.path)

    def execute(self, task, input, ctx, abort):
        aborted = abort.wait(self.hold_s)
        self.record["end"] = time.time()
        self._write()
        if aborted:
            raise rankexec.TaskAborted("aborted")
        arrays = from_blobs(input.blobs, input.meta.get(ARRAYS_KEY))
        return rankexec.Shareable(
            meta={ARRAYS_KEY: input.meta.get(ARRAYS_KEY), "NUM_STEPS_CURRENT_ROUND": 1},
            blobs=dict(arrays),
        )
'''


def wait_for(cond, what: str, cap: float = CAP_S, step: float = 0.2):
    deadline = time.monotonic() + cap
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {cap:g} s")
        time.sleep(step)


def fast_scheduler(server: Path) -> None:
    """The server may run 4 jobs at once and retries a refused job every 1-2 s."""
    resources = server / "local" / "resources.json"
    doc = json.loads(resources.read_text())
    for c in doc["components"]:
        if c["id"] == "job_scheduler":
            c["args"].update(
                max_jobs=4,
                max_schedule_count=1000,
                min_schedule_interval=1.0,
                max_schedule_interval=2.0,
            )
    resources.write_text(json.dumps(doc, indent=2))


@pytest.fixture
def poc(tmp_path, monkeypatch):
    xdg = tempfile.mkdtemp(prefix="rxgpu")  # short: run directories hold sockets
    monkeypatch.setenv("XDG_RUNTIME_DIR", xdg)  # this process reads the same ledger
    p = Poc(tmp_path, clients=1)
    p.env["XDG_RUNTIME_DIR"] = xdg
    for var in ("CUDA_VISIBLE_DEVICES", "RANKEXEC_GPU_INVENTORY", "RANKEXEC_GPU_GRANT"):
        p.env.pop(var, None)
    p.prepare()
    done = p.site_step("gpus", str(p.site(SITE)), "--inventory", "2x16GiB")
    assert done.returncode == 0, done.stderr
    fast_scheduler(p.site("server"))
    try:
        p.start()
    except BaseException:
        p.stop()
        rmtree(Path(xdg))
        raise
    yield p
    left = p.stop()
    rmtree(Path(xdg))
    assert not left, f"processes of the POC were still alive after poc stop: {left}"


def gpu_job(root: Path, name: str, out: Path, num_gpus: int, hold_s: float) -> str:
    executor = {
        "num_of_processes": min(num_gpus, 2),
        "rank_component": "custom/gpu_probe.py:GpuProbe",
        "rank_args": {"out": str(out), "name": name, "hold_s": hold_s},
        "gpu": {"mode": "per_rank"},
        "resources": {"gpu_memory": "6GiB"},
    }
    job = root / name
    app = job / "app"
    (app / "config").mkdir(parents=True)
    (app / "custom").mkdir()
    (app / "custom" / "gpu_probe.py").write_text(PROBE)
    (app / "config" / "config_fed_server.json").write_text(
        json.dumps(server_config(num_rounds=1, min_clients=1, error_logger=False))
    )
    (app / "config" / "config_fed_client.json").write_text(json.dumps(client_config(executor)))
    meta = {
        "name": name,
        "resource_spec": {SITE: {"num_of_gpus": num_gpus, "mem_per_gpu_in_GiB": 8}},
        "deploy_map": {"app": ["@ALL"]},
        "min_clients": 1,
    }
    (job / "meta.json").write_text(json.dumps(meta))
    return str(job)


def records(out: Path, name: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{name}-rank*.json"))]


def flare_grants() -> list[dict]:
    return [e for e in json.loads(_rankexec._gpu_ledger()) if e["id"].startswith("flare/")]


def status(sess, job_id: str) -> str:
    return str(sess.get_job_meta(job_id).get("status", ""))


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_one_gpu_authority_in_a_poc_deployment(poc, tmp_path):
    out = tmp_path / "records"
    out.mkdir()
    jobs = tmp_path / "jobs"
    sess = poc.session()
    try:
        # Two jobs of 2 GPUs x 8 GiB on a site of 2 x 16 GiB, and one of 3 GPUs.
        a = sess.submit_job(gpu_job(jobs, "gpu-a", out, 2, hold_s=3.0))
        b = sess.submit_job(gpu_job(jobs, "gpu-b", out, 2, hold_s=3.0))
        c = sess.submit_job(gpu_job(jobs, "gpu-c", out, 3, hold_s=3.0))
        for j in (a, b):
            wait_for(lambda j=j: status(sess, j).startswith("FINISHED"), f"job {j} finishes")
        assert status(sess, a) == "FINISHED:COMPLETED", sess.get_job_meta(a)
        assert status(sess, b) == "FINISHED:COMPLETED", sess.get_job_meta(b)
        span = {}
        for name, job_id in (("gpu-a", a), ("gpu-b", b)):
            recs = records(out, name)
            assert len(recs) == 2, recs
            # The job got the grant's GPUs; rankexec gave each rank one of them, numbered
            # as torchrun does: each rank sees both, its own at index LOCAL_RANK.
            assert {r["job_visible"] for r in recs} == {"0,1"}, recs
            assert {r["visible"] for r in recs} == {"0,1"}, recs
            assert sorted(r["visible"].split(",")[r["rank"]] for r in recs) == ["0", "1"]
            assert {r["inventory"] for r in recs} == {"2x16GiB"}, recs
            grants = {r["job_grant"] for r in recs}
            assert len(grants) == 1 and grants.pop().startswith(f"flare/{SITE}/{job_id}/"), recs
            span[name] = (min(r["start"] for r in recs), max(r["end"] for r in recs))
        print("ranks ran (epoch s):", span)
        (a0, a1), (b0, b1) = span["gpu-a"], span["gpu-b"]
        assert a1 <= b0 or b1 <= a0, f"the two 2-GPU jobs overlapped: {span}"
        assert not records(out, "gpu-c")

        meta_c = sess.get_job_meta(c)
        history = meta_c.get("schedule_history", [])
        print("gpu-c:", meta_c.get("status"), history[-1] if history else None)
        assert str(meta_c.get("status")) == "SUBMITTED", meta_c
        assert any(
            f"{SITE}: rankexec GPU authority: the job asks for 3 GPUs; this site has 2 "
            "(GPU 0, GPU 1) (it can never run on this site)" in h
            for h in history
        ), history
        sess.delete_job(c)

        # Two jobs of 1 GPU run together on different GPUs; both end badly and free them.
        d = sess.submit_job(gpu_job(jobs, "gpu-d", out, 1, hold_s=600.0))
        e = sess.submit_job(gpu_job(jobs, "gpu-e", out, 1, hold_s=600.0))
        wait_for(lambda: records(out, "gpu-d") and records(out, "gpu-e"), "gpu-d and gpu-e start")
        (rd,), (re_,) = records(out, "gpu-d"), records(out, "gpu-e")
        assert {rd["visible"], re_["visible"]} == {"0", "1"}, (rd, re_)
        held = flare_grants()
        assert sorted(g["id"].split("/")[2] for g in held) == sorted([d, e]), held
        # The admin API's report_resources is the site manager's report (FLARE's table
        # cell is the dict's repr): its inventory and the host's ledger.
        report = ast.literal_eval(sess.report_resources("client", [SITE])[SITE])
        assert sorted(g["id"] for g in report["ledger"] if g["id"].startswith("flare/")) == sorted(
            g["id"] for g in held
        ), report
        assert [g["memory_total"] for g in report["inventory"]["gpus"]] == [16 << 30] * 2
        os.kill(rd["job_pid"], signal.SIGKILL)
        sess.abort_job(e)
        wait_for(lambda: not flare_grants(), "both grants are freed")
        wait_for(lambda: not alive(rd["pid"]) and not alive(re_["pid"]), "their ranks end")
        wait_for(lambda: status(sess, d).startswith("FINISHED"), "gpu-d is finished")
        wait_for(lambda: status(sess, e).startswith("FINISHED"), "gpu-e is finished")
        print("gpu-d (job process killed):", status(sess, d), "gpu-e (aborted):", status(sess, e))
    finally:
        sess.close()
