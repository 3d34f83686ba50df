"""Benchmark variant: the example's rankexec ClientApp, with each message's call and
reply times appended to the file ``BENCH_FLOWER_TIMINGS`` names.

Copied into a copy of examples/flower/ddp-digits as ddp_digits/client_rankexec_timed.py
by bench.py. The timing lives here, in the benchmark, not in rankexec's message path:
the example's ``app`` object is served under this module's name, its class swapped for
a subclass that times ``__call__`` (the ranks still import ``ddp_digits.client_app``).
"""

from __future__ import annotations

import json
import os
import time

from ddp_digits.client_app import app
from flwr.app import Context, Message
from rankexec.flower import ClientApp


class _Timed(ClientApp):
    def __call__(self, message: Message, context: Context) -> Message:
        t_call = time.time()
        reply = super().__call__(message, context)
        rec = {
            "run_id": context.run_id,
            "node_id": context.node_id,
            "message_type": message.metadata.message_type,
            "created_at": message.metadata.created_at,
            "call": t_call,
            "reply": time.time(),
        }
        with open(os.environ["BENCH_FLOWER_TIMINGS"], "a") as f:
            f.write(json.dumps(rec) + "\n")
        return reply


app.__class__ = _Timed

__all__ = ["app"]
