"""The ClientApp: Flower's Message API, each handler running on two DDP ranks.

The only rankexec-specific lines are the import and `num_of_processes`: the handlers
are plain Flower handlers. They run on every rank of the node's rank group, which
lives for the whole run, so the process group, the model and the data are set up on
the first message and reused by the next ones (module globals survive).

torch and the data are imported inside the handlers: Flower imports this module in a
new `flwr-clientapp` process for every message, where only the forwarding runs; the
ranks import them once per run.
"""

from __future__ import annotations

import os
import time

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from rankexec.flower import ClientApp, abort_requested

app = ClientApp(
    num_of_processes=2,
    deadlines={"startup": "120s", "task": "300s"},
    # A rank killed from outside (a signal, the OOM killer) costs a retry of the message
    # on a relaunched group, not the node's round; a rank's own exception is not retried.
    restart={"retry_task": 1},
)

_net: dict = {}


def _setup(context: Context):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_digits import task

    if not _net:
        if not dist.is_initialized():
            dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_* come from rankexec
        model = task.make_model()
        _net["model"], _net["ddp"] = model, DDP(model)
        pid = int(context.node_config.get("partition-id", 0))
        parts = int(context.node_config.get("num-partitions", 1))
        x, y = task.partition(pid, parts)
        rank, world = dist.get_rank(), dist.get_world_size()
        per_rank = len(x) // world
        _net["data"] = (x[rank::world][:per_rank], y[rank::world][:per_rank])
        _net["node_examples"] = per_rank * world
    return _net["model"], _net["ddp"]


@app.train()
def train(msg: Message, context: Context) -> Message:
    t_first = time.time()
    model, ddp = _setup(context)
    import torch.distributed as dist

    from ddp_digits import task

    cfg = context.run_config
    rank, world = dist.get_rank(), dist.get_world_size()
    server_round = int(msg.content["config"]["server-round"])
    part = int(context.node_config.get("partition-id", 0))
    if (
        server_round == int(cfg.get("raise-round", -1))
        and rank == int(cfg.get("raise-rank", -1))
        and part == int(cfg.get("raise-partition", 0))
    ):
        raise RuntimeError(f"rank {rank} raises in round {server_round} (a test hook)")
    slow = float(cfg.get("slow-s", 0.0))
    deadline = time.monotonic() + slow
    while time.monotonic() < deadline and not abort_requested():
        time.sleep(0.05)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = _net["data"]
    t0 = time.time()
    loss = task.train_epochs(
        ddp,
        x,
        y,
        epochs=int(cfg["local-epochs"]),
        lr=float(cfg["lr"]),
        batch_size=int(cfg["batch-size"]),
        seed=task.SEED + 1000 * server_round + rank,
        should_stop=abort_requested,
    )
    compute_s = time.time() - t0
    pids = [0] * world
    dist.all_gather_object(pids, os.getpid())
    metrics = MetricRecord(
        {
            "num-examples": _net["node_examples"],
            "train_loss": loss,
            "pids": pids,
            "world_size": world,
            "t_first": t_first,
            "created_at": float(msg.metadata.created_at),
            "compute_s": compute_s,
        }
    )
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    from ddp_digits import task

    model, _ = _setup(context)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = _net["data"]
    acc, loss = task.evaluate(model, x, y)
    metrics = MetricRecord({"num-examples": len(x), "accuracy": acc, "loss": loss})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
