"""`FlareDigitsTrainer`: the PyTorch component of examples/python/torch_digits, fed by
FLARE's PyTorch exchange format.

The server (FLARE's `FedAvg` with `PTModel(..., allow_numpy_conversion=False)`) sends
the global model as torch tensors; the adapter hands them to every rank as blobs, and
`unpack_data` gives them back as tensors of the same dtype and shape. The rank returns
its `state_dict()` with `pack_data`: torch tensors again on FLARE's side. The site
`site-N` trains on shard N-1 of `num_sites`.

`trainer.py` beside this file is examples/python/torch_digits/trainer.py, copied into
the job's `custom/` folder by FLARE's Job API (`make_job.py`).
"""

from __future__ import annotations

import rankexec
from rankexec.flare.arrays import pack_data, unpack_data
from trainer import DigitsTrainer


class FlareDigitsTrainer(DigitsTrainer):
    """`DigitsTrainer` with FLARE's round, site and data formats."""

    def execute(self, task, input, ctx, abort):
        site_name = str(ctx.get_prop("__identity_name__", "site-1"))
        site = (int(site_name.rsplit("-", 1)[-1]) - 1) % self.num_sites
        self.load(unpack_data(input.meta, input.blobs))
        val_acc, val_loss, _ = self._evaluate(site, self.num_sites)
        if task != "train":
            raise ValueError(f"unknown task {task!r} (FlareDigitsTrainer runs train)")
        round_ = int(input.meta.get("current_round") or 0)
        metrics = self.train(round_, site, self.num_sites, abort)
        meta, blobs = pack_data(
            self.model.state_dict(),
            kind="WEIGHTS",
            meta={"NUM_STEPS_CURRENT_ROUND": metrics["num_samples"]},
        )
        meta.update(metrics, val_accuracy=val_acc, val_loss=val_loss)
        if self.rank == 0:
            print(f"{site_name} round {round_}: global model val_accuracy {val_acc:.4f}, {metrics}")
        return rankexec.Shareable(meta=meta, blobs=blobs)
