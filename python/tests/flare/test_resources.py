"""rankexec as a FLARE site's GPU authority, call by call: FLARE's resource-manager
calls (check, allocate, free, cancel) on `rankexec.flare.resources.GpuResourceManager`
against the real reservation ledger file (in a private XDG_RUNTIME_DIR), a declared
inventory of 2 GPUs of 16 GiB, real FLContexts, and a real second process for the
ledger's reclaim. `python -m rankexec.flare gpus` is run as a site operator runs it.
The whole-FLARE test (POC, admin API) is test_resources_poc.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext

from rankexec import _rankexec
from rankexec.flare.resources import (
    GRANT_ENV,
    INVENTORY_ENV,
    GpuResourceConsumer,
    GpuResourceManager,
    ReservationUnknown,
)

SPEC = {"num_of_gpus": 2, "mem_per_gpu_in_GiB": 8}


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A private ledger and a declared 2 x 16 GiB inventory for this process."""
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    monkeypatch.setenv(INVENTORY_ENV, "2x16GiB")
    for var in ("CUDA_VISIBLE_DEVICES", GRANT_ENV, "CUDA_DEVICE_ORDER"):
        monkeypatch.delenv(var, raising=False)
    return xdg


def ctx(job_id: str) -> FLContext:
    c = FLContext()
    c.set_prop(FLContextKey.CURRENT_JOB_ID, job_id, private=True, sticky=False)
    return c


def ledger() -> list[dict]:
    return json.loads(_rankexec._gpu_ledger())


def wait_until(cond, what: str, cap: float = 30.0) -> None:
    deadline = time.monotonic() + cap
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {cap} s")
        time.sleep(0.05)


def test_two_jobs_of_two_gpus_take_turns_and_the_job_gets_the_reserved_gpus(site):
    m = GpuResourceManager(inventory="2x16GiB")
    consumer = GpuResourceConsumer()
    ok, token_a = m.check_resources(SPEC, ctx("job-a"))
    assert ok
    entries = ledger()
    assert [e["gpu"] for e in entries] == [{"0": 8 << 30, "1": 8 << 30}]
    assert entries[0]["id"].startswith("flare/site/job-a/")
    assert entries[0]["pid"] == os.getpid()

    ok, reason = m.check_resources(SPEC, ctx("job-b"))
    assert not ok
    print("refusal while job-a holds the GPUs:", reason)
    assert reason.startswith("rankexec GPU authority: not now: the job asks for 2 GPUs"), reason
    assert "refused by gpu_memory_floor 2.0 GiB" in reason

    got = m.allocate_resources(SPEC, token_a, ctx("job-a"))
    assert got["gpus"] == ["0", "1"]
    consumer.consume(got)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert os.environ[GRANT_ENV] == entries[0]["id"]
    assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"

    m.free_resources(got, token_a, ctx("job-a"))
    assert ledger() == []
    ok, token_b = m.check_resources(SPEC, ctx("job-b"))
    assert ok
    m.cancel_resources(SPEC, token_b, ctx("job-b"))
    assert ledger() == []
    m.close()


def test_a_job_asking_for_more_than_the_site_has_is_refused_with_the_reason(site):
    m = GpuResourceManager(inventory="2x16GiB")
    ok, reason = m.check_resources({"num_of_gpus": 3, "mem_per_gpu_in_GiB": 8}, ctx("big"))
    assert not ok
    assert reason == (
        "rankexec GPU authority: the job asks for 3 GPUs; this site has 2 (GPU 0, GPU 1) "
        "(it can never run on this site)"
    )
    ok, reason = m.check_resources({"num_of_gpus": 1, "mem_per_gpu_in_GiB": 15}, ctx("fat"))
    assert not ok and "never fits, even on idle GPUs" in reason, reason
    for bad, says in (
        ({"num_of_gpus": "2"}, "num_of_gpus must be a whole number"),
        ({"num_of_gpus": True}, "num_of_gpus must be a whole number"),
        ({"num_of_gpus": 1, "mem_per_gpu_in_GiB": -1}, "mem_per_gpu_in_GiB must be a number"),
        ({"mem_per_gpu_in_GiB": 4}, "is given without num_of_gpus"),
        (["num_of_gpus", 2], "resource_spec must be a dict"),
    ):
        ok, reason = m.check_resources(bad, ctx("bad"))
        assert not ok and says in reason, (bad, reason)
    assert ledger() == []


def test_a_job_without_gpus_sees_none_and_leaves_no_grant_behind(site):
    m = GpuResourceManager()
    consumer = GpuResourceConsumer()
    ok, token = m.check_resources(SPEC, ctx("gpu-job"))
    consumer.consume(m.allocate_resources(SPEC, token, ctx("gpu-job")))
    assert os.environ[GRANT_ENV]
    ok, plain = m.check_resources({}, ctx("cpu-job"))
    assert ok
    got = m.allocate_resources({}, plain, ctx("cpu-job"))
    assert got["gpus"] == []
    consumer.consume(got)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert GRANT_ENV not in os.environ
    m.close()
    assert ledger() == []


def test_a_reservation_never_started_expires(site):
    m = GpuResourceManager(expiration_period=0.3)
    ok, token = m.check_resources(SPEC, ctx("late"))
    assert ok and len(ledger()) == 1
    wait_until(lambda: ledger() == [], "the unstarted reservation expires")
    with pytest.raises(ReservationUnknown, match="no live reservation"):
        m.allocate_resources(SPEC, token, ctx("late"))
    m.close()


def test_expiry_racing_allocation_never_books_a_gpu_twice(site):
    """Reservations expiring while their jobs are allocated, many times: each job's
    allocation either wins (its ledger entry stays for as long as the job runs) or
    loses (ReservationUnknown, the entry gone); never both, a job running on GPUs whose
    ledger entry the expiry removed (the next job would be admitted onto them). Twenty
    small reservations expire together so that the expiry thread releases them one by
    one while this thread allocates them from the other end."""
    import random

    period, jobs, rounds = 0.05, 20, 25
    spec = {"num_of_gpus": 1, "mem_per_gpu_in_GiB": 0.25}
    m = GpuResourceManager(expiration_period=period)
    won = {"allocation": 0, "expiry": 0}
    try:
        for r in range(rounds):
            tokens = []
            for k in range(jobs):
                ok, token = m.check_resources(spec, ctx(f"job-{r}-{k}"))
                assert ok, token
                tokens.append((k, token))
            time.sleep(period * random.uniform(0.8, 1.4))
            running = {}
            for k, token in reversed(tokens):
                try:
                    running[token] = m.allocate_resources(spec, token, ctx(f"job-{r}-{k}"))
                    won["allocation"] += 1
                except ReservationUnknown:
                    won["expiry"] += 1
            wait_until(lambda: m._sweeper is None, "the expiry thread idle")
            held = sorted(e["id"] for e in ledger())
            grants = sorted(g["grant"] for g in running.values())
            assert held == grants, (
                f"round {r}: jobs {sorted(set(grants) - set(held))} run on GPUs the ledger"
                " no longer holds for them"
            )
            for token, got in running.items():
                m.free_resources(got, token, ctx("-"))
            assert ledger() == []
    finally:
        m.close()
    print(f"\n[gpu-authority] {rounds * jobs} races: {won}")
    assert ledger() == []


HOLDER = """
import sys
from nvflare.apis.fl_context import FLContext
from rankexec.flare.resources import GpuResourceManager
m = GpuResourceManager(inventory="2x16GiB")
ok, token = m.check_resources({"num_of_gpus": 2, "mem_per_gpu_in_GiB": 8}, FLContext())
print("held" if ok else token, flush=True)
sys.stdin.read()
"""


def test_a_dead_holders_reservation_is_reclaimed(site):
    """A FLARE client SIGKILLed while it holds GPUs: the next check drops its entry."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        assert [e["pid"] for e in ledger()] == [holder.pid]
        m = GpuResourceManager()
        ok, reason = m.check_resources(SPEC, ctx("next"))
        assert not ok and "reserved by other executors" in reason, reason
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
        ok, _ = m.check_resources(SPEC, ctx("next"))
        assert ok
        assert [e["pid"] for e in ledger()] == [os.getpid()]
        m.close()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=30)


def test_the_declared_inventory_is_checked_and_not_declared_twice(site, monkeypatch):
    with pytest.raises(ValueError, match="invalid GPU inventory `2xx16GiB`"):
        GpuResourceManager(inventory="2xx16GiB")
    with pytest.raises(ValueError, match="declares its GPUs twice"):
        GpuResourceManager(inventory="4x80GiB")
    monkeypatch.delenv(INVENTORY_ENV)
    GpuResourceManager(inventory="1x24GiB")
    assert os.environ[INVENTORY_ENV] == "1x24GiB"
    inv = json.loads(_rankexec._gpu_inventory())
    assert [g["memory_total"] for g in inv["gpus"]] == [24 << 30]


def provisioned_site(root: Path) -> Path:
    """A site kit as `nvflare provision` writes it: startup/ and
    local/resources.json.default with FLARE's own GPU manager."""
    ws = root / "site-1"
    (ws / "startup").mkdir(parents=True)
    (ws / "startup" / "fed_client.json").write_text("{}")
    (ws / "local").mkdir()
    default = {
        "format_version": 2,
        "client": {"retry_timeout": 30},
        "components": [
            {
                "id": "resource_manager",
                "path": "nvflare.app_common.resource_managers.gpu_resource_manager."
                "GPUResourceManager",
                "args": {"num_of_gpus": 0, "mem_per_gpu_in_GiB": 0, "expiration_period": 300},
            },
            {
                "id": "resource_consumer",
                "path": "nvflare.app_common.resource_consumers.gpu_resource_consumer."
                "GPUResourceConsumer",
                "args": {},
            },
            {"id": "process_launcher", "path": "x.Launcher", "args": {}},
        ],
    }
    (ws / "local" / "resources.json.default").write_text(json.dumps(default, indent=2))
    return ws


def gpus_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rankexec.flare", "gpus", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_site_command_installs_the_authority_and_keeps_the_rest(tmp_path):
    ws = provisioned_site(tmp_path)
    resources = ws / "local" / "resources.json"
    dry = gpus_cli(str(ws), "--inventory", "2x16GiB", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert '+      "path": "rankexec.flare.resources.GpuResourceManager"' in dry.stdout
    assert not resources.exists()
    bad = gpus_cli(str(ws), "--inventory", "2xx16GiB")
    assert bad.returncode == 1 and "invalid GPU inventory" in bad.stderr, bad.stderr
    assert not resources.exists()
    done = gpus_cli(str(ws), "--inventory", "2x16GiB", "--floor-gib", "1")
    assert done.returncode == 0, done.stderr
    print(done.stdout)
    doc = json.loads(resources.read_text())
    by_id = {c["id"]: c for c in doc["components"]}
    assert by_id["resource_manager"] == {
        "id": "resource_manager",
        "path": "rankexec.flare.resources.GpuResourceManager",
        "args": {"inventory": "2x16GiB", "gpu_memory_floor_GiB": 1.0},
    }
    assert by_id["resource_consumer"]["path"] == "rankexec.flare.resources.GpuResourceConsumer"
    assert by_id["process_launcher"]["path"] == "x.Launcher"
    assert doc["client"] == {"retry_timeout": 30}
    again = gpus_cli(str(ws), "--inventory", "2x16GiB", "--floor-gib", "1")
    assert again.returncode == 0 and "no change" in again.stdout, again.stdout
