"""The rank code of the numpy FedAvg job: FLARE's NPTrainer, as a rankexec rank.

Every rank receives the global model (the DXO's arrays, mapped from shared memory, no
copy), adds `delta` to every array, and returns the result with one step done. The
executor returns rank 0's result, so after R rounds of FedAvg over clients that all do
this, the server's model is the initial model plus R x delta.
"""

from __future__ import annotations

import rankexec
from rankexec.flare.arrays import ARRAYS_KEY, from_blobs


class AddDelta:
    def __init__(self, delta: float = 1.0) -> None:
        self.delta = float(delta)

    def execute(self, task, input, ctx, abort):
        arrays = from_blobs(input.blobs, input.meta.get(ARRAYS_KEY))
        out = {name: a + a.dtype.type(self.delta) for name, a in arrays.items()}
        if abort.triggered:
            raise rankexec.TaskAborted("aborted before returning")
        return rankexec.Shareable(
            meta={
                ARRAYS_KEY: input.meta.get(ARRAYS_KEY),
                "NUM_STEPS_CURRENT_ROUND": 1,
                "rank": ctx.rank,
            },
            blobs=out,
        )
