"""The rank side of the side-by-side benchmark: what the peer harness's EchoExecutor
does, as a rankexec Python rank (component style).

The task's `dxo_meta` steers it like the peer's headers: `mode` "echo" (return the
payload: the input blob is forwarded, no copy) or "sum" (return its adler32 and
length only); `raise_on_rank` r (raise on rank r, -1 on every rank); `sleep_s`
(sleep, honouring the abort signal, before answering).
"""

from __future__ import annotations

import zlib

import rankexec


class EchoRank:
    def execute(self, task, input, ctx, abort):
        rank = ctx.rank
        steer = input.meta.get("dxo_meta") or {}
        raise_on = steer.get("raise_on_rank")
        if raise_on is not None and int(raise_on) in (rank, -1):
            raise RuntimeError(f"nvfbench: injected failure on rank {rank}")
        sleep_s = float(steer.get("sleep_s") or 0)
        if sleep_s > 0 and abort.wait(sleep_s):
            raise rankexec.TaskAborted("aborted while sleeping")
        payload = input.blobs.get("payload")
        meta = {
            "rank": rank,
            "nbytes": 0 if payload is None else len(payload),
            "dxo_arrays": input.meta.get("dxo_arrays"),
            "dxo_kind": input.meta.get("dxo_kind"),
        }
        if (steer.get("mode") or "echo") == "echo":
            blobs = {} if payload is None else {"payload": payload}
        else:
            blobs = {}
            meta["dxo_arrays"] = {}
            meta["dxo_values"] = {"adler32": zlib.adler32(payload or b"")}
        return rankexec.Shareable(meta=meta, blobs=blobs)
