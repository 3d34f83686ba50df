#!/usr/bin/env python3
"""Side by side: NVIDIA FLARE 2.9's MultiProcessExecutor and rankexec's, under the same
`nvflare simulator`, on the same plan.

This extends the peer harness (`../shared/peers/nvflare/`, passed with `--peer`): its
orchestrator, job layout, server controller, process tracking and records are reused
as they are; for `--impl rankexec` the generated job's client runs
`rankexec.flare.MultiProcessExecutor` (subclassed in `rx_bench.py` only to run the
same measurement phases) with Python ranks (`rx_echo_rank.py`, the peer's
EchoExecutor as a rankexec component). Each experiment runs once per implementation,
one simulator run at a time (`-n 1 -t 1`, as the peer harness does), so the two never
share the CPUs.

    python benchmarks/flare/bench.py --peer ../shared/peers/nvflare \
        --only startup,roundtrip,abort,fault_a,fault_b,fault_c --startup-reps 1 \
        > benchmarks/flare/results.jsonl
    python ../shared/peers/nvflare/summarize.py benchmarks/flare/results.jsonl

Every record is one JSON line with `"impl": "nvflare"` or `"impl": "rankexec"`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def load_peer(peer_dir: str):
    path = os.path.join(peer_dir, "bench.py")
    spec = importlib.util.spec_from_file_location("nvfbench_peer", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load the peer harness from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_rx_job(peer, job_dir, n, plan, no_decomposers=False):
    """The peer's job with rankexec's executor on the client."""
    app = os.path.join(job_dir, "app")
    custom = os.path.join(app, "custom")
    os.makedirs(os.path.join(app, "config"), exist_ok=True)
    os.makedirs(custom, exist_ok=True)
    shutil.copy(os.path.join(peer.HARNESS, "nvfbench_mpe.py"), custom)  # BenchController
    for f in ("rx_bench.py", "rx_echo_rank.py"):
        shutil.copy(os.path.join(HERE, f), custom)
    meta = {
        "name": os.path.basename(job_dir),
        "resource_spec": {},
        "deploy_map": {"app": ["@ALL"]},
        "min_clients": 1,
    }
    server = {
        "format_version": 2,
        "workflows": [{"id": "nvfbench_ctl", "path": "nvfbench_mpe.BenchController", "args": {}}],
        "components": [],
    }
    cap = int(plan.get("cap_s", 60))
    client = {
        "format_version": 2,
        "executors": [
            {
                "tasks": ["nvfbench"],
                "executor": {
                    "path": "rx_bench.RxBenchExecutor",
                    "args": {
                        "num_of_processes": n,
                        "rank_component": "custom/rx_echo_rank.py:EchoRank",
                        "deadlines": {"task": f"{cap}s"},
                        "plan": plan,
                    },
                },
            }
        ],
        "task_result_filters": [],
        "task_data_filters": [],
        "components": [],
    }
    for path, doc in (
        (os.path.join(job_dir, "meta.json"), meta),
        (os.path.join(app, "config", "config_fed_server.json"), server),
        (os.path.join(app, "config", "config_fed_client.json"), client),
    ):
        with open(path, "w") as f:
            json.dump(doc, f, indent=2)


def main() -> None:
    ap = argparse.ArgumentParser(add_help=False)
    default_peer = os.environ.get("RANKEXEC_PEER_NVFLARE", "../shared/peers/nvflare")
    ap.add_argument("--peer", default=default_peer, help="the peer harness's directory")
    ap.add_argument("--impl", default="nvflare,rankexec", help="comma list: nvflare,rankexec")
    ours, rest = ap.parse_known_args()
    peer = load_peer(os.path.abspath(ours.peer))
    original_make_job = peer.make_job
    original_emit = peer.emit
    current = {"impl": "nvflare"}

    def emit(rec):
        rec.setdefault("impl", current["impl"])
        original_emit(rec)

    peer.emit = emit
    argv0 = sys.argv[0]
    for impl in ours.impl.split(","):
        impl = impl.strip()
        current["impl"] = impl
        if impl == "rankexec":
            peer.make_job = lambda job_dir, n, plan, no_decomposers=False: make_rx_job(
                peer, job_dir, n, plan
            )
        elif impl == "nvflare":
            peer.make_job = original_make_job
        else:
            raise SystemExit(f"unknown impl {impl!r}")
        sys.argv = [argv0, *rest]
        peer.main()


if __name__ == "__main__":
    main()
