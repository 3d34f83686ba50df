"""The ServerApp: FedAvg over the nodes, the global model evaluated on held-out digits.

At the end of `main`, `rankexec.flower.close_groups(grid)` closes every node's rank
group (the run is over; without it the nodes' idle leases would do it later). With the
run config's `result-file` set, the accuracy, the rounds' timings and every node's
rank pids per round are written there as JSON (the tests and the benchmark read it).
"""

from __future__ import annotations

import json
import time

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from ddp_digits import task

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    rounds = int(cfg["num-server-rounds"])
    replies: list[list[dict]] = []
    round_end: list[float] = []

    def collect(records, weighting_key):
        round_end.append(time.time())
        replies.append([dict(r["metrics"]) for r in records])
        n = sum(int(r["metrics"]["num-examples"]) for r in records)
        loss = sum(
            float(r["metrics"]["train_loss"]) * int(r["metrics"]["num-examples"]) for r in records
        )
        return MetricRecord({"train_loss": loss / max(n, 1)})

    (_, _), (x_test, y_test) = task.split()

    def central_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model = task.make_model()
        model.load_state_dict(arrays.to_torch_state_dict())
        acc, loss = task.evaluate(model, x_test, y_test)
        return MetricRecord({"accuracy": acc, "loss": loss})

    errors: list[list[str]] = []

    class Recording(FedAvg):
        """FedAvg that keeps the reasons of the replies that came back as errors."""

        def aggregate_train(self, server_round, replies):
            replies = list(replies)
            errors.append([r.error.reason for r in replies if r.has_error()])
            return super().aggregate_train(server_round, replies)

    strategy = Recording(fraction_evaluate=0.0, train_metrics_aggr_fn=collect)
    started = time.time()
    result = strategy.start(
        grid=grid,
        initial_arrays=(initial := ArrayRecord(task.make_model().state_dict())),
        num_rounds=rounds,
        train_config=ConfigRecord({"lr": float(cfg["lr"])}),
        evaluate_fn=central_evaluate,
    )
    ended = time.time()
    closed = {}
    if str(cfg.get("close-groups", "yes")) != "no":
        try:
            from rankexec.flower import close_groups

            closed = close_groups(grid, timeout=float(cfg.get("close-timeout", 120.0)))
        except ImportError:  # the benchmark's plain-Flower variants
            closed = {}
    # With 0 rounds (only the close at the end) the result holds no arrays.
    final = task.evaluate(_model_of(result.arrays if rounds else initial), x_test, y_test)
    print(f"held-out accuracy {final[0]:.4f} after {rounds} rounds")
    if cfg.get("result-file"):
        with open(str(cfg["result-file"]), "w") as f:
            json.dump(
                {
                    "accuracy": final[0],
                    "loss": final[1],
                    "rounds": rounds,
                    "started": started,
                    "ended": ended,
                    "round_end": round_end,
                    "replies": replies,
                    "errors": errors,
                    "closed": {str(k): v for k, v in closed.items()},
                },
                f,
            )


def _model_of(arrays: ArrayRecord):
    model = task.make_model()
    model.load_state_dict(arrays.to_torch_state_dict())
    return model
