"""Benchmark variant: a plain Flower ClientApp training in its own process (no DDP).

Copied into a copy of examples/flower/ddp-digits as ddp_digits/client_single.py by
bench.py. The same model, data split, epochs and learning rate as the example; one
process trains on the node's whole shard.
"""

from __future__ import annotations

import os
import time

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    t_first = time.time()
    from ddp_digits import task

    cfg = context.run_config
    model = task.make_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = task.partition(
        int(context.node_config.get("partition-id", 0)),
        int(context.node_config.get("num-partitions", 1)),
    )
    server_round = int(msg.content["config"]["server-round"])
    t0 = time.time()
    loss = task.train_epochs(
        model,
        x,
        y,
        epochs=int(cfg["local-epochs"]),
        lr=float(cfg["lr"]),
        batch_size=int(cfg["batch-size"]),
        seed=task.SEED + 1000 * server_round,
    )
    metrics = MetricRecord(
        {
            "num-examples": len(x),
            "train_loss": loss,
            "pids": [os.getpid()],
            "world_size": 1,
            "t_first": t_first,
            "created_at": float(msg.metadata.created_at),
            "compute_s": time.time() - t0,
        }
    )
    metrics["t_call"] = t_first
    metrics["t_end"] = time.time()
    content = RecordDict(
        {"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}
    )
    return Message(content=content, reply_to=msg)
