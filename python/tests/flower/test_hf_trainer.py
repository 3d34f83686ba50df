"""Hugging Face ``Trainer`` with DDP on a kept rank group, under Flower's Deployment
Engine (flwr 1.42), offline.

docs/flower.md's command, read from the page (a run-in block): the example's
federation script, ``examples/flower/ddp-digits/federation.sh`` (one SuperLink and two
SuperNodes, ``--insecure``, with this test's ``FLWR_HOME``, free ports and run config,
``HF_HUB_OFFLINE=1``), runs ``examples/flower/hf-trainer`` for 2 rounds: FedAvg of a tiny GPT-2 built from a config, each node's ``train`` and
``evaluate`` handlers running ``transformers.Trainer`` on two gloo DDP ranks. Checked,
from what the ServerApp writes:

- the run completes; every round reports each node's training loss and evaluation
  loss, and the global model's held-out loss falls;
- every rank of a node received the round's global weights (each rank's digest of
  what it loaded equals the ServerApp's digest of what it sent);
- ``Trainer`` trained under DDP on both ranks in every round (the model wrapped in
  ``DistributedDataParallel``, accelerate's world size 2, both ranks' trained weights
  identical), and rank 0's reply carried those trained weights;
- the process group was made once, on the first message, and is the same object in
  the second round (accelerate used it, never made another);
- each node's rank group is one group of two ranks for the whole run (the same two
  pids in every train and evaluate message); ``close_groups`` closed both;
- nothing the test started is left running.

A second test runs a Lightning DDP handler on a rank group without a federation (this
process plays ``flwr-clientapp``, as ``test_host.py`` does): Lightning sees torchrun's
environment (``TORCHELASTIC_RUN_ID``...) and spawns nothing; two rounds on the same two
ranks, the process group made once, the ranks' weights identical after each fit.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")
pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import docrun

from rankexec.flower.deployment import free_port

from .helpers import pid_alive, pids_with_env, wait_until

REPO = Path(__file__).resolve().parents[3]
# What examples/flower/ddp-digits/federation.sh prints of each process it starts.
STARTED = re.compile(r"^federation: (?:superlink|supernode \d+) pid (\d+)$", re.MULTILINE)


def test_hf_trainer_trains_with_ddp_on_one_rank_group_per_node(tmp_path: Path) -> None:
    """docs/flower.md's command, read from the page: the example's federation script
    (a SuperLink, two SuperNodes) running this app, with this test's FLWR_HOME, free
    ports and run config; its output is the page's."""
    root = tmp_path
    out = root / "result.json"
    tmp = root / "tmp"  # the ranks' TMPDIR: Trainer's output_dir, removed at their exit
    tmp.mkdir()
    (step,) = docrun.console("docs/flower.md", "hf-trainer")
    env = {
        **os.environ,
        "FLWR_HOME": str(root / "flwr-home"),
        "LINK_PORT": str(free_port()),
        "NODE_PORTS": f"{free_port()} {free_port()}",
        "RUN_CONFIG": f"result-file={json.dumps(str(out))} num-server-rounds=2",
        "RANKEXEC_FLOWER_DIR": str(root / "rx"),
        "RANKEXEC_LOG": "warn",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(root / "hf-home"),
        "TMPDIR": str(tmp),
        "PYTHONUNBUFFERED": "1",
    }
    t0 = time.monotonic()
    try:
        rc, output = docrun.run(step, root / "federation.out", 480, env)
        took = time.monotonic() - t0
        assert step.check(rc, output) is None, (step.check(rc, output), output[-6000:])
        started = [int(x) for x in STARTED.findall(output)]
        assert len(started) == 3, output[-4000:]  # the SuperLink and the two SuperNodes
        assert not [p for p in started if pid_alive(p)], "the script stopped what it started"
        res = json.loads(out.read_text())
        _check(res, took)
        pids = {p for replies in res["train"] for r in replies for p in r["pids"]}
        wait_until(lambda: not any(pid_alive(p) for p in pids), 30, "the ranks gone after the run")
        assert not list(tmp.glob("hf-trainer-*")), "the ranks removed their output_dir"
        wait_until(lambda: not pids_with_env(str(root)), 30, "no process of the test left")
    finally:
        left = pids_with_env(str(root))
        for pid in left:  # never leave anything behind, even when the test fails
            os.kill(pid, signal.SIGKILL)
        print(f"[hf-trainer] after the script: {len(left)} processes left")


def _check(res: dict, took: float) -> None:
    train, evaluate, held_out = res["train"], res["evaluate"], res["held_out"]
    sent = res["global_digests"]  # [r]: the global weights after round r (0: initial)
    print(
        f"\n[hf-trainer] run completed in {took:.1f}s (federation start included);"
        f" FedAvg's 2 rounds in {res['ended'] - res['started']:.1f}s"
    )
    for r in range(2):
        losses = [round(x["train_loss"], 4) for x in train[r]]
        evals = [round(x["eval_loss"], 4) for x in evaluate[r]]
        print(
            f"[hf-trainer] round {r + 1}: train loss per node {losses}, eval loss per node"
            f" {evals}, held-out loss {held_out[r + 1]['loss']:.4f}"
            f" (round 0: {held_out[0]['loss']:.4f}); rank pids {[x['pids'] for x in train[r]]};"
            f" train handler {[round(x['handler_s'], 2) for x in train[r]]}s"
        )
    assert res["rounds"] == 2
    assert len(train) == 2 and len(evaluate) == 2, "both rounds trained and evaluated"
    assert all(len(replies) == 2 for replies in train + evaluate), "both nodes in every round"
    assert [h["round"] for h in held_out] == [0, 1, 2]

    # Loss and metrics reported, and the global model learned.
    for replies in train:
        for x in replies:
            assert math.isfinite(x["train_loss"]) and x["steps"] > 0, x
    for replies in evaluate:
        for x in replies:
            assert math.isfinite(x["eval_loss"]) and x["perplexity"] > 1, x
    assert held_out[2]["loss"] < held_out[1]["loss"] < held_out[0]["loss"], held_out
    assert len(set(sent)) == 3, "the global weights changed in every round"

    for r, replies in enumerate(train):
        for x in replies:
            # Every rank received this round's global weights.
            assert x["received"] == [sent[r]] * 2, (r, x["received"], sent)
            # Trainer trained under DDP on both ranks: the same trained weights.
            assert x["world_size"] == 2 and x["trainer_world_size"] == 2, x
            assert x["ddp"] == [1, 1], f"round {r + 1}: not DDP on every rank: {x['ddp']}"
            assert len(set(x["trained"])) == 1, f"round {r + 1}: the ranks' weights differ"
            assert x["trained"][0] != sent[r], "the node's training changed the weights"
            # One process group for the run: made by the first message, kept.
            assert x["pg_fresh"] == ([1, 1] if r == 0 else [0, 0]), (r, x["pg_fresh"])
            assert x["pg_inits"] == [1, 1] and x["pg_same"] == [1, 1], x
        # Rank 0's reply carried the weights its ranks trained.
        trained = sorted(x["trained"][0] for x in replies)
        assert sorted(res["reply_digests"][r]) == trained, (res["reply_digests"][r], trained)
    for r, replies in enumerate(evaluate):
        for x in replies:
            assert x["received"] == [sent[r + 1]] * 2, "every rank evaluated the new model"

    # One group of two ranks per node, for the whole run.
    groups = {tuple(x["pids"]) for replies in train + evaluate for x in replies}
    assert len(groups) == 2 and all(len(set(g)) == 2 for g in groups), groups
    assert not set(groups.pop()) & set(groups.pop()), "the nodes' groups are apart"
    for replies in train + evaluate:
        assert len({tuple(x["pids"]) for x in replies}) == 2, "one reply from each group"
    assert len(res["closed"]) == 2 and all(res["closed"].values()), res["closed"]


LIGHTNING_APP = """
import os

from flwr.app import Message, MetricRecord, RecordDict

from rankexec.flower import ClientApp, shared_array_record

app = ClientApp(num_of_processes=2, deadlines={"startup": "120s", "task": "300s"})
_node = {}


def _model():
    import pytorch_lightning as pl
    import torch
    from torch import nn

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(8, 1)

        def training_step(self, batch, i):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return Regression()


def _data():
    import torch

    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8
    )


def _gather(value):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


@app.train()
def train(msg, context):
    import pytorch_lightning as pl
    import torch.distributed as dist
    from pytorch_lightning.plugins.environments import TorchElasticEnvironment
    from pytorch_lightning.strategies import DDPStrategy

    fresh = int(not dist.is_initialized())
    if "model" not in _node:
        _node["model"] = _model()
    model = _node["model"]
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy="ddp",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, _data())
    _node.setdefault("pg", dist.group.WORLD)
    env = trainer.strategy.cluster_environment
    metrics = MetricRecord(
        {
            "pids": _gather(os.getpid()),
            "fresh": _gather(fresh),
            "pg_same": _gather(int(dist.group.WORLD is _node["pg"])),
            "ddp": _gather(int(isinstance(trainer.strategy, DDPStrategy))),
            "elastic": _gather(int(isinstance(env, TorchElasticEnvironment))),
            "world_size": int(trainer.world_size),
            "weight_sum": _gather(float(model.net.weight.detach().double().sum())),
        }
    )
    content = RecordDict({"arrays": shared_array_record(model.state_dict()), "metrics": metrics})
    return Message(content, reply_to=msg)
"""


def test_lightning_ddp_on_a_rank_group_keeps_its_process_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("pytorch_lightning")
    import importlib

    import torch
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from rankexec.flower import CLOSE_MESSAGE_TYPE, host_status

    pkg = tmp_path / "app" / "litapp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "client_app.py").write_text(textwrap.dedent(LIGHTNING_APP))
    monkeypatch.syspath_prepend(str(tmp_path / "app"))
    monkeypatch.setenv("RANKEXEC_FLOWER_DIR", str(tmp_path / "rx"))
    monkeypatch.setenv("RANKEXEC_LOG", "warn")
    app = importlib.import_module("litapp.client_app").app
    node, run = 7301, 51
    log = open(tmp_path / "host.log", "wb")  # noqa: SIM115 - closed below
    host = subprocess.Popen(
        [sys.executable, "-m", "rankexec.flower.host", "--node-id", str(node), "--lease", "120"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    ranks: list[int] = []
    try:
        wait_until(lambda: host_status(node) is not None, 60, "the host listening")
        weights = {"net.weight": torch.zeros(1, 8), "net.bias": torch.zeros(1)}
        seen = []
        for server_round in (1, 2):
            TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run, 0, server_round
            content = RecordDict(
                {
                    "arrays": ArrayRecord(weights),
                    "config": ConfigRecord({"server-round": server_round}),
                }
            )
            msg = Message(content, dst_node_id=node, message_type="train")
            t = time.monotonic()
            reply = app(msg, Context(run, node, {}, RecordDict(), {}))
            assert not reply.has_error(), reply.error.reason
            m = dict(reply.content["metrics"])
            print(f"\n[lightning] round {server_round} in {time.monotonic() - t:.1f}s: {m}")
            seen.append(m)
            weights = reply.content["arrays"].to_torch_state_dict()
            # rank 0's reply carries the weights both ranks hold (DDP kept them equal)
            assert len(set(m["weight_sum"])) == 1, m["weight_sum"]
            assert float(weights["net.weight"].double().sum()) == m["weight_sum"][0]
            assert m["ddp"] == [1, 1] and m["elastic"] == [1, 1] and m["world_size"] == 2, m
            assert m["pg_same"] == [1, 1], m
        assert seen[0]["fresh"] == [1, 1] and seen[1]["fresh"] == [0, 0], "one process group"
        assert seen[0]["pids"] == seen[1]["pids"] and len(set(seen[0]["pids"])) == 2
        assert seen[1]["weight_sum"] != seen[0]["weight_sum"], "the second fit trained"
        ranks = list(seen[0]["pids"])
        close = Message(RecordDict(), dst_node_id=node, message_type=CLOSE_MESSAGE_TYPE)
        reply = app(close, Context(run, node, {}, RecordDict(), {}))
        assert dict(reply.content["rankexec"]) == {"closed": 1, "ranks": 2}
        wait_until(lambda: not any(pid_alive(p) for p in ranks), 30, "the closed group gone")
    finally:
        sys.modules.pop("litapp.client_app", None)
        sys.modules.pop("litapp", None)
        host.send_signal(signal.SIGTERM)
        host.wait(60)
        log.close()
    assert not any(pid_alive(p) for p in ranks)
