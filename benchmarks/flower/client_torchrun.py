"""Benchmark variant: a plain Flower ClientApp that starts torchrun from its handler for
every message (what flwrlabs/flower#4925's users do).

Copied into a copy of examples/flower/ddp-digits as ddp_digits/client_torchrun.py (with
ddp_worker.py beside it) by bench.py. The handler saves the global model and the config
to a temporary folder, runs `python -m torch.distributed.run --standalone
--nproc-per-node 2 ddp_worker.py DIR`, and replies with what rank 0 wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    t_call = time.time()
    import numpy as np

    arrays = msg.content["arrays"]
    with tempfile.TemporaryDirectory() as d:
        np.savez(Path(d) / "in.npz", **{k: a.numpy() for k, a in arrays.items()})
        (Path(d) / "cfg.json").write_text(
            json.dumps(
                {
                    **dict(context.run_config),
                    **dict(context.node_config),
                    "server-round": int(msg.content["config"]["server-round"]),
                }
            )
        )
        worker = Path(__file__).with_name("ddp_worker.py")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                str(worker),
                d,
            ],
            check=True,
            env={**os.environ, "PYTHONPATH": str(worker.parent.parent)},
            timeout=600,
        )
        out = np.load(Path(d) / "out.npz")
        state = {k: out[k] for k in arrays}
        m = json.loads((Path(d) / "metrics.json").read_text())
    m["created_at"] = float(msg.metadata.created_at)
    m["t_call"] = t_call
    m["t_end"] = time.time()
    record = ArrayRecord(array_dict={k: Array(v) for k, v in state.items()})
    content = RecordDict({"arrays": record, "metrics": MetricRecord(m)})
    return Message(content=content, reply_to=msg)
