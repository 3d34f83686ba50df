"""The issue's user script (issue 41): a plain in-place Client API script in the style of
FLARE's LLM examples, as a user writes it.

A gloo group; rank 0 asks ``flare.is_running()``, tells the other ranks whether to go on
(FLARE's other ranks see ``is_running()`` False: their loop is driven by rank 0), receives
the global model, adds 1 to every received tensor in place and sends the *received*
``FLModel`` itself back (``flare.send(input_model)``); the other ranks wait at a barrier.
Unlike ``examples/flare/large-model/client.py`` it builds no new ``FLModel`` and keeps
the received one (``input_model``) until the next round's ``receive()``.

``benchmarks/flare/large_model_bench.py --script inplace`` puts it in the job in place of
the example's ``client.py`` (both executors run the same file). It prints the probes the
benchmark reads (``BENCH <what> <rank> <time.time()>``).
"""

import os
import time

import nvflare.client as flare
import torch
import torch.distributed as dist


def probe(what: str, rank: int) -> None:
    print(f"BENCH {what} {rank} {time.time():.6f}", flush=True)


def main() -> None:
    rank = int(os.environ.get("RANK", "0"))
    probe("script_start", rank)
    dist.init_process_group("gloo")
    flare.init(rank=str(rank))
    probe("init", rank)
    while True:
        go = [False]
        if rank == 0:
            probe("ask", rank)
            go[0] = flare.is_running()
        dist.broadcast_object_list(go, src=0)
        if not go[0]:
            break
        if rank == 0:
            input_model = flare.receive()
            probe("received", rank)
            with torch.no_grad():
                for t in input_model.params.values():
                    t.add_(1.0)
            input_model.meta = {"NUM_STEPS_CURRENT_ROUND": 1}
            probe("sending", rank)
            flare.send(input_model)
            probe("sent", rank)
        dist.barrier()
    probe("end", rank)
    dist.destroy_process_group()
    probe("destroyed", rank)


if __name__ == "__main__":
    main()
