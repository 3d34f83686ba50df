"""On a real FLARE deployment, side by side: FLARE 2.9's ``ClientAPIExecutor`` +
``torchrun_node`` against ``rankexec.flare.ScriptExecutor``, in one run.

One POC deployment (``nvflare poc prepare`` + ``nvflare poc start``: server and two
clients as separate processes, jobs submitted and aborted through FLARE's admin API,
``nvflare.fuel.flare_api``) runs the two exports of ``examples/flare/client-api``
(``jobs/torchrun`` and ``jobs/rankexec``: the same script, 2 ranks per site, 3 rounds),
alternately, ``--reps`` times each. Figures, per job:

- ``ranks_up_s``: ``submit_job`` returning to all 4 rank processes existing (a process
  whose environment holds ``LOCAL_RANK`` and whose working directory is inside the job's
  folder on a site: the script's interpreters on both sides);
- ``first_round_s``: ``submit_job`` returning to rank 0 of both sites printing its
  round 0 line;
- ``wall_s``: ``submit_job`` returning to the admin API reporting ``FINISHED:COMPLETED``
  (polled every 0.25 s), and FLARE's own ``duration`` of the job (``job_duration_s``);
- ``abort_to_ranks_gone_s``: a 50-round job whose rounds are long (``--epochs 200``, about 10 s per round on an idle machine);
  once both sites printed round 0 and site-1's job log shows it received the round 1
  task (``got task assignment`` twice: the ranks are training it), ``abort_job`` is called; the time until every rank
  process is gone (polled every 10 ms), and until the admin API says
  ``FINISHED:ABORTED`` (``abort_to_status_s``);
- ``client_abort_s``: the executor's share of that abort, from the first client's
  receipt of it (``Received command to abort job`` in the site's job log, a wall-clock
  time) to the last rank gone (seen from outside, as above).

Usage, from the repository root in the venv (nvflare 2.9.0, torch, rankexec):
``python benchmarks/flare/poc_bench.py [--reps 2] [--out FILE]``. The deployment is
stopped at the end; what it left behind is killed and reported.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python" / "tests"))

from flare.poc import Poc

JOBS = REPO / "examples" / "flare" / "client-api" / "jobs"
#: Epochs per round of the aborted job: a round of about 10 s on an idle 2-core machine,
#: so the abort lands while the ranks train round 1.
EPOCHS_LONG = 200
TS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")


def rank_processes(poc: Poc, job_id: str) -> list[int]:
    """Processes of the job's ranks on any site (see the module's doc)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cwd = os.readlink(d / "cwd")
            if job_id not in cwd or not cwd.startswith(str(poc.ws)):
                continue
            env = (d / "environ").read_bytes()
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and b"\0LOCAL_RANK=" in b"\0" + env:
            found.append(int(d.name))
    return found


def round0_seen(poc: Poc, job_id: str, site: str) -> bool:
    """Rank 0 printed its round 0 line: in rankexec's rank log, or (FLARE: the external
    process's output goes to the job's log) in the site's job log."""
    job = poc.job_dir(site, job_id)
    candidates = [*job.rglob("rankexec/rank-0/stdout.log"), job / "log.txt"]
    needle = f"{site} round 0:"
    for f in candidates:
        try:
            if needle in f.read_text(errors="replace"):
                return True
        except OSError:
            continue
    return False


def wait(cond, timeout: float, step: float) -> float | None:
    """Seconds until ``cond()`` held (None: not within ``timeout``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(step)
    return None


def long_job(root: Path, kind: str) -> Path:
    job = root / f"{kind}-long-{time.monotonic_ns()}"
    shutil.copytree(JOBS / kind, job)
    cfg = job / "app_server" / "config" / "config_fed_server.json"
    server = json.loads(cfg.read_text())
    server["workflows"][0]["args"]["num_rounds"] = 50
    cfg.write_text(json.dumps(server, indent=2))
    for site in ("app_site-1", "app_site-2"):
        cfg = job / site / "config" / "config_fed_client.json"
        client = json.loads(cfg.read_text())
        args = client["executors"][0]["executor"]["args"]
        if isinstance(args.get("command"), list):  # FLARE: [..., "--epochs", "2"]
            cmd = args["command"]
            cmd[cmd.index("--epochs") + 1] = str(EPOCHS_LONG)
        else:
            args["script_args"] = f"--epochs {EPOCHS_LONG}"
        cfg.write_text(json.dumps(client, indent=2))
    return job


def _seconds(line: str) -> float | None:
    m = TS.match(line)
    if not m:
        return None
    return dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def abort_receipt(poc: Poc, job_id: str) -> float | None:
    """When the first site's client received the abort (``Received command to abort
    job`` in its job log), as a wall-clock time."""
    times = []
    for site in poc.sites:
        try:
            lines = (poc.job_dir(site, job_id) / "log.txt").read_text(errors="replace")
        except OSError:
            continue
        for line in lines.splitlines():
            if "Received command to abort job" in line:
                t = _seconds(line)
                if t is not None:
                    times.append(t)
                break
    return min(times) if times else None


def run_job(poc: Poc, kind: str) -> dict:
    t0 = time.monotonic()
    job_id = poc.submit(JOBS / kind)
    t_sub = time.monotonic()
    ranks_up = wait(lambda: len(rank_processes(poc, job_id)) >= 4, 300, 0.01)
    first = wait(lambda: all(round0_seen(poc, job_id, s) for s in poc.sites), 300, 0.02)
    meta = poc.wait_status(job_id, "FINISHED", 600)
    wall = time.monotonic() - t_sub
    dur = meta.get("duration", "")
    h, m, s = (dur.split(":") + ["0", "0", "0"])[:3] if dur else ("0", "0", "0")
    return {
        "kind": kind,
        "case": "job",
        "status": meta.get("status"),
        "submit_call_s": t_sub - t0,
        "ranks_up_s": ranks_up,
        "first_round_s": None if first is None else (ranks_up or 0) + first,
        "wall_s": wall,
        "job_duration_s": int(h) * 3600 + int(m) * 60 + float(s),
    }


def tasks_received(poc: Poc, job_id: str, site: str) -> int:
    try:
        text = (poc.job_dir(site, job_id) / "log.txt").read_text(errors="replace")
    except OSError:
        return 0
    return text.count("got task assignment")


def run_abort(poc: Poc, kind: str, root: Path) -> dict:
    job_id = poc.submit(long_job(root, kind))
    up = wait(
        lambda: (
            all(round0_seen(poc, job_id, s) for s in poc.sites)
            and tasks_received(poc, job_id, "site-1") >= 2
        ),
        600,
        0.02,
    )
    pids = rank_processes(poc, job_id)
    t0 = time.monotonic()
    wall0 = time.time()
    poc.session().abort_job(job_id)
    gone = wait(lambda: not rank_processes(poc, job_id), 120, 0.01)
    gone_s = None if gone is None else time.monotonic() - t0
    meta = poc.wait_status(job_id, "FINISHED", 300)
    status_s = time.monotonic() - t0
    receipt = abort_receipt(poc, job_id)
    client_s = None if receipt is None or gone_s is None else wall0 + gone_s - receipt
    return {
        "kind": kind,
        "case": "abort",
        "round0_seen": up is not None,
        "ranks_at_abort": len(pids),
        "status": meta.get("status"),
        "abort_to_ranks_gone_s": gone_s,
        "abort_to_status_s": status_s,
        "client_abort_s": client_s,
        "job_id": job_id,
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", type=Path)
    p.add_argument("--cases", default="job,abort", help="comma-separated: job, abort")
    p.add_argument("--keep", action="store_true", help="keep the deployment's folder")
    args = p.parse_args()
    # A SIGTERM (timeout, kill) still stops the deployment: the `finally` below runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    root = Path(tempfile.mkdtemp(prefix="rx-poc-bench-"))
    poc = Poc(root)
    records: list[dict] = []
    try:
        poc.prepare()
        for site in ("server", *poc.sites):
            r = poc.site_step("allow-list", str(poc.site(site)))
            assert r.returncode == 0, r.stderr
        t = time.monotonic()
        poc.start()
        print(f"POC up in {time.monotonic() - t:.1f} s ({root})", flush=True)
        for rep in range(args.reps):
            for kind in ("torchrun", "rankexec") if rep % 2 == 0 else ("rankexec", "torchrun"):
                cases = args.cases.split(",")
                runs = [run_job] if "job" in cases else []
                if "abort" in cases:
                    runs.append(lambda poc, kind: run_abort(poc, kind, root))
                for case in runs:
                    rec = case(poc, kind)
                    rec["rep"] = rep
                    print(json.dumps(rec), flush=True)
                    records.append(rec)
    finally:
        left = poc.stop()
        print(f"nvflare poc stop; left behind (killed): {left}")
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    if args.out:
        with args.out.open("a") as f:
            stamp = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
            for r in records:
                f.write(json.dumps({"at": stamp, **r}) + "\n")
    print(table(records))
    return 0


def table(records: list[dict]) -> str:
    def med(kind: str, case: str, key: str) -> float | None:
        xs = [r[key] for r in records if r["kind"] == kind and r["case"] == case]
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    rows = [
        ("submit -> 4 ranks up", "job", "ranks_up_s"),
        ("submit -> round 0 done on both sites", "job", "first_round_s"),
        ("submit -> FINISHED:COMPLETED (3 rounds)", "job", "wall_s"),
        ("FLARE's job duration", "job", "job_duration_s"),
        ("admin abort -> every rank gone", "abort", "abort_to_ranks_gone_s"),
        ("admin abort -> FINISHED:ABORTED", "abort", "abort_to_status_s"),
        ("client's receipt of the abort -> last rank gone", "abort", "client_abort_s"),
    ]
    out = ["| figure (median) | FLARE ClientAPIExecutor + torchrun | rankexec | ratio |"]
    out.append("|---|---|---|---|")
    for name, case, key in rows:
        a, b = med("torchrun", case, key), med("rankexec", case, key)
        ratio = f"{a / b:.1f}x" if a and b else ""
        fa = f"{a:.3f} s" if a is not None else "-"
        fb = f"{b:.3f} s" if b is not None else "-"
        out.append(f"| {name} | {fa} | {fb} | {ratio} |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
