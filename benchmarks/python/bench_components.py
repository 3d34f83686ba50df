"""Rank components of the Python benchmark."""

from __future__ import annotations

import numpy as np
import rankexec


class Empty:
    """Returns nothing: the round trip of an empty task."""

    def execute(self, task, input, ctx, abort):
        return None


class ReadNumpy:
    """Every rank views the blob `x` as numpy (no copy); rank 0 reads all of it and
    returns the sum of its little-endian u64 words (as a string: it wraps at 2**64)."""

    def execute(self, task, input, ctx, abort):
        words = np.frombuffer(input.blobs["x"], dtype="<u8")
        if ctx.rank != 0:
            return None
        return rankexec.Shareable(meta={"sum": str(int(words.sum(dtype=np.uint64)))})
