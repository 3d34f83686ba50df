"""The ServerApp: FedAvg over the nodes' Trainer runs, the global model evaluated on
held-out records after every round.

At the end of ``main``, ``rankexec.flower.close_groups(grid)`` closes every node's rank
group. With the run config's ``result-file`` set, what each round saw is written there
as JSON (the test reads it): the nodes' train and evaluate metrics (losses, rank pids,
every rank's digest of the weights it received and trained), the digest of the global
weights each round sent, the digest of the weights each node's reply carried, and the
held-out loss of the global model.
"""

from __future__ import annotations

import json
import time

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from hf_trainer import task

app = ServerApp()


def _digest(arrays: ArrayRecord) -> int:
    return task.digest(zip(arrays.keys(), arrays.to_numpy_ndarrays(), strict=True))


def _weighted(records, key: str, weighting_key: str) -> float:
    n = sum(int(r["metrics"][weighting_key]) for r in records)
    total = sum(float(r["metrics"][key]) * int(r["metrics"][weighting_key]) for r in records)
    return total / max(n, 1)


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    rounds = int(cfg["num-server-rounds"])
    train_replies: list[list[dict]] = []
    eval_replies: list[list[dict]] = []
    reply_digests: list[list[int]] = []
    global_digests: list[int] = []  # [r]: the global weights after round r (0: initial)
    held_out: list[dict] = []
    test = task.held_out()

    def collect_train(records, weighting_key):
        train_replies.append([dict(r["metrics"]) for r in records])
        return MetricRecord({"train_loss": _weighted(records, "train_loss", weighting_key)})

    def collect_eval(records, weighting_key):
        eval_replies.append([dict(r["metrics"]) for r in records])
        return MetricRecord({"eval_loss": _weighted(records, "eval_loss", weighting_key)})

    def central_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model = task.make_model()
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, ppl = task.evaluate(model, test)
        global_digests.append(_digest(arrays))
        held_out.append({"round": server_round, "loss": loss, "perplexity": ppl})
        print(f"round {server_round}: held-out loss {loss:.4f}, perplexity {ppl:.2f}")
        return MetricRecord({"loss": loss, "perplexity": ppl})

    class Recording(FedAvg):
        """FedAvg that keeps the digest of the weights in each node's reply."""

        def aggregate_train(self, server_round, replies):
            replies = list(replies)
            reply_digests.append(
                [_digest(r.content["arrays"]) for r in replies if not r.has_error()]
            )
            return super().aggregate_train(server_round, replies)

    strategy = Recording(
        fraction_evaluate=1.0,
        train_metrics_aggr_fn=collect_train,
        evaluate_metrics_aggr_fn=collect_eval,
    )
    started = time.time()
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(task.make_model().state_dict()),
        num_rounds=rounds,
        train_config=ConfigRecord({"lr": float(cfg["lr"])}),
        evaluate_fn=central_evaluate,
    )
    ended = time.time()
    from rankexec.flower import close_groups

    closed = close_groups(grid, timeout=float(cfg.get("close-timeout", 120.0)))
    if cfg.get("result-file"):
        with open(str(cfg["result-file"]), "w") as f:
            json.dump(
                {
                    "rounds": rounds,
                    "started": started,
                    "ended": ended,
                    "train": train_replies,
                    "evaluate": eval_replies,
                    "reply_digests": reply_digests,
                    "global_digests": global_digests,
                    "held_out": held_out,
                    "closed": {str(k): v for k, v in closed.items()},
                },
                f,
            )
