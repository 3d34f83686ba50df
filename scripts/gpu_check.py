"""The Python half of ``scripts/gpu-check.sh``: GPU checks through real rankexec groups.

Each subcommand starts a ``rankexec.host.RankGroup`` of Python ranks (``python -m
rankexec.worker`` running a component of this file), runs one task and prints what it
found, one ``FIGURE name value`` line per figure (the shell script collects them) and a
last line ``RESULT ok|FAILED why``. ``--device cpu`` runs the same code without a GPU
(gloo, host memory), so the plumbing can be checked on any machine.

    python scripts/gpu_check.py placement --ranks 2 --mode shared
    python scripts/gpu_check.py ddp --ranks 1 --backend nccl
    python scripts/gpu_check.py h2d --size 4GiB

- ``placement``: every rank prints ``CUDA_VISIBLE_DEVICES``, ``LOCAL_RANK``,
  ``torch.cuda.current_device()`` after ``set_device(LOCAL_RANK)`` (``LOCAL_RANK % n``
  when ranks share fewer GPUs) and that device's UUID; each is compared with what
  rankexec placed (the host's ``placement`` log line, and the rank's own
  ``CUDA_VISIBLE_DEVICES`` at index ``LOCAL_RANK``) and, with ``nvidia-smi``, with NVML's
  index of that UUID. ``per_rank`` must give every rank a GPU of its own.
- ``ddp``: ``init_process_group(BACKEND)`` in every rank, a DDP step time on a 64M-parameter
  MLP (256 MiB of float32 gradients all-reduced per step) and the all-reduce bus bandwidth
  of a 256 MiB tensor, as nccl-tests count it (``2 (n - 1) / n`` of the bytes per rank).
- ``h2d``: the host sends ``--size`` bytes to one rank through the group (one memory
  file, which the rank maps copy-on-write: the way a received model arrives); the rank
  copies it to its GPU pageable (``.to("cuda")`` from the mapping), through a pinned
  staging buffer (``pin_memory``: the host copy and the pinned copy timed apart), and
  from the mapping registered in place (``cudaHostRegister``, read-only, so no page is
  copied on write), against the same copy from an ordinary anonymous tensor. GB/s is
  10^9 bytes per second, best of ``--reps``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
GIB = 1 << 30


def ranks_path() -> str:
    """The ranks' PYTHONPATH: this folder (they import its tasks), then the caller's
    (where rankexec may be installed)."""
    return os.pathsep.join(
        p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p
    )


def figure(name: str, value: object) -> None:
    print(f"FIGURE {name} {value}", flush=True)


def _uuid(text: str) -> str:
    """A GPU UUID without NVML's ``GPU-`` prefix, lowercase (torch prints it bare)."""
    text = text.strip().lower()
    return text.removeprefix("gpu-").removeprefix("mig-")


# ---- rank components ------------------------------------------------------------------


class Placement:
    """Writes what this rank sees to ``meta["dir"]/rank-N.json``."""

    def execute(self, task, input, ctx, abort):
        import rankexec
        import torch

        seen: dict = {
            "rank": ctx.rank,
            "pid": os.getpid(),
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "LOCAL_RANK": os.environ.get("LOCAL_RANK"),
            "WORLD_SIZE": os.environ.get("WORLD_SIZE"),
        }
        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local if local < n else local % n)
            cur = torch.cuda.current_device()
            props = torch.cuda.get_device_properties(cur)
            seen.update(
                device_count=n,
                set_device=local if local < n else local % n,
                current_device=cur,
                uuid=str(props.uuid),
                name=props.name,
            )
        Path(input.meta["dir"], f"rank-{ctx.rank}.json").write_text(json.dumps(seen))
        return rankexec.Shareable(meta={"ok": True})


class DDPStep:
    """``init_process_group`` on the first task; then times DDP steps and an all-reduce."""

    def __init__(self) -> None:
        self.ready = False

    def execute(self, task, input, ctx, abort):
        import rankexec
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        m = input.meta
        cuda = m["device"] == "cuda"
        if cuda:
            n = torch.cuda.device_count()
            local = int(os.environ.get("LOCAL_RANK", "0"))
            device = torch.device("cuda", local % n)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        if not self.ready:
            t = time.perf_counter()
            dist.init_process_group(m["backend"])
            dist.barrier()
            self.init_s = time.perf_counter() - t
            self.ready = True

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize()

        width = m["width"]
        torch.manual_seed(0)
        layers = [torch.nn.Linear(width, width) for _ in range(m["layers"])]
        model = torch.nn.Sequential(*layers).to(device)
        params = sum(p.numel() for p in model.parameters())
        ddp = DDP(model, device_ids=[device.index] if cuda else None)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        x = torch.randn(m["batch"], width, device=device)
        times = []
        for step in range(m["steps"] + 1):
            sync()
            t = time.perf_counter()
            ddp(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            if step:  # the first step builds DDP's buckets
                times.append(time.perf_counter() - t)
        buf = torch.ones(m["allreduce_bytes"] // 4, device=device)
        world = dist.get_world_size()
        dist.all_reduce(buf)  # warm-up
        sync()
        t = time.perf_counter()
        for _ in range(m["reps"]):
            dist.all_reduce(buf)
        sync()
        per = (time.perf_counter() - t) / m["reps"]
        ok = bool((buf[:8] == float(world) ** (m["reps"] + 1)).all().item())
        busbw = (
            m["allreduce_bytes"] * 2 * (world - 1) / world / per / 1e9
            if world > 1
            else None
        )
        out = {
            "rank": ctx.rank,
            "backend": dist.get_backend(),
            "device": str(device),
            "world": world,
            "init_s": round(self.init_s, 3),
            "params": params,
            "step_ms_median": round(1e3 * sorted(times)[len(times) // 2], 2),
            "allreduce_ms": round(1e3 * per, 2),
            "allreduce_busbw_gbs": None if busbw is None else round(busbw, 1),
            "allreduce_correct": ok,
        }
        Path(m["dir"], f"rank-{ctx.rank}.json").write_text(json.dumps(out))
        # One task per group: leave the process group now, so that the rank exits at
        # once when the host closes the group (a live one holds the interpreter's exit).
        dist.destroy_process_group()
        self.ready = False
        return rankexec.Shareable(meta={"ok": True})


class HostToDevice:
    """Copies the received blob to the GPU three ways; rank 0 only reports."""

    def execute(self, task, input, ctx, abort):
        import numpy as np
        import rankexec
        import torch

        m = input.meta
        cuda = m["device"] == "cuda"
        reps = m["reps"]
        mapped = np.frombuffer(input.blobs["model"], dtype=np.uint8)  # the memory file
        size = mapped.nbytes
        with warnings.catch_warnings():
            warnings.simplefilter(
                "ignore"
            )  # the mapping is read-only here: nothing writes it
            src = torch.from_numpy(mapped)
        out: dict = {"rank": ctx.rank, "bytes": size, "device": m["device"]}
        touch = time.perf_counter()
        out["checksum"] = int(src[:: 1 << 20].sum().item())  # maps one page per MiB
        out["first_touch_s"] = round(time.perf_counter() - touch, 3)
        from rankexec.tensors import PinError, to_device

        # A state dict as a rank holds one: tensors of 64 MiB, views of the memory file.
        chunk = 64 << 20
        views = {f"t{i}": src[i : i + chunk] for i in range(0, size, chunk)}
        if not cuda:  # the plumbing only: a host copy of the mapping
            t = time.perf_counter()
            dst = src.clone()
            out["host_copy_gbs"] = round(size / (time.perf_counter() - t) / 1e9, 2)
            del dst
            same = to_device(views, "cpu")
            out["api_cpu_same"] = all(same[k] is v for k, v in views.items())
        else:
            dev = torch.device("cuda", torch.cuda.current_device())
            gpu = torch.empty(size, dtype=torch.uint8, device=dev)

            def best(copy) -> float:
                times = []
                for _ in range(reps):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    copy()
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t)
                return size / min(times) / 1e9

            out["pageable_from_mapping_gbs"] = round(best(lambda: gpu.copy_(src)), 2)
            t = time.perf_counter()
            pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            out["pin_alloc_s"] = round(time.perf_counter() - t, 3)
            out["mapping_to_pinned_gbs"] = round(best(lambda: pinned.copy_(src)), 2)
            out["pinned_to_device_gbs"] = round(
                best(lambda: gpu.copy_(pinned, non_blocking=True)), 2
            )
            del pinned
            anon = torch.ones(size, dtype=torch.uint8)
            out["pageable_from_anonymous_gbs"] = round(best(lambda: gpu.copy_(anon)), 2)
            del anon
            cudart = torch.cuda.cudart()
            read_only = (
                8  # cudaHostRegisterReadOnly: pins without write faults (no COW)
            )
            t = time.perf_counter()
            err = cudart.cudaHostRegister(src.data_ptr(), size, read_only)
            out["register_s"] = round(time.perf_counter() - t, 3)
            code = int(getattr(err, "value", err))
            out["register_error"] = code
            if code == 0:
                out["registered_mapping_to_device_gbs"] = round(
                    best(lambda: gpu.copy_(src, non_blocking=True)), 2
                )
                cudart.cudaHostUnregister(src.data_ptr())
            out["device_checksum"] = int(gpu[:: 1 << 20].sum().item())
            del gpu
            # rankexec.tensors.to_device: the same state dict, pageable vs registered.
            out["api_pageable_gbs"] = round(
                best(lambda: to_device(views, dev, pin=False)), 2
            )
            try:
                out["api_pinned_gbs"] = round(
                    best(lambda: to_device(views, dev, pin=True)), 2
                )
                # The same with 4 registering threads: slower on the H100 host
                # measured (the pinning does not scale; BENCHMARKS.md).
                from rankexec import _pin, tensors

                threads, tensors._PIN_THREADS = tensors._PIN_THREADS, 4
                try:
                    out["api_pinned_4_threads_gbs"] = round(
                        best(lambda: to_device(views, dev, pin=True)), 2
                    )
                finally:
                    tensors._PIN_THREADS = threads
                out["api_cudart"] = type(_pin.loaded_cudart(cudart)).__name__
            except PinError as e:
                out["api_pin_error"] = str(e)
            back = to_device(views, dev)
            out["api_checksum"] = sum(
                int(v[:: 1 << 20].sum().item()) for v in back.values()
            )
            del back
        Path(m["dir"], f"rank-{ctx.rank}.json").write_text(json.dumps(out))
        return rankexec.Shareable(meta={"ok": True})


# ---- the host side --------------------------------------------------------------------


def group(n: int, component: str, gpu: dict, log: Path):
    from rankexec.host import RankGroup

    return RankGroup(
        {
            "executor_id": "gpu_check",
            "num_of_processes": n,
            "components": [
                {"id": "gpu_check", "path": f"gpu_check:{component}", "args": {}}
            ],
            "worker": {"program": "python", "args": ["-m", "rankexec.worker"]},
            "env": {"set": {"PYTHONPATH": ranks_path(), "RANKEXEC_LOG": "info"}},
            "gpu": gpu,
            "deadlines": {"task": "300s"},
            "log_dir": str(log),
        }
    )


def read_ranks(folder: Path, n: int) -> list[dict]:
    return [json.loads((folder / f"rank-{r}.json").read_text()) for r in range(n)]


def nvml_indices() -> dict[str, str]:
    """UUID (bare) to NVML index, from nvidia-smi; empty without it."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    pairs = (line.split(",") for line in out.splitlines() if "," in line)
    return {_uuid(u): i.strip() for i, u in pairs}


def placed_uuids(stderr_text: str) -> tuple[str, list[str]]:
    """What the host logged it placed: ("per_rank"|"shared"|"cpu", [uuid per GPU])."""
    m = re.search(
        r"placement=(?:\")?(one GPU per rank|ranks share GPUs|CPU ranks)([^\"\n]*)",
        stderr_text,
    )
    if not m:
        return "unknown", []
    kind = {"one GPU per rank": "per_rank", "ranks share GPUs": "shared"}.get(
        m.group(1), "cpu"
    )
    uuids = [_uuid(u) for u in re.findall(r"(?:GPU|MIG)-[0-9a-fA-F-]+", m.group(2))]
    return kind, uuids


def cmd_placement(args: argparse.Namespace, work: Path) -> bool:
    """Runs the group with the ``rankexec`` CLI (``rankexec run --config -v``), whose log
    says what the host placed."""
    config = {
        "executor_id": "gpu_check",
        "num_of_processes": args.ranks,
        "components": [{"id": "gpu_check", "path": "gpu_check:Placement", "args": {}}],
        "worker": {"program": sys.executable, "args": ["-m", "rankexec.worker"]},
        "env": {"set": {"PYTHONPATH": ranks_path()}},
        "gpu": {"mode": args.mode},
        "deadlines": {"task": "120s"},
    }
    (work / "config.json").write_text(json.dumps(config))
    argv = [
        "rankexec",
        "run",
        "--config",
        str(work / "config.json"),
        "-v",
        "--task",
        "placement",
    ]
    argv += ["--meta", json.dumps({"dir": str(work)})]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=150, check=False)
    host_log = run.stdout + run.stderr
    if run.returncode != 0:
        print(host_log[-3000:])
        print(f"RESULT FAILED rankexec run exited {run.returncode}", flush=True)
        return False
    ranks = read_ranks(work, args.ranks)
    kind, placed = placed_uuids(host_log)
    print(f"rankexec placed ({args.mode}): {kind} {' '.join(placed) or '-'}")
    nvml = nvml_indices()
    good = True
    seen_uuids = []
    for r in ranks:
        visible = [_uuid(v) for v in (r["CUDA_VISIBLE_DEVICES"] or "").split(",") if v]
        local = int(r["LOCAL_RANK"] or 0)
        line = (
            f"rank {r['rank']}: CUDA_VISIBLE_DEVICES={r['CUDA_VISIBLE_DEVICES']} "
            f"LOCAL_RANK={r['LOCAL_RANK']}"
        )
        if "uuid" not in r:
            print(f"{line} (no CUDA device visible)")
            good = good and args.device == "cpu"
            continue
        got = _uuid(r["uuid"])
        seen_uuids.append(got)
        want_env = visible[local % len(visible)] if visible else None
        want_host = placed[r["rank"] % len(placed)] if placed else None
        checks = {"CUDA_VISIBLE_DEVICES[LOCAL_RANK]": want_env == got}
        if placed:
            checks["host placement"] = want_host == got
        ok = all(checks.values())
        good = good and ok
        print(
            f"{line} set_device({r['set_device']}) current_device={r['current_device']} "
            f"uuid=GPU-{got} nvml_index={nvml.get(got, '?')} {r['name']}: "
            + ", ".join(
                f"{k} {'matches' if v else 'DIFFERS'}" for k, v in checks.items()
            )
        )
    if args.mode == "per_rank" and len(set(seen_uuids)) != len(seen_uuids):
        print("per_rank placed two ranks on one GPU")
        good = False
    figure(f"placement_{args.mode}_{args.ranks}_ranks", "ok" if good else "MISMATCH")
    return good


def cmd_ddp(args: argparse.Namespace, work: Path) -> bool:
    gpu = {"mode": "none"} if args.device == "cpu" else {"mode": args.mode}
    meta = {
        "dir": str(work),
        "device": args.device,
        "backend": args.backend,
        "width": args.width,
        "layers": args.layers,
        "batch": 64,
        "steps": args.steps,
        "allreduce_bytes": args.allreduce_mib << 20,
        "reps": 5,
    }
    with group(args.ranks, "DDPStep", gpu, work / "logs") as g:
        g.execute("ddp", meta)
    ranks = read_ranks(work, args.ranks)
    for r in ranks:
        print(json.dumps(r))
    r0 = ranks[0]
    tag = f"ddp_{args.backend}_{args.ranks}_ranks_{args.mode}"
    figure(f"{tag}_init_s", r0["init_s"])
    figure(f"{tag}_step_ms", r0["step_ms_median"])
    figure(f"{tag}_allreduce_{args.allreduce_mib}MiB_ms", r0["allreduce_ms"])
    if r0["allreduce_busbw_gbs"] is not None:
        figure(f"{tag}_allreduce_busbw_gbs", r0["allreduce_busbw_gbs"])
    return all(r["allreduce_correct"] and r["backend"] == args.backend for r in ranks)


def cmd_h2d(args: argparse.Namespace, work: Path) -> bool:
    import numpy as np

    gpu = {"mode": "none"} if args.device == "cpu" else {"mode": "per_rank"}
    size = args.size
    model = np.empty(size, dtype=np.uint8)
    model[:: 1 << 20] = 1  # one byte per MiB: a checksum both sides can compute
    blobs = {"model": model}
    del model
    meta = {"dir": str(work), "device": args.device, "reps": args.reps}
    with group(1, "HostToDevice", gpu, work / "logs") as g:
        t = time.perf_counter()
        g.execute(
            "h2d", meta, blobs, consume=True
        )  # the host's copy goes once it is staged
        took = time.perf_counter() - t
    r = read_ranks(work, 1)[0]
    print(json.dumps(r))
    want = size >> 20 if size % (1 << 20) == 0 else -(-size // (1 << 20))
    good = (
        r["checksum"] == want
        and r.get("device_checksum", want) == want
        and r.get("api_checksum", want) == want
        and r.get("api_cpu_same", True)
    )
    figure("h2d_bytes", size)
    figure("h2d_task_s", round(took, 2))
    for k, v in r.items():
        if k.endswith(("_gbs", "_s")) or k in ("register_error", "api_cudart"):
            figure(f"h2d_{k}", v)
    return good


def parse_size(text: str) -> int:
    m = re.fullmatch(r"([\d.]+)\s*(GiB|MiB|)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text} (e.g. 4GiB, 512MiB)")
    return int(float(m.group(1)) * {"GiB": GIB, "MiB": 1 << 20, "": 1}[m.group(2)])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("placement", "ddp", "h2d"):
        s = sub.add_parser(name)
        s.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
        s.add_argument("--ranks", type=int, default=1)
        s.add_argument("--mode", default="per_rank", help="gpu.mode (per_rank, shared)")
    sub.choices["ddp"].add_argument("--backend", default="nccl")
    sub.choices["ddp"].add_argument("--width", type=int, default=4096)
    sub.choices["ddp"].add_argument("--layers", type=int, default=4)
    sub.choices["ddp"].add_argument("--steps", type=int, default=10)
    sub.choices["ddp"].add_argument("--allreduce-mib", type=int, default=256)
    sub.choices["h2d"].add_argument("--size", type=parse_size, default=4 * GIB)
    sub.choices["h2d"].add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    from rankexec.host import RankexecError

    with tempfile.TemporaryDirectory(prefix=f"gpu-check-{args.cmd}-") as tmp:
        try:
            good = {"placement": cmd_placement, "ddp": cmd_ddp, "h2d": cmd_h2d}[
                args.cmd
            ](args, Path(tmp))
        except (
            RankexecError,
            OSError,
            ValueError,
            KeyError,
        ) as e:  # names rank and cause
            print(f"RESULT FAILED {type(e).__name__}: {e}", flush=True)
            return 1
    print(f"RESULT {'ok' if good else 'FAILED (see above)'}", flush=True)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
