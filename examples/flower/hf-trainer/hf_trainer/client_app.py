"""The ClientApp: each handler runs Hugging Face ``Trainer`` with DDP on the node's ranks.

``rankexec.flower.ClientApp(num_of_processes=2)`` runs both handlers on every rank of
the node's rank group, with torchrun's environment (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``...), so ``Trainer`` trains with DDP
across the ranks exactly as under ``torchrun``, and spawns nothing itself. The group
lives for the whole run: the process group, the model and the records are made on the
first message and reused by the next ones (module globals survive).

What keeps ``Trainer`` right in a process that lives across rounds:

- the process group is made once, here, before the first ``TrainingArguments``;
  accelerate's ``PartialState`` (which ``TrainingArguments`` resets and rebuilds for
  every new ``Trainer``) finds it made and uses it;
- a new ``Trainer`` every round, on the same model, and never ``trainer.end()`` (it
  destroys the process group: rankexec's close does that at the end of the run);
- ``use_cpu=True`` where there is no GPU: without it accelerate treats a CPU rank as a
  single process, and each rank would train alone;
- the mark ``Trainer.evaluate()`` leaves on the model (``_is_accelerate_prepared``)
  dropped before each new ``Trainer``: with it, the next ``train()`` would not wrap the
  model in DDP, and each rank would train alone (the evaluate handler of one round
  does this to the train handler of the next);
- no checkpoints, no reporting integrations, no progress bars (``save_strategy="no"``,
  ``report_to="none"``, ``disable_tqdm=True``).

torch and transformers are imported inside the handlers: Flower imports this module in
a new ``flwr-clientapp`` process for every message, where only the forwarding runs.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time

from flwr.app import Context, Message, MetricRecord, RecordDict
from rankexec.flower import ClientApp, abort_requested, shared_array_record

# Nothing here reads the Hub; a typo in a model name fails at once instead of hanging.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# A fast tokenizer's own threads and DataLoader workers do not mix (none are used here).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

app = ClientApp(num_of_processes=2, deadlines={"startup": "120s", "task": "600s"})

# This rank's state for the whole run.
_node: dict = {}


def _on_gpus() -> bool:
    """One GPU per rank (NCCL), else CPU ranks (gloo), as torchrun's scripts decide."""
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= int(
        os.environ["LOCAL_WORLD_SIZE"]
    )


def _setup(context: Context):
    """The process group (once), the model and this node's records."""
    import torch
    import torch.distributed as dist

    from hf_trainer import task

    fresh = 0
    if not dist.is_initialized():
        # RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from rankexec.
        if _on_gpus():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if _on_gpus() else "gloo")
        _node["pg_inits"] = _node.get("pg_inits", 0) + 1
        fresh = 1
    if "model" not in _node:
        _node["pg"] = dist.group.WORLD  # held: the same object in every round
        _node["model"] = task.make_model()
        part = int(context.node_config.get("partition-id", 0))
        parts = int(context.node_config.get("num-partitions", 1))
        train, test = task.partition(part, parts)
        _node["train"], _node["test"] = task.Records(train), task.Records(test)
        # Trainer wants a folder even when it saves nothing; this rank's, gone at its exit.
        _node["out"] = tempfile.mkdtemp(prefix="hf-trainer-")
        atexit.register(shutil.rmtree, _node["out"], ignore_errors=True)
    model = _node["model"]
    # A Trainer's evaluate() marks the bare model as prepared by accelerate; the next
    # Trainer would then train it without DDP, each rank alone (their weights apart).
    model.__dict__.pop("_is_accelerate_prepared", None)
    return model, fresh


def _load(model, msg: Message) -> list[int]:
    """Loads the global weights the message carries; every rank's digest of them."""
    from hf_trainer import task

    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    return _gather(task.digest(model.state_dict().items()))


def _gather(value) -> list:
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _args(context: Context, msg: Message, **kw):
    from transformers import TrainingArguments

    from hf_trainer import task

    cfg = context.run_config
    server_round = int(msg.content["config"]["server-round"])
    return TrainingArguments(
        output_dir=_node["out"],
        use_cpu=not _on_gpus(),
        per_device_train_batch_size=int(cfg["batch-size"]),
        per_device_eval_batch_size=int(cfg["batch-size"]),
        learning_rate=float(cfg["lr"]),
        seed=task.SEED + server_round,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        logging_strategy="no",
        dataloader_num_workers=0,
        ddp_find_unused_parameters=False,
        **kw,
    )


def _abort_callback():
    from transformers import TrainerCallback

    class StopOnAbort(TrainerCallback):
        """rankexec's abort (``flwr stop``, a peer rank failed) ends training at the
        next step instead of after the whole epoch."""

        def on_step_end(self, args, state, control, **kwargs):
            if abort_requested():
                raise RuntimeError("aborted")

    return StopOnAbort()


@app.train()
def train(msg: Message, context: Context) -> Message:
    t0 = time.time()
    model, fresh = _setup(context)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from transformers import Trainer

    from hf_trainer import task

    received = _load(model, msg)
    trainer = Trainer(
        model=model,
        args=_args(context, msg, num_train_epochs=float(context.run_config["local-epochs"])),
        train_dataset=_node["train"],
        callbacks=[_abort_callback()],
    )
    out = trainer.train()
    ddp = int(isinstance(trainer.model_wrapped, DistributedDataParallel))
    trained = _gather(task.digest(model.state_dict().items()))
    pids = _gather(os.getpid())
    same_pg = _gather(int(dist.group.WORLD is _node["pg"]))
    metrics = MetricRecord(
        {
            "num-examples": len(_node["train"]),
            "train_loss": float(out.training_loss),
            "steps": int(out.global_step),
            "pids": pids,
            "world_size": dist.get_world_size(),
            "trainer_world_size": int(trainer.args.world_size),
            "ddp": _gather(ddp),
            "pg_fresh": _gather(fresh),
            "pg_inits": _gather(_node["pg_inits"]),
            "pg_same": same_pg,
            "received": received,
            "trained": trained,
            "handler_s": time.time() - t0,
        }
    )
    # The reply is rank 0's; its arrays go into one memory file, copied once.
    content = RecordDict({"arrays": shared_array_record(model.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    import math

    from transformers import Trainer

    model, _ = _setup(context)
    received = _load(model, msg)
    trainer = Trainer(model=model, args=_args(context, msg), eval_dataset=_node["test"])
    out = trainer.evaluate()  # each rank evaluates its share; the loss is gathered
    loss = float(out["eval_loss"])
    metrics = MetricRecord(
        {
            "num-examples": len(_node["test"]),
            "eval_loss": loss,
            "perplexity": math.exp(loss),
            "pids": _gather(os.getpid()),
            "received": received,
        }
    )
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
