"""The Python-ranks DDP trainer (examples/python/ddp_digits/trainer.py) inside FLARE.

The trainer is reused as it is; this subclass only maps FLARE's conventions onto it:
the round comes as `current_round`, the site from the rank context's `__identity_name__` (`site-N`
trains on shard N-1 of `num_sites`), and the result carries the arrays' shapes
(`dxo_arrays`) and `NUM_STEPS_CURRENT_ROUND` (the samples trained, FedAvg's weight).

`trainer` is the trainer's file, relative to this one: `trainer.py` here is a symbolic
link to `examples/python/ddp_digits/trainer.py` (FLARE copies the file it points to
when it deploys the job).
"""

from __future__ import annotations

import importlib.util
import os
import sys


def _load_trainer(path: str):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), path)
    spec = importlib.util.spec_from_file_location("ddp_digits_trainer", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the DDP trainer from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["ddp_digits_trainer"] = module
    spec.loader.exec_module(module)
    return module


class _Ctx:
    """The rank's context with the site index and count the trainer reads."""

    def __init__(self, ctx, site: int, sites: int) -> None:
        self._ctx, self._site, self._sites = ctx, site, sites

    def get_prop(self, key, default=None):
        if key == "__site_index__":
            return self._site
        if key == "__num_sites__":
            return self._sites
        return self._ctx.get_prop(key, default)

    def __getattr__(self, name):
        return getattr(self._ctx, name)


class _Input:
    def __init__(self, meta, blobs) -> None:
        self.meta, self.blobs = meta, blobs


class FlareDigitsDDP:
    """The trainer's `DigitsDDP`, fed FLARE's round and site (a class: rankexec builds
    classes only)."""

    def __init__(self, trainer: str = "trainer.py", num_sites: int = 2, **kwargs) -> None:
        self._trainer = _load_trainer(trainer).DigitsDDP(**kwargs)
        self._num_sites = num_sites

    def execute(self, task, input, ctx, abort):
        site_name = str(ctx.get_prop("__identity_name__", "site-1"))
        site = (int(site_name.rsplit("-", 1)[-1]) - 1) % self._num_sites
        meta = dict(input.meta)
        meta["round"] = meta.get("current_round") or 0
        out = self._trainer.execute(
            task, _Input(meta, input.blobs), _Ctx(ctx, site, self._num_sites), abort
        )
        out.meta["dxo_arrays"] = input.meta.get("dxo_arrays")
        out.meta["NUM_STEPS_CURRENT_ROUND"] = out.meta.get("num_samples", 1)
        return out

    def handle_event(self, event, ctx):
        self._trainer.handle_event(event, ctx)
