"""A large model through Flower, side by side: Flower's own ``ClientApp`` against
``rankexec.flower.ClientApp``, under one real Deployment Engine, every process's memory
sampled.

    python benchmarks/flower/large_model_bench.py --size 1GiB --dtype float16 \\
        --rounds 3 --ranks 2 --impl flower,rankexec --out benchmarks/flower/results-large-models.jsonl

One SuperLink and one SuperNode (``--insecure``, a private ``FLWR_HOME``, offline) run a
generated app: the ServerApp sends a GPT-2-shaped state dict of ``--size`` in ``--dtype``
(``examples/flare/large-model/gpt_shape.py``'s names and shapes, numpy arrays) with
FedAvg for ``--rounds`` rounds; the ClientApp's ``train`` handler does what a trainer
does with Flower's Message API: it loads the received ``ArrayRecord`` into its model
(``to_torch_state_dict()``, then ``copy_`` into the model's tensors), adds 1 to every
weight in place, and replies ``ArrayRecord(model.state_dict())``.

- ``flower``: ``flwr.clientapp.ClientApp``: the handler runs in the ``flwr-clientapp``
  process Flower starts for the message; the model is built there for every message.
- ``rankexec-ndarrays``: the same, the handler reading the arrays with
  ``rankexec.flower.ndarrays`` (read-only views of the memory file) instead of
  ``to_torch_state_dict()`` (which parses each array into a new one).
- ``rankexec-shared``: as ``rankexec-ndarrays``, the reply made with
  ``rankexec.flower.shared_array_record`` (the tensors written once, straight into the
  memory file that leaves rank 0) instead of ``ArrayRecord(...)``.
- ``rankexec-inplace``: the handler a model the ranks only read and rank 0 updates in
  place is: ``ClientApp(arrays_to="rank0")`` (rank 0 alone receives the arrays, as its
  own writable copy), ``ndarrays(record, writable=True)`` as its tensors (no model of
  its own), ``shared_array_record`` of those same arrays as the reply (their files,
  sealed, no copy). ``flower-inplace`` is its peer under Flower's own ``ClientApp``:
  ``to_torch_state_dict()`` as the model (Flower's arrays are read-only ``bytes``),
  updated in place, ``ArrayRecord(...)`` as the reply.
- ``rankexec``: ``rankexec.flower.ClientApp(num_of_processes=--ranks)``: the same handler
  on every rank of the node's group; rank 0 trains and answers, the others answer at
  once. The handler is the same code both ways (the model is built for each message).
- ``IMPL+files`` (e.g. ``rankexec-shared+files``): any of these with the SuperNode under
  ``--isolation process`` beside ``rankexec-flower-superexec``, whose ClientApp
  processes pull the message's arrays into memory files (``rankexec.flower.superexec``).

Every ``--interval`` s the sampler reads ``/proc/PID/smaps_rollup`` of every process
that carries the deployment's folder in its environment and sorts it by its command
line: ``server`` (SuperLink, its SuperExec, the ServerApp), ``supernode``,
``clientapp`` (Flower's ``flwr-clientapp`` processes and the SuperNode's SuperExec),
``host`` (rankexec's node host), ``rank0``, ``rank_other``. As in
``benchmarks/flare/large_model_bench.py`` (whose readers this script uses), a process
counts ``Pss - Pss_Shmem`` and every memory file its processes hold or map counts once,
whole. Figures per run: the client side's peak (SuperNode + ClientApp processes + host
+ ranks + their memory files) and that peak above the client side's value before the
first message, in GiB and in model sizes; ``client_model_copies``: the client side's
peak minus the peak of the same run with a ``--base-size`` model (what Python, torch,
Flower and rankexec's processes cost without a model), in model sizes; the biggest
process of each kind; the
server side's peak; each round's time (from the ServerApp); the handler's time from
its first line to its reply (rank 0 for rankexec); the whole run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "benchmarks" / "flare"))
sys.path.insert(0, str(REPO / "examples" / "flare" / "large-model"))

from large_model_bench import _rollup, kill_tree, meminfo, memory_files
from rankexec.flower.deployment import Deployment

GIB = 1 << 30
CLIENT = ("supernode", "clientapp", "host", "rank0", "rank_other")
KINDS = ("server", *CLIENT, "other")

PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "lmbench"
version = "1.0.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "rankexec"

[tool.flwr.app.components]
serverapp = "lmbench.server_app:app"
clientapp = "lmbench.client_app:app"

[tool.flwr.app.config]
size = "64MiB"
dtype = "float16"
rounds = 1
result-file = ""
"""

SERVER_APP = '''\
"""The benchmark's ServerApp: a generated GPT-2-shaped model, FedAvg, one node."""

import json
import time

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context
from flwr.server import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from lmbench.gpt_shape import config_for, layout, parse_size

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    shape = config_for(parse_size(str(cfg["size"])), str(cfg["dtype"]))
    del shape["dtype"]
    dtype = np.dtype(str(cfg["dtype"]))
    # Every tensor its own random values, as a trained model's are: Flower's wire is
    # content-addressed, so equal tensors (np.full of a few values) would travel and be
    # held once on its side and make its figures look smaller than a real model's.
    arrays = {
        name: Array(np.random.default_rng(i).random(dims, dtype=np.float32).astype(dtype))
        for i, (name, dims) in enumerate(layout(**shape))
    }
    nbytes = sum(len(a.data) for a in arrays.values())
    initial = ArrayRecord(arrays, keep_input=False)
    del arrays
    round_end, metrics = [], []

    def collect(records, weighting_key):
        round_end.append(time.time())
        metrics.append([dict(r["metrics"]) for r in records])
        return None

    strategy = FedAvg(
        fraction_train=1.0,
        fraction_evaluate=0.0,
        min_train_nodes=1,
        min_available_nodes=1,
        train_metrics_aggr_fn=collect,
    )
    started = time.time()
    result = strategy.start(
        grid=grid,
        initial_arrays=initial,
        num_rounds=int(cfg["rounds"]),
        train_config=ConfigRecord({}),
    )
    ended = time.time()
    first = next(iter(result.arrays.values())).numpy().ravel()[0]
    if cfg.get("result-file"):
        with open(str(cfg["result-file"]), "w") as f:
            json.dump(
                {
                    "started": started,
                    "ended": ended,
                    "round_end": round_end,
                    "metrics": metrics,
                    "model_bytes": nbytes,
                    "tensors": len(result.arrays),
                    "first_value": float(first),
                },
                f,
            )
'''

CLIENT_APP = '''\
"""The benchmark's ClientApp ({impl}): load the model, add 1 to every weight, reply."""

import os
import time

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict

{make_app}

_model: dict = {{}}


@app.train()
def train(msg: Message, context: Context) -> Message:
    t_in = time.time()
    if int(os.environ.get("RANK", "0")) != 0:  # rankexec's other ranks: nothing to do
        return Message(RecordDict({{"metrics": MetricRecord({{"num-examples": 1}})}}), reply_to=msg)
    {load}
    with torch.no_grad():
        for t in _model.values():
            t.add_(1)
    {reply}
    metrics = MetricRecord({{"num-examples": 1, "t_in": t_in, "t_out": time.time(), "pid": os.getpid()}})
    if not {keep}:
        _model.clear()
    return Message(RecordDict({{"arrays": reply, "metrics": metrics}}), reply_to=msg)
'''

# How the handler loads the received arrays into its model: Flower's own API (which
# parses each array into a new one first), or rankexec's read-only views of the mapping.
LOAD = {
    "flower": """received = msg.content["arrays"].to_torch_state_dict()
    if not _model:
        _model.update({k: torch.empty_like(v) for k, v in received.items()})
    with torch.no_grad():
        for k, v in received.items():
            _model[k].copy_(v)
    del received""",
    "ndarrays": """from rankexec.flower import ndarrays

    record = msg.content["arrays"]
    for k, a in zip(record.keys(), ndarrays(record), strict=True):
        if k not in _model:
            _model[k] = torch.empty(a.shape, dtype=getattr(torch, str(a.dtype)))
        _model[k].numpy()[...] = a""",
    "flower-inplace": """_model.update(msg.content["arrays"].to_torch_state_dict())""",
    "rankexec-inplace": """from rankexec.flower import ndarrays

    record = msg.content["arrays"]
    writable = ndarrays(record, writable=True)  # rank 0's own files, in place
    _model.update((k, torch.from_numpy(a)) for k, a in zip(record.keys(), writable, strict=True))""",
}

MAKE_APP = {
    "flower": "from flwr.clientapp import ClientApp\n\napp = ClientApp()",
    "rankexec": (
        "from rankexec.flower import ClientApp\n\n"
        'app = ClientApp(num_of_processes={ranks}, deadlines={{"startup": "300s", "task": "900s"}})'
    ),
}


def write_app(root: Path, impl: str, ranks: int) -> Path:
    app = root / "app"
    pkg = app / "lmbench"
    pkg.mkdir(parents=True)
    (app / "pyproject.toml").write_text(PYPROJECT)
    (pkg / "__init__.py").write_text("")
    shutil.copy(REPO / "examples" / "flare" / "large-model" / "gpt_shape.py", pkg)
    (pkg / "server_app.py").write_text(SERVER_APP)
    make = MAKE_APP[impl.split("-")[0]].format(ranks=ranks)
    # The same handler both ways: the model is built for each message (Flower's process
    # ends with the message; a rank could keep it, which would cost one model more).
    keep = False
    load = LOAD[
        "ndarrays" if impl in ("rankexec-ndarrays", "rankexec-shared") else "flower"
    ]
    if impl in ("flower-inplace", "rankexec-inplace"):
        load = LOAD[impl]
    if impl == "rankexec-inplace":
        make = make.replace("ClientApp(", 'ClientApp(arrays_to="rank0", ', 1)
    reply = "reply = ArrayRecord(_model)"
    if impl in ("rankexec-shared", "rankexec-inplace"):
        reply = "from rankexec.flower import shared_array_record\n\n    reply = shared_array_record(_model)"
    text = CLIENT_APP.format(
        impl=impl, make_app=make, keep=keep, load="{load}", reply="{reply}"
    )
    (pkg / "client_app.py").write_text(
        text.replace("{load}", load).replace("{reply}", reply)
    )
    return app


def _pids_with(needle: bytes) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle in (d / "environ").read_bytes():
                out.append(int(d.name))
        except OSError:
            continue
    return out


def classify(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return "other"
    rank = next((v[5:] for v in env if v.startswith(b"RANK=")), None)
    if rank is not None and "rankexec.flower.host" not in cmd:
        return "rank0" if rank == b"0" else "rank_other"
    if "rankexec.flower.host" in cmd:
        return "host"
    if "flower-superlink" in cmd or "flwr-serverapp" in cmd:
        return "server"
    if "flower-supernode" in cmd:
        return "supernode"
    if "flwr-clientapp" in cmd:
        return "clientapp"
    if "rankexec-flower-superexec" in cmd:  # a node's own (`+files`)
        return "clientapp"
    if "flower-superexec" in cmd:
        return "clientapp" if "clientapp" in cmd else "server"
    return "other"


class Sampler(threading.Thread):
    def __init__(self, needle: bytes, interval: float, min_avail: int) -> None:
        super().__init__(daemon=True)
        self.needle, self.interval, self.min_avail = needle, interval, min_avail
        self.samples: list[dict] = []
        self.stopped = threading.Event()
        self.tripped = False

    def run(self) -> None:
        while not self.stopped.is_set():
            t = time.time()
            own = dict.fromkeys(KINDS, 0)
            biggest = dict.fromkeys(KINDS, 0)
            files: dict[tuple[int, int], tuple[int, bool]] = {}
            for pid in _pids_with(self.needle):
                r = _rollup(pid)
                if r is None:
                    continue
                kind = classify(pid)
                mine = r.get("Pss", 0) - r.get("Pss_Shmem", 0)
                own[kind] += mine
                biggest[kind] = max(biggest[kind], r.get("Pss", 0))
                for key, size in memory_files(pid).items():
                    client = kind in CLIENT or files.get(key, (0, False))[1]
                    files[key] = (size, client)
            client_files = sum(n for n, c in files.values() if c)
            server_files = sum(n for n, c in files.values() if not c)
            self.samples.append(
                {
                    "t": t,
                    "own": own,
                    "biggest": biggest,
                    "client": sum(own[k] for k in CLIENT) + client_files,
                    "client_files": client_files,
                    "server": own["server"] + server_files,
                }
            )
            if meminfo().get("MemAvailable", 1 << 62) < self.min_avail:
                self.tripped = True
                return
            self.stopped.wait(self.interval)


def run_one(args: argparse.Namespace, impl: str) -> dict:
    root = Path(tempfile.mkdtemp(prefix=f"flower-lm-{impl}-"))
    code, _, pull = impl.partition("+")
    app = write_app(root, code, args.ranks)
    out = root / "result.json"
    dep = Deployment(
        root / "dep",
        ["partition-id=0 num-partitions=1"],
        env={"RANKEXEC_FLOWER_DIR": str(root / "rx"), "RANKEXEC_LOG": "warn"},
        pull=pull or "flower",
    )
    needle = str(root).encode()
    sampler = Sampler(needle, args.interval, int(args.min_avail * GIB))
    t0 = time.time()
    try:
        dep.start()
        sampler.start()
        time.sleep(2 * args.interval)  # the client side's baseline: SuperNode idle
        run = dep.submit(
            app,
            {
                "size": args.size,
                "dtype": args.dtype,
                "rounds": args.rounds,
                "result-file": str(out),
            },
        )
        deadline = time.monotonic() + args.timeout
        status = "running"
        while time.monotonic() < deadline and not sampler.tripped:
            status = dep.status(run)
            if status.startswith("finished"):
                break
            time.sleep(1.0)
    finally:
        sampler.stopped.set()
        sampler.join(30)
        dep.stop()
        for pid in _pids_with(needle):
            kill_tree(pid)
    res = json.loads(out.read_text()) if out.exists() else {}
    samples = sampler.samples
    if args.samples:
        with open(args.samples, "a") as f:
            f.writelines(
                json.dumps({"impl": impl, "size": args.size, **smp}) + "\n"
                for smp in samples
            )
    base = samples[0]["client"] if samples else 0
    peak = (
        max(samples, key=lambda s: s["client"]) if samples else {"client": 0, "own": {}}
    )
    model = res.get("model_bytes") or 0
    rounds = []
    if res:
        starts = [res["started"], *res["round_end"][:-1]]
        rounds = [
            round(e - s, 2) for s, e in zip(starts, res["round_end"], strict=False)
        ]
    handler = [
        round(m["t_out"] - m["t_in"], 2)
        for per_round in res.get("metrics", [])
        for m in per_round
        if "t_out" in m
    ]
    line = {
        "impl": impl,
        "size": args.size,
        "dtype": args.dtype,
        "rounds": args.rounds,
        "ranks": args.ranks if impl.startswith("rankexec") else 1,
        "pull": pull or "flower",
        "status": status,
        "oom_guard": sampler.tripped,
        "model_gib": round(model / GIB, 3),
        "tensors": res.get("tensors"),
        "first_value": res.get("first_value"),
        "client_baseline_gib": round(base / GIB, 2),
        "client_peak_gib": round(peak["client"] / GIB, 2),
        "client_above_baseline_gib": round((peak["client"] - base) / GIB, 2),
        "client_above_baseline_models": round((peak["client"] - base) / model, 2)
        if model
        else None,
        "client_peak_parts_gib": {
            **{k: round(peak["own"].get(k, 0) / GIB, 2) for k in CLIENT},
            "memory_files": round(peak.get("client_files", 0) / GIB, 2),
        },
        "biggest_process_gib": {
            k: round(max((s["biggest"][k] for s in samples), default=0) / GIB, 2)
            for k in KINDS
        },
        "server_peak_gib": round(
            max((s["server"] for s in samples), default=0) / GIB, 2
        ),
        "round_s": rounds,
        "handler_s": handler,
        "run_s": round(res["ended"] - res["started"], 1) if res else None,
        "wall_s": round(time.time() - t0, 1),
        "load": os.getloadavg()[0],
    }
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return line


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="1GiB")
    p.add_argument("--dtype", default="float16", choices=["float16", "float32"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--impl", default="flower,rankexec")
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument(
        "--min-avail", type=float, default=1.5, help="GiB; below it the run stops"
    )
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument(
        "--base-size",
        default="1MiB",
        help="also run a model this small; report the peaks' difference in model sizes"
        " ('' to skip)",
    )
    p.add_argument("--out", default=None)
    p.add_argument("--keep", action="store_true", help="keep the run's folder")
    p.add_argument(
        "--samples", default=None, help="append every sample (JSON lines) here"
    )
    args = p.parse_args()
    for impl in args.impl.split(","):
        line = run_one(args, impl)
        if args.base_size:
            # The same run with a tiny model: what the processes cost without the model
            # (Python, torch, Flower; rankexec's host and ranks), so that the model's
            # copies are the difference of the two peaks.
            tiny = run_one(
                argparse.Namespace(**{**vars(args), "size": args.base_size}), impl
            )
            line["tiny_size"] = args.base_size
            line["tiny_client_peak_gib"] = tiny["client_peak_gib"]
            model = line["model_gib"] - tiny["model_gib"]
            if model > 0:
                copies = (line["client_peak_gib"] - tiny["client_peak_gib"]) / model
                line["client_model_copies"] = round(copies, 2)
        print(json.dumps(line), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
