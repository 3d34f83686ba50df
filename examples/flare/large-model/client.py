"""A large-model Client API script in the style of FLARE's LLM examples (``llm_hf``).

Rank 0 receives the global model, "trains" (adds ``--delta`` to every weight, in place,
in the model's own dtype: bfloat16 stays bfloat16, nothing is upcast) and sends the
whole state dict back; the other ranks take part as ``--share`` says:

- ``wait`` (FLARE's minimal pattern): they wait on a broadcast of rank 0's go/stop flag
  and never see the model;
- ``broadcast`` (what ``llm_hf`` and FLARE's HF ``patch()`` do): rank 0 sends them the
  model with ``dist.broadcast_object_list`` (pickled; every rank then holds its own
  copy), and they read every weight;
- ``all``: every rank calls ``flare.receive()`` itself, which needs the executor's
  ``all_ranks_receive=True`` (rankexec's ``ScriptExecutor``; FLARE has no such mode).
  The ranks' tensors are copy-on-write views of the one memory file the group received
  the model in: reading costs nothing, and only what a rank writes is copied. Only rank
  0's ``send()`` counts.

It runs unchanged under FLARE's ``ClientAPIExecutor`` + torchrun (``wait``,
``broadcast``) and under ``rankexec.flare.ScriptExecutor`` (all three). Each rank prints
``BENCH <what> <rank> <time.time()>`` probes around its Client API calls (read by
``benchmarks/flare/large_model_bench.py``) and every rank that gets the model a
``rank R: received N tensors, B bytes, dtypes D`` line per round (read by the CI test).
"""

import argparse
import os
import time

import nvflare.client as flare
import torch
import torch.distributed as dist


def probe(what: str, rank: int) -> None:
    print(f"BENCH {what} {rank} {time.time():.6f}", flush=True)


def train(params: dict, delta: float) -> None:
    """Updates every weight in place, in its own dtype (no float32 copy)."""
    with torch.no_grad():
        for t in params.values():
            t.add_(delta)


def read_all(params: dict) -> float:
    """What a rank that uses the model does at least: touches every weight."""
    with torch.no_grad():
        return float(sum(t.sum().item() for t in params.values()))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--delta", type=float, default=1.0)
    p.add_argument("--share", choices=("wait", "broadcast", "all"), default="wait")
    args = p.parse_args()

    rank = int(os.environ.get("RANK", "0"))
    probe("script_start", rank)
    dist.init_process_group("gloo")
    flare.init(rank=str(rank))
    every_rank = args.share == "all"
    while True:
        params = None
        if every_rank:
            probe("ask", rank)
            if not flare.is_running():
                break
            model = flare.receive()
            probe("received", rank)
            params = model.params
        else:
            go = torch.zeros(1, dtype=torch.int64)
            if rank == 0:
                probe("ask", rank)
                if flare.is_running():
                    model = flare.receive()
                    probe("received", rank)
                    params = model.params
                    go[0] = 1
            dist.broadcast(go, 0)
            if go.item() == 0:
                break
            if args.share == "broadcast":
                box = [params]
                dist.broadcast_object_list(box, src=0)
                params = box[0]
                probe("broadcast_done", rank)
        if params is not None:
            dtypes = sorted({str(t.dtype).replace("torch.", "") for t in params.values()})
            nbytes = sum(t.numel() * t.element_size() for t in params.values())
            print(
                f"rank {rank}: received {len(params)} tensors, "
                f"{nbytes} bytes, dtypes {','.join(dtypes)}",
                flush=True,
            )
        if rank == 0:
            train(params, args.delta)
            probe("sending", rank)
            flare.send(flare.FLModel(params=params, meta={"NUM_STEPS_CURRENT_ROUND": 1}))
            probe("sent", rank)
        elif params is not None:
            read_all(params)
            probe("read", rank)
        del params
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
