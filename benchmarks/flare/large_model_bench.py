"""A large model through FLARE, side by side: FLARE 2.9's ``ClientAPIExecutor`` + torchrun
against ``rankexec.flare.ScriptExecutor``, with every process's memory sampled.

Each side runs the same job under the real ``nvflare simulator``: the one
``examples/flare/large-model/job.py`` exports (FLARE's ``FedAvgRecipe``, a generated
GPT-2-shaped model of ``--size`` in ``--dtype``, or 8 equal tensors with ``--layout flat``, ``server_expected_format="pytorch"``),
with FLARE's own executor (``--executor flare``: ``torchrun_node --nproc-per-node=R``) or
rankexec's (``use_rank_groups``); the script (``client.py``) is the same file: rank 0
receives the global model, adds 1 to every weight in place, sends the whole state dict;
the other ranks wait on a broadcast (``--share wait``), get the model by
``dist.broadcast_object_list`` (``broadcast``) or receive it themselves (``all``,
rankexec's ``all_ranks_receive``).

Every ``--interval`` (0.5 s) the sampler reads ``/proc/PID/smaps_rollup`` of every process
below the simulator and classifies it: ``server`` (the simulator's own processes: the
server and the ``nvflare simulator`` processes above it), ``client_job`` (FLARE's client
job process, ``simulator_worker``), ``torchrun`` (``torchrun_node`` /
``torch.distributed.run``), ``rank0`` and ``rank_other`` (processes with ``RANK`` in their
environment), ``other``. Shared memory is counted apart, so that nothing hides and nothing
counts twice: a memory file's pages that no process maps are in no process's PSS, and a
mapped one is split among its mappers. So each side's memory is the PSS of its processes
without their shared memory (``Pss - Pss_Shmem``) plus the memory files (memfd,
``/dev/shm``) its processes hold open or map, each file once, whole (its allocated
blocks). ``/proc/meminfo``'s ``Shmem`` growth is recorded beside it; it is machine-wide,
so other programs' shared memory shows there too (the load average is recorded).

Figures, per run: per kind the peak PSS of its biggest process and of all its processes
together (GiB); ``client_peak_gib``: job processes + torchrun + every rank + the memory
files they hold, both clients together, at the sample where that sum peaked, and its
parts there; the same above the client side's value when rank 0 first asked for a task
(``client_baseline_gib``), and in model sizes; ``server_peak_gib``; time per round (the
server's ``Round N started`` lines; round 0 includes the clients' start); rank 0's
receive to send (``received`` to ``sent`` probes printed by the script: its own update
plus ``flare.send()``); the whole job. Per site (``sites``: a client job process and
everything below it, with the memory files they hold), its own peak and the parts at
it, above the baseline sample and above the site's idle value (``idle_gib``: its least
from both ranks being up, torch imported, to rank 0's first ``received``; FLARE is
often downloading the first model at the baseline sample already), and above the site
at rest (``rest_gib``: the job process and torchrun at their least in that window, every
rank as large as the other rank was last before the first ``received``; the idle value
catches ranks still importing torch). ``--script inplace``
replaces the example's ``client.py`` in the job by ``inplace_client.py`` (issue 41's
plain in-place script) for both executors. A watchdog kills the run (its own processes, by
pid) when ``MemAvailable`` drops under ``--min-avail`` and records ``"oom_guard": true``
with what it peaked at.

Usage (from the repository root, in the venv with nvflare 2.9.0, torch and rankexec)::

    python benchmarks/flare/large_model_bench.py --size 1GiB --dtype float32 \\
        --clients 2 --ranks 2 --rounds 3 --impl flare,rankexec --out results.jsonl

Prints a JSON line per run and a table; ``--out`` appends the lines to a file.

``RANKEXEC_DRY_RUN=1``: the arguments are parsed and checked as for a run (each of
``--impl`` is ``flare`` or ``rankexec``, the example's ``job.py`` and ``--script``'s file
exist, ``--out``'s folder exists), one ``dry run: ...`` line per run it would make is
printed, and it exits 0 without running anything (python/tests/test_docs.py runs
docs/large-models-scripts.md's commands so).
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "flare" / "large-model"
GIB = 1 << 30
KINDS = ("server", "client_job", "torchrun", "rank0", "rank_other", "other")
CLIENT_KINDS = ("client_job", "torchrun", "rank0", "rank_other")
TS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")
#: A rank's PSS once it has imported torch (about 0.3 GiB): the site is up.
RANK_UP = 200 << 20
#: ``--script``: the file that replaces the example's ``client.py`` in the job.
SCRIPTS = {"inplace": Path(__file__).resolve().parent / "inplace_client.py"}
#: ``--impl``: whose executor runs the job (the example's ``job.py --executor``).
IMPLS = ("flare", "rankexec")
PROBE = re.compile(r"BENCH (\w+) (\d+) ([\d.]+)")


def _epoch(line: str) -> float | None:
    m = TS.match(line)
    if not m:
        return None
    return dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, rest = line.split(":", 1)
        out[name] = int(rest.split()[0]) * 1024
    return out


def _parents() -> dict[int, int]:
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                parents[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return parents


def descendants(root: int, parents: dict[int, int] | None = None) -> list[int]:
    parents = _parents() if parents is None else parents
    out, frontier = [], [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out.extend(kids)
        frontier.extend(kids)
    return out


def _rollup(pid: int) -> dict[str, int] | None:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    out = {}
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 2 and parts[0].endswith(":"):
            out[parts[0][:-1]] = int(parts[1]) * 1024
    return out


def classify(pid: int, root: int) -> str:
    if pid == root:
        return "server"
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return "other"
    if "simulator_worker" in cmd:
        return "client_job"
    if "nvflare simulator" in cmd:  # the server and its helper (resource tracker)
        return "server"
    if "torchrun_node" in cmd or "torch.distributed.run" in cmd or "bin/torchrun" in cmd:
        return "torchrun"
    rank = next((v[5:] for v in env if v.startswith(b"RANK=")), None)
    if rank is not None and ("client.py" in cmd or "run_script" in cmd):
        return "rank0" if rank == b"0" else "rank_other"
    return "other"


def memory_files(pid: int) -> dict[tuple[int, int], int]:
    """The memory files (memfd, /dev/shm) `pid` holds open or maps: (dev, inode) to the
    bytes they have allocated. Each is counted once however many processes hold it."""
    out: dict[tuple[int, int], int] = {}
    paths = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            path = f"/proc/{pid}/fd/{fd}"
            try:
                target = os.readlink(path)
            except OSError:
                continue
            if target.startswith(("/memfd:", "/dev/shm/")):
                paths.append(path)
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                if "/memfd:" in line or "/dev/shm/" in line:
                    paths.append(f"/proc/{pid}/map_files/{line.split()[0]}")
    except OSError:
        return out
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue
        out[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    return out


class Sampler(threading.Thread):
    """Samples the PSS of every process below `root`, the memory files they hold, and
    the machine's Shmem."""

    def __init__(self, root: int, interval: float, min_avail: int, shmem0: int) -> None:
        super().__init__(daemon=True)
        self.root, self.interval, self.min_avail, self.shmem0 = root, interval, min_avail, shmem0
        self.samples: list[dict] = []
        self.kinds: dict[int, str] = {}
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            t = time.time()
            mem = meminfo()
            parents = _parents()
            pids = [self.root, *descendants(self.root, parents)]
            per: dict[str, list[int]] = {k: [] for k in KINDS}
            own: dict[str, int] = dict.fromkeys(KINDS, 0)
            files: dict[tuple[int, int], tuple[int, bool]] = {}
            # Per site (the client job process and everything below it): its processes'
            # own memory by kind, and the memory files they hold (each once per site).
            site_own: dict[int, dict[str, int]] = {}
            site_files: dict[int, dict[tuple[int, int], int]] = {}
            for pid in pids:
                r = _rollup(pid)
                if r is None:
                    continue
                kind = self.kinds.get(pid) or classify(pid, self.root)
                # A rank's kind is known once its script runs (its command line then names it).
                if kind != "other":
                    self.kinds[pid] = kind
                per[kind].append(r.get("Pss", 0))
                # Shared memory is counted below, once per file, whole.
                mine = r.get("Pss", 0) - r.get("Pss_Shmem", 0)
                own[kind] += mine
                site = self._site_of(pid, parents)
                held = memory_files(pid)
                for key, size in held.items():
                    client = kind in CLIENT_KINDS or files.get(key, (0, False))[1]
                    files[key] = (size, client)
                if site is not None and kind in CLIENT_KINDS:
                    parts = site_own.setdefault(site, dict.fromkeys(CLIENT_KINDS, 0))
                    parts[kind] += mine
                    site_files.setdefault(site, {}).update(held)
            self.samples.append(
                {
                    "t": t,
                    "per": per,
                    "own": own,
                    "sites": {
                        site: {
                            **parts,
                            "memory_files": sum(site_files.get(site, {}).values()),
                        }
                        for site, parts in site_own.items()
                    },
                    "files_client": sum(n for n, c in files.values() if c),
                    "files_server": sum(n for n, c in files.values() if not c),
                    "shmem": mem.get("Shmem", 0) - self.shmem0,
                    "avail": mem.get("MemAvailable", 0),
                }
            )
            self.stopped.wait(self.interval)

    def _site_of(self, pid: int, parents: dict[int, int]) -> int | None:
        """The client job process `pid` is, or is below: its site."""
        seen = 0
        while pid and pid != self.root and seen < 64:
            if self.kinds.get(pid) == "client_job":
                return pid
            pid = parents.get(pid, 0)
            seen += 1
        return None


class Guard(threading.Thread):
    """Kills the run (its own processes, by pid) when MemAvailable drops under
    `min_avail`; checked every 0.1 s, apart from the slower sampling."""

    def __init__(self, root: int, min_avail: int, stopped: threading.Event) -> None:
        super().__init__(daemon=True)
        self.root, self.min_avail, self.stopped = root, min_avail, stopped
        self.tripped = False

    def run(self) -> None:
        while not self.stopped.wait(0.1):
            if meminfo().get("MemAvailable", 1 << 62) < self.min_avail:
                self.tripped = True
                kill_tree(self.root)
                return


def kill_tree(root: int) -> None:
    for pid in [*descendants(root), root]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def export_job(args: argparse.Namespace, impl: str, out: Path) -> Path:
    argv = [
        sys.executable,
        "job.py",
        "--size",
        str(args.size),
        "--dtype",
        args.dtype,
        "--layout",
        args.layout,
        "--rounds",
        str(args.rounds),
        "--clients",
        str(args.clients),
        "--ranks",
        str(args.ranks),
        "--share",
        args.share,
        "--executor",
        impl,
        "--export",
        "--export-dir",
        str(out),
    ]
    subprocess.run(argv, cwd=EXAMPLE, check=True, capture_output=True, timeout=300)
    if args.script != "example":
        # The same job, the script replaced (both executors run the same file).
        shutil.copyfile(SCRIPTS[args.script], out / "large-model" / "app" / "custom" / "client.py")
    return out / "large-model"


def _rounds(server_log: str) -> list[float]:
    """Seconds of each round, from the server's `Round N started` banners."""
    starts, last, end = [], None, None
    for line in server_log.splitlines():
        e = _epoch(line)
        if e is not None:
            last = e
        if re.search(r"Round \d+ started\.", line) and last is not None:
            starts.append(last)
        elif "Finished FedAvg." in line and last is not None:
            end = last
    marks = starts + ([end] if end is not None else [])
    return [b - a for a, b in itertools.pairwise(marks)]


def _rank_text(ws: Path, impl: str) -> str:
    texts = []
    for site in sorted(ws.glob("site-*")):
        if impl == "flare":
            texts.append((site / "log.txt").read_text(errors="replace"))
        else:
            for f in sorted((site / "simulate_job" / "rankexec").glob("rank-*/stdout.log")):
                texts.append(f.read_text(errors="replace"))
    return "\n".join(texts)


def _rank0_rounds(ws: Path, impl: str) -> list[float]:
    """Rank 0's `received` to `sent` per round, over every site."""
    out = []
    for site in sorted(ws.glob("site-*")):
        if impl == "flare":
            text = (site / "log.txt").read_text(errors="replace")
        else:
            f = site / "simulate_job" / "rankexec" / "rank-0" / "stdout.log"
            text = f.read_text(errors="replace") if f.exists() else ""
        probes = [(w, float(t)) for w, r, t in PROBE.findall(text) if r == "0"]
        got = None
        for what, t in probes:
            if what == "received":
                got = t
            elif what == "sent" and got is not None:
                out.append(t - got)
                got = None
    return out


def summarize(
    samples: list[dict],
    first_ask: float | None,
    model_bytes: int,
    first_received: float | None = None,
    ranks: int = 2,
) -> dict:
    def g(b: int) -> float:
        return round(b / GIB, 3)

    out: dict = {}
    for kind in KINDS:
        each = max((max(s["per"][kind], default=0) for s in samples), default=0)
        total = max((sum(s["per"][kind]) for s in samples), default=0)
        out[f"{kind}_peak_each_gib"] = g(each)
        out[f"{kind}_peak_sum_gib"] = g(total)

    def client(s: dict) -> int:
        return sum(s["own"][k] for k in CLIENT_KINDS) + s["files_client"]

    def server(s: dict) -> int:
        return s["own"]["server"] + s["files_server"]

    if samples:
        peak = max(samples, key=client)
        out["client_peak_gib"] = g(client(peak))
        out["client_peak_parts_gib"] = {
            **{k: g(peak["own"][k]) for k in CLIENT_KINDS},
            "memory_files": g(peak["files_client"]),
        }
        before = [s for s in samples if first_ask is not None and s["t"] <= first_ask]
        base = client(before[-1]) if before else None
        out["client_baseline_gib"] = None if base is None else g(base)
        if base is not None:
            out["client_above_baseline_gib"] = g(client(peak) - base)
            out["client_above_baseline_models"] = round((client(peak) - base) / model_bytes, 2)
        out["sites"] = _per_site(
            samples, before[-1] if before else None, model_bytes, first_received, ranks
        )
        for key in ("above_baseline_models", "above_idle_models", "above_rest_models"):
            got = [x[key] for x in out["sites"] if key in x]
            if got:
                out[f"site_{key}_max"] = max(got)
        out["server_peak_gib"] = g(max(server(s) for s in samples))
        out["memory_files_client_peak_gib"] = g(max(s["files_client"] for s in samples))
        out["machine_shmem_growth_peak_gib"] = g(max(s["shmem"] for s in samples))
        out["all_peak_gib"] = g(
            max(sum(s["own"].values()) + s["files_client"] + s["files_server"] for s in samples)
        )
        out["mem_available_min_gib"] = g(min(s["avail"] for s in samples))
    out["samples"] = len(samples)
    return out


def _per_site(
    samples: list[dict],
    base: dict | None,
    model_bytes: int,
    first_received: float | None,
    ranks: int,
) -> list[dict]:
    """Each site's own peak (its job process, ranks and memory files at the sample where
    their sum peaked), above its value at the baseline sample, in GiB and models; and
    above its idle value (``idle_gib``: its least from the moment both its ranks are up,
    torch imported, to rank 0's first ``received``: the site before FLARE's download of
    the first model grows its job process, which the baseline sample may be in)."""
    out = []
    t0 = samples[0]["t"]
    for site in sorted({k for s in samples for k in s.get("sites", {})}):

        def val(s: dict, site: int = site) -> int:
            return sum((s.get("sites", {}).get(site) or {}).values())

        peak = max(samples, key=val)
        row = {
            "peak_gib": round(val(peak) / GIB, 3),
            "peak_at_s": round(peak["t"] - t0, 1),
            "parts_gib": {k: round(v / GIB, 3) for k, v in peak["sites"][site].items()},
        }
        if base is not None and site in base.get("sites", {}):
            row["baseline_gib"] = round(val(base) / GIB, 3)
            row["above_baseline_models"] = round((val(peak) - val(base)) / model_bytes, 2)
        up_samples = [
            s
            for s in samples
            if (first_received is None or s["t"] <= first_received)
            and min((s.get("sites", {}).get(site) or {}).get(k, 0) for k in ("rank0", "rank_other"))
            >= RANK_UP
        ]
        up = [val(s) for s in up_samples]
        if up:
            row["idle_gib"] = round(min(up) / GIB, 3)
            row["above_idle_models"] = round((val(peak) - min(up)) / model_bytes, 2)
        if up_samples and ranks > 1:
            # At rest: the job process and torchrun at their least, and every rank as the
            # other rank(s) were last before rank 0's first receive (torch imported, the
            # process group made, no model): the idle value above catches ranks still
            # importing (a rank passes RANK_UP at about 0.2 GiB and rests at 0.33).
            parts = [s["sites"][site] for s in up_samples]
            rest = (
                min(p.get("client_job", 0) for p in parts)
                + min(p.get("torchrun", 0) for p in parts)
                + parts[-1].get("rank_other", 0) * ranks / (ranks - 1)
            )
            row["rest_gib"] = round(rest / GIB, 3)
            row["above_rest_models"] = round((val(peak) - rest) / model_bytes, 2)
        out.append(row)
    return out


def run_one(args: argparse.Namespace, impl: str, root: Path) -> dict:
    job = export_job(args, impl, root / f"job-{impl}")
    ws = root / f"ws-{impl}"
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    subprocess.run(
        [sys.executable, "-m", "rankexec.flare", "allow-list", str(ws)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    from gpt_shape import DTYPES, config_for, flat_config, nbytes

    if args.layout == "flat":
        flat = flat_config(args.size, args.dtype)
        model_bytes = flat["tensors"] * flat["elements"] * DTYPES[args.dtype].itemsize
    else:
        model_bytes = nbytes(**config_for(args.size, args.dtype))
    load0 = os.getloadavg()
    shmem0 = meminfo().get("Shmem", 0)
    t0 = time.monotonic()
    with open(root / f"sim-{impl}.out", "w") as log:
        proc = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "nvflare"),
                "simulator",
                str(job),
                "-w",
                str(ws),
                "-n",
                str(args.clients),
                "-t",
                str(args.clients),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
        sampler = Sampler(proc.pid, args.interval, int(args.min_avail * GIB), shmem0)
        sampler.start()
        guard = Guard(proc.pid, int(args.min_avail * GIB), sampler.stopped)
        guard.start()
        try:
            rc = proc.wait(timeout=args.cap)
        except subprocess.TimeoutExpired:
            rc = -1
        finally:
            sampler.stopped.set()
            sampler.join(timeout=30)
            guard.join(timeout=30)
            kill_tree(proc.pid)
            proc.wait()
    wall = time.monotonic() - t0
    # Every sample, per site, for a closer look (kept with --keep).
    (root / f"samples-{impl}.json").write_text(json.dumps(sampler.samples))
    server_log = (ws / "server" / "log.txt").read_text(errors="replace") if ws.exists() else ""
    text = _rank_text(ws, impl) if ws.exists() else ""
    asks = [float(t) for w, r, t in PROBE.findall(text) if w == "ask" and r == "0"]
    received = [float(t) for w, r, t in PROBE.findall(text) if w == "received" and r == "0"]
    rounds = _rounds(server_log)
    recv = _rank0_rounds(ws, impl) if ws.exists() else []
    dtypes = sorted(set(re.findall(r"dtypes ([\w,]+)", text)))
    errors = {
        str(p.relative_to(ws)): p.read_text(errors="replace")[-2000:]
        for p in ws.rglob("error_log.txt")
        if p.read_text(errors="replace").strip()
    }
    out = {
        "bench": "large_model",
        "label": args.label,
        "executor": impl,
        "size_bytes": model_bytes,
        "dtype": args.dtype,
        "layout": args.layout,
        "clients": args.clients,
        "ranks": args.ranks,
        "rounds": args.rounds,
        "share": args.share,
        "script": args.script,
        "rc": rc,
        "oom_guard": guard.tripped,
        "wall_s": round(wall, 2),
        "round_s": [round(r, 2) for r in rounds],
        "round_after_first_mean_s": round(sum(rounds[1:]) / len(rounds[1:]), 2)
        if len(rounds) > 1
        else None,
        "rank0_recv_to_sent_s": [round(r, 2) for r in recv],
        "dtypes_at_rank0": dtypes,
        **summarize(
            sampler.samples,
            min(asks) if asks else None,
            model_bytes,
            min(received) if received else None,
            args.ranks,
        ),
        "loadavg_before": [round(x, 2) for x in load0],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "commit": _git("rev-parse", "--short", "HEAD"),
        "rankexec_from": _rankexec_from(),
        "errors": errors,
    }
    if rc != 0 or errors:
        keep = REPO / "target" / "large-model-bench-logs" / f"{args.label}-{impl}"
        shutil.rmtree(keep, ignore_errors=True)
        keep.mkdir(parents=True, exist_ok=True)
        for log in [root / f"sim-{impl}.out", *ws.glob("*/*log*.txt")]:
            if log.exists():
                dest = keep / log.relative_to(root).as_posix().replace("/", "__")
                shutil.copyfile(log, dest)
    return out


def _git(*argv: str) -> str:
    try:
        return subprocess.run(
            ["git", *argv], check=False, cwd=REPO, capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def _rankexec_from() -> str:
    import rankexec

    return str(Path(rankexec.__file__).parent)


def table(results: list[dict]) -> str:
    by = {r["executor"]: r for r in results}
    cols = [k for k in ("flare", "rankexec") if k in by]
    head = {
        "flare": "FLARE `ClientAPIExecutor` + torchrun",
        "rankexec": "rankexec `ScriptExecutor`",
    }
    lines = [
        "| | " + " | ".join(head[c] for c in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]

    def row(label: str, f) -> None:
        vals = []
        for c in cols:
            try:
                vals.append(f(by[c]))
            except (KeyError, TypeError, ValueError, IndexError):
                vals.append("-")
        lines.append(f"| {label} | " + " | ".join(vals) + " |")

    row("whole job, s", lambda r: f"{r['wall_s']:.1f}")
    row("rounds, s", lambda r: ", ".join(f"{x:.1f}" for x in r["round_s"]))
    row(
        "client side, peak (PSS without shmem + memory files), GiB",
        lambda r: f"{r['client_peak_gib']:.2f}",
    )
    row(
        "  above its baseline (rank 0's first ask), GiB / models",
        lambda r: f"{r['client_above_baseline_gib']:.2f} / {r['client_above_baseline_models']:.2f}",
    )
    row(
        "  at that peak: job processes / torchrun / rank 0 / other ranks / memory files",
        lambda r: " / ".join(
            f"{r['client_peak_parts_gib'][k]:.2f}"
            for k in ("client_job", "torchrun", "rank0", "rank_other", "memory_files")
        ),
    )
    row(
        "each site's own peak above its idle / above the baseline, models",
        lambda r: "; ".join(
            f"{x['above_idle_models']:.2f} / {x['above_baseline_models']:.2f}" for x in r["sites"]
        ),
    )
    row(
        "each site's own peak above the site at rest, models",
        lambda r: "; ".join(f"{x.get('above_rest_models', float('nan')):.2f}" for x in r["sites"]),
    )
    row(
        "  at each site's peak: job process / torchrun / rank 0 / other ranks / memory files",
        lambda r: "; ".join(
            " / ".join(
                f"{x['parts_gib'][k]:.2f}"
                for k in ("client_job", "torchrun", "rank0", "rank_other", "memory_files")
            )
            for x in r["sites"]
        ),
    )
    for kind in ("client_job", "rank0", "rank_other", "torchrun"):
        row(
            f"biggest {kind} process, peak PSS GiB",
            lambda r, k=kind: f"{r[f'{k}_peak_each_gib']:.2f}",
        )
    row("server side, peak PSS GiB", lambda r: f"{r['server_peak_gib']:.2f}")
    row(
        "client memory files, peak GiB (machine Shmem growth)",
        lambda r: (
            f"{r['memory_files_client_peak_gib']:.2f} ({r['machine_shmem_growth_peak_gib']:.2f})"
        ),
    )
    row(
        "rank 0, receive to send returned, s",
        lambda r: f"{min(r['rank0_recv_to_sent_s']):.2f}-{max(r['rank0_recv_to_sent_s']):.2f}",
    )
    row("dtypes at rank 0", lambda r: ",".join(r["dtypes_at_rank0"]))
    row("exit code / memory guard", lambda r: f"{r['rc']} / {r['oom_guard']}")
    return "\n".join(lines)


def dry_run(p: argparse.ArgumentParser, args: argparse.Namespace, impls: list[str]) -> int:
    """``RANKEXEC_DRY_RUN=1``: checks what a run would use and prints one line per run."""
    script = EXAMPLE / "client.py" if args.script == "example" else SCRIPTS[args.script]
    for need in (EXAMPLE / "job.py", script):
        if not need.is_file():
            p.error(f"{need} is missing")
    if args.out and not Path(args.out).resolve().parent.is_dir():
        p.error(f"--out {args.out}: no such folder")
    for impl in impls:
        print(
            f"dry run: {impl}: nvflare simulator, {args.clients} client(s) x {args.ranks} ranks, "
            f"{args.rounds} rounds, a {args.size} B {args.layout} model in {args.dtype}, "
            f"share {args.share}, script {script.name}, label {args.label!r}"
            + (f", appended to {args.out}" if args.out else "")
        )
    return 0


def main() -> int:
    sys.path.insert(0, str(EXAMPLE))
    from gpt_shape import parse_size

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=parse_size("1GiB"))
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="float32")
    p.add_argument(
        "--layout", choices=("gpt2", "flat"), default="gpt2", help="flat: 8 equal tensors"
    )
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--share", choices=("wait", "broadcast", "all"), default="wait")
    p.add_argument(
        "--script",
        choices=("example", *SCRIPTS),
        default="example",
        help="inplace: the issue's user script (inplace_client.py) instead of client.py",
    )
    p.add_argument("--impl", default="flare,rankexec", help="which sides, in order")
    p.add_argument("--interval", type=float, default=0.5, help="sampling period, s")
    p.add_argument("--min-avail", type=float, default=2.0, help="GiB; below it the run is killed")
    p.add_argument("--cap", type=float, default=1800, help="seconds per run")
    p.add_argument("--label", default="", help="stored with each record (e.g. before, after)")
    p.add_argument("--out", default=None, help="append the JSON lines to this file")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder")
    args = p.parse_args()
    impls = args.impl.split(",")
    if bad := sorted(set(impls) - set(IMPLS)):
        p.error(f"--impl: unknown {bad}: choose from {','.join(IMPLS)}")
    if os.environ.get("RANKEXEC_DRY_RUN") == "1":
        return dry_run(p, args, impls)
    root = Path(tempfile.mkdtemp(prefix="rankexec-lm-bench-"))
    results = []
    try:
        for impl in impls:
            r = run_one(args, impl, root)
            print(json.dumps(r), flush=True)
            results.append(r)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(r) + "\n")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"kept {root}", file=sys.stderr)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
