"""Components for python/tests/test_data_path.py: a rank sending back views of its
input (no copy promised), a slice of it at no page boundary and a copy-on-write view
(copies promised)."""

from __future__ import annotations

import warnings

import numpy as np

import rankexec


class SendViews:
    """Rank 0 returns, for every input blob ``b``: ``b`` as a numpy view, ``b`` as a
    torch view (``<name>.torch``), ``b`` without its first byte (``<name>.tail``, not at a
    page boundary) and a copy-on-write view with its first byte changed
    (``<name>.cow``), plus ``bf16``, a bfloat16 tensor of its own; meta ``inodes`` maps each input blob to its memory file's inode."""

    def execute(self, task, input, ctx, abort):
        if ctx.rank != 0:
            return None
        import torch

        out = {}
        inodes = {}
        for name, blob in input.blobs.items():
            inodes[name] = blob.inode
            view = np.frombuffer(blob, dtype=np.uint8)
            out[name] = view
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a read-only buffer: nothing writes it
                out[name + ".torch"] = torch.frombuffer(blob, dtype=torch.uint8)
            out[name + ".tail"] = view[1:]
            cow = np.frombuffer(blob.copy_on_write(), dtype=np.uint8)
            cow[0] = 99
            out[name + ".cow"] = cow
        # A tensor of a dtype numpy does not have travels as its bytes.
        out["bf16"] = torch.arange(4097, dtype=torch.float32).to(torch.bfloat16)
        return rankexec.Shareable(meta={"inodes": inodes}, blobs=out)
